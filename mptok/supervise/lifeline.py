"""Stop a child process when the process that started it dies.

A frontend must not outlive its supervisor: nobody would restart it, stop
it or remove its ipc dir. On Linux the kernel signals it when its parent
dies, however it dies (``prctl(PR_SET_PDEATHSIG)``: no thread, no polling);
elsewhere a daemon thread waits on the parent's sentinel pipe. The signal
is SIGTERM by default, so the child stops exactly as it does when the
supervisor stops it: gracefully, within its shutdown budget.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def stop_with_parent(parent_pid: int, signum: int = signal.SIGTERM) -> str:
    """Have ``signum`` sent to this process when process ``parent_pid`` (its parent) dies.

    Install the handler of ``signum`` first. If the parent died before this
    call (the race every parent-death watch has), the signal is sent at
    once. Returns how the death is watched: ``"pdeathsig"`` (the kernel,
    Linux) or ``"sentinel"`` (a thread); ``"none"`` if neither is possible
    (not a multiprocessing child, outside Linux), with a warning.

    The kernel sends the signal when the parent's *thread* that started
    this process ends: start children from a thread that lives as long as
    the parent (the supervisor starts them from its main thread).
    """
    if sys.platform.startswith("linux") and _set_pdeathsig(signum):
        how = "pdeathsig"
    else:
        how = _watch_sentinel(parent_pid, signum)
    if os.getppid() != parent_pid:
        # Re-parented before the watch existed: the parent is already gone.
        os.kill(os.getpid(), signum)
    return how


def _set_pdeathsig(signum: int) -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0:
            return True
        logger.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError) as e:
        logger.warning("prctl(PR_SET_PDEATHSIG) is not available: %r", e)
    return False


def _watch_sentinel(parent_pid: int, signum: int) -> str:
    parent = multiprocessing.parent_process()
    if parent is None or parent.pid != parent_pid or parent.sentinel is None:
        logger.warning("cannot watch parent pid %d on this platform", parent_pid)
        return "none"
    threading.Thread(target=_signal_when_ready, args=(parent.sentinel, signum), name="mptok-parent-watch", daemon=True).start()
    return "sentinel"


def _signal_when_ready(sentinel: int, signum: int) -> None:
    multiprocessing.connection.wait([sentinel])
    os.kill(os.getpid(), signum)

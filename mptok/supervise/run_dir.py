"""The private directory of one ``mptok serve``, and the sweep of those whose server died.

A supervisor removes its ipc directory when it exits, unless it is
SIGKILLed (or the machine loses power): then ``mptok-serve-*`` directories
pile up in the temporary directory. So each supervisor holds an ``flock``
on a lock file in its directory for as long as it lives (the kernel
releases it however the process ends), each frontend holds one on its
socket's lock file (``mptok.transport``), and at start a supervisor removes
the directories of this user whose every lock is free.

What is never removed: a symbolic link, anything of another user, a
directory with a held lock, and a directory with no supervisor lock file
(one being created, or made by an mptok that did not write one: it cannot
be told from a live one). The lock file appears under its final name only
once it is locked, so a sweep cannot take the lock of a starting server.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

from mptok.core.private_files import SERVER_LOCK, sweep_unused
from mptok.front.ipc_dir import publish_locked
from mptok.supervise.logfmt import log_event

logger = logging.getLogger("mptok.supervisor")

PREFIX = "mptok-serve-"
LOCK_NAME = SERVER_LOCK


class RunDir:
    """A new private directory (mode 0700) claimed by this process until ``close()`` removes it."""

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix=PREFIX)
        try:
            self._lock_fd = _claim(self.path)
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._lock_fd)


def _claim(path: str) -> int:
    dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = publish_locked(dir_fd, LOCK_NAME, shared=False)
    finally:
        os.close(dir_fd)
    os.write(fd, str(os.getpid()).encode())
    return fd


def sweep_stale() -> None:
    """Remove this user's ``mptok-serve-*`` directories in the temporary directory whose server is gone.

    Never raises for one directory it cannot judge or remove (it is left).
    """
    for path in sweep_unused(tempfile.gettempdir(), PREFIX):
        log_event(logger, logging.WARNING, "swept_stale_ipc_dir", path=path, reason="its server is gone")

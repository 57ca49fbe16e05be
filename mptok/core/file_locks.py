"""``flock`` taken without ever blocking past a bound.

The kernel releases an ``flock`` however its holder ends, SIGKILL included,
so a held lock file says its process is alive and using something. But
``flock`` waits forever for a stopped or stuck holder: every lock here is
taken without blocking, and a wait for one polls until a ``Deadline``.
"""

from __future__ import annotations

import fcntl
import time

from mptok.core.deadline import Deadline

_POLL_S = 0.01


def try_lock(fd: int, *, shared: bool = False) -> bool:
    """Take ``fd``'s ``flock`` (exclusive, or ``shared``) if it is free now; False if another process holds it."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def lock_by(fd: int, deadline: Deadline, *, shared: bool = False, poll_s: float = _POLL_S) -> bool:
    """``try_lock``, polling until ``deadline`` at most; False if it was still held then."""
    while not try_lock(fd, shared=shared):
        if deadline.passed:
            return False
        time.sleep(min(poll_s, deadline.left()))
    return True

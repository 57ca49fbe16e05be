"""How many requests one process of a server holds at once, and the 503 for the next one.

Behind one port a full process keeps taking connections while its peers
idle, and its clients wait without knowing why. So each process of a server
on the supervisor holds at most ``--max-in-flight`` requests and refuses the
next at once, with ``Retry-After``, so that the client tries again and the
kernel hands its connection to a process that is free.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from mptok.api.tokenize_request import RETRY_AFTER_S, RequestError


class Admission:
    """At most ``limit`` requests held by one frontend at once; the next one is refused at once.

    A request holds its place from before its body is read until its work
    has finished or was cancelled unstarted, so bodies in memory, queued
    work and the waits in the pool's queue are all bounded by ``limit``.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._held = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def place(self) -> Iterator[None]:
        """Hold a place for the ``with`` block; ``RequestError`` (503, Retry-After) if none is free."""
        with self._lock:
            if self._held >= self.limit:
                busy = f"this frontend is busy: it holds --max-in-flight={self.limit} requests; retry"
                raise RequestError(503, busy, retry_after_s=RETRY_AFTER_S)
            self._held += 1
        try:
            yield
        finally:
            with self._lock:
                self._held -= 1

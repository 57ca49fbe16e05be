"""A thread-safe map that drops its least recently used entries beyond a byte budget.

What a frontend keeps per conversation besides the cache is kept in one, so
that it is bounded however many conversations come.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class ByteBoundedLru(Generic[V]):
    """Values with their sizes (``put``'s ``nbytes``); at most ``max_bytes`` in all."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._bytes = 0

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: Hashable, value: V, nbytes: int) -> None:
        """Keep ``value`` for ``key`` (replacing what was kept), unless it alone exceeds the budget."""
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            if nbytes > self.max_bytes:
                return
            self._entries[key] = (value, nbytes)
            self._bytes += nbytes
            while self._bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped

    def stats(self) -> tuple[int, int]:
        """(entries, bytes) kept now."""
        with self._lock:
            return len(self._entries), self._bytes

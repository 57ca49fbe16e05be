"""Counts that many threads bump at once, kept by the component that counts.

Every component counts its events and times its work with these two
classes; ``mptok.supervise.metrics`` and ``mptok.front.prometheus`` only
render their snapshots, so no component imports the exposition format.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable
from typing import Any

# Seconds, from a cache hit to a routed call that waited out its timeout (mptok_tokenize_seconds).
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Counters:
    """Named counts (or sums, such as CPU seconds); ``snapshot()`` has every
    name in ``names`` (0 until counted) and every other name counted so far."""

    def __init__(self, names: tuple[str, ...] = ()):
        self._lock = threading.Lock()
        self._counts: dict[str, float] = dict.fromkeys(names, 0)

    def add(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + n

    def add_each(self, *names: str) -> None:
        """One more of each of ``names``, under one acquisition of the lock."""
        with self._lock:
            for name in names:
                self._counts[name] = self._counts.get(name, 0) + 1

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counts)


class Histogram:
    """A thread-safe Prometheus histogram: bucket counts, sum, count."""

    def __init__(self, bounds: Iterable[float] = SECONDS_BUCKETS):
        self._bounds = tuple(sorted(bounds))
        self._lock = threading.Lock()
        self._counts = [0] * (len(self._bounds) + 1)  # the last one is +Inf
        self._sum = 0.0

    def observe(self, value: float) -> None:
        slot = bisect.bisect_left(self._bounds, value)
        with self._lock:
            self._counts[slot] += 1
            self._sum += value

    def snapshot(self) -> dict[str, Any]:
        """``{"bounds": [...], "counts": [...per bucket, not cumulative, +Inf last], "sum": s}``."""
        with self._lock:
            return {"bounds": list(self._bounds), "counts": list(self._counts), "sum": self._sum}

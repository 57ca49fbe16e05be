"""A task run every so often on a thread of its own, stopped once, with a bound, after a last run."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

STOP_JOIN_S = 5.0


class PeriodicTask:
    """Run ``tick`` every ``interval_s`` on a daemon thread until ``stop()``; ``start()`` and ``stop()`` run it
    once on the caller's thread too (so the final state is written), and ``stop()`` waits ``join_s`` at most.
    A ``tick`` that raises is logged and does not stop the loop."""

    def __init__(self, name: str, tick: Callable[[], None], interval_s: float):
        self._tick = tick
        self._interval_s = interval_s
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._tick_logged()
        self._thread.start()

    def stop(self, join_s: float = STOP_JOIN_S) -> None:
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(join_s)
        self._tick_logged()

    def _run(self) -> None:
        while not self._stopping.wait(self._interval_s):
            self._tick_logged()

    def _tick_logged(self) -> None:
        try:
            self._tick()
        except Exception:
            logger.warning("periodic task %s failed", self._thread.name, exc_info=True)

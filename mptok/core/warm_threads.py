"""Run a warm-up once on every thread of a pool, before the pool serves.

A fast engine builds per-thread state on a thread's first calls (fastokens:
tens of milliseconds of CPU), which a pool's first requests would pay as
latency spikes after every start; warming each thread moves it to start-up.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable

from mptok.core.deadline import Deadline

logger = logging.getLogger(__name__)


def warm_every_thread(
    pool: concurrent.futures.ThreadPoolExecutor, threads: int, warm: Callable[[], object], deadline: Deadline
) -> bool:
    """Run ``warm()`` once on each of ``pool``'s ``threads`` threads (its
    ``max_workers``), waiting until ``deadline`` at most; whether every thread
    was warmed. A warm-up that raises or times out is logged, never raised.
    """
    # The executor starts a thread per task while none is idle: a task that
    # holds its thread until all have one reaches every thread.
    all_started = threading.Barrier(threads)

    def warm_one() -> None:
        all_started.wait(deadline.left())
        warm()

    futures = [pool.submit(warm_one) for _ in range(threads)]
    warmed = True
    for future in futures:
        try:
            future.result(timeout=deadline.left())
        except Exception:
            warmed = False
            all_started.abort()  # no thread waits for the others any longer
    if not warmed:
        logger.warning("a pool's threads could not all be warmed; their first calls pay for it")
    return warmed

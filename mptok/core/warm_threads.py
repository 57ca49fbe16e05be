"""Run a warm-up once on every thread of a pool, before the pool serves.

A fast tokenizer engine builds per-thread state and caches on a thread's
first calls (fastokens spends tens of milliseconds of CPU on a new thread's
first prompt). A pool whose threads start on demand hands that cost to its
first requests, one per thread, as latency spikes after every start or
restart. Warming each thread first moves it to start-up.
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
    ``max_workers``), starting them all; wait until ``deadline`` at most.

    Returns whether every thread was warmed. A warm-up that raises or runs
    past the deadline is logged, never raised: the pool still serves, and
    only its first calls pay.
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

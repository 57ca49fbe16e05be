"""The tripwire: a fast engine's results re-checked in the background, within a CPU budget.

The start-up check (``mptok.engines.fast``) decides whether an engine may
be trusted for a tokenizer; this keeps checking it while it serves. The
first ``FIRST_CHECKS`` results, and then as many as ``CheckBudget`` allows,
are re-tokenized by `tokenizers` on one background thread
(``SampledVerifier``), which calls the checked object's ``verify``; what
that does on a difference is its own business (``mptok.engines.choice``).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any, Protocol

from mptok.core.counting import Counters
from mptok.core.deadline import Deadline

logger = logging.getLogger(__name__)

# The process's one background checker thread (it outlives every cache and
# TokenizationOwners, as the backends it checks do).
VERIFIER_THREAD = "mptok-backend-verifier"
# Results of a fast engine re-checked before sampling starts.
FIRST_CHECKS = 8
# Re-checks waiting for the background thread; more are dropped (counted).
CHECK_QUEUE = 4


class CheckBudget:
    """Which results to re-check so that the checks cost a bounded share of
    the engine's CPU, without a clock on the hot path.

    Both the engine and the reference tokenizer are linear in the text, so
    costs are counted in characters: each result earns ``share`` (the check
    share times the engine's CPU per character against the reference's,
    measured when the engine was chosen) of its length as credit, and a
    result is checked when the credit covers re-tokenizing it whole. Safe to
    share between threads.
    """

    def __init__(self, share: float):
        self._share = share
        self._credit = 0.0
        self._lock = threading.Lock()

    def allows(self, chars: int, check_chars: int | None = None) -> bool:
        """Earn credit for a result whose engine tokenized ``chars``
        characters; whether it is to be checked by re-tokenizing
        ``check_chars`` (default ``chars``), whose cost is then spent."""
        cost = chars if check_chars is None else check_chars
        with self._lock:
            self._credit += self._share * chars
            if self._credit < cost:
                return False
            self._credit -= cost
            return True


class Checked(Protocol):
    """What the verifier checks: a backend that can tell right from wrong."""

    def verify(self, text: str, ids: Any) -> None: ...


class SampledVerifier:
    """One background thread re-checking sampled results against `tokenizers`.

    Bounded: one thread per process, at most ``CHECK_QUEUE`` checks waiting;
    a check that finds the queue full is dropped and counted by the caller.
    The thread starts with the first check and is a daemon: a process that
    exits does not wait for a check of a result it already returned.
    """

    def __init__(self, capacity: int = CHECK_QUEUE):
        self._queue: queue.Queue[tuple[Checked, str, Any]] = queue.Queue(capacity)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, backend: Checked, text: str, ids: Any) -> bool:
        """Queue a check; False if the queue was full (the check is dropped)."""
        self._start()
        try:
            self._queue.put_nowait((backend, text, ids))
        except queue.Full:
            return False
        return True

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the queued checks; True if done."""
        deadline = Deadline.after(timeout)
        while not deadline.passed:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(0.005)
        return self._queue.unfinished_tasks == 0

    def after_fork(self) -> None:
        """In a forked child: the parent's thread did not come along, and
        neither may its queue's lock; start afresh."""
        self._queue = queue.Queue(self._queue.maxsize)
        self._thread = None
        self._lock = threading.Lock()

    def _start(self) -> None:
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=VERIFIER_THREAD, daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            backend, text, ids = self._queue.get()
            try:
                backend.verify(text, ids)
            except Exception:
                logger.exception("tokenizer backend check failed to run")
            finally:
                # Not kept while waiting for the next check: a prompt may be large.
                del backend, text, ids
                self._queue.task_done()


VERIFIER = SampledVerifier()
os.register_at_fork(after_in_child=VERIFIER.after_fork)


# Process-wide counts of the background checks.
COUNTERS = Counters(("backend_checks", "backend_checks_dropped", "backend_mismatches"))


def submit_check(check: Checked, text: str, ids: Any) -> None:
    """Queue ``check.verify(text, ids)`` on the background thread, counted
    (``backend_checks``, or ``backend_checks_dropped`` if the queue is full)."""
    COUNTERS.add("backend_checks" if VERIFIER.submit(check, text, ids) else "backend_checks_dropped")

"""Which engine tokenizes a text in full, and the tripwire that keeps it trusted.

``Engines`` runs the start-up decision of ``mptok.engines.fast``. The first
``FIRST_CHECKS`` results, then as many as ``CheckBudget`` allows, are
re-tokenized by the reference on one background thread
(``SampledVerifier``, its CPU counted); on a difference the fast engines
are not used for that tokenizer again in this process.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from mptok.core.counting import Counters
from mptok.core.deadline import Deadline
from mptok.engines.fast import LONG_TEXT_CHARS, Chooser, Chosen, LoadedOnFirstUse, LoadingEngine
from mptok.engines.timing import IdsEngine

logger = logging.getLogger(__name__)

# The re-checks' share of the CPU the engine spends, after the first results.
CHECK_SHARE = 0.05
FIRST_CHECKS = 8
# Re-checks waiting for the background thread; more are dropped (counted).
CHECK_QUEUE = 4
# The process's one checker thread (it outlives every cache, as the backends it checks do).
VERIFIER_THREAD = "mptok-backend-verifier"


class TokenizerRefused(Exception):
    """The Rust tokenizer raised on this text (lone surrogates, say): the cache then calls the
    caller's tokenizer itself, so the caller sees exactly what it does with the text, ids or error."""


class Checked(Protocol):
    """What the verifier checks: a backend that can tell right from wrong."""

    def verify(self, text: str, ids: Any) -> None: ...


class Engines:
    """The fast engines of one tokenizer, chosen at start and checked while used.

    Thread-safe. ``checked.verify`` checks sampled results against ``reference``
    in the background. ``engine``: one the caller vouches for, not checked at start
    (tests use it to build a real mismatch) but checked in the background as ever.
    """

    def __init__(
        self,
        reference: Callable[[str], list[int]],
        spec_json: str,
        split_special: bool,
        choice: str,
        *,
        added_tokens: Iterable[Any],
        name: str,
        checked: Checked,
        engine: IdsEngine | None = None,
    ):
        self._reference = reference
        self._checked = checked
        self.tokenizer_name = name
        self.spec_digest = hashlib.sha256(spec_json.encode()).hexdigest()
        self._results = itertools.count()
        if engine is not None:
            self._chosen = Chosen(engine, None, "forced")
        elif choice == "tokenizers":
            self._chosen = Chosen(None, None, "")
        else:
            self._chosen = Chooser(
                self._reference_or_none, spec_json, self.spec_digest, split_special, choice, list(added_tokens), name, self._distrusts
            ).choose()
        self._engine, self._long_engine = self._chosen.engine, self._chosen.long_engine
        self.report = self._chosen.report
        self._check_budget = CheckBudget(CHECK_SHARE * self._chosen.ratio)

    @property
    def name(self) -> str:
        """"tokenizers", or the short texts' fast engine's name while it is trusted."""
        return self.names["short"]

    @property
    def names(self) -> dict[str, str]:
        """The engines of short and long texts now ("tokenizers" once none is trusted)."""
        short, longer = self._engine, self._long_engine
        name = "tokenizers" if short is None else short.name
        return {"short": name, "long": longer.name if longer is not None and short is not None else name}

    @property
    def chosen_names(self) -> dict[str, str]:
        """``names`` as chosen at start: the long texts' engine even before it is loaded."""
        names = self.names
        longer = self._long_engine
        if isinstance(longer, LoadedOnFirstUse) and self._engine is not None:
            names["long"] = longer.chosen
        return names

    @property
    def summary(self) -> str:
        """The engines chosen, for the start log."""
        names = self.chosen_names
        engines = names["short"] if names["long"] == names["short"] else (
            f"{names['short']}, {names['long']} for texts of {LONG_TEXT_CHARS:,} characters or more"
        )
        if isinstance(self._long_engine, LoadedOnFirstUse):
            engines += f" (loaded when a server warms the backend, else on the first one; {names['short']} until then)"
        return engines

    @property
    def fast(self) -> bool:
        """Whether full tokenizations go through a fast engine (ids only)."""
        return self._engine is not None

    def _distrusts(self, names: Iterable[str]) -> bool:
        """Whether any of ``names`` gave a wrong result for this specification in this process."""
        return any((self.spec_digest, name) in _distrusted for name in names)

    def warm(self) -> None:
        """Ready these engines for a server's first requests: one short text
        tokenized, the short texts' engine's load waited for, and the long
        texts' engine loaded now (seconds of CPU for a large vocabulary, which
        would slow the requests beside it)."""
        self._reference("warm up")
        if isinstance(self._engine, LoadingEngine):
            self._engine.wait()
        longer = self._long_engine
        if isinstance(longer, LoadedOnFirstUse):
            longer.load_now()

    def warm_this_thread(self, text: str) -> None:
        """Run each loaded fast engine on ``text`` on the calling thread, so
        that its per-thread state is built before it serves (nothing is checked)."""
        longer = self._long_engine
        if isinstance(longer, LoadedOnFirstUse):
            longer = longer.loaded
        for engine in {id(e): e for e in (self._engine, longer) if e is not None}.values():
            engine.encode_id_array(text)

    def encode_ids(self, text: str) -> list[int]:
        """Full tokenization's ids by the cheapest exact engine, a new list.
        Text a fast engine rejects goes to the reference, which raises ``TokenizerRefused``."""
        engine = self._engine_for(text)
        return self._by_engine(engine.encode_ids, text) if engine is not None else self._reference(text)

    def encode_id_array(self, text: str) -> Any:
        """``encode_ids`` as the fast engine's int array (no Python int per id), else the list."""
        engine = self._engine_for(text)
        return self._by_engine(engine.encode_id_array, text) if engine is not None else self._reference(text)

    def _engine_for(self, text: str) -> IdsEngine | None:
        engine, longer = self._engine, self._long_engine
        if longer is None or engine is None or len(text) < LONG_TEXT_CHARS:
            return engine
        return longer.current() if isinstance(longer, LoadedOnFirstUse) else longer

    def _by_engine(self, encode: Any, text: str) -> Any:
        """``encode(text)`` by the fast engine, sampled for a check."""
        try:
            ids = encode(text)
        except Exception:
            return self._reference(text)
        if self._engine is not None and self._sampled(len(text)):
            # The caller owns the list it is given and may change it.
            submit_check(self._checked, text, list(ids) if isinstance(ids, list) else ids)
        return ids

    def check_splice(self, text: str, ids: Any, tokenized: int, *, seam_rules: bool) -> None:
        """Queue a background check of a splice's ``ids`` for all of ``text``
        if sampled (the seam rules and the engine made them): the splice earns
        by the ``tokenized`` characters, the check costs all of ``text``."""
        if (self._engine is not None or seam_rules) and self._sampled(tokenized, len(text)):
            submit_check(self._checked, text, ids)

    def _sampled(self, chars: int, check_chars: int | None = None) -> bool:
        return next(self._results) < FIRST_CHECKS or self._check_budget.allows(chars, check_chars)

    def _reference_or_none(self, text: str) -> list[int] | None:
        try:
            return self._reference(text)
        except TokenizerRefused:
            return None

    def verify(self, text: str, ids: Any, *, seam_rules: bool, switch_off: Callable[[], None]) -> None:
        """Compare ``ids`` with the reference's; on a difference, with a
        WARNING, stop using the fast engines, forget the memo's verdict and
        call ``switch_off`` (the caller drops its seam rules), for good."""
        short, longer = self._engine, self._long_engine
        engine = self._engine_for(text)
        if engine is None and not seam_rules:
            return
        # A long text tokenized while its engine was loading went to the
        # short texts' engine: either may have made these ids.
        suspects = {engine.name} if engine is not None else set()
        if isinstance(longer, LoadedOnFirstUse) and short is not None and len(text) >= LONG_TEXT_CHARS:
            suspects |= {short.name, longer.chosen}
        got = ids.to_list() if hasattr(ids, "to_list") else ids.tolist() if hasattr(ids, "tolist") else list(ids)
        expected = self._reference_or_none(text)
        if expected is None or got == expected:
            return
        self._engine = self._long_engine = None
        switch_off()
        _distrusted.update((self.spec_digest, name) for name in suspects)
        if self._chosen.memo is not None:  # the next start checks the engines again
            memo, key = self._chosen.memo
            memo.forget(key)
        COUNTERS.add("backend_mismatches")
        logger.warning(
            "tokenizer backend %s gave ids different from tokenizers for %s on a %d-character text "
            "(first difference at id %d); using tokenizers and splicing at added tokens only for it from now on",
            engine.name if engine is not None else "tokenizers with seam rules",
            self.tokenizer_name,
            len(text),
            next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected))),
        )


# (tokenizer spec digest, engine) pairs that gave a wrong result in this
# process: never trusted again, even by a backend rebuilt after eviction.
_distrusted: set[tuple[str, str]] = set()


class CheckBudget:
    """Which results to re-check so that the checks cost a bounded share of
    the engine's CPU, without a clock on the hot path; thread-safe. Costs are
    counted in characters (both engines are linear in the text): each result
    earns ``share`` of its length, and is checked when the credit covers it."""

    def __init__(self, share: float):
        self._share = share
        self._credit = 0.0
        self._lock = threading.Lock()

    def allows(self, chars: int, check_chars: int | None = None) -> bool:
        """Earn credit for ``chars`` tokenized; whether re-tokenizing
        ``check_chars`` (default ``chars``) is then paid for, and spent."""
        cost = chars if check_chars is None else check_chars
        with self._lock:
            self._credit += self._share * chars
            if self._credit < cost:
                return False
            self._credit -= cost
            return True


class SampledVerifier:
    """One daemon thread (an exiting process does not wait for a check of a result it returned)
    re-checking sampled results against `tokenizers`, its CPU counted (``backend_check_cpu_seconds``);
    at most ``capacity`` checks wait, and more are dropped."""

    def __init__(self, capacity: int = CHECK_QUEUE):
        self._queue: queue.Queue[tuple[Checked, str, Any]] = queue.Queue(capacity)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, backend: Checked, text: str, ids: Any) -> bool:
        """Queue a check; False if the queue was full (the check is dropped)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=VERIFIER_THREAD, daemon=True)
                self._thread.start()
        try:
            self._queue.put_nowait((backend, text, ids))
        except queue.Full:
            return False
        return True

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the queued checks; True if done."""
        deadline = Deadline.after(timeout)
        while self._queue.unfinished_tasks and not deadline.passed:
            time.sleep(0.005)
        return self._queue.unfinished_tasks == 0

    def after_fork(self) -> None:
        """In a forked child, without the parent's thread (and maybe with its queue's lock held): start afresh."""
        self._queue = queue.Queue(self._queue.maxsize)
        self._thread = None
        self._lock = threading.Lock()

    def _run(self) -> None:
        while True:
            backend, text, ids = self._queue.get()
            began = time.thread_time()
            try:
                backend.verify(text, ids)
            except Exception:
                logger.exception("tokenizer backend check failed to run")
            finally:
                COUNTERS.add("backend_check_cpu_seconds", time.thread_time() - began)
                # Not kept while waiting for the next check: a prompt may be large.
                del backend, text, ids
                self._queue.task_done()


VERIFIER = SampledVerifier()
os.register_at_fork(after_in_child=VERIFIER.after_fork)

# Process-wide counts of the background checks, and the CPU seconds they took.
COUNTERS = Counters(("backend_checks", "backend_checks_dropped", "backend_mismatches", "backend_check_cpu_seconds"))


def submit_check(check: Checked, text: str, ids: Any) -> None:
    """Queue ``check.verify(text, ids)``, counted (``backend_checks`` or ``backend_checks_dropped``)."""
    COUNTERS.add("backend_checks" if VERIFIER.submit(check, text, ids) else "backend_checks_dropped")

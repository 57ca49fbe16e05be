"""Which engine tokenizes a tokenizer in full, and whether it is still trusted.

``Engines`` is all the cache sees of the fast engines: ids, id arrays, the
engines' names, and the check of a result. It chooses once per process and
specification (the cheapest engine, per length of text, that passes the
start-up check of ``mptok.engines.fast``; or the verdict a start kept in
``mptok.engines.memo``), samples results for ``mptok.engines.tripwire``,
and on a difference stops using the fast engines for that tokenizer for the
rest of the process. The reference tokenizer is handed in as a callable:
this floor knows nothing of the cache above it.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from mptok.core.settings import ENGINES
from mptok.engines import fast
from mptok.engines import memo as engine_memo
from mptok.engines.fast import EngineUnavailable, IdsEngine
from mptok.engines.tripwire import COUNTERS, FIRST_CHECKS, CheckBudget, Checked, submit_check

logger = logging.getLogger(__name__)

# Texts at least this long use the engine that was cheapest on texts this
# long (about 100k tokens), when two engines pass the start-up check.
LONG_TEXT_CHARS = 400_000

# After the first results, the background re-checks of a fast engine's
# results may cost this share of the CPU the engine itself spends.
DEFAULT_CHECK_SHARE = 0.05
# An engine's CPU per character against the reference's, for an engine that
# was handed over rather than timed (fast engines measured 1/30 to 1/100).
DEFAULT_ENGINE_TO_REFERENCE = 1 / 30


class TokenizerRefused(Exception):
    """The Rust tokenizer raised on this text (lone surrogates, say).

    The cache then calls the caller's tokenizer itself, so the caller sees
    exactly what the tokenizer does with the text: its ids or its error.
    """


class Engines:
    """The fast engines of one tokenizer, chosen at start and checked while used.

    Thread-safe. ``reference`` gives the reference tokenizer's ids (raising
    ``TokenizerRefused``); sampled results are checked against it in the
    background by ``checked.verify`` (the backend, which checks its splices
    too). ``choice`` is one of ``CHOICES``: "auto" the cheapest engine (in
    CPU time) that passes the start-up check, "tokenizers" none, an engine's
    name that engine if it passes (else none, with a WARNING). ``engine``
    hands over one the caller vouches for: no start-up check (tests use it
    to build a real mismatch), the background checks as ever, which cost at
    most ``check_share`` of the engine's CPU after the first ``FIRST_CHECKS``.
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
        check_share: float = DEFAULT_CHECK_SHARE,
    ):
        self._reference = reference
        self._checked = checked
        self._added = list(added_tokens)
        self.tokenizer_name = name
        self.spec_digest = hashlib.sha256(spec_json.encode()).hexdigest()
        self._results = itertools.count()
        self._engine: IdsEngine | None = engine
        # Set when another engine is cheaper on long texts: by _choose_engine,
        # or, from the engine memo, one loaded on the first long text.
        self._long_engine: IdsEngine | _LoadedOnFirstUse | None = None
        self.report = "forced" if engine is not None else ""
        # What a verdict kept in the engine memo was made for: set when the
        # engine was chosen here (not handed over), so that a difference
        # found later can remove it.
        self._memo_inputs = (split_special, choice) if engine is None else None
        engine_to_reference = DEFAULT_ENGINE_TO_REFERENCE
        if engine is None and choice != "tokenizers":
            self._engine, self.report, engine_to_reference = self._chosen_engine(spec_json, split_special, choice)
        self._check_budget = CheckBudget(check_share * engine_to_reference)

    @property
    def name(self) -> str:
        """"tokenizers", or the fast engine's name while it is trusted."""
        engine = self._engine
        return "tokenizers" if engine is None else engine.name

    @property
    def names(self) -> dict[str, str]:
        """The engine of texts shorter than ``LONG_TEXT_CHARS`` (``"short"``) and of longer ones (``"long"``)
        now: what ``auto`` picked at start (the short texts' engine for long ones until the long
        texts' engine, named by the engine memo, is loaded), or "tokenizers" once no fast engine is trusted."""
        short, longer = self._engine, self._long_engine
        name = "tokenizers" if short is None else short.name
        return {"short": name, "long": longer.name if longer is not None and short is not None else name}

    @property
    def chosen_names(self) -> dict[str, str]:
        """``names`` as chosen at start: the long texts' engine even before it is loaded."""
        names = self.names
        longer = self._long_engine
        if isinstance(longer, _LoadedOnFirstUse) and self._engine is not None:
            names["long"] = longer.chosen
        return names

    @property
    def summary(self) -> str:
        """The engines chosen, for the start log."""
        names = self.chosen_names
        engines = names["short"] if names["long"] == names["short"] else (
            f"{names['short']}, {names['long']} for texts of {LONG_TEXT_CHARS:,} characters or more"
        )
        if isinstance(self._long_engine, _LoadedOnFirstUse):
            engines += f" (loaded when a server warms the backend, else on the first one; {names['short']} until then)"
        return engines

    @property
    def fast(self) -> bool:
        """Whether full tokenizations go through a fast engine (ids only)."""
        return self._engine is not None

    @property
    def seam_rules_distrusted(self) -> bool:
        """Whether seam rules made a wrong splice for this specification in this process."""
        return self._distrusts((SEAM_RULES,))

    def _distrusts(self, names: Iterable[str]) -> bool:
        """Whether any of ``names`` gave a wrong result for this specification in this process."""
        return any((self.spec_digest, name) in _distrusted for name in names)

    def warm(self) -> None:
        """Ready these engines for a server's first requests: one short text
        tokenized, and the long texts' engine the engine memo named loaded
        now, rather than by the first long text. That load is seconds of CPU
        for a large vocabulary: on a running server it would slow the
        requests beside it, and the start would decide which engine tokenizes
        the first long prompts."""
        self._reference("warm up")
        longer = self._long_engine
        if isinstance(longer, _LoadedOnFirstUse):
            longer.load_now()

    def warm_this_thread(self, text: str) -> None:
        """Run each loaded fast engine on ``text`` on the calling thread.

        A fast engine builds per-thread state on a thread's first calls
        (fastokens: tens of milliseconds of CPU); a server's threads pay it
        here, before they serve. Not a result: nothing is checked in the
        background, so the first results checked are real prompts.
        """
        longer = self._long_engine
        if isinstance(longer, _LoadedOnFirstUse):
            longer = longer.loaded
        for engine in {id(e): e for e in (self._engine, longer) if e is not None}.values():
            getattr(engine, "encode_id_array", engine.encode_ids)(text)

    def encode_ids(self, text: str) -> list[int]:
        """Full tokenization's ids by the cheapest exact engine, a new list.

        Raises ``TokenizerRefused`` for text the reference rejects; text a
        fast engine rejects goes to the reference.
        """
        engine = self._engine_for(text)
        return self._by_engine(engine.encode_ids, text) if engine is not None else self._reference(text)

    def encode_id_array(self, text: str) -> Any:
        """``encode_ids`` as an int array where the engine gives one (the
        cache stores int32 arrays: a list of 200k Python ints is built and
        read again for nothing), else the list. Raises as ``encode_ids``."""
        to_array = getattr(self._engine_for(text), "encode_id_array", None)
        return self._by_engine(to_array, text) if to_array is not None else self.encode_ids(text)

    def _engine_for(self, text: str) -> IdsEngine | None:
        engine, longer = self._engine, self._long_engine
        if longer is None or engine is None or len(text) < LONG_TEXT_CHARS:
            return engine
        return longer.current() if isinstance(longer, _LoadedOnFirstUse) else longer

    def _by_engine(self, encode: Any, text: str) -> Any:
        """``encode(text)`` by the fast engine, sampled for a check; text the
        engine rejects goes to the reference."""
        try:
            ids = encode(text)
        except Exception:
            return self._reference(text)
        self._spot_check(text, ids)
        return ids

    def _spot_check(self, text: str, ids: Any) -> None:
        """Queue a background check of ``ids`` (a list or an int array), a
        fast engine's full tokenization of ``text``, if this result is
        sampled; only fast results are checked."""
        if self._engine is None or not self._sampled(len(text)):
            return
        if isinstance(ids, list):
            ids = list(ids)  # the caller owns the list it was given and may change it
        submit_check(self._checked, text, ids)

    def check_splice(self, text: str, ids: Any, tokenized: int, *, seam_rules: bool) -> None:
        """Queue a background check of a splice's ``ids`` for the whole of
        ``text`` if sampled: the seam rules (if ``seam_rules``) and the
        engine both made them. ``tokenized`` characters were tokenized for
        it; the check re-tokenizes all of ``text``, so it is sampled on the
        same budget."""
        if self._engine is None and not seam_rules:
            return
        if self._sampled(tokenized, len(text)):
            submit_check(self._checked, text, ids)

    def _sampled(self, chars: int, check_chars: int | None = None) -> bool:
        return next(self._results) < FIRST_CHECKS or self._check_budget.allows(chars, check_chars)

    def verify(self, text: str, ids: Any, *, seam_rules: bool, switch_off: Callable[[], None]) -> None:
        """Compare ``ids`` with the reference's; on a difference stop using
        the fast engines and call ``switch_off`` (the caller stops using what
        else made them: its seam rules), with a WARNING; neither the engines
        nor the seam rules are trusted for this tokenizer again in this
        process, and the engine memo's verdict for it is removed."""
        short, longer = self._engine, self._long_engine
        engine = self._engine_for(text)
        if engine is None and not seam_rules:
            return
        # A long text tokenized while its engine was loading went to the
        # short texts' engine: either may have made these ids.
        suspects = {engine.name} if engine is not None else set()
        if isinstance(longer, _LoadedOnFirstUse) and short is not None and len(text) >= LONG_TEXT_CHARS:
            suspects |= {short.name, longer.chosen}
        got = ids.to_list() if hasattr(ids, "to_list") else ids.tolist() if hasattr(ids, "tolist") else list(ids)
        try:
            expected = self._reference(text)
        except TokenizerRefused:
            return
        if got == expected:
            return
        self._engine = self._long_engine = None
        switch_off()
        suspects.add(SEAM_RULES)
        _distrusted.update((self.spec_digest, name) for name in suspects)
        self._forget_memo()
        COUNTERS.add("backend_mismatches")
        logger.warning(
            "tokenizer backend %s gave ids different from tokenizers for %s on a %d-character text "
            "(first difference at id %d); using tokenizers and splicing at added tokens only for it from now on",
            engine.name if engine is not None else "tokenizers with seam rules",
            self.tokenizer_name,
            len(text),
            next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected))),
        )

    def _chosen_engine(
        self, spec_json: str, split_special: bool, choice: str
    ) -> tuple[IdsEngine | None, str, float]:
        """``_choose_engine``'s verdict, made once per process for a
        specification (a tokenizer loaded again, or by another caller, has
        the same one): its engines are shared, unless one was distrusted
        since. A process's first verdict for it comes from the engine memo
        when that holds one for the same key, else it is made here and kept
        there."""
        slot = (self.spec_digest, split_special, choice)
        with _verdicts_lock:
            verdict = _verdicts.get(slot)
        if verdict is not None and not self._distrusts(name for e in verdict[:2] if e is not None for name in _names_of(e)):
            engine, self._long_engine, report, ratio = verdict
            return engine, report + " (decided earlier in this process)", ratio
        texts = fast.self_check_texts(self._added_contents())
        memo = engine_memo.from_env()
        if memo is None:
            engine, report, ratio, _ = self._choose_engine(spec_json, split_special, choice, texts)
            report = f"decided at this start, engine memo off: {report}"
        else:
            key = engine_memo.memo_key(self.spec_digest, split_special, choice, texts)
            remembered = self._remembered(memo, key, spec_json, split_special)
            if remembered is None:
                # Processes that start at once: one decides, the others wait
                # for its verdict rather than each timing the engines
                # against the others' load and choosing apart.
                with memo.deciding(key) as held:
                    remembered = self._remembered(memo, key, spec_json, split_special) if held else None
                    if remembered is None:
                        remembered = self._decided(memo, key, spec_json, split_special, choice, texts)
            engine, report, ratio = remembered
        if not self._distrusts(ENGINES):
            with _verdicts_lock:
                _verdicts[slot] = (engine, self._long_engine, report, ratio)
        return engine, report, ratio

    def _remembered(
        self, memo: engine_memo.EngineMemo, key: dict[str, Any], spec_json: str, split_special: bool
    ) -> tuple[IdsEngine | None, str, float] | None:
        """The verdict ``memo`` keeps for ``key`` with its engines loaded (and
        ``_long_engine`` set), or None: none kept, one naming an engine
        distrusted here, or one whose engine does not load now."""
        verdict = memo.read(key)
        if verdict is None or self._distrusts(verdict.engines):
            return None
        engine = None
        if verdict.short != "tokenizers":
            try:
                engine = fast.load_engine(verdict.short, spec_json, split_special)
            except EngineUnavailable as e:
                logger.warning(
                    "engine memo %s names %s, which does not load now (%s); deciding again", memo.path(key), verdict.short, e
                )
                return None
        # The long texts' engine when a long text comes, or when a server
        # warms the backend: a library process that never sees one does not
        # pay for loading it (seconds for a large vocabulary).
        self._long_engine = (
            _LoadedOnFirstUse(verdict.long, spec_json, split_special, meanwhile=engine)
            if engine is not None and verdict.long != verdict.short
            else None
        )
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(verdict.decided_at))
        source = f"from the engine memo {memo.path(key)}, decided by pid {verdict.decided_by} at {when}"
        return engine, f"{source}: {verdict.report}", verdict.ratio

    def _decided(
        self,
        memo: engine_memo.EngineMemo,
        key: dict[str, Any],
        spec_json: str,
        split_special: bool,
        choice: str,
        texts: list[str],
    ) -> tuple[IdsEngine | None, str, float]:
        """``_choose_engine``'s verdict, kept in ``memo`` unless an engine
        was found wrong for this tokenizer in this process (the check and
        the timing then did not see every engine)."""
        engine, report, ratio, passed = self._choose_engine(spec_json, split_special, choice, texts)
        if self._distrusts(ENGINES):
            return engine, f"decided at this start, not kept: an engine was found wrong here: {report}", ratio
        short = engine.name if engine is not None else "tokenizers"
        longer = self._long_engine.name if self._long_engine is not None and engine is not None else short
        verdict = engine_memo.Verdict(short, longer, passed, ratio, report, os.getpid(), time.time())
        kept = f"kept in the engine memo {memo.path(key)}" if memo.write(key, verdict) else "the engine memo could not be written"
        return engine, f"decided at this start, {kept}: {report}", ratio

    def _forget_memo(self) -> None:
        """Remove the verdict the engine memo keeps for this backend's
        tokenizer: an engine it trusted gave a wrong result, so the next
        start checks the engines again."""
        if self._memo_inputs is None:
            return
        memo = engine_memo.from_env()
        if memo is not None:
            split_special, choice = self._memo_inputs
            texts = fast.self_check_texts(self._added_contents())
            memo.forget(engine_memo.memo_key(self.spec_digest, split_special, choice, texts))

    def _choose_engine(
        self, spec_json: str, split_special: bool, choice: str, texts: list[str]
    ) -> tuple[IdsEngine | None, str, float, tuple[str, ...]]:
        """The engine to use (None: `tokenizers`), why, its CPU per
        character against the reference's, and the engines that passed
        the check on ``texts``."""
        names = ENGINES if choice == "auto" else (choice,)
        expected: dict[str, list[int] | None] = {}

        def reference(text: str) -> list[int] | None:
            if text not in expected:
                try:
                    expected[text] = self._reference(text)
                except TokenizerRefused:
                    expected[text] = None
            return expected[text]

        timing = fast.timing_texts(texts[-1])
        notes = []
        candidates: list[tuple[float, IdsEngine]] = []
        two_pass = _overlapping_added_tokens(self._added)
        if two_pass:
            # tokenizers matches non-normalized added tokens before normalized
            # ones; both engines match them in one pass, and so does the
            # segment splice's proof. Where the two kinds overlap they differ.
            return None, f"added tokens {two_pass} overlap across the normalized and raw passes", DEFAULT_ENGINE_TO_REFERENCE, ()
        for name in names:
            if self._distrusts((name,)):
                notes.append(f"{name}: gave different ids for this tokenizer earlier in this process")
                continue
            try:
                engine = fast.load_engine(name, spec_json, split_special)
            except EngineUnavailable as e:
                notes.append(f"{name}: {e}")
                continue
            difference = fast.first_difference(engine, reference, texts)
            if difference is not None:
                notes.append(f"{name}: {difference}")
                continue
            cost = fast.cost_of(engine.encode_ids, timing)
            notes.append(f"{name}: {cost.cpu_seconds * 1e3:.2f} ms CPU")
            candidates.append((cost.cpu_seconds, engine))
        if choice != "auto" and not candidates:
            logger.warning("tokenizer backend %s refused for %s (%s); using tokenizers", choice, self.tokenizer_name, notes[0])
        passed = tuple(e.name for _, e in candidates)
        if not candidates:
            return None, "; ".join(notes), DEFAULT_ENGINE_TO_REFERENCE, passed
        # `tokenizers` is linear in the text and ~30x slower: timed on a tenth.
        tenth = fast.cost_of(lambda t: self._reference(t), [t[: len(t) // 10] for t in timing])
        reference_cost = fast.Cost(tenth.cpu_seconds * 10, tenth.wall_seconds * 10)
        notes.append(f"tokenizers: {reference_cost.cpu_seconds * 1e3:.2f} ms CPU")
        cpu, engine = min(candidates, key=lambda c: c[0])
        if choice == "auto" and cpu >= reference_cost.cpu_seconds:
            return None, "; ".join(notes), DEFAULT_ENGINE_TO_REFERENCE, passed
        ratio = cpu / reference_cost.cpu_seconds if reference_cost.cpu_seconds > 0 else DEFAULT_ENGINE_TO_REFERENCE
        report = f"{len(timing[0])} characters: " + "; ".join(notes)
        if len(candidates) > 1:
            # Which engine is cheaper changes with the length (fastokens
            # spreads a long text over threads): long texts are timed apart.
            long_timing = fast.timing_texts(texts[-1], chars=LONG_TEXT_CHARS * 2, count=2)
            if len(long_timing[0]) >= LONG_TEXT_CHARS:
                costs = [(fast.cost_of(e.encode_ids, long_timing).cpu_seconds, e) for _, e in candidates]
                self._long_engine = min(costs, key=lambda c: c[0])[1]
                report += f"; {len(long_timing[0])} characters: " + "; ".join(
                    f"{e.name}: {c * 1e3:.2f} ms CPU" for c, e in costs
                )
        return engine, report, ratio, passed

    def _added_contents(self) -> list[str]:
        return [t.content for t in self._added]


class _LoadedOnFirstUse:
    """The engine the engine memo names for long texts, loaded on a
    background thread when the first long text asks for it, or at start by
    a server (``Engines.warm``); until it is loaded, long texts go
    to the short texts' engine (``meanwhile``), which
    passed the same check. ``name`` is the engine that tokenizes long texts
    now; ``chosen`` the one named. Shared by the backends of one
    specification, as the engines are."""

    def __init__(self, chosen: str, spec_json: str, split_special: bool, *, meanwhile: IdsEngine):
        self.chosen = chosen
        self._spec: tuple[str, bool] | None = (spec_json, split_special)
        self._meanwhile = meanwhile
        self._engine: IdsEngine | None = None
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return (self._engine or self._meanwhile).name

    @property
    def loaded(self) -> IdsEngine | None:
        """The chosen engine once loaded, else None (nothing is loaded for asking)."""
        return self._engine

    def current(self) -> IdsEngine:
        """The engine for a long text now; starts loading the chosen one."""
        engine = self._engine
        if engine is not None:
            return engine
        spec = self._claim_load()
        if spec is not None:
            threading.Thread(target=self._load, args=spec, name="mptok-long-engine", daemon=True).start()
        return self._meanwhile

    def load_now(self) -> None:
        """Load the chosen engine on this thread, unless a load has started."""
        spec = self._claim_load()
        if spec is not None:
            self._load(*spec)

    def _claim_load(self) -> tuple[str, bool] | None:
        """What to load the engine from, to the first caller only: one load per engine."""
        with self._lock:
            spec, self._spec = self._spec, None
        return spec

    def _load(self, spec_json: str, split_special: bool) -> None:
        try:
            self._engine = fast.load_engine(self.chosen, spec_json, split_special)
        except EngineUnavailable as e:
            logger.warning("tokenizer backend %s did not load for long texts (%s); %s tokenizes them", self.chosen, e, self._meanwhile.name)
        else:
            logger.info("tokenizer backend %s loaded for texts of %s characters or more", self.chosen, f"{LONG_TEXT_CHARS:,}")


def _names_of(engine: IdsEngine | _LoadedOnFirstUse) -> set[str]:
    """The engines ``engine`` stands for (a long texts' engine not loaded yet: both)."""
    return {engine.name, engine.chosen} if isinstance(engine, _LoadedOnFirstUse) else {engine.name}


# (spec digest, split_special, choice) -> (engine, long-text engine, report,
# engine CPU per character against the reference's): the start-up check and
# timing take seconds, and their verdict depends only on the specification.
_verdicts: dict[tuple[str, bool, str], tuple[IdsEngine | None, IdsEngine | _LoadedOnFirstUse | None, str, float]] = {}
_verdicts_lock = threading.Lock()

# (tokenizer spec digest, engine) pairs that gave a wrong result in this
# process: never trusted again, even by a backend rebuilt after eviction.
_distrusted: set[tuple[str, str]] = set()
# What ``_distrusted`` names for a specification whose seam rules gave a wrong splice.
SEAM_RULES = "seam rules"


def _overlapping_added_tokens(tokens: Any) -> tuple[str, str] | None:
    """A normalized and a raw added token that one left-to-right pass over
    both would match differently from tokenizers' two passes (raw first),
    or None: the normalized one holds the raw one, or ends with its start
    (matched first, being leftmost, it would take the raw one's start)."""
    normalized = [t.content for t in tokens if t.normalized and t.content]
    raw = [t.content for t in tokens if not t.normalized and t.content]
    if not normalized or not raw:
        return None
    # A tokenizer may have a thousand raw tokens: trying every pair is
    # millions of string operations at every start. Sets of what a raw token
    # can be in a normalized one (itself, or a proper start of it) find the
    # normalized tokens that overlap one; only their pairs are then tried,
    # in order, for the same answer.
    whole = set(raw)
    starts = {b[:n] for b in raw for n in range(1, len(b))}
    for a in normalized:
        if not (
            any(a[i:j] in whole for i in range(len(a)) for j in range(i + 1, len(a) + 1))
            or any(a[-n:] in starts for n in range(1, len(a)))
        ):
            continue
        for b in raw:
            if b in a or any(a.endswith(b[:n]) for n in range(1, min(len(a), len(b)))):
                return a, b
    return None


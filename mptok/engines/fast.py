"""Faster engines for full tokenization, trusted per tokenizer only after a check.

fastokens and gigatoken load the same ``tokenizer.json`` as `tokenizers` and
give the same ids some 30 times faster, ids only, and each refuses some
layouts. This module loads them, checks them id for id at start, times them
(``mptok.engines.timing``) and chooses (``Chooser``); ``mptok.engines.choice``
runs and re-checks them. Nothing proves that two implementations agree on
every text, so the trust rests on three things:

1. Both load the same deterministic specification, except where they read
   it otherwise: they match raw and normalized added tokens in one pass, so
   a tokenizer whose two kinds overlap is not given to them.
2. At start an engine must give `tokenizers`' ids on a fixed adversarial
   corpus built for the tokenizer (``self_check_texts``), or is not used;
   the verdict is kept in the engine memo (``mptok.engines.memo``).
3. While serving, results are re-checked in the background within a CPU
   budget; one difference switches the tokenizer back to `tokenizers` for
   the process (which bounds how long a diverging engine is used).

A deployment for which that is not enough forces `tokenizers`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mptok.core.settings import ENGINES
from mptok.engines import memo as engine_memo
from mptok.engines.timing import LONG_ROUNDS, ROUNDS, IdsEngine, compare

logger = logging.getLogger(__name__)


class EngineUnavailable(Exception):
    """The engine is not installed, or cannot load this tokenizer's layout."""

    def __init__(self, message: str):
        super().__init__(message.strip().splitlines()[0] if message.strip() else message)


class _Fastokens:
    name = "fastokens"

    def __init__(self, spec_json: str, split_special: bool):
        self._tokenizer = _loaded(self.name, lambda package: package.Tokenizer.from_json_str(spec_json))
        self._split_special = split_special

    def encode_ids(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False, split_special_tokens=self._split_special).ids

    def encode_id_array(self, text: str) -> np.ndarray:
        # The flat batch call answers with uint32 bytes: no list of Python
        # ints to build and convert (that costs as much as the encode).
        ids, _ = self._tokenizer.encode_batch_flat(
            [text], add_special_tokens=False, split_special_tokens=self._split_special
        )
        return np.frombuffer(ids, dtype=np.uint32)


class _Gigatoken:
    name = "gigatoken"

    def __init__(self, spec_json: str, split_special: bool):
        if split_special:
            raise EngineUnavailable("gigatoken always splits out special tokens (split_special_tokens is set)")
        self._tokenizer = _loaded(self.name, lambda package: package.Tokenizer.from_json(spec_json))
        # A gigatoken Tokenizer refuses a call while another thread's runs
        # ("Already borrowed"): a server's threads share one, so they take turns.
        self._one_call = threading.Lock()

    def encode_ids(self, text: str) -> list[int]:
        return self.encode_id_array(text).tolist()

    def encode_id_array(self, text: str) -> np.ndarray:
        # gigatoken answers with a uint32 array: no Python ints on the way
        # to the cache's int32 store (ids past int32 are refused there).
        with self._one_call:
            return self._tokenizer.encode(text)


_ENGINE_CLASSES = {"fastokens": _Fastokens, "gigatoken": _Gigatoken}
_import_failures: dict[str, str] = {}
_import_lock = threading.Lock()


def _loaded(name: str, load: Callable[[Any], Any]) -> Any:
    """``load(package)`` of engine ``name``'s package; ``EngineUnavailable``
    if it does not import (logged once per process) or load."""
    try:
        package = importlib.import_module(name)
    except Exception as e:
        with _import_lock:
            first = name not in _import_failures
            _import_failures[name] = repr(e)
        if first:
            logger.info("tokenizer backend %s unavailable: %r", name, e)
        raise EngineUnavailable(f"{name} is not importable: {e!r}") from e
    try:
        return load(package)
    except Exception as e:
        raise EngineUnavailable(f"{name} cannot load this tokenizer: {e}") from e


def load_engine(name: str, spec_json: str, split_special: bool) -> IdsEngine:
    """The engine ``name`` loaded from ``spec_json``; raises ``EngineUnavailable``."""
    return _ENGINE_CLASSES[name](spec_json, split_special)


# -- the start-up check -----------------------------------------------------------

_PIECES = (
    "e\u0301", "e\u0301\u0301\u0301", "a\u0308\u0301", "Z\u0351\u0368\u0314a\u0306\u0301l\u0315go",
    "\u0301", "\u0301\u0301 x", "n\u0303o\u0328\u0301", "\uac00\u11a8", "\u1100\u1161\u11a8",
    "caf\u00e9", "Cafe\u0301", "\ufb01", "\u2126", "\u212b",
    "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466", "\U0001f3f3\ufe0f\u200d\U0001f308",
    "\U0001f44d\U0001f3fd", "\U0001f1eb\U0001f1f7\U0001f1ef\U0001f1f5", "\u2764\ufe0f", "\U0001f600" * 3,
    "\u6211\u4eec\u4eca\u5929\u53bb\u5317\u4eac", "\u4eca\u65e5\u306f\u3044\u3044\u5929\u6c17",
    "\u30ab\u30bf\u30ab\u30ca", "\uc548\ub155\ud558\uc138\uc694", "\u0645\u0631\u062d\u0628\u0627",
    "\u0928\u092e\u0938\u094d\u0924\u0947", "\u05e9\u05dc\u05d5\u05dd", "\u0422\u0435\u0441\u0442",
    "\r\n", "\r\n\r\n", "\r", "\n\n\n", "\t", "\t\t x", " ", "  ", "     ", " " * 17, "\u00a0", "\u3000",
    "\u2003", " \n ", "\n \n", "\ufeff", "\x00", "\x7f", "\ufffd", "\u200b", "\u2581", "\u2581\u2581x",
    "0", "12", "123", "1234", "1234567890", "3.14159", "1,000,000", "\uff11\uff12\uff13", "\u0661\u0662",
    "x" * 40, "aaaa", "don't", "I'm", "'s", "hello", " world", "Hello, World!", "--", "...", "!!!",
    "<", ">", "</", "<|", "|>", "[", "]", "```python\n", "def f(x):\n    return x\n", "a=b;c=d",
    "http://example.com/a?b=c", "#", "@user", "$", "\\", "\"quoted\"", "{\"k\": [1, 2]}",
)


def self_check_texts(added_contents: Iterable[str]) -> list[str]:
    """The fixed adversarial corpus an engine must reproduce id for id: the
    pieces and the tokenizer's added tokens (a fixed sample of many) alone,
    in context and mixed, and one long text of everything."""
    rng = random.Random(0)
    added = sorted(set(c for c in added_contents if c))
    if len(added) > 48:
        added = added[:16] + added[-16:] + rng.sample(added[16:-16], 16)
    pieces = list(_PIECES) + added
    texts = list(pieces)
    for content in added:
        texts += [content + content, "x" + content + "y", " " + content + " ", "\n" + content + "\n\n"]
        # Where a normalizer or a prefix space could make text match a token
        # that the raw text does not: its content trimmed, after another.
        trimmed = content.strip()
        if trimmed and trimmed != content:
            texts += [trimmed, trimmed + " and", added[0] + trimmed + " and"]
    for _ in range(400):
        texts.append("".join(rng.choice(pieces) for _ in range(rng.randint(2, 12))))
    texts.append("".join(texts))
    return texts


def first_difference(engine: IdsEngine, reference: Callable[[str], list[int] | None], texts: Sequence[str]) -> str | None:
    """How ``engine`` first differs from ``reference`` (None: a text it refuses) on ``texts``, or None."""
    for text in texts:
        expected = reference(text)
        if expected is None:
            continue
        for encode in (engine.encode_ids, engine.encode_id_array):
            try:
                got = [int(i) for i in encode(text)]
            except Exception as e:
                return f"raised {e!r} on a {len(text)}-character text"
            if got != expected:
                return f"gave different ids on a {len(text)}-character text {text[:40]!r}"
    return None


# The timing texts' sources (about 0.5M characters, 1.9M with the second set).
_TIMING_MODULES = ("argparse", "difflib", "inspect", "pathlib", "textwrap", "typing")
_MORE_TIMING_MODULES = (
    "pydoc", "_pydecimal", "tarfile", "subprocess", "unittest.mock", "email._header_value_parser",
    "logging", "zipfile", "ssl", "shutil", "collections", "threading", "ast", "enum", "dataclasses", "datetime",
)


def timing_texts(fallback: str, chars: int = 200_000, count: int = 3) -> list[str]:
    """``count`` texts of ``chars`` characters (about 50k tokens, where
    fastokens' threads start to cost CPU) of the standard library's sources, else of ``fallback``."""
    names = _TIMING_MODULES if chars * count <= 480_000 else _TIMING_MODULES + _MORE_TIMING_MODULES
    try:
        source = "".join(open(importlib.import_module(m).__file__, encoding="utf-8").read() for m in names)
    except (OSError, TypeError, ImportError):
        source = fallback
    size = min(chars, len(source) // count)
    return [source[i * size : (i + 1) * size] for i in range(count)]


def cpu_cost(encode: Callable[[str], object], texts: Sequence[str]) -> float:
    """The median CPU time of ``encode`` over ``texts`` (``time.process_time``: all its threads)."""
    cpus = []
    for text in texts:
        began = time.process_time()
        encode(text)
        cpus.append(time.process_time() - began)
    return sorted(cpus)[len(cpus) // 2]


# -- the choice -------------------------------------------------------------------

# Texts this long (about 100k tokens) or longer use the engine cheapest on them.
LONG_TEXT_CHARS = 400_000
# The CPU per character of an engine not timed against the reference's (measured: 1/30 to 1/100).
DEFAULT_ENGINE_TO_REFERENCE = 1 / 30


@dataclass(frozen=True)
class Chosen:
    """What ``Chooser`` decided: the engines of texts shorter than ``LONG_TEXT_CHARS``
    (None: `tokenizers`) and of longer ones (None: the same), as ``memo.Verdict`` keeps it."""

    engine: IdsEngine | None
    long_engine: IdsEngine | LoadedOnFirstUse | None
    report: str
    ratio: float = DEFAULT_ENGINE_TO_REFERENCE
    load: float = 0.0
    spread: float = 0.0
    memo: tuple[engine_memo.EngineMemo, dict[str, Any]] | None = None

    @property
    def names(self) -> set[str]:
        """The engines this stands for (a long texts' engine not loaded yet: both)."""
        engines = [e for e in (self.engine, self.long_engine) if e is not None]
        return {e.name for e in engines} | {e.chosen for e in engines if isinstance(e, LoadedOnFirstUse)}


@dataclass(frozen=True)
class Chooser:
    """The choice of a tokenizer's engines for ``choice`` ("auto": the
    cheapest that passes the start-up check, `tokenizers` included; an
    engine's name: it if it passes, else `tokenizers` with a WARNING).
    ``distrusts(names)``: whether any gave a wrong result here."""

    reference: Callable[[str], list[int] | None]
    spec_json: str
    spec_digest: str
    split_special: bool
    choice: str
    added: list[Any]
    name: str
    distrusts: Callable[[Iterable[str]], bool]

    def choose(self) -> Chosen:
        """Decided once per process and specification (unless an engine was
        distrusted since): the memo's verdict unless stale, else decided here and kept there."""
        slot = (self.spec_digest, self.split_special, self.choice)
        with _verdicts_lock:
            chosen = _verdicts.get(slot)
        if chosen is not None and not self.distrusts(chosen.names):
            return dataclasses.replace(chosen, report=chosen.report + " (decided earlier in this process)")
        texts = self_check_texts(t.content for t in self.added)
        memo = engine_memo.from_env()
        if memo is None:
            chosen, _ = self._decide(texts)
            chosen = dataclasses.replace(chosen, report=f"decided at this start, engine memo off: {chosen.report}")
        else:
            key = engine_memo.memo_key(self.spec_digest, self.split_special, self.choice, texts)
            chosen = dataclasses.replace(self._from_memo(memo, key, texts), memo=(memo, key))
        if not self.distrusts(ENGINES):
            with _verdicts_lock:
                _verdicts[slot] = chosen
        return chosen

    def _from_memo(self, memo: engine_memo.EngineMemo, key: dict[str, Any], texts: list[str]) -> Chosen:
        """The verdict ``memo`` keeps for ``key``, or one decided here and kept there."""
        verdict = self._kept(memo, key)
        if verdict is not None and verdict.stale(time.time(), engine_memo.machine_load()) is None:
            return self._remembered(memo, key, verdict)
        # Starts at once: one decides, the others wait for its verdict rather
        # than time the engines against each other's load and choose apart.
        with memo.deciding(key) as held:
            if held:
                verdict = self._kept(memo, key)
            stale = verdict.stale(time.time(), engine_memo.machine_load()) if verdict is not None else None
            if verdict is not None and (stale is None or not held):
                # Decided meanwhile, or stale while another start decides: still exact.
                return self._remembered(memo, key, verdict)
            return self._decided(memo, key, texts, verdict, stale)

    def _kept(self, memo: engine_memo.EngineMemo, key: dict[str, Any]) -> engine_memo.Verdict | None:
        """The verdict ``memo`` keeps for ``key``, unless it names an engine distrusted here."""
        verdict = memo.read(key)
        return None if verdict is None or self.distrusts(verdict.engines) else verdict

    def _remembered(self, memo: engine_memo.EngineMemo, key: dict[str, Any], verdict: engine_memo.Verdict) -> Chosen:
        """``verdict`` with its engines loading."""
        engine = None
        if verdict.short != "tokenizers":
            engine = LoadingEngine(verdict.short, self.spec_json, self.split_special)
        # Loaded by the first long text or a server's warm-up: a library
        # process that never sees one does not pay for it.
        longer = None
        if engine is not None and verdict.long != verdict.short:
            longer = LoadedOnFirstUse(verdict.long, self.spec_json, self.split_special, meanwhile=engine)
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(verdict.decided_at))
        source = f"from the engine memo {memo.path(key)}, decided by pid {verdict.decided_by} at {when}"
        return Chosen(engine, longer, f"{source}: {verdict.report}", verdict.ratio, verdict.load, verdict.spread)

    def _decided(
        self, memo: engine_memo.EngineMemo, key: dict[str, Any], texts: list[str], stale: engine_memo.Verdict | None, why: str | None
    ) -> Chosen:
        """``_decide``'s verdict (on a ``stale`` one, ``why``), kept in ``memo``
        unless an engine was found wrong here (then not every engine was seen)."""
        chosen, passed = self._decide(texts, stale)
        if self.distrusts(ENGINES):
            return dataclasses.replace(chosen, report=f"decided at this start, not kept: an engine was found wrong here: {chosen.report}")
        short = chosen.engine.name if chosen.engine is not None else "tokenizers"
        longer = chosen.long_engine.name if chosen.long_engine is not None else short
        verdict = engine_memo.Verdict(
            short, longer, passed, chosen.ratio, chosen.report, os.getpid(), time.time(), chosen.load, chosen.spread
        )
        kept = f"kept in the engine memo {memo.path(key)}" if memo.write(key, verdict) else "the engine memo could not be written"
        again = "" if stale is None else f" again ({why}; it chose {stale.short}, {stale.long} for long texts)"
        return dataclasses.replace(chosen, report=f"decided{again} at this start, {kept}: {chosen.report}")

    def _decide(self, texts: list[str], stale: engine_memo.Verdict | None = None) -> tuple[Chosen, tuple[str, ...]]:
        """The engines checked on ``texts`` and timed, and those that passed.
        A ``stale`` verdict's engines that passed are timed, not checked
        again (the key is the same), and its choice is the incumbent."""
        choice = self.choice
        names = ENGINES if choice == "auto" else (choice,)
        reference = functools.cache(self.reference)  # each engine is checked on the same texts
        two_pass = _overlapping_added_tokens(self.added)
        if two_pass:
            # The engines match both kinds in one pass (module docstring, 1).
            return Chosen(None, None, f"added tokens {two_pass} overlap across the normalized and raw passes"), ()
        if stale is not None:
            names = tuple(name for name in names if name in stale.passed)
        notes = []
        candidates: list[IdsEngine] = []
        for name in names:
            if self.distrusts((name,)):
                notes.append(f"{name}: gave different ids for this tokenizer earlier in this process")
                continue
            try:
                engine = load_engine(name, self.spec_json, self.split_special)
            except EngineUnavailable as e:
                notes.append(f"{name}: {e}")
                continue
            if stale is None:
                difference = first_difference(engine, reference, texts)
                if difference is not None:
                    notes.append(f"{name}: {difference}")
                    continue
            candidates.append(engine)
        if choice != "auto" and not candidates:
            logger.warning("tokenizer backend %s refused for %s (%s); using tokenizers", choice, self.name, notes[0])
        passed = tuple(e.name for e in candidates)
        if not candidates:
            return Chosen(None, None, "; ".join(notes)), passed
        by_name = {e.name: e for e in candidates}
        load = engine_memo.machine_load()
        timing = timing_texts(texts[-1])
        short = compare(candidates, timing, ROUNDS, stale.short if stale and stale.short in by_name else passed[0])
        # `tokenizers` (linear, ~30x slower): a tenth, seen once, timed, times ten.
        tenths = [t[: len(t) // 10] for t in timing]
        cpu_cost(self.reference, tenths)
        reference_cpu = 10 * cpu_cost(self.reference, tenths)
        notes += [short.describe(), f"tokenizers: {reference_cpu * 1e3:.2f} ms CPU"]
        cpu, engine = short.costs[short.chosen], by_name[short.chosen]
        if choice == "auto" and cpu >= reference_cpu:
            return Chosen(None, None, "; ".join(notes)), passed
        ratio = cpu / reference_cpu if reference_cpu > 0 else DEFAULT_ENGINE_TO_REFERENCE
        longer, spread = None, short.spread
        if len(candidates) > 1:
            # Long texts are timed apart: fastokens spreads them over threads.
            long_timing = timing_texts(texts[-1], chars=LONG_TEXT_CHARS * 2, count=2)
            if len(long_timing[0]) >= LONG_TEXT_CHARS:
                incumbent = stale.long if stale and stale.long in by_name else short.chosen
                long = compare(candidates, long_timing, LONG_ROUNDS, incumbent)
                longer, spread = by_name[long.chosen], max(spread, long.spread)
                notes.append(long.describe())
        load = max(load, engine_memo.machine_load())
        notes.append(f"load average {load:.2f} per CPU, rounds {spread:.0%} apart")
        return Chosen(engine, longer, "; ".join(notes), ratio, load, spread), passed


# Engine loads run on threads that are not daemons: interpreter exit waits for
# a load (it is finite) instead of ending its thread inside Rust, which
# aborts the process ("FATAL: exception not rethrown").


class LoadingEngine:
    """The engine a memo names, loaded on a thread of its own while the rest of its backend is
    built; its calls wait for it, and raise if it did not load (``Engines`` then uses the reference)."""

    def __init__(self, name: str, spec_json: str, split_special: bool):
        self.name = name
        self._engine: IdsEngine | None = None
        self._thread = threading.Thread(target=self._load, args=(spec_json, split_special), name="mptok-engine-load")
        self._thread.start()

    def wait(self) -> None:
        """Return once the load has ended, loaded or not."""
        self._thread.join()

    def _load(self, spec_json: str, split_special: bool) -> None:
        try:
            self._engine = load_engine(self.name, spec_json, split_special)
        except EngineUnavailable as e:
            logger.warning("tokenizer backend %s, which the engine memo names, did not load (%s); tokenizers tokenizes", self.name, e)
            self.name = "tokenizers"  # what the metrics then say

    def _loaded(self) -> IdsEngine:
        if self._engine is None:
            self._thread.join()
            if self._engine is None:
                raise EngineUnavailable(f"{self.name} did not load")
        return self._engine

    def encode_ids(self, text: str) -> list[int]:
        return self._loaded().encode_ids(text)

    def encode_id_array(self, text: str) -> np.ndarray:
        return self._loaded().encode_id_array(text)


class LoadedOnFirstUse:
    """The memo's engine for long texts, loaded on a thread by the first
    long text or by ``Engines.warm``; until then long texts go to
    ``meanwhile``, the short texts' engine, which passed the same check."""

    def __init__(self, chosen: str, spec_json: str, split_special: bool, *, meanwhile: IdsEngine):
        self.chosen = chosen
        self._spec: tuple[str, bool] | None = (spec_json, split_special)
        self._meanwhile = meanwhile
        self.loaded: IdsEngine | None = None
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return (self.loaded or self._meanwhile).name

    def current(self) -> IdsEngine:
        """The engine for a long text now; starts loading the chosen one."""
        spec = self._claim_load() if self.loaded is None else None
        if spec is not None:
            threading.Thread(target=self._load, args=spec, name="mptok-long-engine").start()
        return self.loaded or self._meanwhile

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
            self.loaded = load_engine(self.chosen, spec_json, split_special)
        except EngineUnavailable as e:
            logger.warning("tokenizer backend %s did not load for long texts (%s); %s tokenizes them", self.chosen, e, self._meanwhile.name)
        else:
            logger.info("tokenizer backend %s loaded for texts of %s characters or more", self.chosen, f"{LONG_TEXT_CHARS:,}")


# (spec digest, split_special, choice) -> the verdict, decided once per process.
_verdicts: dict[tuple[str, bool, str], Chosen] = {}
_verdicts_lock = threading.Lock()


def _overlapping_added_tokens(tokens: Any) -> tuple[str, str] | None:
    """A normalized and a raw added token that one left-to-right pass over
    both would match differently from tokenizers' two passes (raw first),
    or None: the normalized one holds the raw one, or ends with its start
    (matched first, being leftmost, it would take the raw one's start)."""
    normalized = [t.content for t in tokens if t.normalized and t.content]
    raw = [t.content for t in tokens if not t.normalized and t.content]
    if not normalized or not raw:
        return None
    # Not every pair (a thousand raw tokens make millions): sets of what a
    # raw token can be in a normalized one find the normalized tokens whose
    # pairs are then tried, in order, for the same answer.
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

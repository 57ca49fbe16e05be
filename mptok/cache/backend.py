"""The tokenizers that the cache drives, derived once from the caller's tokenizer.

The cache cannot call ``tokenizer(text, add_special_tokens=False)``:
transformers' ``__call__`` rewrites the tokenizer's truncation and padding
state on every call and fails with "Already borrowed" when threads share
it. The Rust ``tokenizers.Tokenizer`` under a fast tokenizer is
thread-safe, so the cache drives a private copy of it, without truncation,
padding or post-processor (with ``add_special_tokens=False`` it adds no
ids; it only trims offsets, which the seam rules' check needs untrimmed).
A second copy, the *continuation* tokenizer, has every segment-start prefix
switched off, for a tail cut from the middle of a segment (docs/CACHE.md).
Full tokenizations go through ``mptok.engines.choice.Engines``: a fast
engine while it is trusted, else this copy.
"""

from __future__ import annotations

import copy
import itertools
import logging
import threading
from collections import OrderedDict
from typing import Any

import orjson
from tokenizers import Encoding, Tokenizer

from mptok.cache.config import CacheConfig
from mptok.cache.seam import PREFIX_FIRST_UNLESS_SPACE, PREFIX_UNLESS_SPACE, SeamRules, SegmentOpeners
from mptok.cache.seam_rules import derive_rules, prove_rules
from mptok.core.settings import CHOICES, ENGINES
from mptok.engines.choice import COUNTERS, Engines, TokenizerRefused
from mptok.engines.fast import IdsEngine, self_check_texts

logger = logging.getLogger(__name__)


class SlowTokenizerError(TypeError):
    """The cache cannot drive this tokenizer: it has no Rust backend, or its
    Rust tokenizer could not be copied. The caller's tokenizer is used as is."""


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


def default_choice() -> str:
    """``MPTOK_CACHE_TOKENIZER_BACKEND`` if set to one of ``CHOICES``, else "auto"."""
    try:
        return CacheConfig().tokenizer_backend
    except ValueError:
        return "auto"  # the cache says so when it is made with that value


def backend_for(tokenizer: Any, choice: str) -> TokenizerBackend:
    """The process-wide ``TokenizerBackend`` of ``tokenizer`` and ``choice``
    (one of ``CHOICES``), built on first use; it holds ``tokenizer`` (so its
    id cannot be reused) until ``MAX_BACKENDS`` newer ones have been built.
    Raises ``SlowTokenizerError``."""
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
    if isinstance(known, SlowTokenizerError):
        raise known
    return known


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


def backend_stats() -> dict[str, float]:
    """How many of the process's backends use each engine now
    (``backend_tokenizers``, ``backend_fastokens``, ``backend_gigatoken``), how
    many splice at added tokens only (``backend_added_tokens_only``: no seam
    rules, ``mptok.cache.seam_rules``), and the background checks of fast results since start (``backend_checks``,
    ``backend_checks_dropped``, ``backend_mismatches``, and their CPU, ``backend_check_cpu_seconds``)."""
    with _backends_lock:
        live = [b for _, b in _backends.values() if isinstance(b, TokenizerBackend)]
    counts = {f"backend_{name}": 0 for name in ("tokenizers",) + ENGINES}
    counts["backend_added_tokens_only"] = 0
    for backend in live:
        counts[f"backend_{backend.engines.name}"] += 1
        counts["backend_added_tokens_only"] += backend.seam_rules is None
    return dict(counts, **COUNTERS.snapshot())


class TokenizerBackend:
    """Full and continuation encodings of one caller's tokenizer; thread-safe
    (it only calls the Rust tokenizer's and the fast engines' encode). Text the
    Rust tokenizer rejects raises ``TokenizerRefused``. ``choice`` and
    ``engine`` choose the engines."""

    _serials = itertools.count()

    def __init__(self, tokenizer: Any, choice: str = "auto", *, engine: IdsEngine | None = None):
        if choice not in CHOICES:
            raise ValueError(f"tokenizer backend {choice!r} is not one of {', '.join(CHOICES)}")
        # Never reused, unlike id(): caches key their entries by it.
        self.serial = next(self._serials)
        rust = rust_tokenizer_of(tokenizer)
        # orjson: a large vocabulary's spec is megabytes of JSON, read once
        # and written once per start (the json module takes several times longer).
        spec = orjson.loads(rust.to_str())
        spec.update(truncation=None, padding=None, post_processor=None)
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
        self.engines = Engines(
            lambda text: self.encode(text).ids, spec_json, split_special, choice,
            added_tokens=self._full.get_added_tokens_decoder().values(), name=self.name, checked=self, engine=engine,
        )
        self._prefix_unless_space = False
        self.seam_rules, rules_report = self._checked_rules(spec, split_special, rust.get_vocab_size(with_added_tokens=True))
        logger.info(
            "tokenizer backend for %s: %s (%s); %s", self.name, self.engines.summary, self.engines.report or choice, rules_report
        )

    def encode_ids(self, text: str) -> list[int]:
        """Full tokenization's ids by the cheapest exact engine, a new list."""
        return self.engines.encode_ids(text)

    def encode_id_array(self, text: str) -> Any:
        """``encode_ids`` as an int array where the engine gives one."""
        return self.engines.encode_id_array(text)

    def check_splice(self, text: str, ids: Any, tokenized: int) -> None:
        """Queue a background check of a splice's ``ids`` (``IdPieces``) for
        the whole of ``text`` if sampled (``Engines.check_splice``)."""
        self.engines.check_splice(text, ids, tokenized, seam_rules=self.seam_rules is not None)

    def verify(self, text: str, ids: Any) -> None:
        """Compare ``ids`` with the Rust tokenizer's; on a difference switch
        to the Rust tokenizer and to splices at added tokens only, with a
        WARNING, for good in this process (``Engines.verify``)."""
        self.engines.verify(text, ids, seam_rules=self.seam_rules is not None, switch_off=self._splice_at_added_tokens_only)

    def _splice_at_added_tokens_only(self) -> None:
        self.seam_rules = None
        _rules_distrusted.add(self.engines.spec_digest)
        # The cache keys what it keeps by the serial: a new one forgets every
        # prompt the engine or the rules made.
        self.serial = next(self._serials)

    def _checked_rules(self, spec: dict[str, Any], split_special: bool, vocab_size: int) -> tuple[SeamRules | None, str]:
        """The seam rules of this tokenizer if it has some and they pass
        their check on the start-up corpus (once per process and
        specification), and a line for the start log."""
        slot = (self.engines.spec_digest, split_special)
        with _rule_verdicts_lock:
            known = _rule_verdicts.get(slot)
        if known is None:
            rules = derive_rules(spec, split_special, vocab_size)
            if isinstance(rules, SeamRules):
                self._prefix_unless_space = _prefixes_unless_space(rules)
                texts = self_check_texts(t.content for t in self._full.get_added_tokens_decoder().values())
                known = prove_rules(rules, self.encode, self._tail_for_check, texts)
            else:
                known = (None, f"no seam rules: {rules}")
            with _rule_verdicts_lock:
                _rule_verdicts[slot] = known
        rules, report = known
        if self.engines.spec_digest in _rules_distrusted:
            rules, report = None, "seam rules found wrong for this tokenizer earlier in this process"
        if rules is None:
            report += "; splicing at added tokens only"
        self._prefix_unless_space = rules is not None and _prefixes_unless_space(rules)
        return rules, report

    def _tail_for_check(self, text: str, at_segment_start: bool) -> list[int]:
        """``encode_tail`` by the reference tokenizer: the rules' check tests the rules, not an engine."""
        if self._tokenized_whole(text, at_segment_start):
            return self.encode(text).ids
        return self._continuation_ids(text) or []

    def encode(self, text: str) -> Encoding:
        """Full tokenization of ``text`` (what the caller's tokenizer returns);
        ``TokenizerRefused`` for text the Rust tokenizer rejects."""
        return _encode(self._full, text)

    def encode_tail(self, text: str, at_segment_start: bool) -> Any:
        """The ids of ``text``, cut from a prompt at a seam, as that prompt's
        full tokenization has them: the whole text's by the engine from a
        segment start (an added token, or right after one) or where the
        layout adds no prefix, else as the continuation of a segment that
        began earlier, by the continuation tokenizer; None if that cannot
        tell the segments apart."""
        if self._tokenized_whole(text, at_segment_start):
            return self.encode_id_array(text)
        return self._continuation_ids(text)

    def _tokenized_whole(self, text: str, at_segment_start: bool) -> bool:
        """Whether a tail is tokenized as a whole text (no prefix would be added
        to it that its prompt's tokenization lacks), not as a continuation."""
        return at_segment_start or self._continuation is None or (self._prefix_unless_space and text.startswith(" "))

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
        for j, token_id in enumerate(full.ids):
            if token_id == cont_ids[first_added] and full.token_to_chars(j) == anchor:
                return cont_ids[:first_added] + full.ids[j:]
        return None

    def normalizes_apart(self, left: str, right: str) -> bool:
        """Whether normalizing ``left + right`` equals normalizing each apart
        (``right`` as a continuation): false for a normalizer that combines
        characters across the boundary (NFC composing a mark with its base, a
        multi-character Replace)."""
        if self._full_normalizer is None:
            return True
        whole = self._full_normalizer.normalize_str(left + right)
        head = self._full_normalizer.normalize_str(left)
        tail = self._continuation_normalizer.normalize_str(right)
        return whole == head + tail


# Seam rules per (specification digest, split_special): the rules, or None, and the start log's words.
_rule_verdicts: dict[tuple[str, bool], tuple[SeamRules | None, str]] = {}
_rule_verdicts_lock = threading.Lock()
# The specifications whose seam rules made a wrong splice in this process, or
# shared a backend with an engine that did: never trusted again.
_rules_distrusted: set[str] = set()


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
    return normalizer is not None and not (normalizer.get("type") == "Sequence" and not normalizer.get("normalizers"))


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
    if normalizer is None or normalizer.get("type") == "Prepend":
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

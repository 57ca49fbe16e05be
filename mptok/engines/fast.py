"""Faster engines for full tokenization, trusted per tokenizer only after a check.

`tokenizers` takes about 100 ms for a 50k-token prompt here; fastokens and
gigatoken load the same ``tokenizer.json`` and give the same ids in 1.5 to
3.5 ms. They give ids only (no offsets, no pre-token boundaries) and each
refuses some layouts (fastokens: Metaspace, BertNormalizer, tekken;
gigatoken: WordPiece, Unigram). This module loads them, checks them id for
id at start and times them; ``mptok.engines.choice`` decides which one is
trusted for a tokenizer, ``mptok.engines.tripwire`` keeps checking it.

**Why a fast engine may be trusted (rule 1: every id list equals full
tokenization).** Nothing proves that two implementations of a tokenizer agree
on every text; sampling cannot either: a result re-checked after it was
returned has already been returned. The trust rests on three things, in this
order:

1. Both engines load the same deterministic specification (the
   ``tokenizer.json`` the caller's tokenizer was built from, with its
   truncation, padding and post-processor removed, as the cache's own copy).
   They do not implement every part of it as `tokenizers` does: both match
   added tokens in one pass where `tokenizers` matches raw ones before
   normalized ones, so a tokenizer whose raw and normalized added tokens
   overlap is never given to them (``mptok.engines.choice``).
2. At start an engine must give ids identical to `tokenizers`, id for id, on a
   fixed adversarial corpus built for that tokenizer (``self_check_texts``:
   combining-mark runs, emoji ZWJ sequences, CJK, CRLF, digit and whitespace
   runs, byte-order marks and controls, the tokenizer's own added-token
   strings alone, doubled and inside words), the places where
   implementations have diverged before. One difference and the engine is not
   used for that tokenizer. The check is made by the first start on the
   machine and kept in the engine memo (``mptok.engines.memo``) under
   a key that holds everything its result is a function of (the
   specification, the corpus, the engines' and `tokenizers`' builds);
   later starts with the same key read it.
3. While serving, results are re-checked by `tokenizers` in the background
   within a CPU budget (``mptok.engines.tripwire``), and one difference
   switches that tokenizer back to `tokenizers` for the rest of the process.
   That bounds how long an engine that diverges on real traffic goes on
   being used, not whether one result was wrong: the differing result, and
   any returned before the check ran, had already been returned.

A deployment for which "the start-up check plus a tripwire" is not enough
forces `tokenizers` (``CacheConfig.tokenizer_backend``,
``MPTOK_CACHE_TOKENIZER_BACKEND=tokenizers``, ``mptok serve
--tokenizer-backend tokenizers``).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

logger = logging.getLogger(__name__)


class EngineUnavailable(Exception):
    """The engine is not installed, or cannot load this tokenizer's layout."""

    def __init__(self, message: str):
        super().__init__(message.strip().splitlines()[0] if message.strip() else message)


class IdsEngine(Protocol):
    """Full tokenization without added special tokens: ids only."""

    name: str

    def encode_ids(self, text: str) -> list[int]: ...


class _Fastokens:
    name = "fastokens"

    def __init__(self, spec_json: str, split_special: bool):
        fastokens = _import("fastokens")
        try:
            self._tokenizer = fastokens.Tokenizer.from_json_str(spec_json)
        except Exception as e:
            raise EngineUnavailable(f"fastokens cannot load this tokenizer: {e}") from e
        self._split_special = split_special

    def encode_ids(self, text: str) -> list[int]:
        return self._tokenizer.encode(
            text, add_special_tokens=False, split_special_tokens=self._split_special
        ).ids

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
        gigatoken = _import("gigatoken")
        try:
            self._tokenizer = gigatoken.Tokenizer.from_json(spec_json)
        except Exception as e:
            raise EngineUnavailable(f"gigatoken cannot load this tokenizer: {e}") from e
        # A gigatoken Tokenizer refuses a call while another thread's call
        # runs ("Already borrowed"); a server's request and peer threads
        # share one, so they take turns.
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


def _import(name: str) -> Any:
    """Import an engine's package; a failure is logged once per process."""
    import importlib

    try:
        return importlib.import_module(name)
    except Exception as e:
        with _import_lock:
            first = name not in _import_failures
            _import_failures[name] = repr(e)
        if first:
            logger.info("tokenizer backend %s unavailable: %r", name, e)
        raise EngineUnavailable(f"{name} is not importable: {e!r}") from e


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


def self_check_texts(added_contents: Iterable[str], seed: int = 0) -> list[str]:
    """The fixed adversarial corpus an engine must reproduce id for id.

    Every piece alone, then mixes of pieces, with the tokenizer's own added
    tokens (a fixed sample when it has many) alone, doubled, glued to words
    and inside whitespace runs, and one long text of everything.
    """
    rng = random.Random(seed)
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
    """A description of the first text on which ``engine`` differs from
    ``reference`` (which returns None for texts it refuses), or None."""
    for text in texts:
        expected = reference(text)
        if expected is None:
            continue
        # Both of the engine's paths, where it has two (ids as a list, as an array).
        for encode in (engine.encode_ids, getattr(engine, "encode_id_array", None)):
            if encode is None:
                continue
            try:
                got = [int(i) for i in encode(text)]
            except Exception as e:
                return f"raised {e!r} on a {len(text)}-character text"
            if got != expected:
                return f"gave different ids on a {len(text)}-character text {text[:40]!r}"
    return None


@dataclass(frozen=True)
class Cost:
    """The cheapest of a few full tokenizations of the same text."""

    cpu_seconds: float  # time.process_time: all the engine's threads
    wall_seconds: float


# Standard-library modules whose sources are the timing texts (every Python
# has them; about 0.5M characters, and 1.9M with the second set).
_TIMING_MODULES = ("argparse", "difflib", "inspect", "pathlib", "textwrap", "typing")
_MORE_TIMING_MODULES = (
    "pydoc", "_pydecimal", "tarfile", "subprocess", "unittest.mock", "email._header_value_parser",
    "logging", "zipfile", "ssl", "shutil", "collections", "threading", "ast", "enum", "dataclasses", "datetime",
)


def timing_texts(fallback: str, chars: int = 200_000, count: int = 3) -> list[str]:
    """``count`` different texts of ``chars`` characters (about 50k tokens,
    where fastokens' threads start to cost CPU) to time engines on: real
    prose and code (the standard library's own sources, which every Python
    has), never seen by an engine before, since fastokens and gigatoken cache
    the words they have tokenized. ``fallback`` (cut in pieces) where the
    sources cannot be read."""
    import importlib

    names = _TIMING_MODULES if chars * count <= 480_000 else _TIMING_MODULES + _MORE_TIMING_MODULES
    try:
        source = "".join(open(importlib.import_module(m).__file__, encoding="utf-8").read() for m in names)
    except (OSError, TypeError, ImportError):
        source = fallback
    size = min(chars, len(source) // count)
    return [source[i * size : (i + 1) * size] for i in range(count)]


def cost_of(encode: Callable[[str], object], texts: Sequence[str]) -> Cost:
    """The median CPU and wall time of ``encode`` over ``texts``."""
    cpus, walls = [], []
    for text in texts:
        wall_began, cpu_began = time.perf_counter(), time.process_time()
        encode(text)
        cpus.append(time.process_time() - cpu_began)
        walls.append(time.perf_counter() - wall_began)
    return Cost(sorted(cpus)[len(cpus) // 2], sorted(walls)[len(walls) // 2])

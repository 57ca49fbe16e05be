"""Extend a cached tokenization to a new prompt, and prove the splice exact.

A new prompt shares a prefix with a cached one. Re-tokenizing only from a
*seam* inside that prefix is exact when full tokenization of the new prompt
splits there too and the text before the seam does not influence the tokens
after it. Comparing the first re-tokenized ids with the cached ids is not
enough (docs/CACHE.md: NFC composes across seams, the legacy SentencePiece
layout adds a dummy prefix whose ids still match), so a seam must pass all of:

1. It starts a pre-token (or an added token): BPE, WordPiece and Unigram
   work inside pre-tokens, so nothing merges across it.
2. Its token shares no character with the token before it: byte-level BPE
   splits one character over several tokens, and no seam there can resync.
3. Its character starts cleanly under Unicode normalization (no combining
   mark, nothing that decomposes into one), and the tokenizer's own
   normalizer gives the same text around it whether it runs across the seam
   or on each side apart.
4. The re-tokenized tail reproduces the cached tokens, ids *and* offsets and
   pre-token boundaries, over at least two complete pre-tokens, all inside the
   shared prefix and clear of its last two pre-tokens (which the new text
   may change: a word can grow, lookahead can see the new characters).
5. The seam plus the longest added token lies inside the shared prefix:
   added tokens are split out first, left to right, and one that the new
   text completes (the kept prompt ended inside its text) must not start
   before the seam.

Pre-tokenizers match left to right without lookbehind, so once the tail and
the cached tokenization agree on a boundary inside the shared prefix they
agree on everything after it; check 4 establishes such a boundary and that
the missing left context changed nothing up to it. A prompt with no seam
that passes is tokenized in full.

A fast engine (``mptok.cache.fast_backends``) gives ids only, so the
offsets and pre-token boundaries of checks 1-4 come from the reference
tokenizer, `tokenizers`, and only where a prompt needs them: a
conversation's first prompt is the engine's (ids, no offsets); its next turn
gets offsets (the reference tokenizer re-tokenizes the kept prompt, or, for
a long one, does it on the background checker's thread, comparing the
engine's ids on the way: ``mptok.cache.prefix_cache``), and a splice inside
the window re-tokenizes its tail with the reference tokenizer, which gives
the new prompt's window. Where an added token opens a segment near the
point the prompts part, the engine is cheaper still, and is tried first:
the seam ``s`` passes when the kept prompt's text from ``s`` on, tokenized
whole, gives exactly the kept prompt's last ids and begins with an added
token; then the kept tokenization matched an added token at ``s`` (the ids
tile the same text from the end), the new prompt matches it there too
(``s`` plus that token's reach lies inside the shared prefix,
``mptok.cache.segments``), and every segment before ``s`` is the same text
in both. The new ids are the kept ones before ``s`` and ``text[s:]``
tokenized whole. A segment splice that would re-tokenize more than three
quarters of the prompt is not tried: a full tokenization costs about as
much. A prompt with an added token in its last quarter (a chat template's
markers open every turn) is never given offsets: its later turns splice at
segments, and where one cannot, the engine tokenizes it whole for less than
the reference tokenizer's offsets would cost.
"""

from __future__ import annotations

import bisect
import unicodedata
from array import array
from dataclasses import dataclass

import numpy as np
from tokenizers import Encoding

from mptok.cache.backend import TokenizerBackend
from mptok.core.ids import IdPieces

__all__ = ["CachedPrompt", "extend_prompt", "tokenize_prompt", "with_window"]

# Characters on each side of a seam handed to the normalizer check. Wider
# than any normalizer rule seen in real tokenizers (NFC works on one
# starter plus its marks, which check 3 already keeps off the seam).
NORMALIZER_CONTEXT = 16

# Candidate seams looked at, cheap checks included, before giving up.
MAX_CANDIDATES = 64


@dataclass(frozen=True)
class CachedPrompt:
    """A prompt with its ids and the offsets of its last tokens.

    ``starts``, ``ends`` and ``word_starts`` describe the tokens from index
    ``window_first`` on; offsets are int32 (``array('i')``, 4 bytes each)
    for any text shorter than 2**31 characters. ``reused`` is how many of
    the first ids a splice took from the prompt it extended (0 when the
    prompt was tokenized in full).
    """

    text: str
    ids: IdPieces
    window_first: int
    starts: array
    ends: array
    word_starts: bytes
    reused: int = 0


def tokenize_prompt(backend: TokenizerBackend, text: str, window_tokens: int, *, with_window: bool = True) -> CachedPrompt:
    """Tokenize ``text`` in full and remember its last ``window_tokens`` tokens'
    offsets. A fast engine gives ids only: with it, ``with_window=False``
    keeps no offsets (until a later turn gives it some: ``with_window``)
    and ``with_window=True`` tokenizes with the reference tokenizer instead."""
    if backend.fast and not with_window:
        return _without_window(text, IdPieces.of(backend.encode_id_array(text)))
    return _windowed(backend, backend.encode(text), text, window_tokens)


def _windowed(
    backend: TokenizerBackend,
    encoding: Encoding,
    text: str,
    window_tokens: int,
    seam: int = 0,
    kept: IdPieces | None = None,
    first: int = 0,
) -> CachedPrompt:
    """A prompt whose ids are ``kept``'s first ``first`` ids followed by
    ``encoding`` (the reference tokenization of ``text[seam:]``), with the
    offsets of its last ``window_tokens`` tokens taken from ``encoding``."""
    ids = encoding.ids
    begin = max(0, len(ids) - window_tokens)
    spans = backend.spans(encoding, begin, len(ids))
    offsets = _offset_type(text)
    all_ids = IdPieces.of(ids) if kept is None else kept.spliced(first, ids)
    return CachedPrompt(
        text,
        all_ids,
        first + begin,
        array(offsets, [s + seam for s in spans.starts]),
        array(offsets, [e + seam for e in spans.ends]),
        bytes(spans.word_starts),
        first,
    )


def _offset_type(text: str) -> str:
    return "i" if len(text) < 2**31 else "q"


def extend_prompt(
    backend: TokenizerBackend,
    cached: CachedPrompt,
    text: str,
    shared: int,
    *,
    window_tokens: int,
    max_attempts: int,
    max_reference_chars: int,
) -> CachedPrompt | None:
    """``text`` tokenized by splicing onto ``cached``, or None if no seam is proven.

    ``shared`` is ``common_prefix_length(cached.text, text)``. The returned
    prompt's ids equal ``backend.encode(text).ids``. With a fast engine a
    seam at a segment-opening added token is tried first (the engine
    tokenizes the tail), then one inside the kept offsets window (the
    reference tokenizer does, and the new prompt gets its window); a kept
    prompt of at most ``max_reference_chars`` characters with no window is
    given one first. With `tokenizers`, the window first.
    """
    if shared == len(text) == len(cached.text):
        return cached
    # A fast engine re-tokenizes a segment for a fraction of what the
    # reference tokenizer takes for a window's tail: segment seams first.
    if backend.fast:
        spliced = _extend_at_segment(backend, cached, text, shared, max_attempts, window_tokens)
        if spliced is None and len(cached.starts):
            spliced = _extend_in_window(backend, cached, text, shared, window_tokens, max_attempts)
        if (
            spliced is None
            and not len(cached.starts)
            and len(cached.text) <= max_reference_chars
            and not splices_at_segments(backend, cached.text, shared)
        ):
            # Kept from a fast engine's ids, with no added token to splice
            # at: the reference tokenizer gives it offsets.
            windowed = with_window(backend, cached, window_tokens)
            if windowed is not None:
                spliced = _extend_in_window(backend, windowed, text, shared, window_tokens, max_attempts)
        return spliced
    return _extend_in_window(backend, cached, text, shared, window_tokens, max_attempts) or _extend_at_segment(
        backend, cached, text, shared, max_attempts, window_tokens
    )


def splices_at_segments(backend: TokenizerBackend, text: str, end: int | None = None) -> bool:
    """Whether ``text[:end]`` has a segment opener (an added token) in its
    last quarter: then a later turn that grows it by less than its length
    splices there with a fast engine, and an offsets window, which costs the
    reference tokenizer's pass over the whole prompt, would buy nothing."""
    end = len(text) if end is None else end
    return next(backend.segment_openers.starts_before(text, end, end - end // 4), None) is not None


def with_window(backend: TokenizerBackend, cached: CachedPrompt, window_tokens: int) -> CachedPrompt | None:
    """``cached`` with the offsets window of its reference tokenization, or
    None if that differs from the kept ids (which the engine gave: the
    backend is told, and stops trusting it)."""
    windowed = tokenize_prompt(backend, cached.text, window_tokens)
    if not windowed.ids.same_as(cached.ids):
        backend.verify(cached.text, cached.ids.array())
        return None
    return windowed


def _extend_in_window(
    backend: TokenizerBackend, cached: CachedPrompt, text: str, shared: int, window_tokens: int, max_attempts: int
) -> CachedPrompt | None:
    """Splice at a pre-token start inside the kept offsets window (checks 1-5)."""
    # Local indices (into the window) of pre-token starts before `shared`,
    # nearest first. The two nearest may change with the new text.
    before_shared = bisect.bisect_left(cached.starts, shared)
    boundaries = _word_starts_before(cached, before_shared)
    nearest = [next(boundaries, None) for _ in range(2)]
    if nearest[1] is None:
        return None
    limit_local = nearest[1]
    # A seam needs two complete pre-tokens between it and the limit.
    skipped = next(boundaries, None)
    if skipped is None:
        return None
    # An added token matched in the new text from before the seam to past
    # it would be missed by the tail; added tokens are matched left to
    # right, so a seam whose longest possible match lies inside the shared
    # prefix sees the same matches before it in both prompts.
    reach = backend.segment_openers.max_reach
    attempts = 0
    for examined, seam_local in enumerate(boundaries):
        if examined >= MAX_CANDIDATES or attempts >= max_attempts:
            return None
        if seam_local == 0 or cached.starts[seam_local] + reach > shared:
            continue
        if not _clean_seam(backend, cached, text, seam_local):
            continue
        attempts += 1
        result = _splice(backend, cached, text, seam_local, limit_local, window_tokens)
        if result is not None:
            return result
    return None


def _word_starts_before(cached: CachedPrompt, end_local: int):
    word_starts = cached.word_starts
    for local in range(end_local - 1, -1, -1):
        if word_starts[local]:
            yield local


def _clean_seam(backend: TokenizerBackend, cached: CachedPrompt, text: str, local: int) -> bool:
    start = cached.starts[local]
    if start < cached.ends[local - 1] or start <= cached.starts[local - 1]:
        return False
    if not _starts_cleanly(text[start]):
        return False
    return backend.normalizes_apart(
        text[max(0, start - NORMALIZER_CONTEXT) : start],
        text[start : start + NORMALIZER_CONTEXT],
    )


def _starts_cleanly(char: str) -> bool:
    """A starter under canonical ordering that does not decompose into a mark."""
    return unicodedata.combining(char) == 0 and (
        unicodedata.combining(unicodedata.normalize("NFD", char)[0]) == 0
    )


def _splice(
    backend: TokenizerBackend,
    cached: CachedPrompt,
    text: str,
    seam_local: int,
    limit_local: int,
    window_tokens: int,
) -> CachedPrompt | None:
    seam = cached.starts[seam_local]
    tail = backend.encode_continuation(text[seam:])
    if tail is None:
        return None
    checked = limit_local - seam_local
    if len(tail.ids) <= checked:
        return None
    seam_index = cached.window_first + seam_local
    limit = cached.starts[limit_local]
    if (
        tail.ids[:checked] != cached.ids.slice(seam_index, seam_index + checked)
        or tail.starts[checked] + seam != limit
        or bytes(tail.word_starts[:checked]) != cached.word_starts[seam_local:limit_local]
        or [s + seam for s in tail.starts[:checked]] != cached.starts[seam_local:limit_local].tolist()
        or [e + seam for e in tail.ends[:checked]] != cached.ends[seam_local:limit_local].tolist()
    ):
        return None
    if _offset_type(text) != cached.starts.typecode:  # grew past int32 offsets
        return None
    ids = cached.ids.spliced(seam_index, tail.ids)
    starts = cached.starts[:seam_local]
    starts.extend(s + seam for s in tail.starts)
    ends = cached.ends[:seam_local]
    ends.extend(e + seam for e in tail.ends)
    word_starts = cached.word_starts[:seam_local] + bytes(tail.word_starts)
    surplus = max(0, len(starts) - window_tokens)
    del starts[:surplus], ends[:surplus]
    return CachedPrompt(
        text, ids, cached.window_first + surplus, starts, ends, word_starts[surplus:], seam_index
    )


def prompt_of_ids(text: str, ids: np.ndarray) -> CachedPrompt:
    """``text`` kept with ``ids``, its exact ids from elsewhere (a peer's
    answer), copied, with no offsets window: a later turn splices at a
    segment, or gets a window as a fast engine's prompt does."""
    return _without_window(text, IdPieces.of(ids))


def _without_window(text: str, ids: IdPieces, reused: int = 0) -> CachedPrompt:
    offsets = _offset_type(text)
    return CachedPrompt(text, ids, ids.length, array(offsets), array(offsets), b"", reused)


def _extend_at_segment(
    backend: TokenizerBackend,
    cached: CachedPrompt,
    text: str,
    shared: int,
    max_attempts: int,
    window_tokens: int,
) -> CachedPrompt | None:
    """Splice at the nearest segment opener that proves itself (module
    docstring). The tail is a fast engine's (ids only), else the reference
    tokenizer's, with the offsets window it gives."""
    openers = backend.segment_openers
    kept = cached.ids.length
    # Re-tokenizing len(cached.text) - s plus len(text) - s characters must
    # stay within three quarters of the prompt: past that a full
    # tokenization costs about as much.
    lowest = max(0, (len(cached.text) + len(text) // 4 + 1) // 2)
    for attempt, seam in enumerate(openers.starts_before(cached.text, shared, lowest)):
        if attempt >= max_attempts:
            return None
        # An array, compared as one: a list of the old tail's ids would cost
        # as much as tokenizing it.
        old_tail = np.asarray(backend.encode_id_array(cached.text[seam:]))
        first = kept - len(old_tail)
        reach = openers.reach_of(int(old_tail[0])) if len(old_tail) else None
        if reach is None or seam + reach > shared or first < 0:
            continue
        if not np.array_equal(cached.ids.array()[first:kept], old_tail):
            continue
        tail = text[seam:]
        if not backend.fast:
            return _windowed(backend, backend.encode(tail), text, window_tokens, seam, cached.ids, first)
        return _without_window(text, cached.ids.spliced(first, backend.encode_id_array(tail)), first)
    return None

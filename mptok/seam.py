"""Extend a cached tokenization to a new prompt, and prove the splice exact.

A new prompt shares a prefix with a cached one. Re-tokenizing only from a
*seam* inside that prefix is exact when full tokenization of the new prompt
splits there too and the text before the seam does not influence the tokens
after it. Comparing the first re-tokenized ids with the cached ids is not
enough (see NOTES.md: NFC composes across seams, the legacy SentencePiece
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

Pre-tokenizers match left to right without lookbehind, so once the tail and
the cached tokenization agree on a boundary inside the shared prefix they
agree on everything after it; check 4 establishes such a boundary and that
the missing left context changed nothing up to it. A prompt with no seam
that passes is tokenized in full.
"""

from __future__ import annotations

import bisect
import unicodedata
from array import array
from dataclasses import dataclass

from mptok.backend import TokenizerBackend

# Characters on each side of a seam handed to the normalizer check. Wider
# than any normalizer rule seen in real tokenizers (NFC works on one
# starter plus its marks, which check 3 already keeps off the seam).
NORMALIZER_CONTEXT = 16

# Candidate seams looked at, cheap checks included, before giving up.
MAX_CANDIDATES = 64


# Pieces a prompt's ids may be held in before they are joined into one list.
MAX_ID_PIECES = 32


@dataclass(frozen=True)
class IdPieces:
    """Token ids held as prefixes of lists that are never mutated.

    Extending a conversation shares the previous prompt's lists instead of
    copying them, so a 200k-token prompt is copied once per turn (into the
    caller's list) rather than twice.
    """

    pieces: tuple[tuple[list[int], int], ...]
    length: int

    @classmethod
    def of(cls, ids: list[int]) -> IdPieces:
        """Wrap ``ids``, which the caller hands over and must not mutate."""
        return cls(((ids, len(ids)),), len(ids))

    def to_list(self) -> list[int]:
        """A new list of all the ids."""
        if not self.pieces:
            return []
        (first, used), *rest = self.pieces
        out = first[:used]
        for ids, used in rest:
            out += ids[:used]
        return out

    def slice(self, start: int, stop: int) -> list[int]:
        """``ids[start:stop]`` as a new list."""
        out: list[int] = []
        offset = 0
        for ids, used in self.pieces:
            if offset >= stop:
                break
            low, high = max(start - offset, 0), min(stop - offset, used)
            if low < high:
                out += ids[low:high]
            offset += used
        return out

    def common_prefix(self, other: IdPieces) -> int:
        """How many leading ids ``self`` and ``other`` share.

        Pieces that both hold (the same list, as a conversation's turns
        share them) are skipped whole; only the rest is compared by value.
        """
        mine, theirs = list(self.pieces), list(other.pieces)
        shared = 0
        while mine and theirs and mine[0][0] is theirs[0][0]:
            used, other_used = mine[0][1], theirs[0][1]
            shared += min(used, other_used)
            if used != other_used:
                break
            mine.pop(0)
            theirs.pop(0)
        rest = min(self.length, other.length) - shared
        a, b = self.slice(shared, shared + rest), other.slice(shared, shared + rest)
        if a == b:
            return shared + rest
        return shared + next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)

    def spliced(self, keep: int, tail: list[int]) -> IdPieces:
        """The first ``keep`` ids followed by ``tail`` (handed over)."""
        pieces = []
        offset = 0
        for ids, used in self.pieces:
            if offset >= keep:
                break
            take = min(used, keep - offset)
            pieces.append((ids, take))
            offset += take
        if tail:
            pieces.append((tail, len(tail)))
        result = IdPieces(tuple(pieces), keep + len(tail))
        if len(pieces) > MAX_ID_PIECES:
            return IdPieces.of(result.to_list())
        return result


@dataclass(frozen=True)
class CachedPrompt:
    """A prompt with its ids and the offsets of its last tokens.

    ``starts``, ``ends`` and ``word_starts`` describe the tokens from index
    ``window_first`` on.
    """

    text: str
    ids: IdPieces
    window_first: int
    starts: array
    ends: array
    word_starts: bytes


def tokenize_prompt(backend: TokenizerBackend, text: str, window_tokens: int) -> CachedPrompt:
    """Tokenize ``text`` in full and remember its last ``window_tokens`` tokens."""
    encoding = backend.encode(text)
    ids = encoding.ids
    first = max(0, len(ids) - window_tokens)
    spans = backend.spans(encoding, first, len(ids))
    return CachedPrompt(
        text,
        IdPieces.of(ids),
        first,
        array("q", spans.starts),
        array("q", spans.ends),
        bytes(spans.word_starts),
    )


def common_prefix_length(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``.

    Compares in C, halving the range: O(n) characters copied and compared in
    total, never a Python-level loop over the text.
    """
    if len(a) <= len(b) and b.startswith(a):
        return len(a)
    if len(b) < len(a) and a.startswith(b):
        return len(b)
    low, high = 0, min(len(a), len(b))  # a[:low] == b[:low]; the answer is < high
    while high - low > 64:
        middle = (low + high) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle
    while low < high and a[low] == b[low]:
        low += 1
    return low


def extend_prompt(
    backend: TokenizerBackend,
    cached: CachedPrompt,
    text: str,
    shared: int,
    *,
    window_tokens: int,
    max_attempts: int,
) -> CachedPrompt | None:
    """``text`` tokenized by splicing onto ``cached``, or None if no seam is proven.

    ``shared`` is ``common_prefix_length(cached.text, text)``. The returned
    prompt's ids equal ``backend.encode(text).ids``.
    """
    if shared == len(text) == len(cached.text):
        return cached
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
    attempts = 0
    for examined, seam_local in enumerate(boundaries):
        if examined >= MAX_CANDIDATES or attempts >= max_attempts:
            return None
        if seam_local == 0 or not _clean_seam(backend, cached, text, seam_local):
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
    ids = cached.ids.spliced(seam_index, tail.ids)
    starts = cached.starts[:seam_local]
    starts.extend(s + seam for s in tail.starts)
    ends = cached.ends[:seam_local]
    ends.extend(e + seam for e in tail.ends)
    word_starts = cached.word_starts[:seam_local] + bytes(tail.word_starts)
    surplus = max(0, len(starts) - window_tokens)
    del starts[:surplus], ends[:surplus]
    return CachedPrompt(
        text, ids, cached.window_first + surplus, starts, ends, word_starts[surplus:]
    )

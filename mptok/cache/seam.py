"""Extend a kept tokenization to a new prompt, and prove the splice exact: the seam encoder, the one place a splice is decided.

A new prompt shares a prefix with a kept one. Re-tokenizing only from a
*seam* inside that prefix is exact when full tokenization of the new prompt
splits there too and the text before the seam does not influence the tokens
after it; comparing the first re-tokenized ids with the kept ids is not
enough. So a seam must pass the five checks of docs/CACHE.md ("The proof
of a seam", numbered as the comments here number them), reading what the
ids of a fast engine do not carry: where each kept token begins
(``SeamRules.token_starts``), where every tokenization splits
(``Boundaries``) and which added tokens open a segment
(``SegmentOpeners``), all derived from the tokenizer and checked at start
(``mptok.cache.seam_rules``). A hit costs the new text: seams are searched
back from where the prompts part, and the walk covers from there to the
end of the kept prompt, never the whole prompt. A tokenizer with no seam
rules splices at added tokens only, each proven by tokenizing the kept
prompt's text from the seam: it must give exactly the kept prompt's last ids.
"""

from __future__ import annotations

import bisect
import copy
import unicodedata
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from mptok.core.ids import IdPieces

__all__ = ["Boundaries", "CachedPrompt", "SeamRules", "SegmentOpeners", "extend_prompt"]

SPACE_MARKER = "\u2581"
# A token whose length the ids do not tell (``<unk>``, whitespace-stripping added tokens).
UNKNOWN = -1
# What a layout puts before a segment's first token.
PREFIX_NONE = "none"
PREFIX_UNLESS_SPACE = "unless-space"  # ByteLevel add_prefix_space, Metaspace "always"
PREFIX_FIRST_UNLESS_SPACE = "first-unless-space"  # Metaspace "first": the text's first segment only
PREFIX_ALWAYS = "always"  # a Prepend normalizer
# The first window searched back for a forced boundary, in characters.
FIRST_WINDOW = 32

# Characters on each side of a seam handed to the normalizer check. Wider
# than any normalizer rule seen in real tokenizers (NFC works on one
# starter plus its marks, which check 3 already keeps off the seam).
NORMALIZER_CONTEXT = 16

# How far before the end of the shared prefix (less the longest added
# token, check 5) seams are looked for, in characters; a kept prompt's text
# is walked back from its end to there.
SEARCH_CHARS = 128
# A new prompt that parts from the kept one further than this before its end
# is tokenized in full: the walk back costs the characters it covers.
MAX_WALK_CHARS = 65536


@dataclass(frozen=True)
class CachedPrompt:
    """A prompt and its exact ids. ``reused`` is how many of the first ids a
    splice took from the prompt it extended (0 when tokenized in full)."""

    text: str
    ids: IdPieces
    reused: int = 0


class Backend(Protocol):
    """What a splice asks of the tokenizer (``mptok.cache.backend.TokenizerBackend``)."""

    seam_rules: SeamRules | None
    segment_openers: SegmentOpeners

    def encode_id_array(self, text: str) -> Any: ...

    def encode_tail(self, text: str, at_segment_start: bool) -> Any: ...

    def normalizes_apart(self, left: str, right: str) -> bool: ...


def extend_prompt(backend: Backend, cached: CachedPrompt, text: str, shared: int, *, max_attempts: int) -> CachedPrompt | None:
    """``text`` tokenized by splicing onto ``cached`` (``shared`` is
    ``common_prefix_length(cached.text, text)``): ids equal to the full
    tokenization of ``text``, or None if no seam is proven within
    ``max_attempts`` tails tokenized."""
    if shared == len(text) == len(cached.text):
        return cached
    if len(cached.text) - shared > MAX_WALK_CHARS:
        return None
    if backend.seam_rules is None:
        return _extend_at_added_token(backend, cached, text, shared, max_attempts)
    return _extend(backend, cached, text, shared, max_attempts)


def _extend(backend: Backend, cached: CachedPrompt, text: str, shared: int, max_attempts: int) -> CachedPrompt | None:
    rules = backend.seam_rules
    kept = cached.ids.array()
    openers = backend.segment_openers
    # Forced boundaries nearest to the end of the shared prefix (check 5 with
    # the longest added token's reach), searched back as far as a run of text
    # without one reaches; the walk covers them and the added tokens just before.
    floor = max(0, len(cached.text) - MAX_WALK_CHARS)
    forced = rules.forced.nearest(text, shared - openers.max_reach + 1, floor, max_attempts + 1)
    lowest = max(floor, min([shared - openers.max_reach - SEARCH_CHARS] + forced))
    located = rules.token_starts(kept, cached.text, lowest, shared) or _NONE_LOCATED
    # Added tokens that open a segment where the kept tokenization has them (check 5 with each one's reach).
    at_added = rules.segment_ends[kept[located.indices]]
    added = {
        position
        for position, index in zip(located.positions[at_added].tolist(), located.indices[at_added].tolist())
        if (reach := openers.reach_of(int(kept[index]))) is not None
        and position + reach <= shared
        and text.startswith(rules.added_contents[int(kept[index])], position)
    }
    candidates = sorted(added.union(forced), reverse=True)
    attempts = 0
    unproven: list[int] = []  # seams to prove by the kept tail instead
    checked_to: tuple[int, int] | None = None  # (position, index) the next seam's tail must reproduce up to
    for seam in candidates:
        index = located.index_at(seam)
        if index is None:
            unproven.append(seam)
            continue
        if attempts >= max_attempts:
            return None
        at_added = seam in added
        if checked_to is None and not at_added:
            # A forced seam needs a later candidate to check its tail against (check 4).
            checked_to = (seam, index)
            unproven.append(seam)
            continue
        if not _clean_seam(backend, text, seam):
            checked_to = (seam, index)
            continue
        attempts += 1
        at_segment_start = at_added or bool(rules.segment_ends[kept[index - 1]])
        tail = backend.encode_tail(text[seam:], at_segment_start)
        if tail is None:
            checked_to = (seam, index)
            continue
        tail = np.asarray(tail)
        if checked_to is not None:
            check_index = checked_to[1]
            overlap = check_index - index
            if len(tail) <= overlap or not np.array_equal(tail[:overlap], kept[index:check_index]):
                checked_to = (seam, index)
                continue
        return CachedPrompt(text, cached.ids.spliced(index, tail), index)
    # Seams the walk did not locate (a token of unknown length after them, a
    # normalizer that changes lengths) or with no later candidate: the kept
    # text from the seam, tokenized, must give exactly the kept prompt's last ids.
    lowest_proven = _lowest_tail_proof(cached, text)
    for seam in unproven:
        if attempts >= max_attempts or seam < lowest_proven:
            return None
        if not _clean_seam(backend, text, seam):
            continue
        attempts += 1
        proof = _index_by_kept_tail(backend, kept, cached.text, seam)
        if proof is None:
            continue
        index, at_segment_start = proof
        tail = backend.encode_tail(text[seam:], at_segment_start)
        # Check 4 here: the new text's first token from the seam is the kept one.
        if tail is not None and len(tail) and int(tail[0]) == int(kept[index]):
            return CachedPrompt(text, cached.ids.spliced(index, np.asarray(tail)), index)
    return None


def _lowest_tail_proof(cached: CachedPrompt, text: str) -> int:
    """The lowest seam proven by tokenizing the kept text from it:
    re-tokenizing ``len(cached.text) - s`` plus ``len(text) - s`` characters
    must stay within three quarters of the prompt; past that a full
    tokenization costs about as much."""
    return max(1, (len(cached.text) + len(text) // 4 + 1) // 2)


def _index_by_kept_tail(backend: Backend, kept: np.ndarray, kept_text: str, seam: int) -> tuple[int, bool] | None:
    """Where the kept ids from ``seam`` begin, and whether a segment starts
    there, if the kept text from ``seam`` tokenizes to exactly the kept
    prompt's last ids (as a continuation of a segment, or as the start of
    one after an added token); else None."""
    for at_segment_start in (False, True):
        old = backend.encode_tail(kept_text[seam:], at_segment_start)
        if old is None:
            return None
        old = np.asarray(old)
        first = len(kept) - len(old)
        if first <= 0:
            return None
        if bool(backend.seam_rules.segment_ends[kept[first - 1]]) != at_segment_start:
            continue
        if np.array_equal(kept[first:], old):
            return first, at_segment_start
        return None
    return None


def _clean_seam(backend: Backend, text: str, seam: int) -> bool:
    """Check 3: the seam's character starts cleanly and the normalizer treats both sides apart."""
    if not starts_cleanly(text[seam]):
        return False
    return backend.normalizes_apart(text[max(0, seam - NORMALIZER_CONTEXT) : seam], text[seam : seam + NORMALIZER_CONTEXT])


def _extend_at_added_token(
    backend: Backend, cached: CachedPrompt, text: str, shared: int, max_attempts: int
) -> CachedPrompt | None:
    """Splice at the nearest added token that proves itself by tokenizing
    the kept text from it (for a tokenizer with no seam rules)."""
    openers = backend.segment_openers
    kept = cached.ids.length
    lowest = _lowest_tail_proof(cached, text)
    for attempt, seam in enumerate(openers.starts_before(cached.text, shared, lowest)):
        if attempt >= max_attempts:
            return None
        old_tail = np.asarray(backend.encode_id_array(cached.text[seam:]))
        first = kept - len(old_tail)
        reach = openers.reach_of(int(old_tail[0])) if len(old_tail) else None
        if reach is None or seam + reach > shared or first < 0:
            continue
        if not np.array_equal(cached.ids.array()[first:kept], old_tail):
            continue
        return CachedPrompt(text, cached.ids.spliced(first, backend.encode_id_array(text[seam:])), first)
    return None

# -- where the kept tokens begin -----------------------------------------------

@dataclass(frozen=True)
class TokenStarts:
    """Where the kept tokens near the end of a text begin: ``positions[k]``
    (characters, ascending) is where token ``indices[k]`` begins. Only tokens
    that begin on a character boundary are listed (byte-level BPE can split
    one character over several tokens)."""

    positions: np.ndarray
    indices: np.ndarray

    def index_at(self, position: int) -> int | None:
        """The index of the token that begins at ``position``, if located."""
        k = int(np.searchsorted(self.positions, position))
        if k < len(self.positions) and self.positions[k] == position:
            return int(self.indices[k])
        return None


_NONE_LOCATED = TokenStarts(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))



@dataclass(frozen=True)
class SeamRules:
    """A tokenizer's rules (``mptok.cache.seam_rules``): ``lengths[i]``, the text
    bytes token ``i`` covers in the middle of a segment (``UNKNOWN`` if the id
    does not tell); ``segment_ends[i]``, true for the added tokens that end a
    segment, whose contents ``added_contents`` holds; the ``forced`` boundaries."""

    lengths: np.ndarray
    segment_ends: np.ndarray
    added_contents: dict[int, str]
    forced: Boundaries
    # What a forced boundary claims: that a pre-token begins there, or (a
    # layout whose pre-tokenizer leaves a segment whole) that a token does.
    claims_pre_tokens: bool
    prefix: str
    nfc: bool
    space_marker: bool
    layout: str

    def token_starts(self, ids: np.ndarray, text: str, lowest: int, upto: int) -> TokenStarts | None:
        """Where the last tokens of ``ids`` (the exact tokenization of ``text``)
        begin, for those that begin in ``[lowest, upto)`` and after any token of
        unknown length; None where the lengths do not tile the text. The walk
        counts the text in the lengths' units (UTF-8 bytes, ``▁`` one where a space
        becomes ``▁``); for an NFC normalizer, the text from the first clean point
        at or after ``upto`` is counted as NFC makes it, and tokens are located
        only where NFC leaves the text as it is."""
        if self.nfc:
            rest = _nfc_clean_from(text, upto)
            lowest = _nfc_stable_from(text, lowest, rest)
            walked = text[lowest:rest] + unicodedata.normalize("NFC", text[rest:])
            locatable = rest - lowest
        else:
            walked = text[lowest:]
            locatable = len(walked)
        if self.prefix == PREFIX_NONE:
            return self._walk_back(ids, walked, lowest, locatable)
        try:
            points = np.frombuffer(walked.encode("utf-32-le"), dtype=np.uint32)
        except UnicodeEncodeError:
            return None
        units = 1 + (points >= 0x80).astype(np.int64) + (points >= 0x800) + (points >= 0x10000)
        if self.space_marker:
            units[points == ord(SPACE_MARKER)] = 1
        char_units = np.cumsum(units) - units  # where each character begins, in units
        total = int(char_units[-1] + units[-1]) if len(units) else 0
        tail, lengths = self._last_tokens(ids, total)
        if tail is None:
            return None
        count = len(tail)
        lengths = self._without_prefixes(tail, lengths, walked, char_units, total, count == len(ids) and lowest == 0, lowest == 0)
        if lengths is None:
            return None
        # starts[k]: the unit where tail[k] begins, counted back from the end;
        # meaningful only after the last token of unknown length.
        unknown = np.flatnonzero(lengths < 0)
        known = int(unknown[-1]) + 1 if len(unknown) else 0
        starts = total - np.cumsum(lengths[::-1])[::-1]
        if known == 0 and count == len(ids) and (starts[0] > 0 or (lowest == 0 and starts[0] != 0)):
            return None  # every token walked, and they do not tile the text
        first = known + int(np.searchsorted(starts[known:], 0, side="left"))
        begins = starts[first:]
        chars = np.searchsorted(char_units, begins)
        inside = chars < locatable
        on_boundary = inside & (char_units[np.minimum(chars, len(char_units) - 1)] == begins) if len(char_units) else inside
        positions = lowest + chars[on_boundary]
        indices = len(ids) - count + first + np.flatnonzero(on_boundary)
        return TokenStarts(positions.astype(np.int64), indices.astype(np.int64))

    def _walk_back(self, ids: np.ndarray, walked: str, lowest: int, locatable: int) -> TokenStarts | None:
        """``token_starts`` for a layout that adds nothing at a segment's
        start: every token covers a unit at least, so the tokens to walk are
        known at once."""
        marked = walked.replace(SPACE_MARKER, " ") if self.space_marker else walked
        try:
            encoded = marked.encode("utf-8")
        except UnicodeEncodeError:
            return None
        total = len(encoded)
        count = min(len(ids), total + 1)
        first = len(ids) - count
        tail = np.asarray(ids[first:])
        if count and (int(tail.min()) < 0 or int(tail.max()) >= len(self.lengths)):
            return None
        lengths = self.lengths[tail].astype(np.int64)
        unknown = np.flatnonzero(lengths < 0)
        # starts[k]: the unit where tail[k] begins, counted back from the end.
        starts = total - np.cumsum(lengths[::-1])[::-1]
        if not len(unknown) and count == len(ids) and count and starts[0] > 0:
            return None  # every token walked, and they do not tile the text
        known = int(unknown[-1]) + 1 if len(unknown) else 0
        begin = known + int(np.searchsorted(starts[known:], 0, side="left"))
        units = starts[begin:]
        indices = np.arange(first + begin, first + count, dtype=np.int64)
        if total == len(marked):  # ASCII: a unit is a character
            keep = units < locatable
            return TokenStarts(lowest + units[keep], indices[keep])
        # Where each character begins, in units: not a continuation byte.
        char_units = np.flatnonzero((np.frombuffer(encoded, dtype=np.uint8) & 0xC0) != 0x80)
        chars = np.searchsorted(char_units, units)
        ok = (chars < locatable) & (char_units[np.minimum(chars, len(char_units) - 1)] == units)
        return TokenStarts(lowest + chars[ok], indices[ok])

    def _last_tokens(self, ids: np.ndarray, total: int) -> tuple[np.ndarray | None, np.ndarray]:
        """The last ids, enough of them to cover ``total`` units or all,
        and their lengths; None for an id out of the table. Gathered a few
        at a time from the end: a token covers several units on average,
        and each gather reads the length table where the cache has it not."""
        count = min(len(ids), total // 4 + 8)
        while True:
            tail = np.asarray(ids[len(ids) - count :]).astype(np.int64)
            if len(tail) and (tail.min() < 0 or tail.max() >= len(self.lengths)):
                return None, tail
            lengths = self.lengths[tail].astype(np.int64)
            # Enough once they cover the window even if every segment's first
            # token turns out to hold a prefix (a unit of no text).
            prefixes = int(self.segment_ends[tail].sum()) + 1
            if count == len(ids) or lengths.sum() - prefixes >= total or (lengths < 0).any():
                return tail, lengths
            count = min(len(ids), 2 * count)

    def _without_prefixes(
        self, tail: np.ndarray, lengths: np.ndarray, walked: str, char_units: np.ndarray, total: int, covers_start: bool,
        at_text_start: bool,
    ) -> np.ndarray | None:
        """``lengths`` with a segment prefix taken out of each segment's first
        token where the layout added one; None where that cannot be told."""
        after_added = np.zeros(len(tail), dtype=bool)
        after_added[1:] = self.segment_ends[tail[:-1]] & ~self.segment_ends[tail[1:]]
        firsts = list(np.flatnonzero(after_added))
        if covers_start and len(tail) and not self.segment_ends[tail[0]]:
            firsts.insert(0, 0)
        if not firsts:
            return lengths
        if self.prefix == PREFIX_FIRST_UNLESS_SPACE:
            firsts = [0] if firsts[0] == 0 and covers_start else []
        lengths = lengths.copy()
        end = total
        done = len(tail)
        for first in reversed(firsts):
            if (lengths[first:done] < 0).any():
                return lengths  # the walk stops at the unknown length before reaching this segment
            end -= int(lengths[first + 1 : done].sum())
            done = first
            if end - int(lengths[first]) < 0 and not at_text_start:
                # Its first token begins before the window, or at its start
                # with a prefix: which, the text does not say. Not located.
                lengths[first] = UNKNOWN
                return lengths
            if self.prefix == PREFIX_ALWAYS:
                lengths[first] -= 1
            else:
                added = self.added_contents.get(int(tail[first - 1]), "") if first else ""
                prefixed = _prefixed(walked, char_units, end, int(lengths[first]), added)
                if prefixed is None:
                    return None
                lengths[first] -= prefixed
            end -= int(lengths[first])
        return lengths


def _nfc_stable_from(text: str, lowest: int, end: int) -> int:
    """The first position ``p >= lowest`` from which NFC leaves ``text`` as
    it is up to ``end`` (a clean point): ``text[p:end]`` is NFC already and
    ``p`` is a clean point itself."""
    window = text[lowest:end]
    low, high = 0, len(window)
    if not unicodedata.is_normalized("NFC", window):
        # A suffix of a normalized text is normalized: halve towards the shortest that is not.
        while low < high:
            middle = (low + high) // 2
            if unicodedata.is_normalized("NFC", window[middle:]):
                high = middle
            else:
                low = middle + 1
    return _nfc_clean_from(text, lowest + low, end)


def _nfc_clean_from(text: str, position: int, end: int | None = None) -> int:
    """The first clean point at or after ``position`` (before ``end``, else
    ``end``): a starter that neither decomposes into a mark nor composes
    with what comes before it, so NFC treats the text on each side apart."""
    end = len(text) if end is None else end
    while position < end and not (starts_cleanly(text[position]) and _nfc_apart(text, position)):
        position += 1
    return position


# Characters on each side of a position that NFC is run on to see whether it
# joins them: composition chains through starters (Hangul L+V+T) and marks,
# and a mark is never a clean start.
NFC_CONTEXT = 4


def _nfc_apart(text: str, position: int) -> bool:
    """Whether NFC of the text around ``position`` equals NFC of each side apart."""
    left = text[max(0, position - NFC_CONTEXT) : position]
    right = text[position : position + NFC_CONTEXT]
    return unicodedata.normalize("NFC", left + right) == unicodedata.normalize("NFC", left) + unicodedata.normalize("NFC", right)


def starts_cleanly(char: str) -> bool:
    """A starter under canonical ordering that does not decompose into a mark."""
    return unicodedata.combining(char) == 0 and unicodedata.combining(unicodedata.normalize("NFD", char)[0]) == 0


def _prefixed(walked: str, char_units: np.ndarray, end: int, length: int, added: str) -> int | None:
    """Whether a segment's first token, ending at unit ``end`` and ``length``
    long with a prefix space counted, got that space from the layout (1) or
    from the text (0): the one of the two under which the text fits (it
    begins with the space exactly when no prefix was added, right after the
    added token's content); None if both or neither fit."""
    fits = []
    for prefixed in (0, 1):
        start = end - length + prefixed
        at = int(np.searchsorted(char_units, start))
        if not 0 <= start <= end or (at < len(char_units) and char_units[at] != start):
            continue
        if (walked[at : at + 1] == " ") != (prefixed == 0):
            continue
        if added and walked[max(0, at - len(added)) : at] != added[max(0, len(added) - at) :]:
            continue
        fits.append(prefixed)
    return fits[0] if len(fits) == 1 else None

# -- forced boundaries ---------------------------------------------------------

def code_points(text: str) -> np.ndarray:
    """``text`` as an array of code points (lone surrogates included)."""
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)


class Boundaries:
    """A forced-boundary rule decided by the two characters around a point."""

    def forced_at(self, points: np.ndarray) -> np.ndarray:
        """For code points ``points``, whether a boundary is forced between each two."""
        raise NotImplementedError

    def without(self, text: str, position: int) -> Boundaries:
        """This rule less the claim at ``position`` of ``text`` (refuted)."""
        raise NotImplementedError

    @property
    def claim_count(self) -> int:
        raise NotImplementedError

    def between(self, text: str, low: int, high: int) -> np.ndarray:
        """Forced boundaries ``x`` with ``low <= x < high`` and ``x >= 1``, ascending; each
        decided by ``text[x - 1]`` and ``text[x]`` alone."""
        low = max(low, 1)
        if high <= low:
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero(self.forced_at(code_points(text[low - 1 : high]))) + low

    def nearest(self, text: str, high: int, floor: int, count: int) -> list[int]:
        """Up to ``count`` forced boundaries in ``[floor, high)``, nearest to
        ``high`` first: searched back in windows that grow fourfold, so the
        cost is bounded by the run of text that holds none."""
        found: list[int] = []
        end, window = high, FIRST_WINDOW
        while end > floor and len(found) < count:
            start = max(floor, end - window)
            found += self.between(text, start, end)[::-1][: count - len(found)].tolist()
            end, window = start, 4 * window
        return found


class ForcedPairs(Boundaries):
    """Forced boundaries as a matrix of class pairs: ``pairs[x, y]`` says
    that a boundary lies between a character of class x and one of class y
    (``classes``: a ``mptok.cache.seam_rules.CharClasses``)."""

    def __init__(self, classes: Any, pairs: np.ndarray):
        self.classes = classes
        self.pairs = pairs

    def forced_at(self, points: np.ndarray) -> np.ndarray:
        classes = self.classes.table[points]
        return self.pairs[classes[:-1], classes[1:]]

    def without(self, text: str, position: int) -> ForcedPairs:
        x, y = self.classes.of(text[position - 1 : position + 1]).tolist()
        pairs = self.pairs.copy()
        pairs[x, y] = False
        return ForcedPairs(self.classes, pairs)

    @property
    def claim_count(self) -> int:
        return int(self.pairs.sum())


class UnspannedPairs(Boundaries):
    """Where a segment is tokenized whole (no pre-tokenizer split), the
    points that no vocabulary piece spans: between two characters that no
    piece holds side by side (a space counted as the ▁ it becomes). BPE
    merges only into pieces and Unigram picks among pieces, so no token
    crosses such a point and each side is tokenized as if alone; unless both
    characters are unknown to the vocabulary and the model fuses unknowns."""

    def __init__(self, pieces: Iterable[str], space_marker: bool, fuse_unknown: bool):
        pieces = list(pieces)
        self.space_marker = space_marker
        pairs = {(ord(p[i]) << 21) | ord(p[i + 1]) for p in pieces for i in range(len(p) - 1)}
        self.spanned = np.array(sorted(pairs), dtype=np.int64)
        self.alphabet = np.array(sorted({ord(p) for p in pieces if len(p) == 1}), dtype=np.int64)
        self.fuse_unknown = fuse_unknown

    def forced_at(self, points: np.ndarray) -> np.ndarray:
        points = points.astype(np.int64)
        if self.space_marker:
            points[points == 0x20] = 0x2581
        forced = ~_holds(self.spanned, (points[:-1] << 21) | points[1:])
        if self.fuse_unknown:
            known = _holds(self.alphabet, points)
            forced &= known[:-1] | known[1:]
        return forced

    def without(self, text: str, position: int) -> UnspannedPairs:
        points = code_points(text[position - 1 : position + 1]).astype(np.int64)
        if self.space_marker:
            points[points == 0x20] = 0x2581
        rule = copy.copy(self)
        rule.spanned = np.union1d(self.spanned, [(points[0] << 21) | points[1]])
        return rule

    @property
    def claim_count(self) -> int:
        return -1  # every pair of characters the vocabulary does not span


def _holds(sorted_values: np.ndarray, values: np.ndarray) -> np.ndarray:
    at = np.searchsorted(sorted_values, values)
    return (at < len(sorted_values)) & (sorted_values[np.minimum(at, len(sorted_values) - 1)] == values)

# -- segment openers -----------------------------------------------------------

# Candidate positions looked at before giving up, matching or not.
MAX_SCANNED = 256


class SegmentOpeners:
    """The added tokens that open a segment, how far past its start each
    reaches, and a search for them in text.

    Added tokens are split out first, left to right, the longest match at each
    position, raw (``normalized=False``) tokens in a first pass and normalized
    ones in the gaps it leaves: where one is matched at ``s`` in a kept prompt
    and in a new one sharing its first characters, the new prompt's ids from
    ``s`` on are those of ``text[s:]`` tokenized whole, unless the new text
    completes past the shared prefix a match that holds the opener's text, or
    (for a normalized opener) a raw token that starts inside it with the rest
    of it. An opener's *reach* is the furthest past ``s`` such a token can end
    (``max_reach``, the longest added token, bounds every opener's). Tokens
    that look at their surroundings open nothing: ``lstrip``, ``single_word``,
    contents that begin with whitespace (a token before them with ``rstrip``
    could take it), ``normalized`` tokens when there is a normalizer, and
    special tokens when special tokens are not split out.
    """

    def __init__(self, added: Mapping[int, Any], *, has_normalizer: bool, split_special: bool):
        matched = {i: t for i, t in added.items() if t.content and not (split_special and t.special)}
        self.max_reach = max((len(t.content) for t in matched.values()), default=0)
        openers = {
            i: t for i, t in matched.items()
            if not (t.lstrip or t.single_word or t.content[0].isspace() or (has_normalizer and t.normalized))
        }
        tokens = _Joined([t.content for t in matched.values()])
        raw_tokens = _Joined([t.content for t in matched.values() if not t.normalized])
        reach_of_content: dict[str, int] = {}
        for t in openers.values():
            reach = _reach_holding(tokens, t.content)
            if t.normalized:
                reach = max(reach, _reach_of_raw_inside(raw_tokens, t.content))
            reach_of_content[t.content] = max(reach, reach_of_content.get(t.content, 0))
        self._reach_of_id = {i: reach_of_content[t.content] for i, t in openers.items()}
        self._reach_of_content = reach_of_content
        self._lengths = sorted({len(c) for c in reach_of_content}, reverse=True)
        self._first_chars = frozenset(c[0] for c in reach_of_content)
        self._least_reach = min(reach_of_content.values(), default=0)

    def reach_of(self, token_id: int) -> int | None:
        """How far past its start added token ``token_id`` reaches, or None
        if it is not an opener."""
        return self._reach_of_id.get(token_id)

    def starts_before(self, text: str, end: int, lowest: int) -> Iterator[int]:
        """Positions ``p >= lowest`` where ``text[p:]`` begins with an opener's
        content whose reach ends by ``end``, nearest to ``end`` first. (Of
        the openers that begin there, the longest is the one the reach is
        taken for: the caller checks the token it finds there with
        ``reach_of``.)"""
        highest = end - self._least_reach
        if highest < lowest or not self._reach_of_content:
            return
        reach_of_content, lengths, first_chars = self._reach_of_content, self._lengths, self._first_chars
        position = highest + 1
        for _ in range(MAX_SCANNED):
            position = _last_of(text, first_chars, lowest, position)
            if position < 0:
                return
            reach = next((reach_of_content[c] for n in lengths if (c := text[position : position + n]) in reach_of_content), None)
            if reach is not None and position + reach <= end:
                yield position


def _last_of(text: str, chars: frozenset[str], lowest: int, end: int) -> int:
    """The last position in ``[lowest, end)`` that holds one of ``chars``, or -1,
    searched in windows doubling back from ``end``: a seam is usually near the
    end of a long prompt, and searching the whole range per character would
    cost the prompt's length every turn."""
    window, high = 1024, end
    while high > lowest:
        low = max(lowest, high - window)
        found = max(text.rfind(char, low, high) for char in chars)
        if found >= 0:
            return found
        high, window = low, 2 * window
    return -1


def _reach_holding(tokens: _Joined, content: str) -> int:
    """The most characters that a token holding ``content`` at offset k has
    from k on (at least ``len(content)``)."""
    return max([len(content)] + [len(token) - offset for offset, token in tokens.occurrences(content)])


def _reach_of_raw_inside(raw_tokens: _Joined, content: str) -> int:
    """The furthest past the start of ``content`` that a raw token beginning
    inside it with the rest of ``content`` ends (0 if none)."""
    starts = ((j, token) for j in range(1, len(content)) for token in raw_tokens.starting_with(content[j:]))
    return max((j + len(token) for j, token in starts), default=0)


class _Joined:
    """Strings joined into one by a character none of them holds, so that
    finding every string that holds (or begins with) a needle is a few C
    string searches, not one comparison per string."""

    def __init__(self, parts: list[str]):
        used = set("".join(parts))
        self._separator = next(chr(c) for c in range(0x110000) if chr(c) not in used)
        self._parts = parts
        self._starts: list[int] = []
        position = 0
        for part in parts:
            position += 1
            self._starts.append(position)
            position += len(part)
        self._text = "".join(self._separator + part for part in parts)

    def occurrences(self, needle: str) -> Iterator[tuple[int, str]]:
        """(offset of ``needle`` in the string, the string) for each
        occurrence of ``needle`` (which never crosses a separator)."""
        found = self._text.find(needle)
        while found >= 0:
            index = bisect.bisect_right(self._starts, found) - 1
            yield found - self._starts[index], self._parts[index]
            found = self._text.find(needle, found + 1)

    def starting_with(self, prefix: str) -> Iterator[str]:
        """Each string that begins with ``prefix``."""
        needle = self._separator + prefix
        found = self._text.find(needle)
        while found >= 0:
            yield self._parts[bisect.bisect_left(self._starts, found + 1)]
            found = self._text.find(needle, found + 1)

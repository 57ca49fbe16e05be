"""Forced boundaries as pairs of character classes, measured on the tokenizer itself.

A *forced boundary* is a point between two characters at which every
tokenization splits, whatever text came before: the text before it cannot
influence the tokens after it (``mptok.cache.seam``). Which points are forced
is a property of the tokenizer's pre-tokenizer (and, where the pre-tokenizer
leaves a segment whole, of its vocabulary), not of a family's assumed shape,
so it is measured per tokenizer, as claims about pairs of *character
classes*: "between a character of class X and one of class Y, a pre-token
(or a token) always begins".

The classes are the Unicode general categories that regex pre-tokenizers
are written in (letters by case, marks, digits, other numbers, punctuation,
symbols, the whitespace characters each on their own, other, and unassigned
code points, which are never claimed), split into ASCII and the rest and
then by every set a pattern names: each bracket expression of a ``Split``
regex and each literal character (both cases under ``(?i``) is carved out
as its own class, so that the pattern cannot tell two characters of one
class apart (``'s`` makes ``'`` a class of its own; DeepSeek's CJK ranges
and its list of ASCII punctuation make theirs). A layout whose
pre-tokenizer leaves a segment whole (the legacy SentencePiece layout,
``Metaspace`` without ``split``) has claims from its vocabulary instead
(``UnspannedPairs``): the points between two characters that no piece holds
side by side.

``measure_pairs`` tokenizes a long random text over the classes (runs of
each, in random order) with `tokenizers` and keeps the pairs that always
split there; ``mptok.cache.seam_rules.prove_rules`` then checks each claim on
the adversarial corpus and drops the claims it refutes, one by one.

At run time a search for boundaries maps characters to classes by a table
and looks the pairs up: numpy over the characters it covers, searching back
from a point in windows that grow until one holds a boundary.
"""

from __future__ import annotations

import copy
import functools
import random
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

__all__ = ["Boundaries", "CharClasses", "ForcedPairs", "UnspannedPairs", "pattern_sets", "measure_pairs"]

# Base classes: the whitespace characters that patterns name one by one, then general categories.
_CR, _LF, _SPACE, _TAB, _OTHER_SPACE, _UPPER, _LOWER, _MODIFIER, _OTHER_LETTER = range(9)
_MARK, _DIGIT, _OTHER_NUMBER, _PUNCTUATION, _SYMBOL, _OTHER, _UNASSIGNED = range(9, 16)
_BY_CATEGORY = {
    "Lu": _UPPER, "Lt": _UPPER, "Ll": _LOWER, "Lm": _MODIFIER, "Lo": _OTHER_LETTER,
    "Mn": _MARK, "Mc": _MARK, "Me": _MARK, "Nd": _DIGIT, "Nl": _OTHER_NUMBER, "No": _OTHER_NUMBER,
    "Pc": _PUNCTUATION, "Pd": _PUNCTUATION, "Ps": _PUNCTUATION, "Pe": _PUNCTUATION,
    "Pi": _PUNCTUATION, "Pf": _PUNCTUATION, "Po": _PUNCTUATION,
    "Sm": _SYMBOL, "Sc": _SYMBOL, "Sk": _SYMBOL, "So": _SYMBOL,
    # A tokenizer's regex engine may know characters of a later Unicode version: never claimed.
    "Cn": _UNASSIGNED,
}  # fmt: skip
# Past this code point, outside plane 14, everything is unassigned or private use.
_ASSIGNED_END = 0x32400
_PLANE_14 = range(0xE0000, 0xE0200)
# Characters of a class that the random text draws from.
SAMPLES_PER_CLASS = 24
# The first window searched back for a forced boundary, in characters.
FIRST_WINDOW = 32
# Length of the random text, and how often a pair must be seen, always
# split, to be claimed.
PROBE_CHARS = 80_000
MIN_SEEN = 3
WHITESPACE_WEIGHT = 6


@functools.cache
def _base_table() -> np.ndarray:
    """Each code point's base class (built once per process)."""
    table = np.full(0x110000, _UNASSIGNED, dtype=np.uint8)
    table[0xF0000:] = _OTHER  # private use
    points = list(range(_ASSIGNED_END)) + list(_PLANE_14)
    table[points] = [_BY_CATEGORY.get(unicodedata.category(chr(c)), _OTHER) for c in points]
    # Unicode's White_Space (str.isspace adds four separators of category Cc).
    spaces = [c for c in points if chr(c).isspace() and not 0x1C <= c <= 0x1F]
    table[spaces] = _OTHER_SPACE
    table[[0x0D, 0x0A, 0x20, 0x09]] = [_CR, _LF, _SPACE, _TAB]
    return table


def code_points(text: str) -> np.ndarray:
    """``text`` as an array of code points (lone surrogates included)."""
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)


class CharClasses:
    """A table from code point to class: the base classes, split into
    ASCII and the rest and by each of ``sets`` (code point ranges)."""

    def __init__(self, sets: Iterable[Sequence[tuple[int, int]]]):
        key = _base_table().astype(np.int64) * 2
        key[:0x80] += 1
        for bit, ranges in enumerate(sets):
            for low, high in ranges:
                key[low : high + 1] |= 1 << (bit + 5)
        _, table = np.unique(key, return_inverse=True)
        self.count = int(table.max()) + 1
        self.table = table.astype(np.uint16)
        self.unassigned = np.unique(self.table[_base_table() == _UNASSIGNED])

    def of(self, text: str) -> np.ndarray:
        return self.table[code_points(text)]

    def samples(self, rng: random.Random) -> list[list[str]]:
        """Up to ``SAMPLES_PER_CLASS`` characters of each class, none a surrogate."""
        order = np.argsort(self.table, kind="stable")
        ends = np.searchsorted(self.table[order], np.arange(self.count + 1))
        samples = []
        for c in range(self.count):
            members = order[ends[c] : ends[c + 1]]
            members = members[(members < 0xD800) | (members > 0xDFFF)]
            picked = members if len(members) <= SAMPLES_PER_CLASS else members[rng.sample(range(len(members)), SAMPLES_PER_CLASS)]
            samples.append([chr(int(p)) for p in picked])
        return samples


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
        """Forced boundaries ``x`` with ``low <= x < high`` and ``x >= 1``, ascending."""
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
    that a boundary lies between a character of class x and one of class y."""

    def __init__(self, classes: CharClasses, pairs: np.ndarray):
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


def pattern_sets(pattern: str) -> list[list[tuple[int, int]]]:
    """The character sets a regex names, as code point ranges: each bracket
    expression's characters and ranges (the properties inside it are the
    base classes already), and each literal character outside one (with its
    other case under ``(?i``). A set named wrongly makes classes finer or
    coarser than the pattern's, never a claim unchecked: the measurement
    refutes a pair whose characters the pattern treats apart."""
    fold = "(?i" in pattern
    sets: list[list[tuple[int, int]]] = []
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "[":
            ranges, i = _bracket(pattern, i + 1)
            sets.append(ranges)
            continue
        if char == "\\":
            literal, i = _escape(pattern, i)
        else:
            literal, i = (None if char in "()|?*+.^${}" else char), i + 1
        if literal is not None:
            cases = {literal, literal.swapcase()} if fold and len(literal.swapcase()) == 1 else {literal}
            sets.append([(ord(c), ord(c)) for c in cases])
    return sets


def _bracket(pattern: str, i: int) -> tuple[list[tuple[int, int]], int]:
    """The ranges of the bracket expression whose body starts at ``i``, and where it ends."""
    ranges: list[tuple[int, int]] = []
    depth = 1
    if pattern[i : i + 1] == "^":
        i += 1
    while i < len(pattern) and depth:
        char = pattern[i]
        if char == "[":
            depth, i = depth + 1, i + 1
            continue
        if char == "]":
            depth, i = depth - 1, i + 1
            continue
        if char == "\\":
            literal, i = _escape(pattern, i)
        else:
            literal, i = char, i + 1
        if literal is None:
            continue
        if pattern[i : i + 1] == "-" and pattern[i + 1 : i + 2] not in ("]", ""):
            high, i = (_escape(pattern, i + 1) if pattern[i + 1] == "\\" else (pattern[i + 1], i + 2))
            if high is not None and ord(high) >= ord(literal):
                ranges.append((ord(literal), ord(high)))
                continue
        ranges.append((ord(literal), ord(literal)))
    return ranges, i


_ESCAPED = {"r": "\r", "n": "\n", "t": "\t", "f": "\f", "v": "\v", "a": "\a", "e": "\x1b"}


def _escape(pattern: str, i: int) -> tuple[str | None, int]:
    """The literal character of the escape at ``i`` (None for a class or an
    assertion such as ``\\p{L}`` or ``\\s``), and where it ends."""
    char = pattern[i + 1 : i + 2]
    if char in ("p", "P"):
        end = pattern.find("}", i) if pattern[i + 2 : i + 3] == "{" else i + 2
        return None, end + 1
    if char in ("u", "x"):
        if pattern[i + 2 : i + 3] == "{":
            end = pattern.find("}", i)
            return chr(int(pattern[i + 3 : end], 16)), end + 1
        digits = 4 if char == "u" else 2
        return chr(int(pattern[i + 2 : i + 2 + digits], 16)), i + 2 + digits
    if char in _ESCAPED:
        return _ESCAPED[char], i + 2
    if char.isalnum():
        return None, i + 2  # \s \d \w \b \A \z and the like
    return char, i + 2


def measure_pairs(
    classes: CharClasses,
    candidates: np.ndarray,
    encode: Callable[[str], Any],
    claims_pre_tokens: bool,
    seed: int = 0,
) -> np.ndarray:
    """The ``candidates`` pairs that split every time they are seen (at
    least ``MIN_SEEN`` times) in a random text tokenized by ``encode`` (the
    reference, with offsets and word ids): a pre-token begins there (a token,
    without ``claims_pre_tokens``)."""
    rng = random.Random(seed)
    samples = classes.samples(rng)
    usable = [c for c in range(classes.count) if samples[c]]
    # Whitespace runs are drawn more often: patterns look ahead over them
    # (``\s+(?!\S)``, ``\s*[\r\n]+``), so what follows a run of them decides its pairs.
    spaces = set(classes.of("\r\n \t\u00a0\u3000").tolist())
    weights = [WHITESPACE_WEIGHT if c in spaces else 1 for c in usable]
    parts: list[str] = []
    length = 0
    while length < PROBE_CHARS:
        c = rng.choices(usable, weights)[0]
        run = "".join(rng.choice(samples[c]) for _ in range(rng.choice((1, 1, 1, 2, 3, 5))))
        parts.append(run)
        length += len(run)
    text = "".join(parts)
    encoding = encode(text)
    splits = np.zeros(len(text) + 1, dtype=bool)
    offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
    starts = offsets[:, 0]
    if claims_pre_tokens:
        words = np.asarray([-1 if w is None else w for w in encoding.word_ids], dtype=np.int64)
        new_word = np.ones(len(words), dtype=bool)
        new_word[1:] = (words[1:] != words[:-1]) | (words[1:] < 0)
        first_of_start = np.ones(len(starts), dtype=bool)
        first_of_start[1:] = starts[1:] != starts[:-1]
        splits[starts[new_word & first_of_start]] = True
    else:
        splits[starts] = True
    # A character that one token ends inside and the next begins inside (byte-level) is no split.
    inside = offsets[1:, 0] < offsets[:-1, 1]
    splits[starts[1:][inside]] = False
    points = classes.of(text)
    left, right = points[:-1].astype(np.int64), points[1:].astype(np.int64)
    split_here = splits[1 : len(text)]
    seen = np.zeros((classes.count, classes.count), dtype=np.int64)
    np.add.at(seen, (left, right), 1)
    refuted = np.zeros_like(seen)
    np.add.at(refuted, (left[~split_here], right[~split_here]), 1)
    return candidates & (seen >= MIN_SEEN) & (refuted == 0)

"""A tokenizer's seam rules, derived from its specification and proven at start: what the seam encoder reads.

A splice (``mptok.cache.seam``) needs facts that the ids of a fast engine do
not carry and that `tokenizers` would take a pass over the whole prompt to
give (its offsets and word ids): where each token begins (a length table:
every vocabulary entry covers a fixed number of bytes of the text) and where
every pre-tokenization splits (*forced boundaries*, as pairs of character
classes measured on the tokenizer, or the points no vocabulary piece spans
where nothing splits a segment). ``derive_rules`` reads them from
tokenizer.json; being claims about the tokenizer, ``prove_rules`` tests
them against `tokenizers` itself when a backend is built: a wrong length
table leaves the tokenizer splicing at added tokens only, a refuted
boundary claim is dropped alone. docs/CACHE.md ("The seam rules") has the
classes, the measurement and the check in full.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from mptok.cache.seam import (
    PREFIX_ALWAYS,
    PREFIX_FIRST_UNLESS_SPACE,
    PREFIX_NONE,
    PREFIX_UNLESS_SPACE,
    SPACE_MARKER,
    UNKNOWN,
    Boundaries,
    ForcedPairs,
    SeamRules,
    UnspannedPairs,
    code_points,
)

__all__ = ["CharClasses", "derive_rules", "measure_pairs", "pattern_sets", "prove_rules"]

_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# Tails tokenized from forced boundaries per text of the start-up check.
TAILS_CHECKED_PER_TEXT = 2
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
# Length of the random text, and how often a pair must be seen, always
# split, to be claimed.
PROBE_CHARS = 80_000
MIN_SEEN = 3
WHITESPACE_WEIGHT = 6


def derive_rules(spec: dict[str, Any], split_special: bool, vocab_size: int) -> SeamRules | str:
    """The rules for the tokenizer specified by ``spec`` (tokenizer.json as a
    dict), with every pair its layout allows claimed (``prove_rules`` keeps
    the ones that hold), or why it has none."""
    model = spec.get("model") or {}
    if model.get("type") not in ("BPE", "Unigram", "WordLevel", "WordPiece"):
        return f"{model.get('type')} model"
    normalizer = _normalizer_steps(spec.get("normalizer"))
    pre = _pre_tokenizer_steps(spec.get("pre_tokenizer"))
    if isinstance(pre, str):
        return pre
    byte_level = any(step["type"] == "ByteLevel" for step in pre)
    metaspace = [s for s in pre if s["type"] == "Metaspace"]
    prefix = PREFIX_NONE
    if any(s["type"] == "ByteLevel" and s.get("add_prefix_space") for s in pre):
        prefix = PREFIX_UNLESS_SPACE
    space_marker = "replace" in normalizer or bool(metaspace)
    for step in metaspace:
        if step.get("replacement", SPACE_MARKER) != SPACE_MARKER:
            return "a Metaspace replacement other than ▁"
        scheme = step.get("prepend_scheme") or ("always" if step.get("add_prefix_space", True) else "never")
        if scheme == "always":
            prefix = PREFIX_UNLESS_SPACE
        elif scheme == "first":
            prefix = PREFIX_FIRST_UNLESS_SPACE
    if "prepend" in normalizer:
        if prefix != PREFIX_NONE:
            return "two segment prefixes"
        prefix = PREFIX_ALWAYS
    # Lengths in text bytes only where the normalizer is one the walk counts
    # through and a piece is its text; else every seam is proven by the kept tail.
    plain_pieces = model.get("type") != "WordPiece" and not model.get("continuing_subword_prefix") and not model.get("end_of_word_suffix")
    lengths = _lengths(spec, model, byte_level, vocab_size, split_special, normalizer, plain_pieces and "other" not in normalizer)
    patterns = [s["pattern"]["Regex"] for s in pre if s["type"] == "Split"]
    patterns += [_BYTE_LEVEL_PATTERN for s in pre if s["type"] == "ByteLevel" and s.get("use_regex", True)]
    splits = [s for s in pre if (s["type"] != "ByteLevel" or s.get("use_regex", True)) and (s["type"] != "Metaspace" or s.get("split", True))]
    if splits:
        sets = [range_set for pattern in patterns for range_set in pattern_sets(pattern)]
        classes = CharClasses(sets + [[(ord(SPACE_MARKER), ord(SPACE_MARKER))]])
        candidates = np.ones((classes.count, classes.count), dtype=bool)
        candidates[classes.unassigned, :] = candidates[:, classes.unassigned] = False
        if prefix in (PREFIX_UNLESS_SPACE, PREFIX_FIRST_UNLESS_SPACE):
            # A tail from a space gets no segment prefix (the engine tokenizes it whole).
            candidates[:, np.arange(classes.count) != int(classes.of(" ")[0])] = False
        forced: Boundaries = ForcedPairs(classes, candidates)
    elif normalizer <= {"replace", "prepend"}:
        pieces = [p for p in _pieces(model) if not (model.get("byte_fallback") and _BYTE_FALLBACK.fullmatch(p))]
        forced = UnspannedPairs(pieces, space_marker, fuse_unknown=model.get("type") == "Unigram" or bool(model.get("fuse_unk")))
    else:
        return "no pre-tokenizer split, and a normalizer that rewrites the pieces' characters"
    added = [t for t in spec.get("added_tokens") or () if t["id"] < len(lengths) and not (split_special and t.get("special"))]
    segment_ends = np.zeros(len(lengths), dtype=bool)
    segment_ends[[t["id"] for t in added]] = True
    return SeamRules(
        lengths=lengths,
        segment_ends=segment_ends,
        added_contents={t["id"]: t["content"] for t in added},
        forced=forced,
        claims_pre_tokens=bool(splits),
        prefix=prefix,
        nfc="nfc" in normalizer,
        space_marker=space_marker,
        layout=" + ".join(s["type"] for s in pre) or "no pre-tokenizer",
    )


_BYTE_LEVEL_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def _normalizer_steps(normalizer: dict[str, Any] | None) -> set[str]:
    """The normalizer as the steps the rules know ("nfc", "replace" (a space
    becomes ▁), "prepend" (▁ before each segment)), and "other" for any
    other step."""
    if normalizer is None:
        return set()
    kind = normalizer.get("type")
    if kind == "Sequence":
        return set().union(*(_normalizer_steps(inner) for inner in normalizer.get("normalizers") or ()))
    if kind == "NFC":
        return {"nfc"}
    if kind == "Replace" and normalizer.get("pattern") == {"String": " "} and normalizer.get("content") == SPACE_MARKER:
        return {"replace"}
    if kind == "Prepend" and normalizer.get("prepend") == SPACE_MARKER:
        return {"prepend"}
    return {"other"}


def _pre_tokenizer_steps(pre: dict[str, Any] | None) -> list[dict[str, Any]] | str:
    if pre is None:
        return []
    kind = pre.get("type")
    if kind == "Sequence":
        steps: list[dict[str, Any]] = []
        for inner in pre.get("pretokenizers") or ():
            found = _pre_tokenizer_steps(inner)
            if isinstance(found, str):
                return found
            steps += found
        return steps
    if kind == "Split" and "Regex" not in (pre.get("pattern") or {}):
        return "a Split pre-tokenizer on a string"
    return [pre]


def _lengths(
    spec: dict[str, Any], model: dict[str, Any], byte_level: bool, vocab_size: int, split_special: bool, normalizer: set[str],
    pieces_counted: bool,
) -> np.ndarray:
    """Each id's length in text bytes (``UNKNOWN`` where the id does not
    tell; every model piece where not ``pieces_counted``)."""
    pieces = _pieces(model)
    lengths = np.full(vocab_size, UNKNOWN, dtype=np.int32)
    byte_fallback = bool(model.get("byte_fallback"))
    for piece, i in pieces.items() if pieces_counted else ():
        if not 0 <= i < vocab_size:
            continue
        if byte_level:
            lengths[i] = len(piece)
        elif byte_fallback and _BYTE_FALLBACK.fullmatch(piece):
            lengths[i] = 1
        else:
            lengths[i] = len(piece.replace(SPACE_MARKER, " ").encode("utf-8"))
    # Where pieces are not counted, their text may not tile the prompt (a
    # pre-tokenizer that drops whitespace): no added token is located either.
    for token in spec.get("added_tokens") or () if pieces_counted else ():
        i = token["id"]
        if not 0 <= i < vocab_size or (split_special and token.get("special")):
            continue
        if token.get("lstrip") or token.get("rstrip") or (normalizer and token.get("normalized")):
            lengths[i] = UNKNOWN
        else:
            lengths[i] = len(token["content"].encode("utf-8"))
    # After the added tokens: an added token that is also the model's unknown
    # piece stands for text of any length where the model produced it.
    for unk in (model.get("unk_id"), pieces.get(model.get("unk_token") or "")):
        if unk is not None and 0 <= unk < vocab_size:
            lengths[unk] = UNKNOWN
    return lengths


def _pieces(model: dict[str, Any]) -> dict[str, int]:
    vocab = model.get("vocab") or {}
    if model.get("type") == "Unigram":
        return {piece: i for i, (piece, _score) in enumerate(vocab)}
    return dict(vocab)


def prove_rules(
    rules: SeamRules, encode: Callable[[str], Any], tail_ids: Callable[[str, bool], Sequence[int]], texts: Sequence[str]
) -> tuple[SeamRules | None, str]:
    """``rules`` with only the claimed pairs that `tokenizers` never contradicts
    (measured on a random text over the classes, then checked on ``texts``),
    and a line for the start log; None if the lengths are contradicted.
    ``encode`` is the reference (an ``Encoding`` with offsets and word ids);
    ``tail_ids(text, at_segment_start)`` what a splice tokenizes a tail with."""
    claims_pre_tokens = rules.claims_pre_tokens
    if isinstance(rules.forced, ForcedPairs):
        try:
            pairs = measure_pairs(rules.forced.classes, rules.forced.pairs, encode, claims_pre_tokens)
        except Exception:
            pairs = np.zeros_like(rules.forced.pairs)  # the text was refused: nothing measured, nothing claimed
        rules = dataclasses.replace(rules, forced=ForcedPairs(rules.forced.classes, pairs))
    refuted: list[str] = []
    for text in texts:
        try:
            encoding = encode(text)
        except Exception:
            continue
        ids = np.asarray(encoding.ids, dtype=np.int64)
        offsets = encoding.offsets
        words = encoding.word_ids
        located = rules.token_starts(ids, text, 0, len(text))
        if located is not None:
            for position, index in zip(located.positions.tolist(), located.indices.tolist()):
                if offsets[index][0] != position:
                    return None, f"seam rules refuted: token {index} of a {len(text)}-character text begins at {offsets[index][0]}, not {position}"
        starts = {}
        for index, (start, _end) in enumerate(offsets):
            starts.setdefault(start, index)
        # Added tokens are split out before the pre-tokenizer sees the text:
        # a forced boundary inside one says nothing (and is no seam: no token begins there).
        inside_added = np.zeros(len(text) + 1, dtype=bool)
        for (start, end), i in zip(offsets, ids.tolist()):
            if rules.segment_ends[i]:
                inside_added[start + 1 : end] = True
        checked: list[int] = []
        forced = rules.forced.between(text, 0, len(text))
        for position in forced[~inside_added[forced]].tolist():
            index = starts.get(position)
            splits = index is not None and (
                not claims_pre_tokens or index == 0 or words[index] is None or words[index] != words[index - 1]
            )
            if not splits:
                refuted.append(f"{text[position - 1 : position + 1]!r}")
                rules = dataclasses.replace(rules, forced=rules.forced.without(text, position))
            else:
                checked.append(position)
        step = max(1, len(checked) // TAILS_CHECKED_PER_TEXT)
        for position in checked[::step][:TAILS_CHECKED_PER_TEXT]:
            index = starts[position]
            at_segment_start = index == 0 or bool(rules.segment_ends[ids[index - 1]])
            tail = [int(i) for i in tail_ids(text[position:], at_segment_start)]
            if tail != ids[index:].tolist():
                refuted.append(f"{text[position - 1 : position + 1]!r}")
                rules = dataclasses.replace(rules, forced=rules.forced.without(text, position))
    claimed = rules.forced.claim_count
    report = f"seam rules: {rules.layout}, " + (f"{claimed} class pairs forced" if claimed >= 0 else "points no piece spans forced")
    if refuted:
        report += f" ({len(refuted)} refuted at start, first at {refuted[0]})"
    return rules, report

# -- character classes ---------------------------------------------------------

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


class CharClasses:
    """A table from code point to class: the base classes, split into
    ASCII and the rest and by each of ``sets`` (code point ranges)."""

    def __init__(self, sets: Iterable[Sequence[tuple[int, int]]]):
        base = _base_table()
        key = base.astype(np.int64) * 2
        key[:0x80] += 1
        for bit, ranges in enumerate(sets):
            for low, high in ranges:
                key[low : high + 1] |= 1 << (bit + 5)
        # A class per distinct key, numbered in key order; found over the runs
        # of equal keys, a few thousand, not over every code point.
        ends = np.append(np.flatnonzero(key[1:] != key[:-1]) + 1, len(key))
        keys, run_classes = np.unique(key[ends - 1], return_inverse=True)
        self.count = len(keys)
        self.table = np.repeat(run_classes.astype(np.uint16), np.diff(ends, prepend=0))
        self.unassigned = np.unique(run_classes[base[ends - 1] == _UNASSIGNED])

    def of(self, text: str) -> np.ndarray:
        return self.table[code_points(text)]

    def samples(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``SAMPLES_PER_CLASS`` code points of each class, none a surrogate:
        a row per class, and how many of each row's are real."""
        order = np.argsort(self.table, kind="stable")
        ends = np.searchsorted(self.table[order], np.arange(self.count + 1))
        rows = np.zeros((self.count, SAMPLES_PER_CLASS), dtype=np.uint32)
        counts = np.zeros(self.count, dtype=np.int64)
        for c in range(self.count):
            members = order[ends[c] : ends[c + 1]]
            members = members[(members < 0xD800) | (members > 0xDFFF)]
            if len(members) > SAMPLES_PER_CLASS:
                members = rng.choice(members, SAMPLES_PER_CLASS, replace=False)
            rows[c, : len(members)] = members
            counts[c] = len(members)
        return rows, counts


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


def _probe_text(classes: CharClasses, rng: np.random.Generator) -> str:
    """``PROBE_CHARS`` characters or more: runs of one to five characters of one class each."""
    rows, counts = classes.samples(rng)
    usable = np.flatnonzero(counts)
    # Whitespace runs are drawn more often: patterns look ahead over them
    # (``\s+(?!\S)``, ``\s*[\r\n]+``), so what follows a run of them decides its pairs.
    weights = np.where(np.isin(usable, classes.of("\r\n \t\u00a0\u3000")), WHITESPACE_WEIGHT, 1.0)
    # As many runs as characters: enough, a run being one character or more.
    run_classes = rng.choice(usable, PROBE_CHARS, p=weights / weights.sum())
    run_lengths = rng.choice(np.array([1, 1, 1, 2, 3, 5]), PROBE_CHARS)
    runs = int(np.searchsorted(np.cumsum(run_lengths), PROBE_CHARS)) + 1
    char_classes = np.repeat(run_classes[:runs], run_lengths[:runs])
    picks = (rng.random(len(char_classes)) * counts[char_classes]).astype(np.int64)
    return rows[char_classes, picks].tobytes().decode("utf-32-le")


def measure_pairs(
    classes: CharClasses, candidates: np.ndarray, encode: Callable[[str], Any], claims_pre_tokens: bool, seed: int = 0
) -> np.ndarray:
    """The ``candidates`` pairs that split every time they are seen (at
    least ``MIN_SEEN`` times) in a random text tokenized by ``encode`` (the
    reference, with offsets and word ids): a pre-token begins there (a token,
    without ``claims_pre_tokens``)."""
    text = _probe_text(classes, np.random.default_rng(seed))
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

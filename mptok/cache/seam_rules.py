"""What the proof of a seam reads from the tokenizer: where each kept token begins, where every tokenization splits, and which added tokens open a segment.

A splice keeps a prompt's ids up to a seam and tokenizes only the text from
the seam on (``mptok.cache.seam``). To prove the seam it needs facts that
the ids of a fast engine do not carry and that `tokenizers` would take a
pass over the whole prompt to give (its offsets and word ids):

- **Where each token begins.** Every vocabulary entry covers a fixed number
  of bytes of the text: a byte-level BPE entry one byte per character (the
  ByteLevel alphabet maps each byte to one character), a SentencePiece piece
  its UTF-8 bytes with ``▁`` standing for a space, a byte-fallback piece
  (``<0x0A>``) one byte, an added token its content. So the kept ids,
  walked back from the end of the kept text, say where each of the last
  tokens begins: a gather of a length table and a cumulative sum over the
  tokens near the end, never over the prompt. What a layout adds at the start
  of a segment (the text between two added tokens: ByteLevel's
  ``add_prefix_space``, Metaspace's prepend scheme, a ``Prepend``
  normalizer) covers no byte of the text; the walk takes it out where it
  applies. A token of unknown length (``<unk>``; an added token that strips
  whitespace or is matched in normalized text) ends the walk. A literal
  ``▁`` (which a space also becomes) and text that NFC would change (for an
  NFC normalizer) make the lengths ambiguous: nothing is located across them.
- **Where every pre-tokenization splits** (*forced boundaries*): points
  at which the pre-tokenizer splits whatever it started from, so the text
  before them cannot influence the tokens after them: pairs of character
  classes measured on the tokenizer, or, where nothing splits a segment,
  points no vocabulary piece spans (``mptok.cache.boundaries``). A layout
  whose segment start gets a prefix unless it begins with a space keeps
  only the pairs before a space, so that the tail from there gets no
  prefix either.
- **Which added tokens open a segment** (``SegmentOpeners``). Added tokens
  are split out first, so where one is matched at ``s`` in a kept prompt
  and in a new one sharing its first characters, the new prompt's ids from
  ``s`` on are those of ``text[s:]`` tokenized whole. They are found left to
  right, each match the longest at its position, raw (``normalized=False``)
  tokens in a first pass and normalized ones in the gaps it leaves; so the
  prompts can decide differently up to ``s`` only through a match that the
  new text completes past the shared prefix: one holding the opener's text,
  or (for a normalized opener) a raw token that starts inside it and begins
  with the rest of it. An opener's *reach* is the furthest past ``s`` such a
  token can end; ``max_reach``, the longest added token, bounds every
  opener's. Tokens that look at their surroundings open nothing: ``lstrip``,
  ``single_word``, contents that begin with whitespace (a token before them
  with ``rstrip`` could take it), ``normalized`` tokens when there is a
  normalizer, and special tokens when special tokens are not split out.

The first two are claims about the tokenizer, so ``prove_rules`` tests them
when a backend is built, against `tokenizers` itself, on the adversarial
corpus the fast engines are checked on: a wrong length table leaves the
tokenizer splicing at added tokens only, a refuted boundary claim is
dropped alone. Where lengths are not counted (a normalizer that rewrites
characters, WordPiece's ``##``, a pre-tokenizer that drops whitespace),
``lengths`` is all ``UNKNOWN`` and seams are proven by the kept tail
(``mptok.cache.seam``).
"""

from __future__ import annotations

import bisect
import dataclasses
import re
import unicodedata
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mptok.cache.boundaries import Boundaries, CharClasses, ForcedPairs, UnspannedPairs, measure_pairs, pattern_sets

__all__ = ["SeamRules", "SegmentOpeners", "derive_rules", "prove_rules"]

SPACE_MARKER = "\u2581"
# A token whose length the ids do not tell (``<unk>``, whitespace-stripping added tokens).
UNKNOWN = -1
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")

# What a layout puts before a segment's first token.
PREFIX_NONE = "none"
PREFIX_UNLESS_SPACE = "unless-space"  # ByteLevel add_prefix_space, Metaspace "always"
PREFIX_FIRST_UNLESS_SPACE = "first-unless-space"  # Metaspace "first": the text's first segment only
PREFIX_ALWAYS = "always"  # a Prepend normalizer

# Code points from which a character takes 2, 3 and 4 UTF-8 bytes.
_UTF8_UNITS = np.array([0x80, 0x800, 0x10000], dtype=np.uint32)
# What a claim of a forced boundary says: that a pre-token begins there, or
# (a layout whose pre-tokenizer leaves a segment whole) that a token does.
CLAIMS_PRE_TOKENS = "pre-tokens"
CLAIMS_TOKENS = "tokens"
# Tails tokenized from forced boundaries per text of the start-up check.
TAILS_CHECKED_PER_TEXT = 2

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


@dataclass(frozen=True)
class SeamRules:
    """A tokenizer's length table and forced-boundary rule (module docstring).

    ``lengths[i]`` is the number of text bytes token ``i`` covers in the middle
    of a segment (``UNKNOWN`` if the id does not tell); ``segment_ends[i]`` is
    true for the added tokens that end a segment, whose contents
    ``added_contents`` holds.
    """

    lengths: np.ndarray
    segment_ends: np.ndarray
    added_contents: dict[int, str]
    forced: Boundaries
    claims: str  # CLAIMS_PRE_TOKENS or CLAIMS_TOKENS
    prefix: str
    nfc: bool
    space_marker: bool
    layout: str

    def forced_boundaries(self, text: str, low: int, high: int) -> np.ndarray:
        """Forced boundaries ``x`` with ``low <= x < high``, ascending; each
        decided by ``text[x - 1]`` and ``text[x]`` alone."""
        return self.forced.between(text, low, high)

    def token_starts(self, ids: np.ndarray, text: str, lowest: int, upto: int) -> TokenStarts | None:
        """Where the last tokens of ``ids`` (the exact tokenization of
        ``text``) begin, for those that begin in ``[lowest, upto)`` and after
        any token of unknown length; None where the lengths do not tile the
        text.

        The walk counts the text in the units the lengths are in (UTF-8
        bytes, ``▁`` one where a space becomes ``▁``); for an NFC normalizer,
        the text from the first clean point at or after ``upto`` is counted
        as NFC makes it, and tokens are located only where NFC leaves the
        text as it is."""
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
        self,
        tail: np.ndarray,
        lengths: np.ndarray,
        walked: str,
        char_units: np.ndarray,
        total: int,
        covers_start: bool,
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
    segment_ends = np.zeros(len(lengths), dtype=bool)
    added_contents = {}
    for token in spec.get("added_tokens") or ():
        if token["id"] < len(segment_ends) and not (split_special and token.get("special")):
            segment_ends[token["id"]] = True
            added_contents[token["id"]] = token["content"]
    return SeamRules(
        lengths=lengths,
        segment_ends=segment_ends,
        added_contents=added_contents,
        forced=forced,
        claims=CLAIMS_PRE_TOKENS if splits else CLAIMS_TOKENS,
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
    spec: dict[str, Any],
    model: dict[str, Any],
    byte_level: bool,
    vocab_size: int,
    split_special: bool,
    normalizer: set[str],
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
    rules: SeamRules,
    encode: Callable[[str], Any],
    tail_ids: Callable[[str, bool], Sequence[int]],
    texts: Sequence[str],
) -> tuple[SeamRules | None, str]:
    """``rules`` with only the claimed pairs that `tokenizers` never
    contradicts (measured on a random text over the classes, then checked
    on ``texts``), and a line for the start log; None if the lengths are
    contradicted. ``encode`` is the reference full
    encoding (an ``Encoding`` with offsets and word ids); ``tail_ids(text,
    at_segment_start)`` what a splice tokenizes a tail cut at a forced
    boundary with (a boundary right after an added token starts a segment)."""
    claims_pre_tokens = rules.claims == CLAIMS_PRE_TOKENS
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
        forced = rules.forced_boundaries(text, 0, len(text))
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


# -- segment openers ---------------------------------------------------------------

# Candidate positions looked at before giving up, matching or not.
MAX_SCANNED = 256


class SegmentOpeners:
    """The added tokens that open a segment, how far past its start each
    reaches (module docstring), and a search for them in text."""

    def __init__(self, added: Mapping[int, Any], *, has_normalizer: bool, split_special: bool):
        matched = {i: t for i, t in added.items() if t.content and not (split_special and t.special)}
        self.max_reach = max((len(t.content) for t in matched.values()), default=0)
        openers = {
            i: t
            for i, t in matched.items()
            if not t.lstrip
            and not t.single_word
            and not t.content[0].isspace()
            and not (has_normalizer and t.normalized)
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
    """The last position in ``[lowest, end)`` that holds one of ``chars``, or -1.

    Searches windows doubling back from ``end``: a seam is usually near the
    end of a long prompt, and one search of the whole range per character
    would cost what the prompt's length costs, for every turn.
    """
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

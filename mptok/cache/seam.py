"""Extend a kept tokenization to a new prompt, and prove the splice exact: the one place a splice is decided.

A new prompt shares a prefix with a kept one. Re-tokenizing only from a
*seam* inside that prefix is exact when full tokenization of the new prompt
splits there too and the text before the seam does not influence the tokens
after it. Comparing the first re-tokenized ids with the kept ids is not
enough (docs/CACHE.md: NFC composes across seams, the legacy SentencePiece
layout adds a dummy prefix whose ids still match), so a seam must pass all of
(``mptok.cache.seam_rules`` reads what they need from the tokenizer):

1. Every tokenization of the new prompt splits there: it is a *forced
   boundary* of the tokenizer's pre-tokenizer, decided by the characters on
   each side (so one before the shared prefix's last character is one in
   both prompts), or the start of an added token that opens a segment.
2. It is where a kept token begins: the kept ids, walked back from the end
   of the kept text by their lengths (``SeamRules.token_starts``), say which
   token; a character split over several tokens never is. Where the walk
   cannot tell (a token of unknown length after the seam, lengths a
   normalizer changes), the kept text from the seam, tokenized, must give
   exactly the kept prompt's last ids, and the new tail's first id must be
   the first of them.
3. Its character starts cleanly under Unicode normalization (no combining
   mark, nothing that decomposes into one), and the tokenizer's own
   normalizer gives the same text around it whether it runs across the seam
   or on each side apart.
4. The tail tokenized from the seam reproduces the kept ids up to the next
   seam candidate inside the shared prefix (a forced boundary or added
   token there too): both tokenize the same pre-tokens, so a difference
   means a rule or an engine is wrong, and the splice is refused.
5. The seam plus the longest added token (for an added token's own seam,
   its reach) lies inside the shared prefix: added tokens are split out
   first, left to right, and one that the new text completes (the kept
   prompt ended inside its text) must not start before the seam.

Then the new prompt's ids are the kept ids before the seam followed by the
tail's, tokenized by the backend's engine: the whole text's from an added
token or a segment start, a continuation of the segment from anywhere else
(``TokenizerBackend.encode_tail``). A hit costs the new text: the search for
seams goes back from the point where the prompts part in windows that grow
until they hold enough forced boundaries (across a long run without one it
costs that run), and the walk covers from there to the end of the kept
prompt, never the whole prompt.

A tokenizer with no seam rules (``seam_rules`` is None) splices at added
tokens only, each proven by tokenizing the kept prompt's text from the seam
with the engine: it must give exactly the kept prompt's last ids, starting
with the added token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mptok.cache.backend import TokenizerBackend
from mptok.cache.seam_rules import TokenStarts, starts_cleanly
from mptok.core.ids import IdPieces

__all__ = ["CachedPrompt", "extend_prompt", "tokenize_prompt", "prompt_of_ids"]

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


def tokenize_prompt(backend: TokenizerBackend, text: str) -> CachedPrompt:
    """``text`` tokenized in full by the backend's engine."""
    return CachedPrompt(text, IdPieces.of(backend.encode_id_array(text)))


def prompt_of_ids(text: str, ids: np.ndarray) -> CachedPrompt:
    """``text`` kept with ``ids``, its exact ids from elsewhere (a peer's answer), copied."""
    return CachedPrompt(text, IdPieces.of(ids))


def extend_prompt(
    backend: TokenizerBackend, cached: CachedPrompt, text: str, shared: int, *, max_attempts: int
) -> CachedPrompt | None:
    """``text`` tokenized by splicing onto ``cached``, or None if no seam is proven.

    ``shared`` is ``common_prefix_length(cached.text, text)``. The returned
    prompt's ids equal the full tokenization of ``text``; at most
    ``max_attempts`` tails are tokenized.
    """
    if shared == len(text) == len(cached.text):
        return cached
    if len(cached.text) - shared > MAX_WALK_CHARS:
        return None
    if backend.seam_rules is None:
        return _extend_at_added_token(backend, cached, text, shared, max_attempts)
    return _extend(backend, cached, text, shared, max_attempts)


def _extend(
    backend: TokenizerBackend, cached: CachedPrompt, text: str, shared: int, max_attempts: int
) -> CachedPrompt | None:
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


_NONE_LOCATED = TokenStarts(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))


def _lowest_tail_proof(cached: CachedPrompt, text: str) -> int:
    """The lowest seam proven by tokenizing the kept text from it:
    re-tokenizing ``len(cached.text) - s`` plus ``len(text) - s`` characters
    must stay within three quarters of the prompt; past that a full
    tokenization costs about as much."""
    return max(1, (len(cached.text) + len(text) // 4 + 1) // 2)


def _index_by_kept_tail(
    backend: TokenizerBackend, kept: np.ndarray, kept_text: str, seam: int
) -> tuple[int, bool] | None:
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


def _clean_seam(backend: TokenizerBackend, text: str, seam: int) -> bool:
    """Check 3: the seam's character starts cleanly and the normalizer treats both sides apart."""
    if not starts_cleanly(text[seam]):
        return False
    return backend.normalizes_apart(text[max(0, seam - NORMALIZER_CONTEXT) : seam], text[seam : seam + NORMALIZER_CONTEXT])


def _extend_at_added_token(
    backend: TokenizerBackend, cached: CachedPrompt, text: str, shared: int, max_attempts: int
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

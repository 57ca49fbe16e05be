"""Where an added token starts a segment that two prompts tokenize alike.

A tokenizer splits added tokens out of the text before anything else, then
normalizes, pre-tokenizes and runs its model on each segment between them,
on its own. So if an added token is matched at character ``s`` of a kept
prompt and of a new prompt that shares its first characters, the new
prompt's ids from ``s`` on are those of ``text[s:]`` tokenized whole: no
offsets or pre-token boundaries are needed to prove such a splice. This is
the seam a fast backend (which gives ids only) can use
(``mptok.cache.seam``).

Whether the match at ``s`` is the same in both prompts: added tokens are
found left to right, each match the longest at its position, raw
(``normalized=False``) tokens in a first pass and normalized ones in the
gaps it leaves. The two prompts can decide differently up to ``s`` only
through a match that the new prompt's text completes past the shared
prefix. Such a match starts at or before ``s`` and so contains the opener's
text, or (for a normalized opener, which the first pass does not see) it is
a raw token that starts inside the opener and begins with the rest of it.
Each opener's *reach* is the furthest past ``s`` that any such token can end
(its own length when no added token contains it); a position with ``s`` plus
its opener's reach inside the shared prefix is decided alike. ``max_reach``,
the longest added token, bounds every opener's.

Tokens that look at their surroundings are never used as openers:
``lstrip`` (takes the whitespace before it), ``single_word`` (looks at the
characters around it), contents that begin with whitespace (a token before
them with ``rstrip`` could take it), ``normalized`` tokens when there is a
normalizer (matched in normalized text), and special tokens when special
tokens are not split out.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping
from typing import Any

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
        reaches = _Reaches([t.content for t in matched.values()], [t.content for t in matched.values() if not t.normalized])
        reach_of_content: dict[str, int] = {}
        for t in openers.values():
            reach = reaches.containing(t.content)
            if t.normalized:
                reach = max(reach, reaches.raw_inside(t.content))
            reach_of_content[t.content] = max(reach, reach_of_content.get(t.content, 0))
        self._reach_of_id = {i: reach_of_content[t.content] for i, t in openers.items()}
        self._reach_of_content = reach_of_content
        self._lengths = sorted({len(c) for c in reach_of_content}, reverse=True)
        self._first_chars = frozenset(c[0] for c in reach_of_content)
        self._least_reach = min(reach_of_content.values(), default=0)

    def __bool__(self) -> bool:
        return bool(self._reach_of_content)

    def reach_of(self, token_id: int) -> int | None:
        """How far past its start added token ``token_id`` reaches, or None
        if it is not an opener."""
        return self._reach_of_id.get(token_id)

    def starts_before(self, text: str, end: int, lowest: int = 0) -> Iterator[int]:
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


class _Reaches:
    """How far past an opener's start the added tokens that could overlap it end."""

    def __init__(self, contents: list[str], raw_contents: list[str]):
        self._all = _Joined(contents)
        self._raw = _Joined(raw_contents)

    def containing(self, content: str) -> int:
        """The most characters that a token holding ``content`` at offset k
        has from k on (at least ``len(content)``)."""
        reach = len(content)
        for offset_in_token, token in self._all.occurrences(content):
            reach = max(reach, len(token) - offset_in_token)
        return reach

    def raw_inside(self, content: str) -> int:
        """The furthest past the start of ``content`` that a raw token
        beginning inside it with the rest of ``content`` ends (0 if none)."""
        reach = 0
        for j in range(1, len(content)):
            for token in self._raw.starting_with(content[j:]):
                reach = max(reach, j + len(token))
        return reach


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

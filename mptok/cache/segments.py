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
found left to right, each match the longest at its position, so every
decision up to ``s`` depends only on the text up to ``s + reach`` (the
longest added token). A position with ``s + reach`` inside the shared prefix
is decided alike. Tokens that look at their surroundings are never used as
openers: ``lstrip`` (takes the whitespace before it), ``single_word`` (looks
at the characters around it), contents that begin with whitespace (a token
before them with ``rstrip`` could take it), ``normalized`` tokens when there
is a normalizer (matched in normalized text), and special tokens when
special tokens are not split out.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

# Candidate positions looked at before giving up, matching or not.
MAX_SCANNED = 256


class SegmentOpeners:
    """The added tokens that open a segment, and a search for them in text."""

    def __init__(self, added: Mapping[int, Any], *, has_normalizer: bool, split_special: bool):
        matched = {i: t for i, t in added.items() if t.content and not (split_special and t.special)}
        self.reach = max((len(t.content) for t in matched.values()), default=0)
        self.ids = frozenset(matched)
        contents = {
            t.content
            for t in matched.values()
            if not t.lstrip
            and not t.single_word
            and not t.content[0].isspace()
            and not (has_normalizer and t.normalized)
        }
        self._contents = frozenset(contents)
        self._lengths = sorted({len(c) for c in contents}, reverse=True)
        self._first_chars = frozenset(c[0] for c in contents)

    def __bool__(self) -> bool:
        return bool(self._contents)

    def starts_before(self, text: str, end: int, lowest: int = 0) -> Iterator[int]:
        """Positions ``p >= lowest`` where ``text[p:]`` begins with an opener's
        content and ``p + reach <= end``, nearest to ``end`` first."""
        highest = end - self.reach
        if highest < lowest or not self._contents:
            return
        previous = {c: text.rfind(c, lowest, highest + 1) for c in self._first_chars}
        contents, lengths = self._contents, self._lengths
        for _ in range(MAX_SCANNED):
            char, position = max(previous.items(), key=lambda item: item[1])
            if position < 0:
                return
            if any(text[position : position + n] in contents for n in lengths):
                yield position
            previous[char] = text.rfind(char, lowest, position)

"""A conversation's messages as its chat template sees them, and their rendering, kept from its last turn.

A turn of a chat resends every earlier message, and checking, converting,
preparing, counting and rendering each is Python per message. ``ChatTurns``
keeps, per conversation key, its last turn's messages as sent and as
prepared: a new turn whose first messages equal those (one comparison, at C
speed) takes their preparation and character count, and checks and prepares
only the messages after them. With the built-in template (``BuiltInPieces``:
each message's piece of the prompt depends on that message alone) the pieces
are kept too, and the prompt is one join: no template code runs for the
messages before. Bounded (``ByteBoundedLru``): about the messages' size,
least recently used conversation dropped first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from mptok.api.chat_template import BuiltInPieces, template_messages, vllm_conversation
from mptok.api.tokenize_request import check_messages
from mptok.core.lru import ByteBoundedLru

DEFAULT_MAX_BYTES = 64 << 20
_MESSAGE_OVERHEAD_BYTES = 400  # two dicts of a few keys, as CPython holds them


@dataclass(frozen=True)
class _Pieces:
    """The built-in template's piece of each of a turn's messages; ``systems``:
    (index, content) of each system message."""

    pieces: list[str]
    systems: list[tuple[int, str]]

    def extended(self, prepared: list[dict[str, Any]], start: int) -> _Pieces | None:
        """The pieces of the messages before ``start``, then those of ``prepared`` (messages ``start``...);
        None if the template refuses one of them (its Jinja source then renders the refusal)."""
        pieces, systems = self.pieces[:start], [s for s in self.systems if s[0] < start]
        for i, message in enumerate(prepared, start):
            piece = BuiltInPieces.piece(message)
            if piece is None:
                return None
            if message["role"] == "system":
                systems.append((i, message["content"]))
            pieces.append(piece)
        return _Pieces(pieces, systems)

    def text(self, add_generation_prompt: bool) -> str:
        return BuiltInPieces.text([content for _, content in self.systems], self.pieces, add_generation_prompt)


_NO_PIECES = _Pieces([], [])


@dataclass(frozen=True)
class _Kept:
    """A turn's messages as sent and as prepared; ``chars[i]`` and ``sizes[i]``:
    the content characters and the bytes of the first ``i`` messages; their pieces (built-in template)."""

    sent: list[dict[str, Any]]
    prepared: list[dict[str, Any]]
    chars: list[int]
    sizes: list[int]
    pieces: _Pieces | None


class ChatTurn:
    """One request's messages, with what its conversation's last turn had of them."""

    def __init__(self, turns: ChatTurns, key: str | None, messages: list[Any], kept: _Kept | None):
        self._turns, self._key, self.messages = turns, key, messages
        self._kept = kept
        self.known = 0 if kept is None else _shared(kept.sent, messages)
        self._pieces: _Pieces | None = None

    def check(self) -> None:
        """``RequestError`` (400) for a message vLLM would refuse (those known from the last turn were checked then)."""
        check_messages(self.messages, self.known)

    def content_chars(self) -> int:
        """The characters of every message's content (``check`` first)."""
        before = self._kept.chars[self.known] if self._kept is not None else 0
        return before + sum(map(_content_chars, self.messages[self.known :]))

    def prepared(self) -> list[dict[str, Any]]:
        """The messages as the template sees them (``template_messages`` of ``vllm_conversation``),
        kept for the conversation's next turn; ``ChatTemplateError`` as ``vllm_conversation`` raises it."""
        known, kept = self.known, self._kept
        new = template_messages(vllm_conversation(self.messages[known:], known))
        prepared = new if kept is None else kept.prepared[:known] + new
        if self._turns.pieces:
            if kept is not None and kept.pieces is not None:
                self._pieces = kept.pieces.extended(new, known)
            else:
                self._pieces = _NO_PIECES.extended(prepared, 0)
        if self._key is not None:
            chars, sizes = ([0], [0]) if kept is None else (kept.chars[: known + 1], kept.sizes[: known + 1])
            for message in self.messages[known:]:
                chars.append(chars[-1] + _content_chars(message))
                sizes.append(sizes[-1] + _message_bytes(message))
            self._turns.kept.put(self._key, _Kept(list(self.messages), prepared, chars, sizes, self._pieces), sizes[-1])
        return prepared

    def built_in_text(self, add_generation_prompt: bool) -> str | None:
        """After ``prepared``: the built-in template's prompt from the kept pieces; None
        when the template is another or refuses a message."""
        return None if self._pieces is None else self._pieces.text(add_generation_prompt)


class ChatTurns:
    """Per conversation key, its last turn's messages; ``turn`` starts a request's. Thread-safe.

    ``pieces``: the template is the built-in one (its pieces are kept too)."""

    def __init__(self, pieces: bool, max_bytes: int = DEFAULT_MAX_BYTES):
        self.pieces = pieces
        self.kept: ByteBoundedLru[_Kept] = ByteBoundedLru(max_bytes)

    def turn(self, key: str | None, messages: list[Any]) -> ChatTurn:
        return ChatTurn(self, key, messages, None if key is None else self.kept.get(key))


def _shared(kept: list[Any], messages: list[Any]) -> int:
    """How many messages at the start of ``messages`` equal ``kept``'s."""
    n = min(len(kept), len(messages))
    if kept[:n] == messages[:n]:
        return n
    return next(i for i in range(n) if kept[i] != messages[i])


def _content_chars(message: dict[str, Any]) -> int:
    content = message.get("content") or ""
    return len(content) if isinstance(content, str) else sum(len(part["text"]) for part in content)


def _message_bytes(message: dict[str, Any]) -> int:
    """About what a message holds kept: as sent, its prepared copy's own strings, its piece of the prompt."""
    return _MESSAGE_OVERHEAD_BYTES + 3 * len(orjson.dumps(message))

"""What both sides of the peer delta protocol share: the versions a cache keeps, and a reply.

A frontend that routes a conversation to its owner holds the owner's last
reply for it (``mptok.routing.held``); its next turn sends only the
characters after those it shares with the held text, naming the held
version. The owner remembers a few earlier versions of each conversation
(``history_after``), rebuilds the prompt, and answers with the ids that
changed (``mptok.routing.answer``). The cache keeps the versions
(``Kept``, ``History``) without calling the protocol; the transport carries
``PeerReply`` without reading its ids. Every layer that speaks of them
imports them from here, the bottom layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mptok.core.ids import IdPieces

# Earlier versions of a conversation whose ids an owner remembers, so that a
# peer holding one of them gets only the ids that changed (``answer_peer``).
# A peer last saw a conversation about F turns ago, but the gap is geometric:
# with F = 4, 8 versions left 7% of routed prompts (replayed) needing a second
# call with the whole text; 16 leave about 1% ((3/4)^16). The versions share
# their id lists (``IdPieces``) until a splice compacts them, so the ids kept
# for 16 are a few lists per conversation, not 16. A version that shares no
# character with the newest prompt is of no use to a peer and is dropped.
PEER_HISTORY = 16

# Earlier versions of a kept prompt, newest first: (version, ids, characters
# that version shares with the kept prompt).
History = tuple[tuple[int, IdPieces, int], ...]


@dataclass(frozen=True)
class PeerReply:
    """An owner's answer for one prompt of a conversation.

    The prompt's ids are the first ``reused`` ids of the version the peer
    named, followed by ``ids``. ``version`` names the prompt just kept (0 if
    it was not kept), for the peer's next request.
    """

    version: int
    reused: int
    ids: Sequence[int]  # a list from ``answer_peer``; an int32 array from the transport


@dataclass(frozen=True)
class Kept:
    """A prompt a cache keeps for a conversation: its text, its version, its
    ids, and the earlier versions it remembers (``History``)."""

    text: str
    version: int
    ids: IdPieces
    history: History


def history_after(known: Kept | None, shared: int) -> History:
    """The history of the prompt that replaces ``known`` and shares its first
    ``shared`` characters: ``known`` itself, then what it remembered, each
    version capped at ``shared`` characters, at most ``PEER_HISTORY``."""
    if known is None or shared == 0:
        return ()
    history = ((known.version, known.ids, shared),) + tuple(
        (version, ids, min(chars, shared)) for version, ids, chars in known.history if chars > 0
    )
    return history[:PEER_HISTORY]


def version_in(kept: Kept, version: int) -> tuple[IdPieces, int] | None:
    """The ids of ``version`` of ``kept``'s conversation, and how many of its
    characters ``kept``'s text shares; None if it is not remembered."""
    if kept.version == version:
        return kept.ids, len(kept.text)
    for known, ids, shared in kept.history:
        if known == version:
            return ids, shared
    return None



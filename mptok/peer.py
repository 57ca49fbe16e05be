"""What an owner answers a peer: shared by the cache that computes it and the
transport that carries it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PeerReply:
    """An owner's answer for one prompt of a conversation.

    The prompt's ids are the first ``reused`` ids of the version the peer
    named, followed by ``ids``. ``version`` names the prompt just kept (0 if
    it was not kept), for the peer's next request.
    """

    version: int
    reused: int
    ids: list[int]

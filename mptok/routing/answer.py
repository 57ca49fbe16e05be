"""The owner's side of the peer protocol: what it answers a peer.

A peer sends either a whole prompt, or the characters after those its
fingerprint covers (``mptok.core.protocol``). The owner answers either in
one cache call, with all the prompt's ids as int32; None when no prompt it
keeps has that fingerprint, and the peer then sends the whole text.
"""

from __future__ import annotations

from typing import Any, Protocol

from mptok.core.protocol import PeerReply


class PeerCache(Protocol):
    """What the protocol needs from an owner's cache (``PrefixTokenCache``)."""

    def encode_reply(self, tokenizer: Any, text: str, key: str | None) -> PeerReply:
        """All the ids of ``text``, tokenized and kept here, with the version kept."""
        ...

    def answer_peer(self, tokenizer: Any, key: str, since: int, shared_chars: int, tail: str) -> PeerReply | None:
        """The reply for the prompt whose first ``shared_chars`` characters
        have fingerprint ``since`` and which goes on with ``tail``; None when
        no kept prompt has that fingerprint."""
        ...


def answer_peer(
    cache: PeerCache, tokenizer: Any, text: str, key: str | None, since: int | None = None, shared_chars: int = 0
) -> PeerReply | None:
    """What an owner answers a peer for a prompt of conversation ``key``
    (``mptok.transport.PeerAnswer`` once ``cache`` and ``tokenizer`` are bound).

    Without ``since``, ``text`` is the whole prompt. With it, ``text`` holds
    the characters after the first ``shared_chars``, which ``since``
    fingerprints (``mptok.core.fingerprint.Fingerprint.since``). The reply
    holds all the prompt's ids. Returns None when the fingerprint matches no
    prompt kept here; a prompt without a key has no fingerprint and is
    answered whole. Raises what ``cache.encode`` raises for bad input.
    """
    if since is None:
        return cache.encode_reply(tokenizer, text, key)
    if key is None:
        return None
    return cache.answer_peer(tokenizer, key, since, shared_chars, text)

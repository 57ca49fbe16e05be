"""The owner's side of the peer protocol: what this frontend answers a peer.

A peer sends a ``PeerRequest``: either a whole prompt, or the characters
after those its fingerprint covers (``mptok.core.protocol``). ``PeerService``
answers either in one cache call, with all the prompt's ids; None when no
prompt kept here has that fingerprint, and the peer then sends the whole
text. The transport (``mptok.transport.serve_encode``) decodes the request
and encodes the reply; this module only decides what the reply is.
"""

from __future__ import annotations

from typing import Any, Protocol

from mptok.core.protocol import PeerReply, PeerRequest


class PeerCache(Protocol):
    """What the protocol needs from an owner's cache (``PrefixTokenCache``)."""

    def encode_reply(self, tokenizer: Any, text: str, key: str | None) -> PeerReply:
        """All the ids of ``text``, tokenized and kept here, and whether it was kept."""
        ...

    def answer_peer(self, tokenizer: Any, key: str, since: int, shared_chars: int, tail: str) -> PeerReply | None:
        """The reply for the prompt whose first ``shared_chars`` characters
        have fingerprint ``since`` and which goes on with ``tail``; None when
        no kept prompt has that fingerprint."""
        ...


class PeerService:
    """This frontend's answers to its peers: ``cache`` tokenizing with ``tokenizer``."""

    def __init__(self, cache: PeerCache, tokenizer: Any):
        self._cache = cache
        self._tokenizer = tokenizer

    def answer(self, request: PeerRequest) -> PeerReply | None:
        """The reply to ``request``: all the prompt's ids. None when a delta's
        fingerprint matches no prompt kept here; a prompt without a key has
        no fingerprint and is answered whole. Raises what ``cache.encode``
        raises for bad input. Called on the transport's threads, concurrently."""
        if request.since is None:
            return self._cache.encode_reply(self._tokenizer, request.text, request.key)
        if request.key is None:
            return None
        return self._cache.answer_peer(self._tokenizer, request.key, request.since, request.shared_chars, request.text)

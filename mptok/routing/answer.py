"""The owner's side of the peer delta protocol: what it answers a peer.

A peer names the version it holds of a conversation and sends only the
characters after those it shares with it (``mptok.core.protocol``); the
owner rebuilds the prompt from its cache, tokenizes it there, and answers
with the ids that changed. If the owner no longer remembers that version it
answers None, and the peer sends the whole text.
"""

from __future__ import annotations

from typing import Any, Protocol

from mptok.core.protocol import Kept, PeerReply, version_in


class PeerCache(Protocol):
    """What the protocol needs from an owner's cache (``PrefixTokenCache``)."""

    def encode(self, tokenizer: Any, text: str, key: str | None = None) -> list[int]:
        """Ids of ``text``, tokenized and kept here."""
        ...

    def encode_kept(self, tokenizer: Any, text: str, key: str) -> Kept | list[int]:
        """Tokenize ``text`` here as ``encode`` does; the ``Kept`` prompt
        (with its new version) if it was kept, else its ids."""
        ...

    def kept_branches(self, tokenizer: Any, key: str) -> list[Kept]:
        """The prompts kept for conversation ``key``, newest first."""
        ...


def answer_peer(
    cache: PeerCache, tokenizer: Any, text: str, key: str | None, since: int | None = None, shared_chars: int = 0
) -> PeerReply | None:
    """What an owner answers a peer for a prompt of conversation ``key``
    (``mptok.transport.PeerAnswer`` once ``cache`` and ``tokenizer`` are bound).

    Without ``since``, ``text`` is the whole prompt and the reply holds all
    its ids. With ``since``, the peer holds the ids of this conversation's
    prompt version ``since``, and ``text`` holds only the characters after
    the first ``shared_chars``, which the new prompt shares with that
    version. Returns None when the cache cannot rebuild the prompt (it does
    not remember that version, or not that many of its characters); the peer
    then sends the whole text. A prompt without a key has no versions: it is
    answered whole. Raises what ``cache.encode`` raises for bad input.
    """
    if key is None:
        return None if since is not None else PeerReply(0, 0, cache.encode(tokenizer, text, None))
    old_ids = None
    if since is not None:
        found = next(
            (
                (kept, known)
                for kept in cache.kept_branches(tokenizer, key)
                if (known := version_in(kept, since)) is not None
            ),
            None,
        )
        if found is None or not 0 <= shared_chars <= found[1][1]:
            return None
        kept, (old_ids, _) = found
        text = kept.text[:shared_chars] + text
    result = cache.encode_kept(tokenizer, text, key)
    if not isinstance(result, Kept):
        return PeerReply(0, 0, result)
    ids = result.ids
    reused = old_ids.common_prefix(ids) if old_ids is not None else 0
    return PeerReply(result.version, reused, ids.slice(reused, ids.length))



"""The asker's side of the peer protocol: a fingerprint of each conversation it routed.

``HeldReplies`` keeps, per conversation this frontend routed and owner it
went to, the fingerprint of the prompt it sent (``mptok.core.fingerprint``):
about 440 bytes with a 36-character key, as Python allocates it, whatever
the conversation's length; not the text or its ids. The next turn sends the owner only
the characters after those the fingerprint covers, and the owner answers
with all the ids. A turn goes whole when nothing is held for it here, when
its text no longer starts with what the fingerprint covers, or when the
owner no longer keeps the conversation.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

import numpy as np

from mptok.cache.config import DEFAULT_MAX_HELD_BYTES
from mptok.core.fingerprint import Fingerprint, checkpoint_blocks, extend_chain
from mptok.core.ids import key_bytes
from mptok.core.protocol import PeerReply


class BadReply(Exception):
    """An owner's reply contradicts what this frontend sent it."""


# One call to an owner: (text, since, shared_chars) -> its reply, or None
# when no prompt it keeps has fingerprint ``since``.
AskOwner = Callable[[str, int | None, int], PeerReply | None]

# What a held fingerprint costs beyond its key, its (owner, key) tuple and its
# digest: the Fingerprint object, the LRU dict's slot, the pair in it and the
# byte count (tests/test_memory.py holds the total to what tracemalloc sees).
HELD_OVERHEAD_BYTES = 256


class HeldReplies:
    """A fingerprint of the last prompt this frontend routed per (owner,
    conversation). LRU, bounded by entries and by bytes
    (``CacheConfig.max_held_bytes``). Thread-safe."""

    def __init__(self, max_entries: int = 16384, max_bytes: int = DEFAULT_MAX_HELD_BYTES):
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._held: OrderedDict[Hashable, tuple[Fingerprint, int]] = OrderedDict()
        self._bytes = 0

    def ask(self, owner: Hashable, key: str, text: str, call: AskOwner) -> tuple[np.ndarray, bool]:
        """The ids of ``text`` as an int32 array, from ``owner`` through
        ``call``, and whether the owner answered from the fingerprint (else
        it got the whole text, in a second call if the fingerprint matched
        nothing it keeps).

        Holds the new prompt's fingerprint for the next turn. Raises
        ``BadReply`` when the owner says it lacks a prompt for a whole text
        or claims to reuse ids, and whatever ``call`` raises.
        """
        held = self.get(owner, key)
        chain = b""
        reply = None
        if held is not None and len(text) >= held.chars:
            chain = extend_chain(text, upto_blocks=held.blocks)
            if held.matches(chain):
                reply = call(text[held.chars :], held.since, held.chars)
        answered_since = reply is not None
        if reply is None:
            reply = call(text, None, 0)
            if reply is None:
                raise BadReply("the owner asked for a fingerprint it was not given")
        if reply.reused != 0:
            self.put(owner, key, None)
            raise BadReply("the owner claims to reuse ids this frontend does not hold")
        ids = reply.id_array()
        if reply.version:
            chain = extend_chain(text, chain, upto_blocks=checkpoint_blocks(len(text)))
            self.put(owner, key, Fingerprint.of(text, chain))
        else:
            self.put(owner, key, None)
        return ids, answered_since

    def get(self, owner: Hashable, key: str) -> Fingerprint | None:
        with self._lock:
            held = self._held.get((owner, key))
            if held is None:
                return None
            self._held.move_to_end((owner, key))
            return held[0]

    def put(self, owner: Hashable, key: str, held: Fingerprint | None) -> None:
        """Hold ``held`` (None: forget) for ``key``'s conversation at ``owner``."""
        # The owner's identity is one object that all its entries share: each counts only its own tuple and key.
        nbytes = 0 if held is None else sys.getsizeof((owner, key)) + key_bytes(key) + sys.getsizeof(held.digest) + HELD_OVERHEAD_BYTES
        with self._lock:
            old = self._held.pop((owner, key), None)
            if old is not None:
                self._bytes -= old[1]
            if held is None or nbytes > self._max_bytes:
                return
            self._held[(owner, key)] = (held, nbytes)
            self._bytes += nbytes
            while len(self._held) > self._max_entries or self._bytes > self._max_bytes:
                _, (_, evicted_bytes) = self._held.popitem(last=False)
                self._bytes -= evicted_bytes

    def stats(self) -> dict[str, int]:
        """``held_entries`` and ``held_bytes`` (never more than ``held_max_bytes``)."""
        with self._lock:
            return {"held_entries": len(self._held), "held_bytes": self._bytes, "held_max_bytes": self._max_bytes}

"""The asker's side of the peer protocol: a fingerprint of each conversation it routed.

``HeldFingerprints`` keeps, per conversation this frontend routed and owner
it went to, the fingerprint of the prompt it sent (``mptok.core.fingerprint``):
about 440 bytes with a 36-character key, as Python allocates it, whatever
the conversation's length; not the text or its ids. ``request`` makes the
next turn's ``PeerRequest``: only the characters after those the
fingerprint covers when the text still starts with them, else the whole
text; ``remember`` holds the fingerprint of what the owner kept. The owner
answers a delta it cannot match with None, and the asker then sends the
whole text.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Hashable

from mptok.cache.config import DEFAULT_MAX_HELD_BYTES
from mptok.core.fingerprint import Fingerprint, checkpoint_blocks, extend_chain
from mptok.core.ids import key_bytes
from mptok.core.protocol import PeerRequest

# What a held fingerprint costs beyond its key, its (owner, key) tuple and its
# digest: the Fingerprint object, the LRU dict's slot, the pair in it and the
# byte count (tests/test_memory.py holds the total to what tracemalloc sees).
HELD_OVERHEAD_BYTES = 256


class HeldFingerprints:
    """A fingerprint of the last prompt this frontend routed per (owner,
    conversation). LRU, bounded by entries and by bytes
    (``CacheConfig.max_held_bytes``). Thread-safe."""

    def __init__(self, max_entries: int = 16384, max_bytes: int = DEFAULT_MAX_HELD_BYTES):
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._held: OrderedDict[Hashable, tuple[Fingerprint, int]] = OrderedDict()
        self._bytes = 0

    def request(self, owner: Hashable, key: str, text: str) -> tuple[PeerRequest, bytes]:
        """What to send ``owner`` for ``text``: a delta when a fingerprint is
        held and ``text`` starts with the characters it covers, else the whole
        text; and the digest chain of ``text`` computed for it (``remember``
        goes on from there)."""
        held = self.get(owner, key)
        if held is None or len(text) < held.chars:
            return PeerRequest(text, key), b""
        chain = extend_chain(text, upto_blocks=held.blocks)
        if not held.matches(chain):
            return PeerRequest(text, key), chain
        return PeerRequest(text[held.chars :], key, held.since, held.chars), chain

    def remember(self, owner: Hashable, key: str, text: str, chain: bytes, kept: bool) -> bytes:
        """``owner`` answered for ``text`` (``chain`` as ``request`` gave it):
        hold its fingerprint if the owner ``kept`` the prompt, else forget.
        Returns the digests of ``text`` computed so far (a prefix of its chain)."""
        if not kept:
            self.put(owner, key, None)
            return chain
        chain = extend_chain(text, chain, upto_blocks=checkpoint_blocks(len(text)))
        self.put(owner, key, Fingerprint.of(text, chain))
        return chain

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

"""The asker's side of the peer delta protocol: what a frontend holds of each conversation it routed.

``HeldReplies`` keeps the owner's last reply for each routed conversation,
so that the next turn sends the owner only the new characters
(``mptok.core.protocol``) and splices the ids that changed into the held ones.
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from mptok.cache.config import CacheConfig
from mptok.core.ids import INT32, IdPieces, common_prefix_length, held_bytes
from mptok.core.protocol import PeerReply


class BadReply(Exception):
    """An owner's reply contradicts what this frontend sent it."""


@dataclass(frozen=True)
class Held:
    """The last reply an owner sent this frontend for one conversation.

    ``ids`` are shared ints (``IdPieces``) once a delta was spliced into
    them, which makes the next splice and the caller's list cheap; a reply
    that came whole keeps the int32 array it came in (4 bytes an id) until
    then: under a tight budget most are evicted unused, and interning 40k
    ids costs the asker 2-3 ms (``HeldReplies.ask``).
    """

    version: int
    text: str
    ids: IdPieces | array


# One call to an owner: (text, since, shared_chars) -> its reply, or None
# when it does not remember version ``since``.
AskOwner = Callable[[str, int | None, int], PeerReply | None]

# What a held reply costs beyond its key, text and ids: the Held and
# IdPieces objects, piece tuples or the array's header, the LRU dict's slot
# (scripts/bench_memory.py).
HELD_OVERHEAD_BYTES = 512


class HeldReplies:
    """What this frontend holds of each conversation it routed: the owner's
    last reply, with its version, text and ids.

    ``ask`` sends the owner only the characters after those a prompt shares
    with the held text and splices the ids that changed into the held ones.
    LRU, bounded by entries and by bytes, counted as the cache counts its
    own (``CacheConfig.max_held_bytes``): key, text, ids (see ``Held``),
    bookkeeping.
    A reply over the budget by itself is not held. Thread-safe.
    """

    def __init__(self, max_entries: int = 1024, max_bytes: int = CacheConfig().max_held_bytes):
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._held: OrderedDict[Hashable, tuple[Held, int]] = OrderedDict()
        self._bytes = 0

    def ask(self, owner: Hashable, key: str, text: str, call: AskOwner) -> tuple[list[int], bool]:
        """The ids of ``text``, from ``owner`` through ``call``, and whether
        the owner answered from the version held here (else it got the whole
        text, in a second call if it no longer had that version).

        Holds the owner's reply for the next turn. Raises ``BadReply`` when
        the owner asks for a version it was not given or reuses more ids
        than are held here, and whatever ``call`` raises.
        """
        held = self.get(owner, key)
        reply = None
        if held is not None:
            shared = common_prefix_length(held.text, text)
            reply = call(text[shared:], held.version, shared)
        answered_since = reply is not None
        if reply is None:
            held = None
            reply = call(text, None, 0)
            if reply is None:
                raise BadReply("the owner asked for a version it was not given")
        if reply.reused > (_length(held.ids) if held is not None else 0):
            self.put(owner, key, None)
            raise BadReply("the owner reused more ids than this frontend holds")
        if held is None:  # the whole prompt's ids: held as they came
            whole = reply.ids if isinstance(reply.ids, array) else array(INT32, reply.ids)
            self.put(owner, key, Held(reply.version, text, whole) if reply.version else None)
            return whole.tolist(), answered_since
        base = held.ids if isinstance(held.ids, IdPieces) else IdPieces.of(held.ids.tolist())
        tail = reply.ids.tolist() if isinstance(reply.ids, array) else list(reply.ids)
        ids = base.spliced(reply.reused, tail).bounded()
        self.put(owner, key, Held(reply.version, text, ids) if reply.version else None)
        return ids.to_list(), answered_since

    def get(self, owner: Hashable, key: str) -> Held | None:
        with self._lock:
            held = self._held.get((owner, key))
            if held is None:
                return None
            self._held.move_to_end((owner, key))
            return held[0]

    def put(self, owner: Hashable, key: str, held: Held | None) -> None:
        """Hold ``held`` (None: forget) for ``key``'s conversation at ``owner``."""
        nbytes = 0 if held is None else _held_reply_bytes((owner, key), held)
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


def _length(ids: IdPieces | array) -> int:
    return ids.length if isinstance(ids, IdPieces) else len(ids)


def _held_reply_bytes(key: Hashable, held: Held) -> int:
    if isinstance(held.ids, IdPieces):
        return held_bytes(key, held.text, held.ids) + HELD_OVERHEAD_BYTES
    return held_bytes(key, held.text) + sys.getsizeof(held.ids) + HELD_OVERHEAD_BYTES

"""The peer delta protocol: what an owner answers a peer, and what the peer holds.

A frontend that routes a conversation to its owner (``mptok.routing``) holds
the owner's last reply for it (``HeldReplies``): its version, text and ids.
Its next turn sends the owner only the characters after those it shares with
the held text, naming the held version; the owner, which remembers a few
earlier versions of each conversation (``history_after``), rebuilds the
prompt, tokenizes it with its cache, and answers with only the ids that
changed (``answer_peer``, a ``PeerReply``). If the owner no longer remembers
that version it answers None and the peer sends the whole text.

Both sides live here, and nothing else does: the cache keeps each
conversation's versions for this protocol (``Kept``, ``History``) but never
calls it, the transport carries its requests and ``PeerReply`` without
reading them, and routing only decides whom to ask.
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mptok.config import CacheConfig
from mptok.ids import INT32, IdPieces, common_prefix_length, held_bytes

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


# -- the asker's side -------------------------------------------------------


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
AskOwner = Callable[[str, "int | None", int], "PeerReply | None"]

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

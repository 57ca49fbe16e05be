"""Token ids held compactly: shared int objects, shared lists, and their byte cost.

A cached conversation holds one id per token of its last prompt, and the
versions before it. Held as the Rust tokenizer returns them, each id is a
fresh Python int (28 bytes) behind an 8-byte list slot: about 35 bytes per
token, several times the prompt's own text. Here every stored id is replaced
by the one shared int object of its value (``intern_ids``), so a stored
token costs its 8-byte slot, and the versions of a conversation share their
lists (``IdPieces``), so a version costs only the ids it changed.

An ``array('i')`` would cost 4 bytes a token, but turning it back into the
``list[int]`` callers get creates an int object per id: about 100 times
slower than copying a list of shared ints (30 ms against 0.3 ms at 200k
ids), which would eat the whole gain of a cache hit.

``IdPieces.nbytes`` and ``list_bytes`` are what a cache's byte budget counts;
the shared ints themselves are a fixed cost per process (one object per
token id value seen, at most the vocabulary: about 4.6 MB for 128k ids),
never per cached token.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

# Ids at or above this stay as they are (no real vocabulary comes near it);
# the shared table never grows past it.
MAX_INTERNED_ID = 1 << 22

# The array type code of ids as they cross between frontends: int32 ("i" is
# 4 bytes wherever CPython runs); the transport packs them so, and an asker
# holds a reply that came whole in it (``mptok.routing.held.Held``).
INT32 = "i"

# Pieces a prompt's ids may be held in before they are joined into one list.
MAX_ID_PIECES = 32

_LIST_HEADER = sys.getsizeof([])
_SLOT = 8

_shared_ints: list[int] = list(range(1024))
_grow_lock = threading.Lock()


def _grow_to(highest: int) -> None:
    global _shared_ints
    with _grow_lock:
        size = len(_shared_ints)
        if highest < size:
            return
        # Grown by doubling and swapped in whole, so that readers without
        # the lock see either table, both valid.
        new_size = min(max(size * 2, highest + 1), MAX_INTERNED_ID)
        _shared_ints = _shared_ints + list(range(size, new_size))


def intern_ids(ids: list[int]) -> list[int]:
    """``ids`` (handed over, mutated in place) with each id replaced by the
    process-wide int object of its value; the same list is returned."""
    if not ids or min(ids) < 0:  # a negative index would read the wrong int
        return ids
    try:
        # Materialized before anything is assigned: an IndexError leaves ids as they were.
        ids[:] = map(_shared_ints.__getitem__, ids)
    except IndexError:
        highest = max(ids)
        if highest >= MAX_INTERNED_ID:
            return ids
        _grow_to(highest)
        ids[:] = map(_shared_ints.__getitem__, ids)
    return ids


def list_bytes(ids: list[int]) -> int:
    """Bytes a list of shared ints costs: header and slots (over-allocation
    included), not the ints."""
    return sys.getsizeof(ids)


def exact_list(ids: list[int]) -> list[int]:
    """``ids`` itself if it has no spare slots, else an exact copy (a slice
    allocates exactly; a list grown by appending does not)."""
    return ids[:] if sys.getsizeof(ids) > _LIST_HEADER + _SLOT * len(ids) else ids


@dataclass(frozen=True)
class IdPieces:
    """Token ids held as prefixes of lists of shared ints that are never mutated.

    Extending a conversation shares the previous prompt's lists instead of
    copying them, so a 200k-token prompt is copied once per turn (into the
    caller's list) rather than twice, and earlier versions cost only their
    own tails.
    """

    pieces: tuple[tuple[list[int], int], ...]
    length: int

    @classmethod
    def of(cls, ids: list[int]) -> IdPieces:
        """Wrap ``ids``, which the caller hands over and must not mutate."""
        intern_ids(ids)
        return cls(((ids, len(ids)),), len(ids))

    def to_list(self) -> list[int]:
        """A new list of all the ids."""
        if not self.pieces:
            return []
        (first, used), *rest = self.pieces
        out = first[:used]
        for ids, used in rest:  # growing in place beats preallocating (no stores of a filler)
            out += ids if used == len(ids) else ids[:used]
        return out

    def slice(self, start: int, stop: int) -> list[int]:
        """``ids[start:stop]`` as a new list."""
        out: list[int] = []
        offset = 0
        for ids, used in self.pieces:
            if offset >= stop:
                break
            low, high = max(start - offset, 0), min(stop - offset, used)
            if low < high:
                out += ids[low:high]
            offset += used
        return out

    def lists(self) -> Iterable[list[int]]:
        """The lists holding these ids (each once per piece)."""
        return (ids for ids, _ in self.pieces)

    def shared_by_identity(self, other: IdPieces) -> int:
        """Leading ids that ``self`` and ``other`` hold in the very same lists."""
        shared = 0
        for (mine, used), (theirs, other_used) in zip(self.pieces, other.pieces):
            if mine is not theirs:
                break
            shared += min(used, other_used)
            if used != other_used:
                break
        return shared

    def common_prefix(self, other: IdPieces) -> int:
        """How many leading ids ``self`` and ``other`` share.

        Pieces that both hold (the same list, as a conversation's turns
        share them) are skipped whole; only the rest is compared by value.
        """
        shared = self.shared_by_identity(other)
        rest = min(self.length, other.length) - shared
        a, b = self.slice(shared, shared + rest), other.slice(shared, shared + rest)
        if a == b:
            return shared + rest
        return shared + _first_difference(a, b, 0, rest)

    def head(self, keep: int) -> list[tuple[list[int], int]]:
        """The pieces holding the first ``keep`` ids."""
        pieces = []
        offset = 0
        for ids, used in self.pieces:
            if offset >= keep:
                break
            take = min(used, keep - offset)
            pieces.append((ids, take))
            offset += take
        return pieces

    def spliced(self, keep: int, tail: list[int]) -> IdPieces:
        """The first ``keep`` ids followed by ``tail`` (handed over, interned).

        Never joins pieces: a caller that keeps other versions sharing these
        lists joins with ``compacted`` and moves them onto the joined list
        (``rebased``), so that no list is held twice.
        """
        pieces = self.head(keep)
        if tail:
            pieces.append((intern_ids(exact_list(tail)), len(tail)))
        return IdPieces(tuple(pieces), keep + len(tail))

    def compacted(self) -> IdPieces:
        """The same ids in one list."""
        joined = exact_list(self.to_list())
        return IdPieces(((joined, len(joined)),), len(joined))

    def rebased(self, before: IdPieces, after: IdPieces) -> IdPieces:
        """These ids, with the part held in ``before``'s lists read from
        ``after`` instead (``after`` holds the same ids as ``before``)."""
        shared = self.shared_by_identity(before)
        if shared == 0:
            return self
        pieces = after.head(shared)
        offset = 0
        for ids, used in self.pieces:
            end = offset + used
            if end > shared:
                if offset < shared:  # the rest of a list that ``before`` holds too
                    rest = ids[shared - offset : used]
                    pieces.append((rest, len(rest)))
                else:
                    pieces.append((ids, used))
            offset = end
        return IdPieces(tuple(pieces), self.length)

    def bounded(self) -> IdPieces:
        """``self``, or ``compacted()`` once it has more than MAX_ID_PIECES pieces."""
        return self.compacted() if len(self.pieces) > MAX_ID_PIECES else self


NO_IDS = IdPieces((), 0)


def distinct_list_bytes(*ids: IdPieces) -> int:
    """Bytes of the lists that hold ``ids``, each list counted once."""
    seen: set[int] = set()
    total = 0
    for pieces in ids:
        for held in pieces.lists():
            if id(held) not in seen:
                seen.add(id(held))
                total += list_bytes(held)
    return total


def held_bytes(key: Hashable, text: str, *ids: IdPieces) -> int:
    """Bytes a kept prompt's key, text and id lists cost (lists counted once)."""
    return _key_bytes(key) + sys.getsizeof(text) + distinct_list_bytes(*ids)


def _key_bytes(key: Hashable) -> int:
    if isinstance(key, tuple):
        return sys.getsizeof(key) + sum(_key_bytes(part) for part in key)
    return sys.getsizeof(key)


def common_prefix_length(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``.

    Compares in C, halving the range: O(n) characters copied and compared in
    total, never a Python-level loop over the text.
    """
    if len(a) <= len(b) and b.startswith(a):
        return len(a)
    if len(b) < len(a) and a.startswith(b):
        return len(b)
    return _first_difference(a, b, 0, min(len(a), len(b)))


def _first_difference(a: Sequence, b: Sequence, low: int, high: int) -> int:
    """The first index in ``[low, high)`` where ``a`` and ``b`` differ, given
    ``a[:low] == b[:low]`` and a difference before ``high``.

    Compares slices, in C (a Python loop over 200k ids takes milliseconds):
    windows doubling from ``low`` until one differs, then halving inside it,
    so a difference k items in costs O(k), wherever it is.
    """
    window = 64
    while high - low > window and a[low : low + window] == b[low : low + window]:
        low += window
        window *= 2
    high = min(high, low + window)
    while high - low > 64:
        middle = (low + high) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle
    while low < high and a[low] == b[low]:
        low += 1
    return low

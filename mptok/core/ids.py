"""Token ids in one compact form, from the cache to the JSON bytes: int32 numpy arrays.

A list copy of a 47k-id prompt's Python ints took 0.87 ms, as much as the
rest of a cache hit; an int32 array is copied with one ``memcpy``, spliced
without an int, and written to JSON and sent as it is. ``IdPieces`` is one
version of a prompt's ids: a buffer's first ``length`` ids, which nothing
writes again; a version that extends another writes only its new ids into
the buffer's spare room.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

# The array type code of int32 ids ("i" is 4 bytes wherever CPython runs).
INT32 = "i"
ID_DTYPE = np.dtype(np.int32)

# Spare room a new buffer gets for later appends, as a fraction of its ids
# (1/16: a version pins at most 4.25 bytes an id), and at least this many ids.
HEADROOM_SHARE = 16
MIN_HEADROOM_IDS = 256

_EMPTY = np.zeros(0, dtype=ID_DTYPE)
_EMPTY.flags.writeable = False


def as_id_array(ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """``ids`` as a 1-D int32 array: the same memory for an int32 array or
    buffer (``array('i')``), else a copy. Raises ``OverflowError`` for an id
    outside int32 and ``ValueError`` for anything not one-dimensional."""
    if isinstance(ids, np.ndarray) and ids.dtype == ID_DTYPE:
        out = ids
    elif isinstance(ids, (list, tuple)):
        out = np.array(ids, dtype=ID_DTYPE) if ids else _EMPTY
    else:
        out = np.frombuffer(ids, dtype=ID_DTYPE) if getattr(ids, "typecode", None) == INT32 else np.asarray(ids)
        if out.dtype != ID_DTYPE:
            if out.size and (out.min() < np.iinfo(ID_DTYPE).min or out.max() > np.iinfo(ID_DTYPE).max):
                raise OverflowError("token ids must fit in int32")
            out = out.astype(ID_DTYPE)
    if out.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {out.shape}")
    return out


class _IdBuffer:
    """An int32 buffer; ids below ``published`` never change, and an append claims the room after it under ``lock``."""

    __slots__ = ("array", "lock", "published")

    def __init__(self, ids: np.ndarray, room: int):
        self.array = np.empty(len(ids) + room, dtype=ID_DTYPE)
        self.array[: len(ids)] = ids
        self.published = len(ids)
        self.lock = threading.Lock()

    @classmethod
    def holding(cls, *parts: np.ndarray) -> _IdBuffer:
        total = sum(len(part) for part in parts)
        buffer = cls(_EMPTY, total + max(MIN_HEADROOM_IDS, total // HEADROOM_SHARE))
        offset = 0
        for part in parts:
            buffer.array[offset : offset + len(part)] = part
            offset += len(part)
        buffer.published = total
        return buffer

    def append_at(self, start: int, ids: np.ndarray) -> bool:
        """Write and publish ``ids`` at ``start`` if the published ids end there and they fit; whether they were."""
        end = start + len(ids)
        with self.lock:
            if start != self.published or end > len(self.array):
                return False
            self.array[start:end] = ids
            self.published = end
        return True


@dataclass(frozen=True)
class IdPieces:
    """One version of a prompt's token ids, ``buffer``'s first ``length``: immutable."""

    buffer: _IdBuffer | None
    length: int

    @classmethod
    def of(cls, ids: Sequence[int] | np.ndarray) -> IdPieces:
        """The ids copied into a buffer of their own, with room to grow."""
        ids = as_id_array(ids)
        if len(ids) == 0:
            return NO_IDS
        return cls(_IdBuffer.holding(ids), len(ids))

    def array(self) -> np.ndarray:
        """All the ids as a read-only int32 view (no copy); it never changes."""
        if self.buffer is None:
            return _EMPTY
        view = self.buffer.array[: self.length]
        view.flags.writeable = False
        return view

    def to_list(self) -> list[int]:
        """A new list of all the ids."""
        return self.array().tolist()

    @property
    def nbytes(self) -> int:
        """Bytes this version pins: its whole buffer, spare room included."""
        return 0 if self.buffer is None else self.buffer.array.nbytes + _ARRAY_HEADER_BYTES

    def spliced(self, keep: int, tail: Sequence[int] | np.ndarray) -> IdPieces:
        """The first ``keep`` ids followed by ``tail``: this version's buffer
        shared when ``tail`` agrees with the ids it holds after ``keep`` and
        its new ids fit in the room after what was published; else a copy."""
        if not 0 <= keep <= self.length:
            raise ValueError(f"keep={keep} is outside 0..{self.length}")
        tail = as_id_array(tail)
        length = keep + len(tail)
        if self.buffer is None or keep == 0:
            return IdPieces.of(tail)
        mine = self.buffer.array[keep : self.length]
        overlap = min(len(mine), len(tail))
        if np.array_equal(mine[:overlap], tail[:overlap]) and (
            length <= self.length or self.buffer.append_at(self.length, tail[overlap:])
        ):
            return IdPieces(self.buffer, length)
        return IdPieces(_IdBuffer.holding(self.buffer.array[:keep], tail), length)


NO_IDS = IdPieces(None, 0)

_ARRAY_HEADER_BYTES = sys.getsizeof(np.empty(0, dtype=ID_DTYPE))


def held_bytes(key: Hashable, text: str, *ids: IdPieces) -> int:
    """Bytes a kept prompt's key, text and id buffers cost (each buffer once)."""
    buffers = {id(pieces.buffer): pieces.nbytes for pieces in ids}
    return key_bytes(key) + sys.getsizeof(text) + sum(buffers.values())


def key_bytes(key: Hashable) -> int:
    """Bytes a key (a str, an int, or tuples of them) costs."""
    if isinstance(key, tuple):
        return sys.getsizeof(key) + sum(key_bytes(part) for part in key)
    return sys.getsizeof(key)


def common_prefix_length(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, compared in C (O(n) in all)."""
    if len(a) <= len(b) and b.startswith(a):
        return len(a)
    if len(b) < len(a) and a.startswith(b):
        return len(b)
    return _first_text_difference(a, b, 0, min(len(a), len(b)))


# Windows stop doubling here: a slice this size (at most 64 KiB of UCS-4)
# stays below glibc's mmap threshold, so its memory is reused instead of
# being mapped and faulted in afresh for every comparison of a long prompt.
_MAX_COMPARED_CHARS = 16384


def _first_text_difference(a: str, b: str, low: int, high: int) -> int:
    """The first index in ``[low, high)`` where ``a`` and ``b`` differ, given
    ``a[:low] == b[:low]`` and a difference before ``high``: windows doubling
    from ``low`` until one differs, then halving inside it; each step slices
    only ``a`` and matches it in place in ``b``."""
    window = 64
    while high - low > window and b.startswith(a[low : low + window], low):
        low += window
        window = min(2 * window, _MAX_COMPARED_CHARS)
    high = min(high, low + window)
    while high - low > 64:
        middle = (low + high) // 2
        if b.startswith(a[low:middle], low):
            low = middle
        else:
            high = middle
    while low < high and a[low] == b[low]:
        low += 1
    return low

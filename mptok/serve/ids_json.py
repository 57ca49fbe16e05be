"""The JSON of an answer's ids, reusing what the conversation's last answer wrote.

Writing a turn's whole id list again costs about 6 ns an id, the largest
cost of a hit turn at 150k tokens. ``IdsJson`` keeps, per conversation, the
ids it last wrote and their JSON in chunks of ``CHUNK_IDS``; a new answer
reuses the chunks its ids share with those (found at C speed: the same
cache buffer, else one array comparison) and writes only the rest, bytes
exactly as ``orjson.dumps(ids, option=OPT_SERIALIZE_NUMPY)``. Bounded by
``max_bytes`` (the JSON and the id buffers it pins), least recently used first out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import orjson

from mptok.core.lru import ByteBoundedLru

CHUNK_IDS = 4096
DEFAULT_MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class _Written:
    """Ids (an immutable int32 view) and the JSON of each ``CHUNK_IDS`` of them, brackets left out."""

    ids: np.ndarray
    chunks: tuple[bytes, ...]


def _chunk_json(ids: np.ndarray) -> bytes:
    return orjson.dumps(ids, option=orjson.OPT_SERIALIZE_NUMPY)[1:-1]


def _shared(a: np.ndarray, b: np.ndarray) -> int:
    """How many ids ``a`` and ``b`` share at their start."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    if a.base is not None and a.base is b.base and a.ctypes.data == b.ctypes.data:
        return n  # views of one cache buffer from its start: ids below what was published never change
    different = a[:n] != b[:n]
    return int(different.argmax()) if different.any() else n


class IdsJson:
    """JSON arrays of ids per conversation key, each reusing the key's last one. Thread-safe."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES):
        self._kept: ByteBoundedLru[_Written] = ByteBoundedLru(max_bytes)

    def parts(self, ids: np.ndarray, key: str | None) -> list[bytes]:
        """``orjson.dumps(ids, option=OPT_SERIALIZE_NUMPY)`` in parts, from ``key``'s last answer
        where it can, for the caller to join with what surrounds it (one copy)."""
        if key is None or len(ids) < CHUNK_IDS:
            return [orjson.dumps(ids, option=orjson.OPT_SERIALIZE_NUMPY)]
        last = self._kept.get(key)
        reused = () if last is None else last.chunks[: _shared(last.ids, ids) // CHUNK_IDS]
        start = len(reused) * CHUNK_IDS
        chunks = reused + tuple(_chunk_json(ids[i : i + CHUNK_IDS]) for i in range(start, len(ids), CHUNK_IDS))
        # Nothing writes an answered array again (the cache's views are immutable; the others are this answer's own).
        pinned = ids.base.nbytes if isinstance(ids.base, np.ndarray) else ids.nbytes
        self._kept.put(key, _Written(ids, chunks), pinned + sum(map(len, chunks)))
        parts = [b","] * (2 * len(chunks) + 1)
        parts[0], parts[-1] = b"[", b"]"
        parts[1:-1:2] = chunks
        return parts

    def stats(self) -> dict[str, int]:
        entries, nbytes = self._kept.stats()
        return {"answers_kept": entries, "answer_bytes": nbytes}

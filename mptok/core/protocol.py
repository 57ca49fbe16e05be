"""The two records that cross between frontends: a peer's request and the owner's reply.

A frontend that routes a conversation to its owner keeps a fingerprint of
the prompt it sent (``mptok.core.fingerprint``; ``mptok.routing.held``),
not the text or its ids. Its next turn sends only the characters after
those the fingerprint covers, with the fingerprint (``since`` and
``shared_chars``); the owner finds the kept prompt whose leading characters
have that fingerprint, tokenizes the new prompt from there in one cache
call and answers with all its ids. When no kept prompt has that
fingerprint it answers None and the asker sends the whole text.

Each record is built once and decoded once: the transport sends
``PeerRequest.to_wire()`` and ``PeerReply.to_wire()`` and the other end
builds the record with ``from_wire``, which refuses anything malformed
(``ValueError``). The reply's ids cross as the cache's int32 buffer (a
``PickleBuffer``, copied only into the message) and are read on arrival
with ``np.frombuffer`` on the received bytes, never as Python ints. Every
layer that speaks of them imports them from here, the bottom layer.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import numpy as np

from mptok.core.ids import ID_DTYPE, as_id_array


@dataclass(frozen=True)
class PeerRequest:
    """What an asker sends an owner for one prompt of conversation ``key``.

    Whole (``since`` None): ``text`` is the prompt. A delta: ``text`` is the
    prompt after its first ``shared_chars`` characters, which the
    fingerprint ``since`` names (``mptok.core.fingerprint.Fingerprint``).
    """

    text: str
    key: str | None
    since: int | None = None
    shared_chars: int = 0

    @property
    def delta(self) -> bool:
        return self.since is not None

    def to_wire(self) -> tuple[str, str | None, int | None, int]:
        """The arguments of the owner's ``encode``."""
        return (self.text, self.key, self.since, self.shared_chars)

    @classmethod
    def from_wire(cls, args: tuple) -> PeerRequest:
        """The request ``to_wire`` sent; ``ValueError`` for anything else."""
        if len(args) != 4:
            raise ValueError(f"a request has 4 fields, not {len(args)}")
        text, key, since, shared_chars = args
        if (
            not isinstance(text, str)
            or not (key is None or isinstance(key, str))
            or not (since is None or type(since) is int)
            or type(shared_chars) is not int
        ):
            raise ValueError("encode takes (text: str, key: str | None, since: int | None, shared_chars: int)")
        return cls(text, key, since, shared_chars)


@dataclass(frozen=True)
class PeerReply:
    """An owner's answer for one prompt: all its ids (int32), and whether it
    ``kept`` the prompt (only then may the asker fingerprint it for the next turn)."""

    kept: bool
    ids: np.ndarray  # a list, or any int32 buffer, is taken as an int32 array

    def __post_init__(self) -> None:
        ids = self.ids
        if not isinstance(ids, (list, tuple)):
            ids = np.asarray(ids)
            if ids.dtype != ID_DTYPE:
                raise TypeError(f"ids must be int32, not {ids.dtype}")
        object.__setattr__(self, "ids", as_id_array(ids))

    def to_wire(self) -> tuple[bool, pickle.PickleBuffer]:
        """``(kept, ids)``, the ids a read-only buffer over the cache's own
        memory: pickled, they are copied once, into the message."""
        ids = np.ascontiguousarray(self.ids)
        return (self.kept, pickle.PickleBuffer(memoryview(ids).toreadonly()))

    @classmethod
    def from_wire(cls, fields: object) -> PeerReply:
        """The reply ``to_wire`` sent, its ids an int32 array over the received
        bytes (no copy); ``ValueError`` for anything else."""
        if not (
            isinstance(fields, tuple)
            and len(fields) == 2
            and type(fields[0]) is bool
            and isinstance(fields[1], (bytes, bytearray))
        ):
            raise ValueError(f"not a reply: {str(fields)[:200]}")
        kept, payload = fields
        if len(payload) % ID_DTYPE.itemsize:
            raise ValueError(f"{len(payload)} bytes are not int32 ids")
        return cls(kept, np.frombuffer(payload, dtype=ID_DTYPE))

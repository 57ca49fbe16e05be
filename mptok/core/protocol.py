"""What crosses between frontends: a peer's request, the owner's reply, and the fingerprint by which a request names text.

A fingerprint is a chain of digests over ``BLOCK_CHARS``-character blocks,
each covering the one before, so the digest at block k covers exactly the
first ``k * BLOCK_CHARS`` characters: the next turn sends only the text
after them, and an owner that keeps no text with that digest answers None,
so a stale or wrong fingerprint never gets ids of other text. SHA-256 cut to
128 bits: a client cannot make two texts collide. Each record is decoded
once, by ``from_wire`` (``ValueError`` for anything malformed); the reply's
ids cross as the cache's int32 buffer, without a copy.
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass

import numpy as np

from mptok.core.ids import ID_DTYPE, as_id_array

BLOCK_CHARS = 4096
DIGEST_BYTES = 16
# An asker's fingerprint stops this far before the end of what it sent: the
# next turn may rewrite a prompt's end (a generation prompt, 8 to 30 characters).
SLACK_CHARS = 256

_SEED = hashlib.sha256(b"mptok prompt fingerprint v1").digest()[:DIGEST_BYTES]


def extend_chain(text: str, chain: bytes = b"", upto_blocks: int | None = None) -> bytes:
    """The digest chain of ``text``'s full blocks (the first ``upto_blocks``
    of them if given), continuing ``chain``: the digests of ``text``'s first
    ``len(chain) // DIGEST_BYTES`` blocks, which the caller knows to be right."""
    done = len(chain) // DIGEST_BYTES
    blocks = len(text) // BLOCK_CHARS if upto_blocks is None else min(upto_blocks, len(text) // BLOCK_CHARS)
    if blocks <= done:
        return chain[: blocks * DIGEST_BYTES]
    digest = chain[-DIGEST_BYTES:] if done else _SEED
    parts = [chain]
    for block in range(done, blocks):
        piece = text[block * BLOCK_CHARS : (block + 1) * BLOCK_CHARS].encode("utf-8", "surrogatepass")
        digest = hashlib.sha256(digest + piece).digest()[:DIGEST_BYTES]
        parts.append(digest)
    return b"".join(parts)


def digest_at(chain: bytes, blocks: int) -> bytes | None:
    """The fingerprint of the first ``blocks`` blocks in ``chain``; None if the chain is shorter."""
    if blocks <= 0 or len(chain) < blocks * DIGEST_BYTES:
        return None
    return chain[(blocks - 1) * DIGEST_BYTES : blocks * DIGEST_BYTES]


def checkpoint_blocks(length: int) -> int:
    """The blocks an asker fingerprints of a prompt of ``length`` characters it sent."""
    return max(0, length - SLACK_CHARS) // BLOCK_CHARS


@dataclass(frozen=True)
class Fingerprint:
    """What an asker keeps of a prompt it routed: the digest of its first
    ``blocks`` blocks (about 100 bytes as Python holds it), and how it crosses the transport
    (``since``: the digest as an int, ``shared_chars``: the characters it covers)."""

    blocks: int
    digest: bytes

    @property
    def chars(self) -> int:
        return self.blocks * BLOCK_CHARS

    @property
    def since(self) -> int:
        return int.from_bytes(self.digest, "big")

    @classmethod
    def from_wire(cls, since: int, shared_chars: int) -> Fingerprint | None:
        """The fingerprint an asker sent; None for values no fingerprint has."""
        if not (0 < since < 1 << (8 * DIGEST_BYTES)) or shared_chars <= 0 or shared_chars % BLOCK_CHARS:
            return None
        return cls(shared_chars // BLOCK_CHARS, since.to_bytes(DIGEST_BYTES, "big"))

    @classmethod
    def of(cls, text: str, chain: bytes) -> Fingerprint | None:
        """The fingerprint of ``text`` (``chain`` holds at least its
        checkpoint's digests); None when it is too short to have one."""
        blocks = checkpoint_blocks(len(text))
        digest = digest_at(chain, blocks)
        return None if digest is None else cls(blocks, digest)

    def matches(self, chain: bytes) -> bool:
        return digest_at(chain, self.blocks) == self.digest


@dataclass(frozen=True)
class PeerRequest:
    """What an asker sends an owner for one prompt of conversation ``key``: the
    whole prompt, or (a delta) the text after the ``shared_chars`` characters
    that the fingerprint ``since`` names."""

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
        memory, which the transport sends from where it is."""
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

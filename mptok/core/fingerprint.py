"""Fingerprints of a prompt's leading characters, so that an asker can name text it no longer holds.

A frontend that routed a conversation to its owner sends the next turn only
the characters after those the owner already has. It proves which ones
those are with a fingerprint instead of holding the text: a chain of
digests over ``BLOCK_CHARS``-character blocks (each block's digest covers
the one before it), so that a prompt's fingerprint at block k covers
exactly its first ``k * BLOCK_CHARS`` characters. The owner keeps the chain
of its kept text (16 bytes a block, extended by the blocks a new prompt
changed, never recomputed) and answers only when the asker's fingerprint
equals its own at that block: a stale or wrong fingerprint gets the whole
text asked for, never ids of other text. SHA-256 (hardware-accelerated on
most CPUs), truncated to 128 bits: a client cannot make two texts collide.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

BLOCK_CHARS = 4096
DIGEST_BYTES = 16
# The characters at the end of a prompt that the next turn may rewrite (a
# chat template's generation prompt, about 8 to 30 characters): an asker's
# fingerprint stops at least this far before the end of what it sent.
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

"""Which frontend owns a conversation: the same answer in every process.

Every frontend computes a conversation's order of frontends from its key
alone, so that all of them send its prompts to the same owner, and, while
that owner is down, to the same next one.
"""

from __future__ import annotations

import hashlib

_HASH_PERSON = b"mptok-route-v1"


def owner_order(key: str, num_frontends: int) -> list[int]:
    """Frontend ids in the order they serve conversation ``key``; the first is its owner.

    Rendezvous (highest random weight) hashing over blake2b: the same in
    every process and every run, whatever PYTHONHASHSEED is. While a
    frontend is down, each of its conversations moves to the next frontend in
    that conversation's own order, so the load of a dead frontend spreads
    over the others and nothing else moves.
    """
    if num_frontends < 1:
        raise ValueError(f"num_frontends must be >= 1, got {num_frontends}")
    base = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8, person=_HASH_PERSON)
    scored = []
    for frontend in range(num_frontends):
        h = base.copy()
        h.update(frontend.to_bytes(4, "big"))
        scored.append((h.digest(), frontend))
    scored.sort(reverse=True)
    return [frontend for _, frontend in scored]


def owner_of(key: str, num_frontends: int) -> int:
    """The frontend that tokenizes conversation ``key`` while it is up."""
    return owner_order(key, num_frontends)[0]

"""What the layers above rely on from a cache, and from routing above it: every ``Protocol`` in one place.

``PrefixTokenCache`` is the one cache and ``TokenizationOwners`` the one
router; the fronts (``mptok.front``, ``mptok.serve``, ``mptok.vllm``) and
routing speak to them through these descriptions, so that each layer names
only what it calls. ``Kept`` is what the owner's call answers
(``PrefixTokenCache.extend_after``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from mptok.cache.config import CacheConfig
from mptok.core.deadline import Deadline
from mptok.core.protocol import Fingerprint


@dataclass(frozen=True)
class Kept:
    """What a cache did with one prompt of a conversation: all its ``ids``
    (int32, read-only when they are the cache's own), and whether the prompt
    is now ``kept`` as the conversation's latest (a later prompt of it is
    then extended from it)."""

    ids: np.ndarray
    kept: bool


class Encoder(Protocol):
    """Anything that tokenizes like ``PrefixTokenCache.encode``: the cache
    itself, or routing above it (``TokenizationOwners``)."""

    def encode(self, tokenizer: Any, text: str, key: str | None = None) -> list[int]:
        """Exactly ``tokenizer(text, add_special_tokens=False)["input_ids"]``."""
        ...

    def encode_array(self, tokenizer: Any, text: str, key: str | None = None) -> np.ndarray:
        """``encode``'s ids as a 1-D int32 numpy array."""
        ...


class TokenCache(Encoder, Protocol):
    """What the fronts and routing rely on from a cache (``PrefixTokenCache``)."""

    config: CacheConfig

    def extend_if_kept(self, tokenizer: Any, text: str, key: str) -> np.ndarray | None:
        """The ids, extended from what ``key`` keeps here; None, at once, where it keeps nothing."""
        ...

    def extend_after(self, tokenizer: Any, text: str, key: str, after: Fingerprint | None = None) -> Kept | None:
        """``key``'s prompt (``text`` after what ``after`` names) kept as its
        latest, and its ids; None when no kept prompt has ``after``."""
        ...

    def adopt(self, tokenizer: Any, text: str, key: str, ids: np.ndarray, chain: bytes = b"") -> bool:
        """Keep ``text``'s exact ``ids`` from elsewhere as ``key``'s copy where that evicts nothing."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters and sizes, for /metrics."""
        ...


class Routing(Encoder, Protocol):
    """Routing above a cache (``TokenizationOwners``): it encodes, by a
    caller's deadline if given, and counts what it did."""

    def encode(self, tokenizer: Any, text: str, key: str | None = None, deadline: Deadline | None = None) -> list[int]:
        """``Encoder.encode``, waiting on no other frontend past ``deadline``."""
        ...

    def encode_array(self, tokenizer: Any, text: str, key: str | None = None, deadline: Deadline | None = None) -> np.ndarray:
        """``Encoder.encode_array``, waiting on no other frontend past ``deadline``."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters since start, for /metrics."""
        ...

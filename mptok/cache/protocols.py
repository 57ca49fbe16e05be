"""What the layers above rely on from a cache, and from routing above it: every ``Protocol`` in one place.

``PrefixTokenCache`` is the one cache and ``TokenizationOwners`` the one
router; the fronts (``mptok.front``, ``mptok.serve``, ``mptok.vllm``) and
routing speak to them through these descriptions, so that each layer names
only what it calls. ``Kept`` is the answer of the one call routing makes
beyond encoding (``PrefixTokenCache.keep``).
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

    def keep(
        self, tokenizer: Any, text: str, key: str, *, after: Fingerprint | None = None, ids: np.ndarray | None = None,
        chain: bytes = b"", if_kept: bool = False, room_only: bool = False,
    ) -> Kept | None:
        """Make ``text`` conversation ``key``'s latest kept prompt and give its ids
        (see ``PrefixTokenCache.keep``); None when ``after`` names no kept
        prompt, or with ``if_kept`` when nothing of ``key`` is kept here."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters and sizes, for /metrics."""
        ...


class Routing(Encoder, Protocol):
    """Routing above a cache (``TokenizationOwners``): it encodes, by a
    caller's deadline if given, and counts what it did."""

    def encode(
        self, tokenizer: Any, text: str, key: str | None = None, deadline: Deadline | None = None
    ) -> list[int]:
        """``Encoder.encode``, waiting on no other frontend past ``deadline``."""
        ...

    def encode_array(
        self, tokenizer: Any, text: str, key: str | None = None, deadline: Deadline | None = None
    ) -> np.ndarray:
        """``Encoder.encode_array``, waiting on no other frontend past ``deadline``."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters since start, for /metrics."""
        ...

"""mptok: tokenize long multi-turn prompts once, across frontend processes.

``PrefixTokenCache`` tokenizes only the new tail of each prompt, exactly;
``TokenizationOwners``, a layer above it, makes each frontend process serve
its cache to the others, and its ``encode`` sends each conversation to the
frontend whose cache holds it.
"""

from mptok.backend import load_tokenizer
from mptok.cache import PrefixTokenCache
from mptok.config import CacheConfig
from mptok.errors import RouteFailed
from mptok.routing import TokenizationOwners, owner_of, owner_order

__all__ = [
    "CacheConfig",
    "PrefixTokenCache",
    "RouteFailed",
    "TokenizationOwners",
    "load_tokenizer",
    "owner_of",
    "owner_order",
]

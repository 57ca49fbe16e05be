"""mptok: tokenize long multi-turn prompts once, across frontend processes.

``PrefixTokenCache`` tokenizes only the new tail of each prompt, exactly;
``TokenizationOwners``, a layer above it, makes each frontend process serve
its cache to the others, and its ``encode`` sends each conversation to the
frontend whose cache holds it.

The names below are loaded on first use, so that importing one layer (the
supervisor, say) does not import the tokenizer stack of every other.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mptok.cache.loading import load_tokenizer
    from mptok.cache.config import CacheConfig
    from mptok.cache.prefix_cache import PrefixTokenCache
    from mptok.routing.owners import TokenizationOwners
    from mptok.routing.router import owner_of, owner_order

_PUBLIC = {
    "CacheConfig": "mptok.cache.config",
    "PrefixTokenCache": "mptok.cache.prefix_cache",
    "TokenizationOwners": "mptok.routing.owners",
    "load_tokenizer": "mptok.cache.loading",
    "owner_of": "mptok.routing.router",
    "owner_order": "mptok.routing.router",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'mptok' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

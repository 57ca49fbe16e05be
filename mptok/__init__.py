"""mptok: tokenize long multi-turn prompts once, across frontend processes.

``PrefixTokenCache`` tokenizes only the new tail of each prompt, exactly;
``mptok.routing`` sends each conversation to the frontend whose cache holds it.
"""

from mptok.backend import load_tokenizer
from mptok.cache import PrefixTokenCache
from mptok.config import CacheConfig
from mptok.errors import RouteFailed

__all__ = ["CacheConfig", "PrefixTokenCache", "RouteFailed", "load_tokenizer"]

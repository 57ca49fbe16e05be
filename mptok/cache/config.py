"""The cache's limits, settable in code or from the environment.

Operators tune a running fleet through the environment (``MPTOK_CACHE_*``),
library users through ``CacheConfig(...)``; both go through the same
validation, so a bad value fails at start-up with the name of the setting
instead of misbehaving later.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from mptok.core.settings import CHOICES, MiB, parse_bytes

ENV_PREFIX = "MPTOK_CACHE_"

# Longest conversation id, in UTF-8 bytes. Ids are kept whole as cache keys
# (and routed by), so an unbounded one would be memory a client controls.
MAX_KEY_BYTES = 256

# About 9,000 routed conversations' fingerprints per frontend (``CacheConfig.max_held_bytes``).
DEFAULT_MAX_HELD_BYTES = 4 * MiB


def check_key(key: str) -> None:
    """``ValueError`` if conversation id ``key`` is longer than ``MAX_KEY_BYTES``."""
    if len(key) * 4 > MAX_KEY_BYTES and (size := len(key.encode("utf-8", "surrogatepass"))) > MAX_KEY_BYTES:
        raise ValueError(f"a conversation id may be at most {MAX_KEY_BYTES} bytes (UTF-8), got {size}")


@dataclass(frozen=True)
class CacheConfig:
    """Bounds of a ``PrefixTokenCache``.

    max_entries: prompts kept (one per conversation, up to
        ``mptok.cache.prefix_cache.MAX_BRANCHES`` when conversations share a key), least
        recently used evicted first.
    max_bytes: memory the cache may hold for its conversations: prompt
        text, ids, fingerprint chains, keys and bookkeeping, counted as
        Python allocates them; least recently used conversations are evicted
        to stay within it, and a prompt that alone exceeds it is tokenized
        but not kept.
    max_held_bytes: memory for the fingerprints a frontend holds of the
        conversations it routed to their owners (``mptok.routing.router``),
        about 440 bytes each with a 36-character key; least recently routed
        evicted.
    min_chars: prompts shorter than this are tokenized normally, neither
        looked up nor kept (0 caches everything).
    max_seam_attempts: how many candidate seams are re-tokenized and checked
        before the prompt is tokenized in full.
    tokenizer_backend: what tokenizes prompts in full (``mptok.engines``):
        "auto" (the cheapest that passes the start-up check), "tokenizers",
        "fastokens" or "gigatoken"; default ``MPTOK_CACHE_TOKENIZER_BACKEND``,
        else "auto".
    """

    max_entries: int = 1024
    max_bytes: int = 512 * MiB
    max_held_bytes: int = DEFAULT_MAX_HELD_BYTES
    min_chars: int = 256
    max_seam_attempts: int = 4
    # MPTOK_CACHE_TOKENIZER_BACKEND, else "auto" (load_tokenizer builds that one).
    tokenizer_backend: str = dataclasses.field(
        default_factory=lambda: os.environ.get(ENV_PREFIX + "TOKENIZER_BACKEND", "").strip() or "auto"
    )

    def __post_init__(self) -> None:
        for name in ("tokenizer_backend", *_LOWEST):
            value = getattr(self, name)
            problem = _problem(name, value)
            if problem == _NOT_AN_INT:
                raise TypeError(f"CacheConfig.{name} {problem}, got {type(value).__name__}")
            if problem is not None:
                raise ValueError(f"CacheConfig.{name} {problem}, got {value!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: int | str) -> CacheConfig:
        """Defaults, then ``MPTOK_CACHE_<FIELD>`` variables (``MPTOK_CACHE_MAX_BYTES=1G``;
        sizes take K, M, G suffixes), then ``overrides``. A variable whose value
        cannot be its setting raises ``ValueError`` with one line naming the
        variable and the value (``mptok serve`` refuses to start with it)."""
        environ = os.environ if environ is None else environ
        values: dict[str, int | str] = {}
        for field in dataclasses.fields(cls):
            variable = ENV_PREFIX + field.name.upper()
            raw = environ.get(variable)
            if raw is None or raw.strip() == "":
                continue
            value = _parse(field.name, raw)
            not_a_number = _NOT_A_SIZE if field.name.endswith("_bytes") else "is not a whole number"
            problem = not_a_number if value is None else _problem(field.name, value)
            if problem is not None:
                raise ValueError(f"{variable}={raw!r} {problem}")
            values[field.name] = value
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]


# The least value of each numeric setting.
_LOWEST = {"max_entries": 1, "max_bytes": 1, "max_held_bytes": 1, "min_chars": 0, "max_seam_attempts": 1}
_NOT_AN_INT = "must be an int"
_NOT_A_SIZE = "is not a size in bytes (say 536870912, 512M or 1GiB)"


def _problem(name: str, value: object) -> str | None:
    """What is wrong with ``value`` as ``CacheConfig.<name>``, or None."""
    if name == "tokenizer_backend":
        return None if value in CHOICES else f"must be one of {', '.join(CHOICES)}"
    if isinstance(value, bool) or not isinstance(value, int):
        return _NOT_AN_INT
    return None if value >= _LOWEST[name] else f"must be at least {_LOWEST[name]}"


def _parse(name: str, raw: str) -> int | str | None:
    """The setting ``name`` as its variable's text ``raw`` spells it; None if it spells no number."""
    if name == "tokenizer_backend":
        return raw.strip()
    try:
        return parse_bytes(raw) if name.endswith("_bytes") else int(raw.strip().replace("_", ""))
    except ValueError:
        return None

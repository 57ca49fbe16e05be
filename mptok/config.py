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

ENV_PREFIX = "MPTOK_CACHE_"


@dataclass(frozen=True)
class CacheConfig:
    """Bounds of a ``PrefixTokenCache``.

    max_entries: conversations kept (one entry each), least recently used
        evicted first.
    max_cached_chars: total characters of the prompts kept; a prompt longer
        than this is tokenized but not kept.
    min_chars: prompts shorter than this are tokenized normally, neither
        looked up nor kept (0 caches everything).
    seam_window_tokens: how many tokens at the end of each kept prompt are
        remembered with their offsets; a new prompt that differs from the
        kept one before that window is tokenized in full.
    max_seam_attempts: how many candidate seams are re-tokenized and checked
        before the prompt is tokenized in full.
    """

    max_entries: int = 1024
    max_cached_chars: int = 256 * 1024 * 1024
    min_chars: int = 256
    seam_window_tokens: int = 4096
    max_seam_attempts: int = 4

    def __post_init__(self) -> None:
        lower_bounds = {
            "max_entries": 1,
            "max_cached_chars": 1,
            "min_chars": 0,
            "seam_window_tokens": 16,
            "max_seam_attempts": 1,
        }
        for name, lowest in lower_bounds.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"CacheConfig.{name} must be an int, got {type(value).__name__}")
            if value < lowest:
                raise ValueError(f"CacheConfig.{name} must be at least {lowest}, got {value}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: int) -> CacheConfig:
        """Defaults, then ``MPTOK_CACHE_<FIELD>`` variables, then ``overrides``.

        ``MPTOK_CACHE_MAX_ENTRIES=64`` sets ``max_entries``. A value that is
        not a whole number raises ``ValueError`` naming the variable.
        """
        environ = os.environ if environ is None else environ
        values: dict[str, int] = {}
        for field in dataclasses.fields(cls):
            variable = ENV_PREFIX + field.name.upper()
            raw = environ.get(variable)
            if raw is None or raw.strip() == "":
                continue
            try:
                values[field.name] = int(raw.strip().replace("_", ""))
            except ValueError:
                raise ValueError(f"{variable}={raw!r} is not a whole number") from None
        values.update(overrides)
        return cls(**values)

"""Values an operator writes, read the same way by every layer: sizes in bytes, tokenizer backends.

Standard library only: the supervisor reads its options and refuses bad
ones before it starts anything, and loads nothing of the tokenizer stack
to do so (``mptok.cache.config`` holds the cache's limits built on these).
"""

from __future__ import annotations

MiB = 1024 * 1024

# The engines ``mptok.cache.fast_backends`` runs, and what
# ``CacheConfig.tokenizer_backend`` accepts ("auto" picks the cheapest exact one).
ENGINES = ("fastokens", "gigatoken")
CHOICES = ("auto", "tokenizers") + ENGINES

_BYTE_UNITS = {"": 1, "K": 1024, "M": MiB, "G": 1024 * MiB, "T": 1024 * 1024 * MiB}


def parse_bytes(text: str) -> int:
    """A size in bytes: ``536870912``, ``512M``, ``512MiB``, ``1G`` (units of 1024).

    Raises ``ValueError`` for anything else.
    """
    raw = text.strip().replace("_", "")
    number = raw.rstrip("BbiIKkMmGgTt")
    unit = raw[len(number) :].upper().removesuffix("B").removesuffix("I")
    if unit not in _BYTE_UNITS or not number.isdigit():
        raise ValueError(f"{text!r} is not a size in bytes (say 536870912, 512M or 1GiB)")
    return int(number) * _BYTE_UNITS[unit]

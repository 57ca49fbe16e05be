"""Values an operator writes, read the same way by every layer: sizes in bytes, tokenizer backends.

Standard library only: the supervisor checks its options with these before
it starts anything, without loading the tokenizer stack.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

MiB = 1024 * 1024

# The fast engines, and what ``CacheConfig.tokenizer_backend`` accepts ("auto": the cheapest exact one).
ENGINES = ("fastokens", "gigatoken")
CHOICES = ("auto", "tokenizers") + ENGINES

_BYTE_UNITS = {"": 1, "K": 1024, "M": MiB, "G": 1024 * MiB, "T": 1024 * 1024 * MiB}


def parse_bytes(text: str) -> int:
    """A size in bytes: ``536870912``, ``512M``, ``512MiB``, ``1G`` (units of 1024); ``ValueError`` for anything else."""
    raw = text.strip().replace("_", "")
    number = raw.rstrip("BbiIKkMmGgTt")
    unit = raw[len(number) :].upper().removesuffix("B").removesuffix("I")
    if unit not in _BYTE_UNITS or not number.isdigit():
        raise ValueError(f"{text!r} is not a size in bytes (say 536870912, 512M or 1GiB)")
    return int(number) * _BYTE_UNITS[unit]


# The engine memo's directory (``mptok.engines.memo``), or "off".
ENGINE_MEMO_VARIABLE = "MPTOK_ENGINE_MEMO"
ENGINE_MEMO_OFF = "off"


def engine_memo_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """The engine memo's directory: ``MPTOK_ENGINE_MEMO`` if set, else
    ``$XDG_CACHE_HOME/mptok``, else ``~/.cache/mptok``; None when the
    variable says "off" or there is no home to put it in. ``ValueError`` for
    a relative path, which each process would read from its own working
    directory (a relative ``XDG_CACHE_HOME`` is ignored, as XDG says).
    """
    environ = os.environ if environ is None else environ
    raw = environ.get(ENGINE_MEMO_VARIABLE, "")
    value = raw.strip()
    if value.lower() == ENGINE_MEMO_OFF:
        return None
    if value:
        if not os.path.isabs(value):
            raise ValueError(f"{ENGINE_MEMO_VARIABLE}={raw!r} must be an absolute directory path, or {ENGINE_MEMO_OFF!r}")
        return os.path.normpath(value)
    base = environ.get("XDG_CACHE_HOME", "").strip()
    if not os.path.isabs(base):
        home = environ.get("HOME", "").strip() or os.path.expanduser("~")
        if not os.path.isabs(home):
            return None
        base = os.path.join(home, ".cache")
    return os.path.join(base, "mptok")

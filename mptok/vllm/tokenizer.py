"""The tokenizer of ``--tokenizer-mode mptok``: exactly vLLM's own HF tokenizer, in every vLLM process.

Caching happens in the renderer (``mptok.vllm.renderer``); this class exists
because vLLM picks the renderer by the tokenizer mode, and it is where an
unsupported vLLM is refused, before anything is served.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm.tokenizers.hf import CachedHfTokenizer

from mptok.vllm.compat import check_vllm


class MptokTokenizer(CachedHfTokenizer):
    """``CachedHfTokenizer`` after the version check (see ``mptok.vllm.compat``)."""

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | Path, *args: Any, **kwargs: Any) -> Any:
        check_vllm()
        return CachedHfTokenizer.from_pretrained(path_or_repo_id, *args, **kwargs)

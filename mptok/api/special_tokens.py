"""The ids a tokenizer's post-processor puts around one sequence.

The cache only knows ``add_special_tokens=False``; an HTTP frontend and the
vLLM plugin both answer requests with ``add_special_tokens=True`` too (a
completion, ``/tokenize`` with a prompt). For most tokenizers those ids are
fixed ids around the sequence (a BOS before it, say), so the cache's ids can
be framed; this module proves that per tokenizer, or says it cannot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mptok.core.ids import as_id_array

# Two different texts whose tokenizations, with and without special tokens,
# reveal what the post-processor adds around a single sequence.
_SENTINELS = ("Hello world", "x = 1;\n\n\t\u00e9\U0001f642 end")


@dataclass(frozen=True)
class SpecialTokenFrame:
    """The ids the tokenizer's post-processor puts around one sequence.

    For ``add_special_tokens=True`` the ids are ``prefix + ids + suffix``
    when the post-processor adds fixed ids around the sequence; ``derive``
    proves that on two different texts and returns None otherwise (then
    prompts are tokenized in full).
    """

    prefix: tuple[int, ...]
    suffix: tuple[int, ...]

    @classmethod
    def derive(cls, tokenizer: Any) -> SpecialTokenFrame | None:
        frames = set()
        for text in _SENTINELS:
            with_special = list(tokenizer(text, add_special_tokens=True)["input_ids"])
            without = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            frame = cls._split(with_special, without)
            if frame is None:
                return None
            frames.add(frame)
        return frames.pop() if len(frames) == 1 else None

    @classmethod
    def _split(cls, with_special: list[int], without: list[int]) -> SpecialTokenFrame | None:
        n = len(without)
        for start in range(len(with_special) - n + 1):
            if with_special[start : start + n] == without:
                return cls(tuple(with_special[:start]), tuple(with_special[start + n :]))
        return None

    @property
    def prefix_ids(self) -> np.ndarray:
        """``prefix`` in the compact form (``mptok.core.ids``)."""
        return as_id_array(list(self.prefix))

    @property
    def suffix_ids(self) -> np.ndarray:
        """``suffix`` in the compact form (``mptok.core.ids``)."""
        return as_id_array(list(self.suffix))

"""The ids a tokenizer's post-processor puts around one sequence.

The cache only knows ``add_special_tokens=False``. For most tokenizers
``True`` adds fixed ids around the sequence (a BOS before it, say), so the
cache's ids can be framed; this module proves that per tokenizer, or says it cannot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Two different texts whose tokenizations, with and without special tokens,
# reveal what the post-processor adds around a single sequence.
_SENTINELS = ("Hello world", "x = 1;\n\n\t\u00e9\U0001f642 end")


@dataclass(frozen=True)
class SpecialTokenFrame:
    """For ``add_special_tokens=True`` the ids are ``prefix + ids + suffix``; ``derive`` proves
    the frame fixed on two different texts, and returns None otherwise."""

    prefix: tuple[int, ...]
    suffix: tuple[int, ...]

    @classmethod
    def derive(cls, tokenizer: Any) -> SpecialTokenFrame | None:
        frames = set()
        for text in _SENTINELS:
            with_special = list(tokenizer(text, add_special_tokens=True)["input_ids"])
            without = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            n = len(without)
            start = next((i for i in range(len(with_special) - n + 1) if with_special[i : i + n] == without), None)
            if start is None:
                return None
            frames.add(cls(tuple(with_special[:start]), tuple(with_special[start + n :])))
        return frames.pop() if len(frames) == 1 else None

"""The rules of vLLM's tokenizer endpoints that are not about parsing a body.

A router or gateway that calls vLLM's ``/tokenize`` and ``/detokenize``
expects vLLM's answers: a 404 for a model the server does not serve, a 400
for more tokens than the context holds, the context length in every
answer, and ``/tokenizer_info`` (docs/SERVE.md, "Endpoints").
"""

from __future__ import annotations

import json
from typing import Any

from mptok.api.chat_template import ChatTemplate
from mptok.api.tokenize_request import RequestError

# transformers reports an unknown context length as int(1e30); a limit at or above this is not a real model's.
_UNKNOWN_MODEL_MAX_LENGTH = 2**31


class RequestLimits:
    """What a request may name and hold: the served model names, the context
    length, the tokenizer's ids. Each ``check_*`` raises a ``RequestError``
    with vLLM's status and message, or returns. Immutable, so threads may share it."""

    def __init__(self, tokenizer: Any, max_model_len: int | None, served_model_names: tuple[str, ...]):
        self.max_model_len = max_model_len
        self.served_model_names = served_model_names
        ids = set(tokenizer.get_vocab().values())
        self._id_limit = max(ids) + 1 if ids else 0
        self._missing_ids = frozenset(set(range(self._id_limit)) - ids)

    def check_model(self, model: str | None) -> None:
        """vLLM's rule: no name, or no --served-model-name, is accepted; else it must be one of them."""
        if model and self.served_model_names and model not in self.served_model_names:
            raise RequestError(404, f"The model `{model}` does not exist.", param="model")

    def check_length(self, count: int) -> None:
        """More than max_model_len tokens is a 400 with vLLM's message (its
        renderer checks /tokenize and /detokenize as prompts with no output)."""
        if self.max_model_len is not None and count > self.max_model_len:
            raise RequestError(
                400, f"You passed {count} input tokens and requested 0 output tokens. However, the model's context length is only "
                f"{self.max_model_len} tokens, resulting in a maximum input length of {self.max_model_len} tokens. "
                "Please reduce the length of the input prompt.",
            )

    def check_ids(self, ids: list[int]) -> None:
        """Every id must name a token: ``tokenizer.decode`` silently drops the
        others, or overflows on those past 2**32."""
        if ids and (min(ids) < 0 or max(ids) >= self._id_limit):
            bad = next(i for i in ids if not 0 <= i < self._id_limit)
            raise RequestError(400, f"token id {bad} is outside the vocabulary (ids 0 to {self._id_limit - 1})")
        missing = self._missing_ids.intersection(ids) if self._missing_ids else ()
        if missing:
            raise RequestError(400, f"token id {min(missing)} is not in the vocabulary")


def resolve_max_model_len(configured: int | None, tokenizer: Any) -> int | None:
    """``--max-model-len`` if given, else the tokenizer's ``model_max_length``
    when it is a real limit (a positive int below 2**31), else None (unknown)."""
    if configured is not None:
        return configured
    own = getattr(tokenizer, "model_max_length", None)
    return own if isinstance(own, int) and 0 < own < _UNKNOWN_MODEL_MAX_LENGTH else None


def tokenizer_info_payload(tokenizer: Any, template: ChatTemplate) -> bytes:
    """What vLLM's ``GET /tokenizer_info`` answers. In stdlib json: transformers'
    "unknown" model_max_length, int(1e30), does not fit orjson's 64-bit integers."""
    info = {k: _plain(v) for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()}
    for path_field in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path"):
        info.pop(path_field, None)
    info["tokenizer_class"] = type(tokenizer).__name__
    info["model_max_length"] = getattr(tokenizer, "model_max_length", None)
    info["added_tokens_decoder"] = {
        str(i): {"content": token.content, "special": bool(token.special)}
        for i, token in sorted(getattr(tokenizer, "added_tokens_decoder", {}).items())
    }
    if template.source is not None:
        info["chat_template"] = template.source
    return json.dumps(info, ensure_ascii=False).encode("utf-8")


def _plain(value: Any) -> Any:
    if hasattr(value, "content"):  # an AddedToken
        return value.content
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)

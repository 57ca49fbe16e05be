"""The hooks that send SGLang's prompt tokenization through mptok.

SGLang tokenizes on the worker that took the connection, synchronously on
its event loop: a chat is rendered, then its text goes to the tokenizer's
``encode`` (through ``parallel_prompt_encode``, which falls back to
``encode`` for a tokenizer whose ``encode`` is its own); ``/v1/tokenize``
calls ``encode``; ``/generate``'s text goes to
``TokenizerManager._tokenize_texts``. Three hooks:

- after ``TokenizerManager.init_tokenizer_and_processor``: the manager's
  tokenizer gets an ``encode`` of its own (``MptokEncode``) that gives one
  text's ids from this process's ``PromptTokens`` and anything else from
  the tokenizer's ``encode``;
- around ``OpenAIServingChat._render_and_encode_chat_template``: the
  chat's name (its messages up to the first user message) for the time of
  the call, which ``MptokEncode`` reads (the event loop runs the call to
  the end without switching tasks);
- around ``TokenizerManager._tokenize_texts``: one text, as ``/generate``
  sends it, through ``PromptTokens`` with the special tokens the tokenizer
  adds by default, as SGLang's call gives.

What SGLang gives up: ``parallel_prompt_encode`` (on by default from
32,768 characters: SGLang's long prompts cut at added tokens and tokenized
on the ``tokenizers`` thread pool) refuses a tokenizer whose ``encode`` is
not transformers' own, so every prompt goes through mptok, whose miss is
its fast engine's full tokenization.

Whatever happens inside mptok, the ids are exactly the tokenizer's, or
the hook calls SGLang's own path.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any

from mptok.api.affinity import chat_identity, named
from mptok.front.engine_tokens import ANY_SEAT, EngineFront, PromptTokens

logger = logging.getLogger("sglang.mptok")

FRONT = EngineFront(
    switch="mptok sglang", process_label="tokenizer_worker", process_name="tokenizer worker", logger_name="sglang.mptok"
)

_TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
_CHAT_RENDER = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._render_and_encode_chat_template"

_CONVERSATION: contextvars.ContextVar[str | None] = contextvars.ContextVar("mptok_sglang_conversation", default=None)


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{_TOKENIZER_MANAGER}.init_tokenizer_and_processor", attach, HookType.AFTER)
    HookRegistry.register(f"{_TOKENIZER_MANAGER}._tokenize_texts", tokenize_texts, HookType.AROUND)
    HookRegistry.register(_CHAT_RENDER, render_chat, HookType.AROUND)


class MptokEncode:
    """A tokenizer's ``encode``: one text's ids from ``prompt_tokens``, anything else from ``original``."""

    def __init__(self, tokenizer: Any, prompt_tokens: PromptTokens):
        self._original = tokenizer.encode
        self._backend = getattr(tokenizer, "_tokenizer", None)
        self.prompt_tokens = prompt_tokens

    def __call__(self, text: Any, *args: Any, **kwargs: Any) -> list[int]:
        ids = None
        if not args and isinstance(text, str) and set(kwargs) <= {"add_special_tokens"}:
            ids = self.ids(text, kwargs.get("add_special_tokens", True))
        return ids if ids is not None else self._original(text, *args, **kwargs)

    def ids(self, text: str, add_special_tokens: bool) -> list[int] | None:
        """The ids of ``text`` through mptok, or None when only the tokenizer's own call gives them."""
        backend = self._backend
        if backend is not None and (backend.truncation is not None or backend.padding is not None):
            return None  # the tokenizer would truncate or pad: its own call does
        identity = named(None, _CONVERSATION.get())
        return self.prompt_tokens.tokenize(text, bool(add_special_tokens), identity)


def attach(result: Any, manager: Any) -> None:
    """After ``init_tokenizer_and_processor``: give the manager's tokenizer mptok's ``encode``."""
    tokenizer = getattr(manager, "tokenizer", None)
    if tokenizer is None or not getattr(tokenizer, "is_fast", False) or isinstance(tokenizer.encode, MptokEncode):
        return None
    _log_where_sglang_logs()
    count = max(1, int(getattr(manager.server_args, "tokenizer_worker_num", 1) or 1))
    try:
        prompt_tokens = PromptTokens.of_process(tokenizer, ANY_SEAT if count > 1 else 0, count, FRONT)
    except Exception:
        logger.warning("mptok: could not start in this process; SGLang tokenizes alone", exc_info=True)
        return None
    if prompt_tokens is not None:
        tokenizer.encode = MptokEncode(tokenizer, prompt_tokens)
    return None


def _log_where_sglang_logs() -> None:
    """In a uvicorn worker SGLang configures only its HTTP server's and uvicorn's loggers, so mptok's
    lines (its start line above all) would be dropped: they get a handler of their own, in SGLang's format."""
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%Y-%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def render_chat(original: Any, serving: Any, messages: Any, *args: Any, **kwargs: Any) -> Any:
    """Around the chat's render and encode: the chat's name, for ``MptokEncode``."""
    token = _CONVERSATION.set(chat_identity(messages))
    try:
        return original(serving, messages, *args, **kwargs)
    finally:
        _CONVERSATION.reset(token)


async def tokenize_texts(original: Any, manager: Any, texts: Any, is_cross_encoder: bool = False) -> Any:
    """Around ``_tokenize_texts``: one text (``/generate``'s) through mptok, as the tokenizer's call gives it."""
    encode = getattr(getattr(manager, "tokenizer", None), "encode", None)
    if (
        isinstance(encode, MptokEncode)
        and isinstance(texts, str)
        and not is_cross_encoder
        and texts
        and manager.async_dynamic_batch_tokenizer is None
        and not getattr(manager.model_config, "is_embedding_gemma", False)
    ):
        ids = encode.ids(texts, True)
        if ids is not None:
            return ids, None
    return await original(manager, texts, is_cross_encoder)

"""The renderer of ``--tokenizer-mode mptok``: vLLM's HF renderer, tokenizing through mptok.

vLLM renders every request in two steps: ``render_messages`` turns a chat
into prompt text with the chat template, and ``_tokenize_prompt`` turns
prompt text into ids. This renderer keeps the first as it is and replaces
only the second, so the text is vLLM's own and the ids equal what vLLM's
tokenizer call would return:

- a prompt is named for routing as ``mptok serve`` names it: by the
  request's session header (``mptok.vllm.session``), else a chat by
  ``chat_identity``, a name that travels from ``render_messages`` to
  ``_tokenize_prompt`` in the prompt dict and is removed there; a
  completion prompt without a header is matched by content;
- vLLM tokenizes in an executor thread, run here in a copy of the
  request's context, so that the middleware's header is seen there;
- vLLM's own path tokenizes what mptok cannot take exactly: multimodal
  prompts and prompt embeddings, token offsets, tokenizer arguments other
  than ``add_special_tokens`` / ``truncation`` / ``max_length``, and a
  prompt longer than the truncation length (vLLM truncates it).
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Any

from vllm.inputs import TokensPrompt
from vllm.renderers.hf import HfRenderer

from mptok.api.affinity import ConversationIdentity, chat_identity, named
from mptok.front.catalogue import PROCESS_LABEL, VLLM
from mptok.front.engine_tokens import EngineFront, PromptTokens
from mptok.vllm.session import run_in_context, session_id

FRONT = EngineFront(
    switch="--tokenizer-mode mptok", process_label=PROCESS_LABEL[VLLM], process_name="API server", logger_name="vllm.mptok"
)
# The conversation's name, from render_messages to _tokenize_prompt.
CONVERSATION_FIELD = "_mptok_conversation"
# Prompt fields that send it down vLLM's own path.
_NOT_TEXT_ONLY = ("multi_modal_data", "multi_modal_uuids", "prompt_embeds", "_prompt_embeds", "prompt_token_ids")
_ENCODE_ARGUMENTS = frozenset({"add_special_tokens", "truncation", "max_length"})


class MptokRenderer(HfRenderer):
    """``HfRenderer`` whose text prompts are tokenized by this process's ``PromptTokens``."""

    def __init__(self, config: Any, tokenizer: Any) -> None:
        super().__init__(config, tokenizer)
        parallel = config.parallel_config
        rank, count = parallel._api_process_rank, parallel._api_process_count
        self._prompt_tokens = None if self.tokenizer is None else PromptTokens.of_process(self.tokenizer, rank, count, FRONT)
        # vLLM's own wrapper runs it on this executor, outside the request's context.
        executor = getattr(self, "_executor", None)
        if isinstance(executor, Executor):
            self._tokenize_prompt_async = run_in_context(self._tokenize_prompt, executor)

    def render_messages(self, messages: list[Any], params: Any) -> tuple[list[Any], Any]:
        conversation, prompt = super().render_messages(messages, params)
        return conversation, _named(prompt, messages)

    async def render_messages_async(self, messages: list[Any], params: Any) -> tuple[list[Any], Any]:
        conversation, prompt = await super().render_messages_async(messages, params)
        return conversation, _named(prompt, messages)

    def _tokenize_prompt(self, prompt: Any, params: Any) -> Any:
        identity = named(session_id(), prompt.pop(CONVERSATION_FIELD, None))
        ids = self._ids_through_mptok(prompt, params, identity)
        if ids is not None:
            # What _build_tokens_prompt builds, without its copy of the list: this one is new, made for this prompt alone.
            return TokensPrompt(prompt_token_ids=ids, **prompt)
        tokens_prompt = super()._tokenize_prompt(prompt, params)
        if self._prompt_tokens is not None:
            self._prompt_tokens.count_direct(len(tokens_prompt["prompt_token_ids"]))
        return tokens_prompt

    def _ids_through_mptok(self, prompt: Any, params: Any, identity: ConversationIdentity) -> list[int] | None:
        if self._prompt_tokens is None or not _text_only(prompt) or self._wants_offsets(prompt, params):
            return None
        arguments = params.get_encode_kwargs()
        if not set(arguments) <= _ENCODE_ARGUMENTS:
            return None
        ids = self._prompt_tokens.tokenize(prompt["prompt"], bool(arguments.get("add_special_tokens")), identity)
        max_length = arguments.get("max_length")
        if ids is not None and arguments.get("truncation") and max_length is not None and len(ids) > max_length:
            return None  # the tokenizer would truncate: vLLM's own call does it as vLLM does
        return ids


def _text_only(prompt: Any) -> bool:
    return isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str) and all(prompt.get(f) is None for f in _NOT_TEXT_ONLY)


def _named(prompt: Any, messages: list[Any]) -> Any:
    """``prompt`` with its conversation's name, when it is a text prompt and the chat has one."""
    if not _text_only(prompt):
        return prompt
    key = chat_identity(messages)
    if key is not None:
        prompt[CONVERSATION_FIELD] = key
    return prompt

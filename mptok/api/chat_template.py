"""Turn a chat (``messages``) into the prompt text the model sees.

``POST /tokenize`` accepts ``messages`` the way vLLM's does, so the frontend
needs a chat template: ``--chat-template FILE``, else the tokenizer's own
(``tokenizer_config.json``), else, for the embedded DeepSeek V3-family
tokenizer whose config carries none, ``DEEPSEEK_V3_TEMPLATE`` below, written
for its added tokens. A tokenizer with none of these answers ``messages``
with a clear 400, never with a guessed format.

Rendering is transformers' ``apply_chat_template(..., tokenize=False)``'s,
the sandboxed Jinja environment vLLM uses, so a template renders here as it
does there; it never touches the Rust tokenizer, so threads may render at once.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jinja2
import jinja2.meta
import jinja2.sandbox

# vLLM's answer (without --trust-request-chat-template, mptok's only mode) to a
# request that brings its own template, in the body or its chat_template_kwargs.
UNTRUSTED_TEMPLATE_REFUSAL = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)

# DeepSeek V3's template without its tool-call branches (text before "</think>" dropped from answers, as V3 does).
DEEPSEEK_V3_TEMPLATE = (
    "{%- set ns = namespace(system_prompt='', is_first_sp=true) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- if ns.is_first_sp -%}{%- set ns.system_prompt = message['content'] -%}{%- set ns.is_first_sp = false -%}"
    "{%- else -%}{%- set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] -%}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "<｜begin▁of▁sentence｜>{{ ns.system_prompt }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{ '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{%- set content = message['content'] -%}"
    "{%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1] -%}{%- endif -%}"
    "{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}"
    "{%- elif message['role'] != 'system' -%}"
    "{{ raise_exception('unsupported role ' + message['role'] + ': use system, user or assistant') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<｜Assistant｜>' }}{%- endif -%}"
)

# The added tokens DEEPSEEK_V3_TEMPLATE writes; a tokenizer without them gets no default.
_DEEPSEEK_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>")


class BuiltInPieces:
    """``DEEPSEEK_V3_TEMPLATE`` in Python, message by message, so a conversation's
    kept rendering of its earlier messages is reused (``mptok.api.chat_turns``);
    tests/test_vllm_contract.py compares it with the Jinja source turn after turn.
    """

    @staticmethod
    def piece(message: dict[str, Any]) -> str | None:
        """What the template writes for ``message`` in its loop (a system message:
        nothing); None for what it refuses (the Jinja source then says why)."""
        role, content = message.get("role"), message.get("content")
        if not isinstance(content, str):
            return None
        if role == "user":
            return "<｜User｜>" + content
        if role == "assistant":
            return "<｜Assistant｜>" + content.split("</think>")[-1] + "<｜end▁of▁sentence｜>"
        return "" if role == "system" else None

    @staticmethod
    def text(system_prompts: list[str], pieces: list[str], add_generation_prompt: bool) -> str:
        """The prompt, from the messages' system prompts and their pieces (one join: one copy of the prompt)."""
        generation = "<｜Assistant｜>" if add_generation_prompt else ""
        return "".join(["<｜begin▁of▁sentence｜>", "\n\n".join(system_prompts), *pieces, generation])


class ChatTemplateError(ValueError):
    """The messages cannot be rendered: the template refused them, or there is no template."""


def _parsed(source: str) -> jinja2.nodes.Template:
    return jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(source)


def check_template_source(source: str) -> None:
    """Raise ``ChatTemplateError`` naming the line if ``source`` is not valid Jinja."""
    try:
        _parsed(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template line {e.lineno}: {e.message}") from None


class ChatTemplate:
    """Renders ``messages`` to prompt text with one fixed template (or refuses: no template)."""

    def __init__(self, source: str | None, origin: str):
        if source is not None:
            check_template_source(source)
        self.source = source
        self.origin = origin
        # The built-in template, in Python (wherever its source came from).
        self.pieces = BuiltInPieces if source == DEEPSEEK_V3_TEMPLATE else None

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, override: str | None = None) -> ChatTemplate:
        """``override``, else the tokenizer's template, else the DeepSeek V3 default
        if the tokenizer has its added tokens, else no template."""
        if override is not None:
            return cls(override, "--chat-template")
        own = getattr(tokenizer, "chat_template", None)
        if isinstance(own, str) and own:
            return cls(own, "tokenizer")
        if _has_tokens(tokenizer, _DEEPSEEK_TOKENS):
            return cls(DEEPSEEK_V3_TEMPLATE, "built-in deepseek-v3")
        return cls(None, "none")

    def render(
        self, tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool, *, continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None, prepared: bool = False,
    ) -> str:
        """The prompt text; ``ChatTemplateError`` if the template refuses the messages.

        ``template_kwargs``: a request's ``chat_template_kwargs``, filtered by
        ``accepted_kwargs``. ``prepared``: the messages are ``template_messages``' already.
        The text is ``apply_chat_template(..., tokenize=False)``'s, rendered by
        its compiled template without its per-call copy of every message; only
        ``continue_final_message`` and ``documents`` go through it.
        """
        if self.source is None:
            raise ChatTemplateError("this tokenizer has no chat template: send a prompt, or start the server with --chat-template FILE")
        kwargs = template_kwargs or {}
        try:
            if self._compiled is None or continue_final_message or "documents" in kwargs:
                text = tokenizer.apply_chat_template(
                    messages, tools=tools, chat_template=self.source, **kwargs, add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message, tokenize=False,
                )
            else:
                text = self._compiled.render(
                    messages=messages if prepared else template_messages(messages), tools=tools, documents=None,
                    add_generation_prompt=add_generation_prompt, **{**tokenizer.special_tokens_map, **kwargs},
                )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template refused the messages: {e}") from None
        except ValueError as e:
            # transformers' own refusals, e.g. continue_final_message when the final message does not appear in the rendered text.
            # Anything else is the template's own code failing on these messages: the caller names it (``TokenizeService``).
            raise ChatTemplateError(f"cannot render the messages: {e}") from None
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, not str")
        return text

    @functools.cached_property
    def _compiled(self) -> Any:
        """transformers' compiled template of ``source`` (cached there), or None
        where its compiler is not where this version of transformers keeps it."""
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template
        except ImportError:
            return None
        return _compile_jinja_template(self.source)

    def accepted_kwargs(self, requested: dict[str, Any]) -> dict[str, Any]:
        """The part of a request's ``chat_template_kwargs`` that reaches the template, as in vLLM:
        ``chat_template`` and ``tokenize`` are refused (``ChatTemplateError``); names the template
        never reads, other than ``documents``, are dropped."""
        if requested.get("chat_template") is not None:
            raise ChatTemplateError(UNTRUSTED_TEMPLATE_REFUSAL)
        refused = sorted({"chat_template", "tokenize"} & requested.keys())
        if refused:
            raise ChatTemplateError(f"Found unexpected chat template kwargs from request: {', '.join(refused)}")
        if self.source is None:
            return {}
        variables = self._template_variables | {"documents"}
        return {k: v for k, v in requested.items() if k in variables and k not in _SET_BY_REQUEST}

    @functools.cached_property
    def _template_variables(self) -> set[str]:
        return set(jinja2.meta.find_undeclared_variables(_parsed(self.source)))


# Request fields that reach apply_chat_template under their own name; the
# request's fields win over chat_template_kwargs, as in vLLM.
_SET_BY_REQUEST = frozenset({"add_generation_prompt", "continue_final_message", "tools", "messages"})


def vllm_conversation(messages: list[dict[str, Any]], start: int = 0) -> list[dict[str, Any]]:
    """The messages as vLLM hands them to a chat template (text-only, "string" content format):
    text parts joined with newlines, a tool call's JSON ``arguments`` parsed to an object (as
    tool-use templates expect). ``ChatTemplateError`` when they are not JSON, naming the
    message by its index plus ``start``.
    """
    conversation = []
    for i, message in enumerate(messages, start):
        content = message.get("content")
        if isinstance(content, list):
            content = "\n".join(part["text"] for part in content)
        role = message["role"]
        converted: dict[str, Any] = {"role": role, "content": content or ""}
        if role == "assistant":
            if message.get("tool_calls"):  # an empty list is dropped
                converted["tool_calls"] = [_with_parsed_arguments(i, call) for call in message["tool_calls"]]
            reasoning = message.get("reasoning", message.get("reasoning_content"))
            if reasoning is not None:
                converted["reasoning"] = converted["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            converted["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            converted["name"] = message["name"]
        if role == "developer":
            converted["tools"] = message.get("tools")
        conversation.append(converted)
    return conversation


# The names transformers passes a message's reasoning under, the first the one templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def template_messages(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as transformers' ``apply_chat_template`` hands them to a
    template: the keys whose value is None dropped, a message's reasoning
    also under ``thinking`` (first) and ``reasoning_content`` (last)."""
    prepared = []
    for message in conversation:
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared


def _with_parsed_arguments(index: int, call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call["function"])
    arguments = function.get("arguments")
    if not arguments:
        function["arguments"] = {}
    elif isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ChatTemplateError(f"messages[{index}]: a tool call's arguments are not JSON: {e}") from None
    return {**call, "function": function}


def vllm_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools as vLLM hands them to a chat template.

    vLLM reads each tool into a model and dumps it back: ``type`` first
    (default "function"), then ``function`` with ``name``, ``description``
    and ``parameters`` in that order (null when absent), then any other keys
    as sent. A template that prints a tool as JSON prints exactly this.
    """
    normalized = []
    for tool in tools:
        function = tool["function"]
        # A key already placed keeps its place when ``**function`` sets it again.
        dumped = {"name": function["name"], "description": function.get("description"), "parameters": function.get("parameters"), **function}
        others = {k: v for k, v in tool.items() if k not in ("type", "function")}
        normalized.append({"type": tool.get("type", "function"), "function": dumped, **others})
    return normalized


def _has_tokens(tokenizer: Any, tokens: tuple[str, ...]) -> bool:
    """Whether ``tokenizer``'s vocabulary, added tokens included, holds every one of ``tokens``.

    Asked of the Rust tokenizer where there is one: ``get_vocab`` builds a
    dict of the whole vocabulary at every frontend's start, for four lookups.
    """
    rust = getattr(tokenizer, "backend_tokenizer", None)
    if rust is not None and hasattr(rust, "token_to_id"):
        return all(rust.token_to_id(token) is not None for token in tokens)
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return all(token in vocab for token in tokens)

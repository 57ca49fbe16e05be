"""The bodies of ``POST /tokenize`` and ``POST /detokenize``, validated the way vLLM reads them, and the errors a client gets.

A client's mistake is a ``RequestError`` with a 4xx status and a message
that names the field, never a 500.
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import orjson

from mptok.api.chat_template import UNTRUSTED_TEMPLATE_REFUSAL
from mptok.cache.config import check_key

# What a refused client is told to wait before retrying (Retry-After, whole seconds).
RETRY_AFTER_S = 1


class RequestError(Exception):
    """A client's mistake: answered with ``status`` and ``message``, never a 500."""

    def __init__(self, status: int, message: str, *, retry_after_s: int | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s  # sent as Retry-After (503: overloaded or stopping)
        self.param = param  # the error body's "param": the field at fault, where vLLM names it


@dataclass(frozen=True)
class TokenizeRequest:
    """A validated ``POST /tokenize`` body: exactly one of ``prompt`` and ``messages``."""

    prompt: str | None
    messages: list[dict[str, Any]] | None
    add_generation_prompt: bool
    add_special_tokens: bool
    conversation_id: str | None
    # vLLM's other fields (see _vllm_fields); defaults are vLLM's.
    model: str | None = None
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


def parse_tokenize_request(body: bytes, header_conversation_id: str | None) -> TokenizeRequest:
    """Parse and type-check a body the way vLLM's ``/tokenize`` reads it; ``RequestError`` (400) if wrong.

    The caller checks each message (``check_messages``). ``add_special_tokens`` defaults to true for
    a prompt, false for messages; ``add_generation_prompt`` to true; ``conversation_id`` in the body wins.
    """
    data = _json_object(body)
    has_prompt, has_messages = "prompt" in data, "messages" in data
    if has_prompt == has_messages:
        raise RequestError(400, 'give exactly one of "prompt" (a string) and "messages" (a list of messages)')
    conversation_id = _optional(data, "conversation_id", str, None) or header_conversation_id or None
    if conversation_id is not None:
        try:
            check_key(conversation_id)
        except ValueError as e:
            raise RequestError(400, str(e)) from None
    prompt = data.get("prompt")
    if has_prompt and not isinstance(prompt, str):
        raise RequestError(400, f'"prompt" must be a string, not {_json_type(prompt)}')
    return TokenizeRequest(
        prompt=prompt, messages=None if has_prompt else _message_list(data["messages"]),
        add_generation_prompt=not has_prompt and _optional(data, "add_generation_prompt", bool, True),
        add_special_tokens=_optional(data, "add_special_tokens", bool, has_prompt), conversation_id=conversation_id,
        **_vllm_fields(data, chat=not has_prompt),
    )


def _json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object; ``RequestError`` (400) naming what is wrong with it."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise RequestError(400, f"the body is not valid JSON: it is not UTF-8 (byte {bad.start})") from None
        if "surrogate" in str(e):
            raise RequestError(
                400, f"the body has a lone UTF-16 surrogate (\\ud800-\\udfff) in a string; text must be valid Unicode ({e})"
            ) from None
        raise RequestError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise RequestError(400, f"the body must be a JSON object, not {_json_type(data)}")
    return data


def _message_list(messages: Any) -> list[Any]:
    if not isinstance(messages, list):
        raise RequestError(400, f'"messages" must be a non-empty list, not {_json_type(messages)}')
    if not messages:
        raise RequestError(400, '"messages" must be a non-empty list; it is empty')
    return messages


def check_messages(messages: list[Any], start: int = 0) -> None:
    """``RequestError`` (400) naming the first of ``messages[start:]`` that vLLM would refuse
    (those before ``start`` were checked on an earlier turn)."""
    for i in range(start, len(messages)):
        message = messages[i]
        if not isinstance(message, dict):
            raise RequestError(400, f"messages[{i}] must be an object, not {_json_type(message)}")
        if not isinstance(message.get("role"), str):
            raise RequestError(400, f'messages[{i}]["role"] must be a string, not {_json_type(message.get("role"))}')
        _check_content(i, message)


def _check_content(i: int, message: dict[str, Any]) -> None:
    """A string, a list of text parts, or absent or null (the template then sees ""), as vLLM reads it."""
    content = message.get("content")
    if message.get("tool_calls") is not None:
        _check_tool_calls(i, message["tool_calls"])
    if content is None or isinstance(content, str):
        return
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content
    ):
        return
    raise RequestError(
        400,
        f'messages[{i}]["content"] must be a string or a list of {{"type": "text", "text": ...}} parts, '
        f"not {_json_type(content)} (only text is tokenized)",
    )


def _check_tool_calls(i: int, calls: Any) -> None:
    if not isinstance(calls, list):
        raise RequestError(400, f'messages[{i}]["tool_calls"] must be a list, not {_json_type(calls)}')
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(400, f'messages[{i}]["tool_calls"][{j}] must be {{"function": {{"name": ..., "arguments": ...}}}}')
        if not isinstance(function.get("arguments"), (str, dict, type(None))):
            raise RequestError(400, f'messages[{i}]["tool_calls"][{j}]["function"]["arguments"] must be a JSON string')


def _vllm_fields(data: dict[str, Any], *, chat: bool) -> dict[str, Any]:
    """``model`` and ``return_token_strs``; for messages also ``continue_final_message``,
    ``tools`` and ``chat_template_kwargs``, type-checked as vLLM's request models do."""
    fields = {"model": _optional(data, "model", str, None), "return_token_strs": _optional(data, "return_token_strs", bool, False)}
    if not chat:
        return fields
    continue_final = _optional(data, "continue_final_message", bool, False)
    if continue_final and _optional(data, "add_generation_prompt", bool, True):
        raise RequestError(
            400,
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True "
            '(add_generation_prompt defaults to true: send "add_generation_prompt": false)',
        )
    if data.get("chat_template") is not None:
        raise RequestError(400, UNTRUSTED_TEMPLATE_REFUSAL)
    fields["continue_final_message"] = continue_final
    fields["tools"] = _check_tools(_optional(data, "tools", list, None))
    fields["chat_template_kwargs"] = _optional(data, "chat_template_kwargs", dict, None)
    return fields


def _check_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    for i, tool in enumerate(tools or ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(400, f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., ...}}}}')
        if tool.get("type", "function") != "function":
            raise RequestError(400, f'tools[{i}]["type"] must be "function"')
        if not isinstance(function.get("description"), (str, type(None))):
            raise RequestError(400, f'tools[{i}]["function"]["description"] must be a string')
        if not isinstance(function.get("parameters"), (dict, type(None))):
            raise RequestError(400, f'tools[{i}]["function"]["parameters"] must be an object')
    return tools


def _optional(data: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise RequestError(400, f'"{name}" must be a {_JSON_NAMES[kind]}, not {_json_type(value)}')
    return value


_JSON_NAMES = {str: "string", bool: "boolean", int: "number", float: "number", list: "list", dict: "object", type(None): "null"}


def _json_type(value: Any) -> str:
    return _JSON_NAMES.get(type(value), type(value).__name__)


_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 413: "RequestTooLarge", 500: "InternalServerError", 503: "ServiceUnavailable"}


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """An error in vLLM's shape: ``{"object": "error", "message", "type", "param", "code"}``
    as older vLLM releases answer, with the same fields under ``"error"`` as
    current ones do, so that clients written against either read it."""
    kind = _ERROR_TYPES.get(status) or "".join(HTTPStatus(status).phrase.split())
    fields = {"message": message, "type": kind, "param": param, "code": status}
    return orjson.dumps({"object": "error", **fields, "error": fields})


@dataclass(frozen=True)
class DetokenizeRequest:
    """A validated ``POST /detokenize`` body: ``{"model"?, "tokens": [ids]}``."""

    model: str | None
    tokens: list[int]


def parse_detokenize_request(body: bytes) -> DetokenizeRequest:
    """Parse a body the way vLLM's ``/detokenize`` reads it; ``RequestError`` (400) if wrong."""
    data = _json_object(body)
    tokens = data.get("tokens")
    if not isinstance(tokens, list):
        raise RequestError(400, f'"tokens" must be a list of token ids, not {_json_type(tokens)}')
    for i, token in enumerate(tokens):
        if not isinstance(token, int) or isinstance(token, bool):
            what = token if isinstance(token, float) else _json_type(token)  # JSON's 1e23 arrives as a float
            raise RequestError(400, f"tokens[{i}] must be an integer token id, not {what}")
    return DetokenizeRequest(model=_optional(data, "model", str, None), tokens=tokens)

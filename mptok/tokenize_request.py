"""The body of ``POST /tokenize``, validated the way vLLM reads it, and the errors a client gets.

Kept apart from the HTTP app and from tokenizing so that what a client may
send, and what it hears back when the body is wrong, reads in one place: a
client's mistake is a ``RequestError`` with a 4xx status and a message that
names the field, never a 500.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from mptok.config import check_key


class RequestError(Exception):
    """A client's mistake: answered with ``status`` and ``message``, never a 500."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class TokenizeRequest:
    """A validated ``POST /tokenize`` body: exactly one of ``prompt`` and ``messages``."""

    prompt: str | None
    messages: list[dict[str, Any]] | None
    add_generation_prompt: bool
    add_special_tokens: bool
    conversation_id: str | None


def parse_tokenize_request(body: bytes, header_conversation_id: str | None) -> TokenizeRequest:
    """Parse and type-check a body the way vLLM's ``/tokenize`` reads it; ``RequestError`` (400) if wrong.

    ``add_special_tokens`` defaults to true for a prompt and false for
    messages, ``add_generation_prompt`` to true; ``conversation_id`` in the
    body wins over the header's.
    """
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
    has_prompt, has_messages = "prompt" in data, "messages" in data
    if has_prompt == has_messages:
        raise RequestError(400, 'give exactly one of "prompt" (a string) and "messages" (a list of messages)')
    conversation_id = _optional(data, "conversation_id", str, None) or header_conversation_id or None
    if conversation_id is not None:
        try:
            check_key(conversation_id)
        except ValueError as e:
            raise RequestError(400, str(e)) from None
    if has_prompt:
        prompt = data["prompt"]
        if not isinstance(prompt, str):
            raise RequestError(400, f'"prompt" must be a string, not {_json_type(prompt)}')
        return TokenizeRequest(
            prompt=prompt,
            messages=None,
            add_generation_prompt=False,
            add_special_tokens=_optional(data, "add_special_tokens", bool, True),
            conversation_id=conversation_id,
        )
    return TokenizeRequest(
        prompt=None,
        messages=_check_messages(data["messages"]),
        add_generation_prompt=_optional(data, "add_generation_prompt", bool, True),
        add_special_tokens=_optional(data, "add_special_tokens", bool, False),
        conversation_id=conversation_id,
    )


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, f'"messages" must be a non-empty list, not {_json_type(messages)}')
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(400, f"messages[{i}] must be an object, not {_json_type(message)}")
        for field in ("role", "content"):
            if not isinstance(message.get(field), str):
                raise RequestError(400, f'messages[{i}]["{field}"] must be a string, not {_json_type(message.get(field))}')
    return messages


def _optional(data: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise RequestError(400, f'"{name}" must be a {_JSON_NAMES[kind]}, not {_json_type(value)}')
    return value


_JSON_NAMES = {str: "string", bool: "boolean", int: "number", float: "number", list: "list", dict: "object"}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return _JSON_NAMES.get(type(value), type(value).__name__)


def error_body(status: int, message: str) -> bytes:
    """An error in vLLM's shape: ``{"object": "error", "message", "type", "code"}``."""
    kind = {400: "BadRequestError", 413: "RequestTooLarge", 503: "ServiceUnavailable"}.get(status, "InternalServerError")
    return orjson.dumps({"object": "error", "message": message, "type": kind, "code": status})

"""The requests of the render server's tests in every format it takes, and what vLLM answers them without the switch.

``test_render_server.py`` (``vllm launch render`` with the switch) and
``test_render_tier.py`` (``mptok render``) compare against the same
answers: those of one render server without the switch (the
``render_plain`` fixture of ``conftest.py``, made once per session): the
ids of every case, and the whole answer (status and every field, in
order) of every ``ANSWER_CASES`` request.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mptok_harness.serve import request
from mptok_harness.vllm import RENDER, VllmServer
from mptok_harness.vllm_requests import TOOLS, agent_turns

from test_plugin import AGENTS, CASES, TURNS, _ids

# fastokens has no token offsets (vLLM answers 501 with it).
WITHOUT_OFFSETS = {name: case for name, case in CASES.items() if not case[1].get("return_token_offsets")}


def _anthropic_body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """An OpenAI chat of ``agent_turns`` as an Anthropic Messages request: tool calls
    as ``tool_use`` blocks, their results as ``tool_result`` blocks of a user turn."""
    system, *rest = messages
    converted: list[dict[str, Any]] = []
    for message in rest:
        if message["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": message["tool_call_id"], "content": message["content"]}
            converted.append({"role": "user", "content": [block]})
        elif message.get("tool_calls"):
            blocks = [
                {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": json.loads(call["function"]["arguments"])}
                for call in message["tool_calls"]
            ]
            converted.append({"role": "assistant", "content": blocks})
        else:
            converted.append({"role": message["role"], "content": message["content"]})
    tools = [
        {"name": tool["function"]["name"], "description": tool["function"].get("description", ""), "input_schema": tool["function"]["parameters"]}
        for tool in TOOLS
    ]
    return {"max_tokens": 16, "system": system["content"], "messages": converted, "tools": tools, "tool_choice": {"type": "none"}}


def _responses_body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The same chat as an OpenAI Responses request: ``function_call`` and ``function_call_output`` items."""
    system, *rest = messages
    items: list[dict[str, Any]] = []
    for message in rest:
        if message["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": message["tool_call_id"], "output": message["content"]})
        elif message.get("tool_calls"):
            items += [
                {"type": "function_call", "call_id": call["id"], "name": call["function"]["name"], "arguments": call["function"]["arguments"]}
                for call in message["tool_calls"]
            ]
        else:
            items.append({"type": "message", "role": message["role"], "content": message["content"]})
    tools = [{"type": "function", **{k: tool["function"].get(k) for k in ("name", "description", "parameters")}} for tool in TOOLS]
    return {"instructions": system["content"], "input": items, "tools": tools, "tool_choice": "none"}


# Render endpoints of the render server beyond test_plugin's: name -> (path, body).
# Agents of their own, so that no two formats of one chat share the cache.
API_TURNS = 5
API_CASES = {
    f"{label}-turn{turn}": (path, body(messages))
    for label, path, body, seed in (
        ("messages-render", "/v1/messages/render", _anthropic_body, 10),
        ("responses-render", "/v1/responses/render", _responses_body, 11),
    )
    for turn, messages in enumerate(agent_turns(seed, API_TURNS))
}
# The agents' turns after their first two, in every format: each extends a
# prompt the cache holds (the second may land before a provable seam exists).
LATER_TURNS = AGENTS * (TURNS - 2) + 2 * (API_TURNS - 2)


def answer_every_format(server: VllmServer, cases: dict[str, tuple[str, dict[str, Any]]] = CASES) -> dict[str, list[int]]:
    """The ids of ``cases`` (test_plugin's kinds) and of ``API_CASES``."""
    ids = {name: _ids(server, kind, body) for name, (kind, body) in cases.items()}
    for name, (path, body) in API_CASES.items():
        ids[name] = server.post(path, body)["token_ids"]  # type: ignore[call-overload]
    return ids


def render_server(model_dir: Path, log_path: Path, *, mptok: bool, env: dict[str, str] | None = None) -> VllmServer:
    return VllmServer(model_dir, log_path, mptok=mptok, api_servers=1, command=RENDER, env=env)


CHAT = "/v1/chat/completions/render"
COMPLETION = "/v1/completions/render"
SAMPLING = {
    "temperature": 0.2, "top_p": 0.9, "top_k": 20, "seed": 7, "max_tokens": 64, "stop": ["\n\n"], "presence_penalty": 0.5,
    "frequency_penalty": 0.1, "repetition_penalty": 1.1, "min_tokens": 2, "logprobs": True, "top_logprobs": 2,
}  # fmt: skip
# A completion's logprobs are a count; it has no top_logprobs.
COMPLETION_SAMPLING = {**{k: v for k, v in SAMPLING.items() if k != "top_logprobs"}, "logprobs": 2}
SEVERAL_SYSTEMS = [
    {"role": "system", "content": "You are terse."},
    {"role": "developer", "content": "Answer in French."},
    {"role": "system", "content": "Never apologise."},
    {"role": "user", "content": "What is a prefix cache?"},
    {"role": "assistant", "content": "Un cache.", "reasoning_content": "The user wants a definition."},
    {"role": "user", "content": "And a seam?"},
    {"role": "assistant", "content": "Une couture.", "reasoning": "Keep it short."},
    {"role": "user", "content": "Thanks"},
]


def _answer_cases() -> dict[str, tuple[str, Any, dict[str, str]]]:
    """Requests whose whole answers are compared with vLLM's: name -> (path, body, headers).

    The body is a dict (the model filled in when it has no ``model``) or raw bytes. Chats of
    agents with tool calls whose ``arguments`` are JSON text, with and without sampling
    parameters; several system messages and reasoning; template arguments; completions;
    requests the hit path leaves to vLLM (a field it does not know, content parts, several
    prompts); and bad requests, which must get vLLM's status and error.
    """
    cases: dict[str, tuple[str, Any, dict[str, str]]] = {}
    for turn, messages in enumerate(agent_turns(20, 6)):
        cases[f"tools-turn{turn}"] = (CHAT, {"messages": messages, "tools": TOOLS, "tool_choice": "none"}, {})
        cases[f"sampling-turn{turn}"] = (CHAT, {"messages": messages, **SAMPLING}, {})
    chat = {"messages": SEVERAL_SYSTEMS}
    cases |= {
        "systems-and-reasoning": (CHAT, chat, {}),
        "systems-max-completion-tokens": (CHAT, {**chat, "max_completion_tokens": 10, "include_reasoning": False}, {}),
        "template-kwargs": (CHAT, {**chat, "chat_template_kwargs": {"enable_thinking": False}, "add_generation_prompt": False}, {}),
        "continue-final-message": (CHAT, {**chat, "add_generation_prompt": False, "continue_final_message": True}, {}),
        "request-id-in-body": (CHAT, {**chat, "request_id": "mine-1"}, {}),
        "request-id-header": (CHAT, chat, {"X-Request-Id": "header-1"}),
        "cache-salt-priority": (CHAT, {**chat, "cache_salt": "salt", "priority": 3}, {}),
        "completion": (COMPLETION, {"prompt": "The seam is proven"}, {}),
        "completion-sampling": (COMPLETION, {"prompt": "The seam is proven", **COMPLETION_SAMPLING, "add_special_tokens": False}, {}),
        # vLLM's path: a field the hit path does not know, content parts, several prompts.
        "unknown-field": (CHAT, {**chat, "mptok_test_field": 1}, {}),
        "content-parts": (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}]}, {}),
        "echo": (COMPLETION, {"prompt": "echo me", "echo": False}, {}),
        "several-prompts": (COMPLETION, {"prompt": ["one", "two"]}, {}),
        # Bad requests.
        "bad-model": (CHAT, {**chat, "model": "no-such-model"}, {}),
        "bad-temperature": (CHAT, {**chat, "temperature": -1}, {}),
        "bad-messages": (CHAT, {"messages": "not a list"}, {}),
        "bad-role": (CHAT, {"messages": [{"role": "nobody", "content": 3}]}, {}),
        "bad-json": (CHAT, b'{"messages": [', {}),
        "bad-content-type": (CHAT, {**chat}, {"Content-Type": "text/plain"}),
        "bad-tool-choice": (CHAT, {**chat, "tools": TOOLS, "tool_choice": "auto"}, {}),
        "bad-generation-flags": (CHAT, {**chat, "continue_final_message": True}, {}),
        "bad-min-tokens": (CHAT, {**chat, "max_tokens": 2, "min_tokens": 5}, {}),
        "bad-too-long": (COMPLETION, {"prompt": "word " * 70_000}, {}),
        "bad-completion-model": (COMPLETION, {"prompt": "x", "model": "no-such-model"}, {}),
    }
    return cases


ANSWER_CASES = _answer_cases()
# vLLM's request ids are random where the client names none.
_RANDOM_REQUEST_ID = re.compile(rb'"(chatcmpl|cmpl)-[0-9a-f]{16}(-[0-9]+)?"')


@dataclass(frozen=True)
class Answer:
    """One answer as a client sees it: status, content type, and the JSON's fields in their order
    (objects as lists of pairs), a random request id replaced by its prefix."""

    status: int
    content_type: str | None
    fields: Any


def answer_of(server: VllmServer, path: str, body: Any, headers: dict[str, str]) -> Answer:
    if isinstance(body, dict):
        body = {"model": server.model, **body}
    status, payload, answer_headers = request(server.port, "POST", path, body, headers, timeout_s=120)
    payload = _RANDOM_REQUEST_ID.sub(rb'"\1-<random>\2"', payload)
    return Answer(status, answer_headers.get("content-type"), json.loads(payload, object_pairs_hook=list))


def answer_every_case(server: VllmServer) -> dict[str, Answer]:
    return {name: answer_of(server, *case) for name, case in ANSWER_CASES.items()}


@dataclass(frozen=True)
class PlainRender:
    """What ``vllm launch render`` without the switch answered: every case's ids, every answer case's answer."""

    ids: dict[str, list[int]]
    answers: dict[str, Answer]


def plain_render(model_dir: Path, logs_dir: Path) -> PlainRender:
    """Every case's ids and answer from a render server without the switch, which is then stopped."""
    with render_server(model_dir, logs_dir / "render-plain.log", mptok=False) as server:
        return PlainRender(answer_every_format(server), answer_every_case(server))

"""The requests of the render server's tests in every format it takes, and the ids vLLM gives them without the switch.

``test_render_server.py`` (``vllm launch render`` with the switch) and
``test_render_tier.py`` (``mptok render``) compare against the same ids:
those of one render server without the switch (the ``render_plain_ids``
fixture of ``conftest.py``, made once per session).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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




def plain_render_ids(model_dir: Path, logs_dir: Path) -> dict[str, list[int]]:
    """The ids of every case from a render server without the switch, which is then stopped."""
    with render_server(model_dir, logs_dir / "render-plain.log", mptok=False) as server:
        return answer_every_format(server)

"""The requests the plugin's tests and the render benchmark send to vLLM: agentic chats with tools, and what else a client sends.

Real text (the standard library's sources, shuffled by a seeded generator)
as the users' and the tools' content, so prompts are long enough to be
cached (``CacheConfig.min_chars``) and tokenize like code and prose do.
"""

from __future__ import annotations

import json
import random
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the test suite and return its output.",
            "parameters": {"type": "object", "properties": {"selector": {"type": "string"}}},
        },
    },
]

# What user text may hold that a tokenizer treats specially.
AWKWARD = ["café naïve e\u0301\u0301", "👩\u200d👩\u200d👧 emoji", "中文字符", "\r\n\t  spaces   ", "<｜User｜> literal", "1234567890"]


def text_source(seed: int) -> Callable[[int], str]:
    """``piece(chars)``: a random run of ``chars`` characters of real text."""
    rng = random.Random(seed)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted(stdlib.glob("*.py"))[:40])

    def piece(chars: int) -> str:
        start = rng.randrange(0, len(text) - chars)
        return text[start : start + chars] + " " + rng.choice(AWKWARD)

    return piece


def agent_turns(seed: int, turns: int, chars_per_turn: int = 1500) -> Iterator[list[dict[str, Any]]]:
    """The messages of each turn of one agent's conversation: a system prompt, a task,
    then answers, tool calls and their results; each turn's messages extend the last's."""
    piece = text_source(seed)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. " + piece(400)},
        {"role": "user", "content": f"Task {seed}: " + piece(chars_per_turn)},
    ]
    for turn in range(turns):
        yield [dict(m) for m in messages]
        if turn % 3 == 1:
            call_id = f"call_{seed}_{turn}"
            arguments = json.dumps({"path": f"src/module_{turn}.py"})
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "read_file", "arguments": arguments}}],
                }
            )
            messages.append({"role": "tool", "tool_call_id": call_id, "content": piece(chars_per_turn)})
        else:
            messages.append({"role": "assistant", "content": piece(chars_per_turn // 3)})
            messages.append({"role": "user", "content": piece(chars_per_turn // 2)})

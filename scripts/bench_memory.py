#!/usr/bin/env python3
"""Benchmark: what the cache's memory costs, that its byte budget holds, and what a hit's ids cost.

Four measurements, on the embedded tokenizer and real text (the Python
standard library's sources):

1. Bytes per cached token beyond the prompt text, traced with tracemalloc:
   24 conversations of 40k-160k characters, two turns each.
2. A flood against a small budget (``--budget``): hundreds of conversations,
   unrelated prompts under one key, conversations with the longest allowed
   ids, and ids over the limit (refused); the traced memory the cache holds,
   sampled after every request, against the budget.
3. The resident memory (RSS) of each frontend of ``mptok serve
   --cache-bytes`` before and after a flood over HTTP, with the bytes each
   reports on /metrics (cache and held fingerprints).
4. The CPU of a cache hit after other work (an unrelated tokenization and
   64 MiB written, as a serving process does between two turns), at ~50k
   and ~200k tokens: the same prompt again and the prompt plus one turn,
   through ``encode_array`` (the compact form, and with orjson writing its
   JSON) and through ``encode`` (a list), against fastokens' full
   tokenization of the same prompt, all interleaved in one run. With
   ``--baseline-repo DIR`` (a checkout of another revision, say
   ``git worktree add /tmp/base main``) the same hits run there too, in
   worker processes interleaved with this checkout's.

Writes docs/results/bench_memory.md (scripts/report.py).

    .venv/bin/python -m scripts.bench_memory                # ~8 min on 2 busy cores
    .venv/bin/python -m scripts.bench_memory --skip-serve   # 1, 2 and 4
    .venv/bin/python -m scripts.bench_memory --smoke        # all four on a small workload, no report

Exit status 1 when a cached prompt's ids differ from full tokenization, the
bytes per token are over 9.3 or the flood's peak is over its budget.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import mptok
from mptok.cache.config import MAX_KEY_BYTES, parse_bytes
from mptok_harness.checks import warm_up
from mptok_harness.texts import stdlib_sources
from mptok.engines import choice
from scripts.report import script_command, write_report
from scripts.smoke import parse_args_with_smoke

REPO = Path(__file__).resolve().parent.parent

MiB = 1024 * 1024


@dataclass(frozen=True)
class Workload:
    """How much each in-process measurement does."""

    traced_conversations: int = 24  # measurement 1
    flood_conversations: int = 300  # measurement 2: two turns each
    one_key_prompts: int = 100  # measurement 2: unrelated prompts under one key
    longest_keys: int = 200  # measurement 2: conversations under the longest key allowed
    hit_tokens: tuple[int, ...] = (50_000, 200_000)  # measurement 4: prompt sizes


SMOKE = Workload(traced_conversations=2, flood_conversations=10, one_key_prompts=5, longest_keys=5, hit_tokens=(4_000,))


def traced() -> int:
    return tracemalloc.get_traced_memory()[0]


def with_utf8(text: str) -> str:
    """``text`` with the UTF-8 copy that CPython keeps beside a non-ASCII str
    once a tokenizer has read it, made now: it is part of the text's cost
    (``sys.getsizeof`` counts it), not of the cache's."""
    ctypes.pythonapi.PyUnicode_AsUTF8AndSize.restype = ctypes.c_void_p
    ctypes.pythonapi.PyUnicode_AsUTF8AndSize(ctypes.py_object(text), None)
    return text


def bytes_per_token(tokenizer, text: str, rng: random.Random, count: int) -> dict:
    """``count`` conversations of 40k-160k characters, two turns each; then each
    second turn again, its ids checked against full tokenization."""
    conversations = []
    for i in range(count):
        start = rng.randrange(0, len(text) - 200_000)
        length = rng.randrange(40_000, 160_000)
        first = text[start : start + length]
        second = first + text[start + length : start + length + 1_200]
        conversations.append((f"conversation-{i}", with_utf8(first), with_utf8(second)))
    cache = mptok.PrefixTokenCache(mptok.CacheConfig())
    gc.collect()
    tracemalloc.start()
    try:
        before = traced()
        for key, first, second in conversations:
            cache.encode(tokenizer, first, key)
            cache.encode(tokenizer, second, key)
        # A queued check holds a result's ids until the background thread gets
        # to it; what is measured is what the cache keeps, so let it finish.
        choice.VERIFIER.drain(timeout=600)
        gc.collect()
        held = traced() - before
    finally:
        tracemalloc.stop()
    stats = cache.stats()
    expected = [tokenizer(second, add_special_tokens=False)["input_ids"] for _, _, second in conversations]
    wrong = sum(cache.encode(tokenizer, second, key) != ids for (key, _, second), ids in zip(conversations, expected))
    text_bytes = sum(sys.getsizeof(second) for _, _, second in conversations)
    tokens = sum(len(ids) for ids in expected)
    return {
        "conversations": count,
        "wrong": wrong,
        "tokens": tokens,
        "text_mib": text_bytes / MiB,
        "traced_mib": held / MiB,
        "per_token": held / tokens,
        "counted_mib": (stats["cached_bytes"] - text_bytes) / MiB,
        "hits": stats["hits"],
    }


def flood(tokenizer, text: str, rng: random.Random, budget: int, workload: Workload) -> dict:
    """Traced memory of a cache under a flood, sampled after every request."""
    cache = mptok.PrefixTokenCache(mptok.CacheConfig(max_bytes=budget))
    refused = requests = 0
    peak = 0
    gc.collect()
    tracemalloc.start()

    def sample() -> None:
        nonlocal peak
        gc.collect()
        peak = max(peak, traced() - before)

    def piece(length: int) -> str:
        start = rng.randrange(0, len(text) - length)
        return text[start : start + length]

    try:
        before = traced()
        for i in range(workload.flood_conversations):  # two turns each
            first = piece(rng.randrange(5_000, 60_000))
            for prompt in (first, first + piece(1_000)):
                cache.encode(tokenizer, prompt, f"conversation-{i}")
                requests += 1
            sample()
        for _ in range(workload.one_key_prompts):
            cache.encode(tokenizer, piece(rng.randrange(5_000, 40_000)), "one-key")
            requests += 1
            sample()
        for i in range(workload.longest_keys):  # the longest ids allowed, and ids far over it
            key = f"{i:08d}".ljust(MAX_KEY_BYTES, "k")
            cache.encode(tokenizer, piece(2_000), key)
            try:
                cache.encode(tokenizer, piece(2_000), key * 256)
            except ValueError:
                refused += 1
            requests += 2
            sample()
        end = traced() - before
    finally:
        tracemalloc.stop()
    stats = cache.stats()
    return {
        "budget_mib": budget / MiB,
        "requests": requests,
        "refused": refused,
        "peak_mib": peak / MiB,
        "end_mib": end / MiB,
        "counted_mib": stats["cached_bytes"] / MiB,
        "entries": stats["entries"],
    }


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def serve_flood(text: str, rng: random.Random, budget: int, frontends: int, requests: int) -> dict:
    """RSS of each frontend of ``mptok serve --cache-bytes`` before and after an HTTP flood."""
    from mptok_harness.serve import Server, scrape, tokenize, total, wait_for_snapshots

    with tempfile.TemporaryDirectory() as tmp:
        with Server(Path(tmp) / "serve.log", "--frontends", str(frontends), "--cache-bytes", str(budget)) as server:
            pids = server.frontend_pids()
            before = {frontend: rss_kib(pid) for frontend, pid in pids.items()}
            prompts = []
            for i in range(requests // 2):
                start = rng.randrange(0, len(text) - 100_000)
                first = text[start : start + rng.randrange(5_000, 60_000)]
                prompts.append((f"flood-{i}", first, first + text[start + 60_000 : start + 61_000]))

            def conversation(item: tuple[str, str, str]) -> None:
                key, first, second = item
                for prompt in (first, second):
                    tokenize(server.port, {"prompt": prompt, "conversation_id": key, "add_special_tokens": False})

            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                list(pool.map(conversation, prompts))
            wait_for_snapshots()
            samples = scrape(server.port)
            after = {frontend: rss_kib(pid) for frontend, pid in pids.items()}
            rows = []
            for frontend in sorted(pids):
                label = str(frontend)
                rows.append({
                    "frontend": frontend,
                    "rss_before_mib": before[frontend] / 1024,
                    "rss_after_mib": after[frontend] / 1024,
                    "cache_mib": total(samples, "mptok_cache_bytes", frontend=label) / MiB,
                    "held_mib": total(samples, "mptok_held_fingerprint_bytes", frontend=label) / MiB,
                })
            return {"requests": 2 * len(prompts), "rows": rows}


# One worker measures hits in the checkout on its PYTHONPATH: it prints, per
# prompt size, the median CPU seconds of each way of getting a hit's ids. It
# reads the text from a file this process wrote, so that every checkout
# measures the same text whatever its own code.
HIT_WORKER = r"""
import gc, json, sys, time
import orjson
import mptok

sizes, reps = json.loads(sys.argv[1]), int(sys.argv[2])
tokenizer = mptok.load_tokenizer()
with open(sys.argv[3], encoding="utf-8") as f:
    text = f.read()
scratch = bytearray(64 << 20)
unrelated = text[len(text) // 2 : len(text) // 2 + 120_000]
out = {}
for tokens, chars in sizes:
    prompt = text[:chars]
    turn = text[chars : chars + 1_200]
    cache = mptok.PrefixTokenCache()
    cache.encode(tokenizer, prompt, "c")
    ways = {"list": lambda p: cache.encode(tokenizer, p, "c")}
    if hasattr(cache, "encode_array"):
        ways["array"] = lambda p: cache.encode_array(tokenizer, p, "c")
        ways["array+json"] = lambda p: orjson.dumps(cache.encode_array(tokenizer, p, "c"), option=orjson.OPT_SERIALIZE_NUMPY)
    ways["list+json"] = lambda p: orjson.dumps(cache.encode(tokenizer, p, "c"))
    times = {}
    for _ in range(reps):
        for name, way in ways.items():
            for label, p in (("same", prompt), ("turn", prompt + turn)):
                cache.encode(tokenizer, prompt, "c")  # the kept prompt is the first one again
                tokenizer(unrelated, add_special_tokens=False)
                scratch[:] = bytes(len(scratch))
                gc.collect()
                began = time.process_time()
                way(p)
                times.setdefault(f"{name} {label}", []).append(time.process_time() - began)
    out[str(tokens)] = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
print(mptok.__file__, file=sys.stderr)
print(json.dumps(out))
"""


def hit_workers(repo: Path, sizes: list[tuple[int, int]], reps: int, text_path: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(repo), TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(
        [sys.executable, "-c", HIT_WORKER, json.dumps(sizes), str(reps), str(text_path)],
        env=env, capture_output=True, text=True, timeout=900, check=True,
        cwd=repo,  # "-c" puts the working directory first on sys.path: the checkout measured
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def fastokens_cpu(text: str, sizes: list[tuple[int, int]], reps: int, tokenizer) -> dict:
    """Median CPU seconds of fastokens' full tokenization of each prompt, after other work."""
    import fastokens

    from mptok.cache.loading import _embedded_tokenizer_file

    fast = fastokens.Tokenizer.from_file(str(_embedded_tokenizer_file()))
    scratch = bytearray(64 << 20)
    unrelated = text[len(text) // 2 : len(text) // 2 + 120_000]
    out = {}
    for tokens, chars in sizes:
        prompt = text[:chars]
        assert fast.encode(prompt, add_special_tokens=False).ids == tokenizer(prompt, add_special_tokens=False)["input_ids"]
        times = []
        for _ in range(reps):
            tokenizer(unrelated, add_special_tokens=False)
            scratch[:] = bytes(len(scratch))
            began = time.process_time()
            fast.encode(prompt, add_special_tokens=False).ids
            times.append(time.process_time() - began)
        out[str(tokens)] = statistics.median(times)
    return out


def hit_cpu(tokenizer, text: str, hit_tokens: tuple[int, ...], reps: int, rounds: int, baseline: Path | None) -> dict:
    sample = text[:200_000]
    chars_per_token = len(sample) / len(tokenizer(sample, add_special_tokens=False)["input_ids"])
    sizes = [(tokens, int(tokens * chars_per_token)) for tokens in hit_tokens]
    runs: dict[str, list[dict]] = {"this checkout": [], "fastokens": []}
    if baseline is not None:
        runs["baseline"] = []
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        text_path = Path(tmp) / "text.txt"
        text_path.write_text(text, encoding="utf-8")
        for _ in range(rounds):  # interleaved: each round runs every side once
            runs["this checkout"].append(hit_workers(REPO, sizes, reps, text_path))
            if baseline is not None:
                runs["baseline"].append(hit_workers(baseline, sizes, reps, text_path))
            runs["fastokens"].append(fastokens_cpu(text, sizes, reps, tokenizer))
    merged: dict[str, dict] = {}
    for side, results in runs.items():
        for result in results:
            for tokens, value in result.items():
                for way, seconds in (value.items() if isinstance(value, dict) else (("full", value),)):
                    merged.setdefault(tokens, {}).setdefault(f"{side}: {way}", []).append(seconds)
    return {tokens: {k: statistics.median(v) for k, v in ways.items()} for tokens, ways in merged.items()}


def _shown_args(args: argparse.Namespace) -> list[str]:
    """The command line, with the baseline's path (this machine's) named by its commit."""
    shown = []
    for arg in sys.argv[1:]:
        if args.baseline_repo is not None and arg == str(args.baseline_repo):
            commit = subprocess.run(
                ["git", "-C", arg, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
            ).stdout.strip()
            arg = f"<a checkout of {commit or 'the baseline'}>"
        shown.append(arg)
    return shown


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", default="32M", help="byte budget of the flooded cache (default 32M)")
    parser.add_argument("--serve-budget", default="64M", help="--cache-bytes of the served frontends (default 64M)")
    parser.add_argument("--frontends", type=int, default=2)
    parser.add_argument("--requests", type=int, default=600, help="HTTP requests of the serve flood")
    parser.add_argument("--skip-serve", action="store_true")
    parser.add_argument("--skip-hits", action="store_true", help="skip measurement 4")
    parser.add_argument("--baseline-repo", type=Path, help="another checkout whose hits run interleaved with these")
    parser.add_argument("--hit-reps", type=int, default=7, help="hits timed per way, size and round (default 7)")
    parser.add_argument("--hit-rounds", type=int, default=3, help="interleaved rounds of measurement 4 (default 3)")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write docs/results/bench_memory.md")
    parser.set_defaults(workload=Workload())
    smoke = {"workload": SMOKE, "requests": 20, "hit_reps": 1, "hit_rounds": 1, "no_write": True}
    args = parse_args_with_smoke(parser, smoke)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tokenizer = mptok.load_tokenizer()
    warm_up(mptok.PrefixTokenCache(), tokenizer)
    text = stdlib_sources()
    rng = random.Random(0)
    failed = False
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line)
        lines.append(line)

    row = bytes_per_token(tokenizer, text, rng, args.workload.traced_conversations)
    say("## Bytes per cached token beyond the prompt text (tracemalloc)\n")
    say("| conversations | cached tokens | prompt text MiB | traced beyond text MiB | bytes per token | counted by the cache MiB |")
    say("|---:|---:|---:|---:|---:|---:|")
    say(
        f"| {row['conversations']} x 2 turns | {row['tokens']:,} | {row['text_mib']:.1f} | {row['traced_mib']:.1f} "
        f"| {row['per_token']:.2f} | {row['counted_mib']:.1f} |"
    )
    if row["wrong"]:
        say(f"\n**{row['wrong']} cached prompts tokenized wrong**")
    failed |= row["per_token"] > 9.3 or row["wrong"] > 0

    budget = parse_bytes(args.budget)
    row = flood(tokenizer, text, rng, budget, args.workload)
    say("\n## A flood against a small budget (tracemalloc, sampled after every request)\n")
    say("| budget MiB | requests | ids refused (too long) | peak traced MiB | traced at the end MiB | counted MiB | entries |")
    say("|---:|---:|---:|---:|---:|---:|---:|")
    say(
        f"| {row['budget_mib']:.0f} | {row['requests']:,} | {row['refused']} | {row['peak_mib']:.1f} "
        f"| {row['end_mib']:.1f} | {row['counted_mib']:.1f} | {row['entries']} |"
    )
    failed |= row["peak_mib"] > 1.2 * row["budget_mib"] + 4

    if not args.skip_serve:
        result = serve_flood(text, rng, parse_bytes(args.serve_budget), args.frontends, args.requests)
        say(f"\n## mptok serve --cache-bytes {args.serve_budget}: {result['requests']} HTTP requests\n")
        say("| frontend | RSS before MiB | RSS after MiB | cache bytes (metrics) MiB | held fingerprints (metrics) MiB |")
        say("|---:|---:|---:|---:|---:|")
        for r in result["rows"]:
            say(
                f"| {r['frontend']} | {r['rss_before_mib']:.0f} | {r['rss_after_mib']:.0f} "
                f"| {r['cache_mib']:.1f} | {r['held_mib']:.2f} |"
            )

    try:
        import fastokens  # noqa: F401  (the baseline of measurement 4: pip install -e '.[bench]')
    except ImportError:
        if not args.skip_hits:
            say("\n(measurement 4 skipped: fastokens is not installed; pip install -e '.[bench]')")
        args.skip_hits = True
    if not args.skip_hits:
        medians = hit_cpu(tokenizer, text, args.workload.hit_tokens, args.hit_reps, args.hit_rounds, args.baseline_repo)
        say("\n## CPU of a cache hit after other work, against fastokens' full tokenization (medians, ms)\n")
        say("`same`: the kept prompt again; `turn`: the kept prompt plus ~300 tokens (its tail tokenized by the")
        say("cache's backend, `tokenizers` here). `array`: `encode_array`; `+json`: and orjson writes the ids;")
        say("`list`: `encode`. Ratios are to fastokens' full tokenization of the same (`same`) prompt.\n")
        say("| tokens | way | CPU ms | / fastokens |")
        say("|---:|---|---:|---:|")
        for tokens, ways in medians.items():
            fast = ways["fastokens: full"]
            for way, seconds in sorted(ways.items()):
                say(f"| {int(tokens):,} | {way} | {seconds * 1e3:.3f} | {seconds / fast:.2f} |")

    if not args.no_write:
        command = script_command([sys.argv[0], *_shown_args(args)])
        write_report("bench_memory", "What the cache's memory costs, and a hit's ids", "\n".join(lines), command=command, packages=("mptok", "tokenizers", "transformers", "numpy", "fastokens"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

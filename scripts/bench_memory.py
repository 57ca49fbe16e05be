#!/usr/bin/env python3
"""Benchmark: what the cache's memory costs, and that its byte budget holds.

Three measurements, on the embedded tokenizer and real text (the Python
standard library's sources):

1. Bytes per cached token beyond the prompt text, traced with tracemalloc:
   24 conversations of 40k-160k characters, two turns each.
2. A flood against a small budget (``--budget``): hundreds of conversations,
   unrelated prompts under one key, conversations with the longest allowed
   ids, and ids over the limit (refused); the traced memory the cache holds,
   sampled after every request, against the budget.
3. The resident memory (RSS) of each frontend of ``mptok serve
   --cache-bytes`` before and after a flood over HTTP, with the bytes each
   reports on /metrics (cache and held replies).

    python scripts/bench_memory.py                # ~2 min
    python scripts/bench_memory.py --skip-serve   # 1 and 2 only
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import gc
import os
import random
import sys
import tempfile
import tracemalloc
from pathlib import Path

from bench_cache import corpus

import mptok
from mptok.cache.config import MAX_KEY_BYTES, parse_bytes
from mptok.core.ids import intern_ids

MiB = 1024 * 1024


def traced() -> int:
    return tracemalloc.get_traced_memory()[0]


def with_utf8(text: str) -> str:
    """``text`` with the UTF-8 copy that CPython keeps beside a non-ASCII str
    once a tokenizer has read it, made now: it is part of the text's cost
    (``sys.getsizeof`` counts it), not of the cache's."""
    ctypes.pythonapi.PyUnicode_AsUTF8AndSize.restype = ctypes.c_void_p
    ctypes.pythonapi.PyUnicode_AsUTF8AndSize(ctypes.py_object(text), None)
    return text


def bytes_per_token(tokenizer, text: str, rng: random.Random) -> dict:
    """24 conversations of 40k-160k characters, two turns each."""
    conversations = []
    for i in range(24):
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
        gc.collect()
        held = traced() - before
    finally:
        tracemalloc.stop()
    stats = cache.stats()
    tokens = sum(len(tokenizer(second, add_special_tokens=False)["input_ids"]) for _, _, second in conversations)
    text_bytes = sum(sys.getsizeof(second) for _, _, second in conversations)
    return {
        "tokens": tokens,
        "text_mib": text_bytes / MiB,
        "traced_mib": held / MiB,
        "per_token": held / tokens,
        "counted_mib": (stats["cached_bytes"] - text_bytes) / MiB,
        "hits": stats["hits"],
    }


def flood(tokenizer, text: str, rng: random.Random, budget: int) -> dict:
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
        for i in range(300):  # conversations, two turns each
            first = piece(rng.randrange(5_000, 60_000))
            for prompt in (first, first + piece(1_000)):
                cache.encode(tokenizer, prompt, f"conversation-{i}")
                requests += 1
            sample()
        for _ in range(100):  # unrelated prompts under one key
            cache.encode(tokenizer, piece(rng.randrange(5_000, 40_000)), "one-key")
            requests += 1
            sample()
        for i in range(200):  # the longest ids allowed, and ids far over it
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
                    "held_mib": total(samples, "mptok_held_reply_bytes", frontend=label) / MiB,
                })
            return {"requests": 2 * len(prompts), "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", default="32M", help="byte budget of the flooded cache (default 32M)")
    parser.add_argument("--serve-budget", default="64M", help="--cache-bytes of the served frontends (default 64M)")
    parser.add_argument("--frontends", type=int, default=2)
    parser.add_argument("--requests", type=int, default=600, help="HTTP requests of the serve flood")
    parser.add_argument("--skip-serve", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tokenizer = mptok.load_tokenizer()
    mptok.PrefixTokenCache().encode(tokenizer, "warm up")
    # The shared int objects are a fixed cost per process, made up front so
    # that they are not read as a cost per cached token.
    intern_ids(list(range(len(tokenizer) + 1)))
    text = corpus()
    rng = random.Random(0)
    failed = False

    row = bytes_per_token(tokenizer, text, rng)
    print("## Bytes per cached token beyond the prompt text (tracemalloc)\n")
    print("| conversations | cached tokens | prompt text MiB | traced beyond text MiB | bytes per token | counted by the cache MiB |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(
        f"| 24 x 2 turns | {row['tokens']:,} | {row['text_mib']:.1f} | {row['traced_mib']:.1f} "
        f"| {row['per_token']:.2f} | {row['counted_mib']:.1f} |"
    )
    failed |= row["per_token"] > 10

    budget = parse_bytes(args.budget)
    row = flood(tokenizer, text, rng, budget)
    print("\n## A flood against a small budget (tracemalloc, sampled after every request)\n")
    print("| budget MiB | requests | ids refused (too long) | peak traced MiB | traced at the end MiB | counted MiB | entries |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {row['budget_mib']:.0f} | {row['requests']:,} | {row['refused']} | {row['peak_mib']:.1f} "
        f"| {row['end_mib']:.1f} | {row['counted_mib']:.1f} | {row['entries']} |"
    )
    failed |= row["peak_mib"] > 1.2 * row["budget_mib"] + 4

    if not args.skip_serve:
        result = serve_flood(text, rng, parse_bytes(args.serve_budget), args.frontends, args.requests)
        print(f"\n## mptok serve --cache-bytes {args.serve_budget}: {result['requests']} HTTP requests\n")
        print("| frontend | RSS before MiB | RSS after MiB | cache bytes (metrics) MiB | held replies (metrics) MiB |")
        print("|---:|---:|---:|---:|---:|")
        for r in result["rows"]:
            print(
                f"| {r['frontend']} | {r['rss_before_mib']:.0f} | {r['rss_after_mib']:.0f} "
                f"| {r['cache_mib']:.1f} | {r['held_mib']:.1f} |"
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Benchmark: a cache hit against full tokenization, measured in the same run.

Conversations built from real text on this machine (the Python standard
library's sources) grow by about 300 tokens a turn up to about 4k, 38k and
200k tokens. Every turn is tokenized through the cache (as a frontend would,
one turn after another) and then in full with the caller's tokenizer; the
table gives the medians, their ratio and the hit rate, and every cached
result is checked against the full tokenization.

    python scripts/bench_cache.py                 # default tokenizer, ~1 min
    python scripts/bench_cache.py --families      # also hit rates per family
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import mptok

TOKENS_PER_TURN = 300


def corpus() -> str:
    """Real text: the standard library's sources, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py"))
    return "".join(path.read_text(encoding="utf-8", errors="replace") for path in files)


def conversation(text: str, tokenizer, target_tokens: int, turns: int) -> list[str]:
    """Prompts growing by about TOKENS_PER_TURN tokens a turn up to target_tokens
    (fewer turns where the target is small)."""
    sample = text[:200_000]
    chars_per_token = len(sample) / len(tokenizer(sample, add_special_tokens=False)["input_ids"])
    end = int(target_tokens * chars_per_token)
    step = int(TOKENS_PER_TURN * chars_per_token)
    turns = min(turns, end // step)
    start = end - step * (turns - 1)
    return [text[: start + i * step] for i in range(turns)]


def timed(function, *args) -> tuple[float, object]:
    began = time.perf_counter()
    result = function(*args)
    return time.perf_counter() - began, result


def bench_size(tokenizer, text: str, target: int, turns: int) -> dict:
    prompts = conversation(text, tokenizer, target, turns)
    turns = len(prompts)
    cache = mptok.PrefixTokenCache(mptok.CacheConfig())
    cached_times, cached_ids = [], []
    for prompt in prompts:
        seconds, ids = timed(cache.encode, tokenizer, prompt, f"conversation-{target}")
        cached_times.append(seconds)
        cached_ids.append(ids)
    full_times, wrong = [], 0
    for prompt, ids in zip(prompts, cached_ids):
        seconds, expected = timed(lambda p: tokenizer(p, add_special_tokens=False)["input_ids"], prompt)
        full_times.append(seconds)
        wrong += ids != expected
    stats = cache.stats()
    hit_times = cached_times[1:]  # the first turn is a miss by construction
    return {
        "tokens": len(cached_ids[-1]),
        "turns": turns,
        "full_ms": statistics.median(full_times) * 1e3,
        "hit_ms": statistics.median(hit_times) * 1e3,
        "hit_p99_ms": max(hit_times) * 1e3,
        "hit_rate": stats["hits"] / (turns - 1),
        "wrong": wrong,
    }


def family_hit_rates(turns: int) -> list[tuple[str, float, float, float, int]]:
    """Hit rates per tokenizer family on adversarial, chat and plain turns."""
    from mptok_harness.conversations import adversarial_delta, chat_turns, plain_delta
    from mptok_harness.families import CHAT_MARKERS, FAMILIES, load_family

    rows = []
    for family in FAMILIES:
        tokenizer = load_family(family)
        start, end = CHAT_MARKERS[family]
        rng = random.Random(0)
        kinds = {
            "adversarial": [],
            "chat": chat_turns(rng, start, end, turns),
            "plain": [],
        }
        text = plain_delta(rng, 400)
        plain = plain_delta(rng, 400)
        for _ in range(turns):
            text += f"{start}user\n" + adversarial_delta(rng, (start, end), pieces=60) + end
            kinds["adversarial"].append(text)
            plain += plain_delta(rng, 60)
            kinds["plain"].append(plain)
        rates, wrong = [], 0
        for name, prompts in kinds.items():
            cache = mptok.PrefixTokenCache(mptok.CacheConfig())
            for prompt in prompts:
                ids = cache.encode(tokenizer, prompt, name)
                wrong += ids != tokenizer.encode(prompt, add_special_tokens=False).ids
            rates.append(cache.stats()["hits"] / (len(prompts) - 1))
        rows.append((family, *rates, wrong))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4000,38000,200000", help="target prompt sizes in tokens")
    parser.add_argument("--turns", type=int, default=20, help="turns per conversation")
    parser.add_argument("--families", action="store_true", help="also hit rates per family")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    tokenizer = mptok.load_tokenizer()
    text = corpus()
    print(f"mptok cache benchmark: default tokenizer, {args.turns} turns of ~{TOKENS_PER_TURN} tokens\n")
    print("| prompt tokens | full tokenization ms (median) | cache hit ms (median) | hit max ms | speed-up | hit rate | wrong ids |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    failed = False
    for target in (int(size) for size in args.sizes.split(",")):
        row = bench_size(tokenizer, text, target, args.turns)
        print(
            f"| {row['tokens']:,} | {row['full_ms']:.1f} | {row['hit_ms']:.2f} | {row['hit_p99_ms']:.2f} "
            f"| {row['full_ms'] / row['hit_ms']:.0f}x | {row['hit_rate']:.0%} | {row['wrong']} |"
        )
        failed |= row["wrong"] > 0
    if args.families:
        print("\n| family | adversarial seams | chat-template rewrites | plain growth | wrong ids |")
        print("|---|---:|---:|---:|---:|")
        for family, adversarial, chat, plain, wrong in family_hit_rates(40):
            print(f"| {family} | {adversarial:.0%} | {chat:.0%} | {plain:.0%} | {wrong} |")
            failed |= wrong > 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

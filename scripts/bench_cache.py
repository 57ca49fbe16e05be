#!/usr/bin/env python3
"""Benchmark: a cache hit against full tokenization, measured in the same run.

Conversations built from real text on this machine (the Python standard
library's sources) grow by about 300 tokens a turn up to about 4k, 38k and
200k tokens. Every turn is tokenized through the cache twice: back to back
(one turn after another, nothing in between) and, in a second cache, with
each turn preceded by unrelated work (a full tokenization of other text of
the same size, as a serving process does between two turns of one
conversation), which leaves the CPU's caches and the allocator cold; then in
full with the caller's tokenizer. The table gives the medians, their ratios
and the hit rate, and every cached result is checked against the full
tokenization.

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


def full_tokenization(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def through_cache(tokenizer, prompts: list[str], key: str, unrelated: str | None) -> tuple[list[float], list, dict]:
    """Each prompt through a new cache, timed; before each, if ``unrelated``
    is given, that text is tokenized in full (untimed)."""
    cache = mptok.PrefixTokenCache(mptok.CacheConfig())
    times, results = [], []
    for prompt in prompts:
        if unrelated is not None:
            full_tokenization(tokenizer, unrelated)
        seconds, ids = timed(cache.encode, tokenizer, prompt, key)
        times.append(seconds)
        results.append(ids)
    return times[1:], results, cache.stats()  # the first turn is a miss by construction


def bench_size(tokenizer, text: str, target: int, turns: int) -> dict:
    prompts = conversation(text, tokenizer, target, turns)
    turns = len(prompts)
    middle = len(text) // 2
    unrelated = text[middle : middle + len(prompts[-1])]
    hit_times, cached_ids, stats = through_cache(tokenizer, prompts, f"conversation-{target}", None)
    cold_times, cold_ids, cold_stats = through_cache(tokenizer, prompts, f"conversation-{target}", unrelated)
    full_times, wrong = [], 0
    for prompt, ids, cold in zip(prompts, cached_ids, cold_ids):
        seconds, expected = timed(full_tokenization, tokenizer, prompt)
        full_times.append(seconds)
        wrong += (ids != expected) + (cold != expected)
    return {
        "tokens": len(cached_ids[-1]),
        "turns": turns,
        "full_ms": statistics.median(full_times) * 1e3,
        "hit_ms": statistics.median(hit_times) * 1e3,
        "hit_p99_ms": max(hit_times) * 1e3,
        "cold_ms": statistics.median(cold_times) * 1e3,
        "cold_max_ms": max(cold_times) * 1e3,
        "hit_rate": min(stats["hits"], cold_stats["hits"]) / (turns - 1),
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
    print(
        "| prompt tokens | full tokenization ms (median) | hit ms, back to back (median) | speed-up "
        "| hit ms, after other work (median) | speed-up | hit max ms (back to back / after other work) "
        "| hit rate | wrong ids |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    failed = False
    for target in (int(size) for size in args.sizes.split(",")):
        row = bench_size(tokenizer, text, target, args.turns)
        print(
            f"| {row['tokens']:,} | {row['full_ms']:.1f} | {row['hit_ms']:.2f} | {row['full_ms'] / row['hit_ms']:.0f}x "
            f"| {row['cold_ms']:.2f} | {row['full_ms'] / row['cold_ms']:.0f}x "
            f"| {row['hit_p99_ms']:.2f} / {row['cold_max_ms']:.2f} | {row['hit_rate']:.0%} | {row['wrong']} |"
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

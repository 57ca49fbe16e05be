#!/usr/bin/env python3
"""Benchmark: the cache's misses and hits against full tokenization by each backend, in one run.

For the embedded tokenizer and (``--families``) every test family, chat
conversations built from real text on this machine (the Python standard
library's sources, cut into messages between the family's chat markers)
grow by about 300 tokens a turn up to about 50k and 200k tokens; each prompt
ends with a generation prompt that the next turn replaces. Beside them,
plain text growing by as much (no added token). For the last turns of each
conversation, interleaved turn by turn:

- full tokenization of the prompt by `tokenizers`, fastokens and gigatoken
  (each engine loaded from the same tokenizer.json, where it loads and gives
  the same ids), CPU (``time.process_time``: every thread of the process) and
  wall time;
- through mptok with the automatic backend choice and with `tokenizers`
  forced: a miss (a conversation key the cache has never seen) and a hit
  (the conversation's next turn).

Every timed call is preceded by unrelated work, a full tokenization of other
text of the same size by the same engine, as a serving process does between
two turns of one conversation (it leaves the CPU's caches and the allocator
cold), and waits for the background checks of earlier results. The first
results of a fast engine, which are all re-checked in the background, are
spent before the measured turns; afterwards the checks cost at most
``mptok.engines.choice.DEFAULT_CHECK_SHARE`` of the engine's CPU, and the
report gives what that adds per request.

Every id list is compared with `tokenizers`' full tokenization. The report
gives medians and the ratios the cache is judged by: a miss against the
fastest exact full tokenization (wall), a hit against its CPU time. It is
written to docs/results/bench_cache.md (``scripts.report``).

    .venv/bin/python -m scripts.bench_cache              # embedded tokenizer, a few minutes
    .venv/bin/python -m scripts.bench_cache --families   # also every test family
    .venv/bin/python -m scripts.bench_cache --hit-rates  # also hit rates per family and backend
    .venv/bin/python -m scripts.bench_cache --families --smoke  # 4k tokens, 2 turns, no report

Hit rates (``--hit-rates``): 40-turn conversations per family and backend,
of three kinds: adversarial seams (each turn appends 60 hard pieces:
combining-mark runs, emoji ZWJ sequences, CJK, CRLF, digit and whitespace
runs, special tokens), chat-template transitions (the next turn replaces
``<think>\n``), plain growth (no added tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import mptok
from mptok.cache.backend import backend_for, rust_tokenizer_of
from mptok.core.settings import ENGINES
from mptok.engines import tripwire
from mptok.engines.choice import DEFAULT_CHECK_SHARE
from mptok.engines.fast import EngineUnavailable, load_engine
from mptok_harness.growing_chats import TOKENS_PER_TURN, growing_chat, growing_plain
from mptok_harness.texts import stdlib_sources
from scripts.report import write_report
from scripts.smoke import parse_args_with_smoke

EMBEDDED = "embedded (deepseek)"


def timed(function, *args) -> tuple[float, float, object]:
    """(CPU seconds of the whole process, wall seconds, result), once the
    background checks of earlier fast results are done (their cost is the
    sampling rate's, reported apart)."""
    tripwire.VERIFIER.drain(timeout=60)
    wall, cpu = time.perf_counter(), time.process_time()
    result = function(*args)
    return time.process_time() - cpu, time.perf_counter() - wall, result


@dataclass
class Samples:
    cpu: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)

    def add(self, cpu: float, wall: float) -> None:
        self.cpu.append(cpu)
        self.wall.append(wall)

    def cpu_ms(self) -> float:
        return statistics.median(self.cpu) * 1e3 if self.cpu else float("nan")

    def wall_ms(self) -> float:
        return statistics.median(self.wall) * 1e3 if self.wall else float("nan")


def engines_for(rust) -> tuple[dict[str, object], dict[str, str]]:
    """The fast engines that load this tokenizer, and why the others do not."""
    spec = json.loads(rust.to_str())
    spec["truncation"] = spec["padding"] = spec["post_processor"] = None
    loaded, refused = {}, {}
    for name in ENGINES:
        try:
            loaded[name] = load_engine(name, json.dumps(spec), split_special=False)
        except EngineUnavailable as e:
            refused[name] = str(e).splitlines()[0][:80]
    return loaded, refused


def bench(tokenizer, label: str, markers: tuple[str, str], text: str, target: int, turns: int, kind: str) -> dict:
    rust = rust_tokenizer_of(tokenizer)
    # One turn more than measured: a conversation's second turn is where a
    # fast engine's prompt gets its offsets (docs/CACHE.md), not a steady state.
    count_tokens = lambda t: len(rust.encode(t, add_special_tokens=False).ids)  # noqa: E731
    if kind == "chat":
        grown = growing_chat(text, count_tokens, markers, target, turns + 2)
    else:
        grown = growing_plain(text, count_tokens, target, turns + 2)
    prompts, unrelated = grown.prompts, grown.unrelated
    engines, refused = engines_for(rust)
    full = {"tokenizers": Samples(), **{name: Samples() for name in engines}}
    differs: set[str] = set()
    modes = {choice: mptok.PrefixTokenCache(mptok.CacheConfig(tokenizer_backend=choice)) for choice in ("auto", "tokenizers")}
    backends = {choice: backend_for(tokenizer, choice) for choice in modes}
    hits = {choice: Samples() for choice in modes}
    misses = {choice: Samples() for choice in modes}
    # The compact form a frontend serializes, from a cache of its own, and
    # what making a list of those ids costs by itself (the floor of a hit
    # through encode()).
    compact_cache = mptok.PrefixTokenCache(mptok.CacheConfig(tokenizer_backend="auto"))
    compact, listing = Samples(), Samples()
    wrong = 0
    for warm_up in prompts[:2]:
        compact_cache.encode(tokenizer, warm_up, "conversation")
        for choice, cache in modes.items():
            cache.encode(tokenizer, warm_up, "conversation")
        tripwire.VERIFIER.drain(timeout=600)
    for choice in modes:
        # Past the first results a fast engine has re-checked in the
        # background: from here on the checks cost DEFAULT_CHECK_SHARE of
        # its CPU (reported apart), as in a server that has been up a while.
        for _ in range(tripwire.FIRST_CHECKS):
            backends[choice].encode_ids(prompts[0])
    tripwire.VERIFIER.drain(timeout=600)
    prompts = prompts[1:]
    def by_tokenizers(text: str) -> list[int]:
        return rust.encode_batch([text], add_special_tokens=False)[0].ids

    for turn, prompt in enumerate(prompts[1:]):
        by_tokenizers(unrelated)
        cpu, wall, expected = timed(by_tokenizers, prompt)
        full["tokenizers"].add(cpu, wall)
        for name, engine in engines.items():
            engine.encode_ids(unrelated)
            cpu, wall, ids = timed(engine.encode_ids, prompt)
            full[name].add(cpu, wall)
            if ids != expected:
                differs.add(name)
        for choice, cache in modes.items():
            backends[choice].encode_ids(unrelated)
            cpu, wall, ids = timed(cache.encode, tokenizer, prompt, "conversation")
            hits[choice].add(cpu, wall)
            wrong += ids != expected
            backends[choice].encode_ids(unrelated)
            cpu, wall, ids = timed(cache.encode, tokenizer, prompt, f"new-{turn}")
            misses[choice].add(cpu, wall)
            wrong += ids != expected
        backends["auto"].encode_ids(unrelated)
        cpu, wall, array = timed(compact_cache.encode_array, tokenizer, prompt, "conversation")
        compact.add(cpu, wall)
        backends["auto"].encode_ids(unrelated)
        cpu, wall, ids = timed(array.tolist)
        listing.add(cpu, wall)
        wrong += ids != expected
    exact = {name: samples for name, samples in full.items() if name not in differs}
    fastest = min(exact, key=lambda name: exact[name].cpu_ms())
    stats = modes["auto"].stats()
    return {
        "label": f"{label}, {kind}",
        "tokens": len(expected),
        "turns": len(prompts) - 1,
        "full": full,
        "refused": refused,
        "differs": differs,
        "fastest": fastest,
        "chosen": backends["auto"].engines.name,
        "hits": hits,
        "misses": misses,
        "compact": compact,
        "listing": listing,
        # Of the conversation's turns (the new keys are misses by design).
        "hit_rate": stats["hits"] / len(prompts),
        "wrong": wrong,
    }


def family_hit_rates(turns: int, choice: str) -> list[tuple[str, str, float, float, float, int]]:
    """Hit rates per tokenizer family on adversarial, chat and plain turns."""
    import random

    from mptok_harness.conversations import adversarial_delta, chat_turns, plain_delta
    from mptok_harness.families import CHAT_MARKERS, FAMILIES, load_family

    rows = []
    for family in FAMILIES:
        tokenizer = load_family(family)
        start, end = CHAT_MARKERS[family]
        rng = random.Random(0)
        kinds = {"adversarial": [], "chat": chat_turns(rng, start, end, turns), "plain": []}
        text = plain_delta(rng, 400)
        plain = plain_delta(rng, 400)
        for _ in range(turns):
            text += f"{start}user\n" + adversarial_delta(rng, (start, end), pieces=60) + end
            kinds["adversarial"].append(text)
            plain += plain_delta(rng, 60)
            kinds["plain"].append(plain)
        rates, wrong = [], 0
        for name, prompts in kinds.items():
            cache = mptok.PrefixTokenCache(mptok.CacheConfig(tokenizer_backend=choice))
            for prompt in prompts:
                ids = cache.encode(tokenizer, prompt, name)
                wrong += ids != tokenizer.encode(prompt, add_special_tokens=False).ids
            rates.append(cache.stats()["hits"] / (len(prompts) - 1))
        rows.append((family, backend_for(tokenizer, choice).engines.name, *rates, wrong))
    return rows


def row_text(row: dict) -> str:
    full, fastest = row["full"], row["fastest"]
    best_cpu, best_wall = full[fastest].cpu_ms(), full[fastest].wall_ms()

    def engine_cell(name: str) -> str:
        if name in row["refused"]:
            return "refused"
        if name in row["differs"]:
            return "differs"
        return f"{full[name].cpu_ms():.2f} / {full[name].wall_ms():.2f}"

    auto_hit, auto_miss = row["hits"]["auto"], row["misses"]["auto"]
    check_ms = DEFAULT_CHECK_SHARE * full[row["chosen"]].cpu_ms() if row["chosen"] in full and row["chosen"] != "tokenizers" else 0.0
    forced_hit, forced_miss = row["hits"]["tokenizers"], row["misses"]["tokenizers"]
    return (
        f"| {row['label']} | {row['tokens']:,} | {engine_cell('tokenizers')} | {engine_cell('fastokens')} "
        f"| {engine_cell('gigatoken')} | {row['chosen']} "
        f"| {auto_miss.cpu_ms():.2f} / {auto_miss.wall_ms():.2f} | {auto_miss.wall_ms() / best_wall:.2f}x "
        f"| {row['compact'].cpu_ms():.2f} | {row['compact'].cpu_ms() / best_cpu:.2f}x "
        f"| {auto_hit.cpu_ms():.2f} | {auto_hit.cpu_ms() / best_cpu:.2f}x | {row['listing'].cpu_ms():.2f} "
        f"| {check_ms:.2f} | {forced_miss.cpu_ms():.1f} / {forced_hit.cpu_ms():.2f} | {row['hit_rate']:.0%} | {row['wrong']} |"
    )


HEADER = (
    "| tokenizer | prompt tokens | full: tokenizers ms CPU / wall | fastokens | gigatoken | auto picks "
    "| mptok miss ms CPU / wall | miss / fastest full (wall) | hit, compact form: ms CPU | / fastest full (CPU) "
    "| hit through encode(), a list: ms CPU | / fastest full (CPU) | a list of the ids alone: ms CPU "
    "| background checks ms CPU per request | tokenizers forced: miss / hit ms CPU "
    "| hit rate | wrong ids |\n"
    "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="50000,200000", help="target prompt sizes in tokens")
    parser.add_argument("--turns", type=int, default=6, help="measured turns per conversation")
    parser.add_argument("--families", action="store_true", help="also every test family")
    parser.add_argument("--hit-rates", action="store_true", help="also hit rates per family and backend (40-turn conversations)")
    parser.add_argument("--no-report", action="store_true", help="print only; do not write docs/results/bench_cache.md")
    args = parse_args_with_smoke(parser, {"sizes": "4000", "turns": 2, "no_report": True})
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    text = stdlib_sources()
    tokenizers = [(EMBEDDED, mptok.load_tokenizer(), ("<｜User｜>", "<｜end▁of▁sentence｜>"))]
    if args.families:
        from mptok_harness.families import CHAT_MARKERS, FAMILIES, load_family

        tokenizers += [(family, load_family(family), CHAT_MARKERS[family]) for family in FAMILIES if family != "deepseek"]
    lines, failed = [HEADER], False
    print(HEADER, flush=True)
    for label, tokenizer, markers in tokenizers:
        for target in (int(size) for size in args.sizes.split(",")):
            for kind in ("chat", "plain"):
                row = bench(tokenizer, label, markers, text, target, args.turns, kind)
                lines.append(row_text(row))
                print(lines[-1], flush=True)
                failed |= row["wrong"] > 0
    if args.hit_rates:
        lines += ["", "| family | backend | adversarial seams | chat-template rewrites | plain growth | wrong ids |", "|---|---|---:|---:|---:|---:|"]
        print("\n".join(lines[-3:]), flush=True)
        for choice in ("auto", "tokenizers"):
            for family, engine, adversarial, chat, plain, wrong in family_hit_rates(40, choice):
                lines.append(f"| {family} | {engine} | {adversarial:.0%} | {chat:.0%} | {plain:.0%} | {wrong} |")
                print(lines[-1], flush=True)
                failed |= wrong > 0
    preamble = "\n".join(
        [
            f"Chat conversations and plain text growing by ~{TOKENS_PER_TURN} tokens a turn; medians of {args.turns} turns, every",
            "timed call after unrelated work (the script's docstring says what it measures). Full",
            "tokenization cells: CPU / wall ms, \"refused\" where the engine does not load the layout,",
            "\"differs\" where its ids differ from `tokenizers`' on these prompts. \"auto picks\": the engine the",
            "cache's start-up check and timing chose. Ratios are against the fastest exact full tokenization",
            "of the same prompt: a miss in wall time, a hit in CPU time. A hit is measured in the compact form",
            "(`encode_array`: the int32 array a frontend writes to JSON) and through `encode()` (a `list[int]`);",
            "\"a list of the ids alone\" is `tolist()` of the same array after the same unrelated work, what",
            "any list of these ids costs to build. \"background checks\": the most the re-checks add to a",
            "result of the fast engine, on average (`mptok.engines.choice.DEFAULT_CHECK_SHARE` of the engine's",
            "CPU); a hit whose tail `tokenizers` tokenized adds none. \"chat\": each turn ends with a",
            "generation prompt the next one replaces, and a fast engine splices at the added token that opens",
            "the last turn; \"plain\": text that grows with no added token, spliced anywhere, its tail",
            "tokenized by `tokenizers` (docs/CACHE.md, \"Fast engines\"). The first two turns of each",
            "conversation are not measured (where its offsets are made). The machine is shared: read the",
            "ratios, not the milliseconds.",
        ]
    )
    if not args.no_report:
        path = write_report(
            "bench_cache",
            "Cache benchmark: misses and hits against each backend's full tokenization",
            "\n".join(lines),
            preamble=preamble,
            packages=("mptok", "tokenizers", "transformers", "fastokens", "gigatoken"),
        )
        print(f"\nwritten to {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

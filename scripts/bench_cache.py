#!/usr/bin/env python3
"""Benchmark: mptok's cache against what the field ships, on the turns a server sees.

What a conversation's next turn costs through ``mptok.PrefixTokenCache``,
against the full tokenization that servers run instead: fastokens (vLLM's
fast backend), fastokens with its segment cache on (the ids of the text
between added tokens, content-addressed), gigatoken (SGLang's fast backend)
and `tokenizers`. The script uses only the cache's public API
(``mptok.load_tokenizer``, ``PrefixTokenCache.encode`` and
``encode_array``, ``stats``), so it measures the cache as it is when run.

Tokenizers: the embedded default (DeepSeek V3) and Qwen 3.5
(``mptok_harness.families``), timed; the hit rates also on every other
family (through the engine that loads it, or `tokenizers`).

Workloads, cut from the Python standard library's sources:

- chat: a chat template's output (DeepSeek R1's format on DeepSeek, ChatML
  with Qwen 3's generation prompt elsewhere). Each turn is the previous
  conversation plus the assistant's answer and a user message (together
  1,100-1,300 characters), and the answer replaces the generation prompt
  that the previous turn ended with;
- plain: text growing by 1,100-1,300 characters a turn, cut at random
  character positions (inside words and lines), as a completions client or
  a streaming agent sends it;

each at about 50k and 200k tokens. Between each two turns, the prompt of
another long conversation of the same kind (two of them, alternating, each
starting at 180k characters and growing as this one does) is tokenized by
the same system. Turns come back to back, and, for the cache, again with a
pause (0.5 s) before each. Each system runs the whole sequence in a phase of
its own (its caches and threads see only its own work): warm-up turns, then
the measured ones, in the steady state.

Per turn: the CPU time of the whole process around the call
(``time.process_time``, fastokens' threads and the cache's included) and the
wall time; the tables give medians. The cache also re-checks results on a
background thread, so each phase also gives "whole run": the process's CPU
from its first measured turn until the process is idle after its last,
divided by the measured turns (the turn, the other conversation's prompt and
the background work they caused), and the share of the cache's CPU that its
background checks took (the checking thread's CPU, ``stats()``'
``backend_check_cpu_seconds``), after the first checks of a new tokenizer's
results, which are reported apart. Every id list, the other conversations'
included, is compared with `tokenizers`' full tokenization; one wrong id
fails the run (exit status 1). A hit is a turn the cache's ``hits`` counter
counted; every turn after a conversation's first could hit. The report
holds the cache to its targets: a hit in the compact form at most 1/10 of
the fastest engine's full tokenization (CPU) and 1/4 of fastokens with its
segment cache, through ``encode()`` at most 1/2 (~50k tokens) and 1/3
(~200k), at least 100x / 200x cheaper than `tokenizers`, a miss at most
1.1x the fastest engine (wall), and at least 99% of the turns that could
hit hit.

Writes docs/results/bench_cache.md (``scripts.report``).

    .venv/bin/python -m scripts.bench_cache          # `make bench`: about 6 minutes on 2 cores
    .venv/bin/python -m scripts.bench_cache --smoke  # a small workload, no report
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import tokenizers

import mptok
from mptok_harness.families import CHAT_MARKERS, FAMILIES, _tokenizer_file
from mptok_harness.texts import stdlib_sources
from scripts.report import write_report
from scripts.smoke import parse_args_with_smoke

EMBEDDED = "deepseek"  # the family of mptok's embedded default tokenizer
TIMED = (EMBEDDED, "qwen")
LABELS = {EMBEDDED: "DeepSeek V3 (embedded)", "qwen": "Qwen 3.5"}
TURN_CHARS = (1_100, 1_300)  # what a turn adds
SEGMENT_CACHE_BYTES = 512 << 20  # fastokens' segment cache: the budget mptok's cache has by default
IDLE_CPU_S = 0.002  # a process that spent less CPU in 0.1 s has finished its background work
FASTOKENS, SEGMENTED, GIGATOKEN = "fastokens", "fastokens, segment cache", "gigatoken"
ENGINES = (FASTOKENS, GIGATOKEN)  # the engines whose full tokenization is "the fastest"
CHECK_SHARE_TARGET = 0.05  # the background checks' share of the cache's CPU, once past the first checks


@dataclass(frozen=True)
class Plan:
    """How much the run does."""

    sizes: tuple[int, ...] = (50_000, 200_000)  # tokens of the timed conversations
    warm_up: int = 3  # turns before the measured ones (the first is a miss)
    turns: int = 8  # measured turns
    other_chars: int = 180_000  # the other conversations' first prompts
    pause_s: float = 0.5
    family_tokens: int = 50_000  # the other families' conversations (hit rates only)
    family_turns: int = 16


SMOKE = Plan(sizes=(4_000,), warm_up=2, turns=2, other_chars=8_000, pause_s=0.05, family_tokens=4_000, family_turns=3)


# -- the tokenizers -------------------------------------------------------------


@dataclass
class Subject:
    """One tokenizer: as the cache loads it, as `tokenizers` runs it, and as each engine that loads it does."""

    family: str
    tokenizer: Any  # mptok.load_tokenizer's
    reference: tokenizers.Tokenizer
    engines: dict[str, Callable[[str], Any]]  # full tokenization, without special tokens
    first_checks: Share | None = None  # the first results' checks, at start (settle_first_results)

    @property
    def label(self) -> str:
        return LABELS.get(self.family, self.family)

    def expected(self, text: str) -> list[int]:
        return self.reference.encode(text, add_special_tokens=False).ids

    def engine_names(self) -> str:
        return ", ".join(name for name in ENGINES if name in self.engines) or "none (`tokenizers`)"


def engine_specification(tokenizer_json: str) -> str:
    """The specification as a server loads it into an engine: truncation,
    padding and post-processor off."""
    spec = json.loads(tokenizer_json)
    spec["truncation"] = spec["padding"] = spec["post_processor"] = None
    return json.dumps(spec)


def load_engines(spec_json: str) -> dict[str, Callable[[str], Any]]:
    """Full tokenization by each engine that loads ``spec_json``."""
    engines: dict[str, Callable[[str], Any]] = {}
    try:
        import fastokens

        plain = fastokens.Tokenizer.from_json_str(spec_json)
        segmented = fastokens.Tokenizer.from_json_str(spec_json)
        segmented.enable_segment_cache(SEGMENT_CACHE_BYTES)
        engines[FASTOKENS] = lambda text: plain.encode(text, add_special_tokens=False).ids
        engines[SEGMENTED] = lambda text: segmented.encode(text, add_special_tokens=False).ids
    except Exception:
        pass  # the layout is refused: no column
    try:
        import gigatoken

        engines[GIGATOKEN] = gigatoken.Tokenizer.from_json(spec_json).encode  # a uint32 array
    except Exception:
        pass
    return engines


def load_subject(family: str) -> Subject:
    """The family's tokenizer through ``mptok.load_tokenizer`` (the embedded
    default for EMBEDDED), and each engine loaded from the same specification."""
    tokenizer = mptok.load_tokenizer(None if family == EMBEDDED else _tokenizer_file(family))
    spec_json = engine_specification(tokenizer.backend_tokenizer.to_str())
    subject = Subject(family, tokenizer, tokenizers.Tokenizer.from_str(spec_json), load_engines(spec_json))
    subject.first_checks = settle_first_results(subject)
    return subject


def settle_first_results(subject: Subject) -> Share:
    """A dozen prompts of another text through a cache, then the background
    checks they started: a cache checks a fast engine's first results more
    often than later ones, and what is measured is a server that has been
    up a while. Their checks' share of the CPU."""
    cache = mptok.PrefixTokenCache()
    text = stdlib_sources()[-400_000:]
    share = Share.start(cache)
    for i in range(12):
        cache.encode_array(subject.tokenizer, text[i * 30_000 : (i + 1) * 30_000], key=f"start-{i}")
    share.stop(cpu_when_idle())
    return share


# -- the conversations ----------------------------------------------------------


def deepseek_r1_chat(messages: list[dict[str, str]]) -> str:
    """DeepSeek R1's template: the generation prompt opens a thought that the
    next turn replaces with the answer."""
    parts = ["<｜begin▁of▁sentence｜>", messages[0]["content"]]
    for message in messages[1:]:
        if message["role"] == "user":
            parts += ["<｜User｜>", message["content"]]
        else:
            parts += ["<｜Assistant｜>", message["content"], "<｜end▁of▁sentence｜>"]
    return "".join(parts) + "<｜Assistant｜><think>\n"


def chatml_chat(family: str) -> Callable[[list[dict[str, str]]], str]:
    """ChatML between the family's markers with Qwen 3's generation prompt
    (thinking off), which the next turn replaces with the answer."""
    start, end = CHAT_MARKERS[family]

    def render(messages: list[dict[str, str]]) -> str:
        turns = "".join(f"{start}{m['role']}\n{m['content']}{end}\n" for m in messages)
        return turns + f"{start}assistant\n<think>\n\n</think>\n\n"

    return render


@dataclass
class Conversation:
    """The prompts of one conversation, and the other conversations' prompts
    tokenized between each two of its turns."""

    prompts: list[str]
    others: list[str]


class TextSource:
    """Consecutive, unshared pieces of the standard library's sources."""

    def __init__(self, seed: int):
        self._text, self._cursor, self.rng = stdlib_sources(), 0, random.Random(seed)

    def take(self, length: int) -> str:
        if self._cursor + length > len(self._text):
            self._cursor = 0
        piece = self._text[self._cursor : self._cursor + length]
        self._cursor += length
        return piece

    def turn_chars(self) -> int:
        return self.rng.randint(*TURN_CHARS)


def plain_prompts(source: TextSource, first_chars: int, count: int) -> list[str]:
    """``count`` prompts, the first ``first_chars`` long, each next one a turn's characters longer."""
    cuts = [first_chars]
    for _ in range(count - 1):
        cuts.append(cuts[-1] + source.turn_chars())
    text = source.take(cuts[-1])
    return [text[:cut] for cut in cuts]


def chat_prompts(source: TextSource, render: Callable[[list[dict[str, str]]], str], first_chars: int, count: int) -> list[str]:
    """``count`` renderings of a chat of about ``first_chars`` characters that
    gains an answer and a user message a turn."""

    def message() -> str:
        return source.take(source.turn_chars() // 2)

    messages = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": message()}]
    length = 0
    while length < first_chars:
        for role in ("assistant", "user"):
            messages.append({"role": role, "content": message()})
            length += len(messages[-1]["content"])
    prompts = []
    for _ in range(count):
        prompts.append(render(messages))
        messages += [{"role": "assistant", "content": message()}, {"role": "user", "content": message()}]
    return prompts


def conversation(subject: Subject, source: TextSource, kind: str, tokens: int, plan: Plan, turns: int) -> Conversation:
    """A conversation of ``kind`` whose last prompt has about ``tokens`` tokens,
    and two others of the same kind alternating between its turns."""
    sample = source.take(100_000)
    chars_per_token = len(sample) / len(subject.expected(sample))
    count = plan.warm_up + turns
    first_chars = max(1_000, int(tokens * chars_per_token) - (count - 1) * sum(TURN_CHARS) // 2)
    render = deepseek_r1_chat if subject.family == EMBEDDED else chatml_chat(subject.family)

    def prompts(first: int, number: int) -> list[str]:
        return chat_prompts(source, render, first, number) if kind == "chat" else plain_prompts(source, first, number)

    own = prompts(first_chars, count)
    other_turns = [prompts(plan.other_chars, count // 2) for _ in range(2)]
    others = [other_turns[i % 2][i // 2] for i in range(count - 1)]
    return Conversation(own, others)


# -- measuring --------------------------------------------------------------------


def cpu_when_idle(timeout_s: float = 60.0) -> float:
    """The process's CPU seconds once it is idle: background work (the cache's
    checks, an engine's threads) done, or ``timeout_s`` passed."""
    last, deadline = time.process_time(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = time.process_time()
        if now - last < IDLE_CPU_S:
            return now
        last = now
    return last


def timed(call: Callable[[str], Any], text: str) -> tuple[float, float, Any]:
    """(CPU seconds of the whole process, wall seconds, result)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = call(text)
    return time.process_time() - cpu, time.perf_counter() - wall, result


@dataclass
class Share:
    """The cache's background checks' CPU (``backend_check_cpu_seconds``) against the process's, over a stretch."""

    cache: Any
    checks: float
    cpu: float

    @classmethod
    def start(cls, cache: Any) -> Share:
        return cls(cache, -cache.stats()["backend_check_cpu_seconds"], -time.process_time())

    def stop(self, cpu_now: float) -> None:
        self.checks += self.cache.stats()["backend_check_cpu_seconds"]
        self.cpu += cpu_now
        self.cache = None

    def percent(self) -> str:
        return f"{self.checks / self.cpu:.1%}" if self.cpu > 0 else "-"


@dataclass
class Phase:
    """One system's run through a conversation: the measured turns (for the
    cache, those that hit), the whole run's CPU per turn and, for the cache,
    its checks' share of it, hits and wrong ids."""

    cpu: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    whole_cpu: float = float("nan")
    checks: Share | None = None
    hits: int = 0
    could_hit: int = 0
    wrong: int = 0

    def cpu_ms(self) -> float:
        return statistics.median(self.cpu) * 1e3 if self.cpu else float("nan")

    def wall_ms(self) -> float:
        return statistics.median(self.wall) * 1e3 if self.wall else float("nan")

    def whole_ms(self) -> float:
        return self.whole_cpu * 1e3


class Checker:
    """Compares id lists with `tokenizers`' full tokenization, each text's once."""

    def __init__(self, subject: Subject):
        self._subject, self._expected = subject, {}

    def expected(self, text: str) -> list[int]:
        if text not in self._expected:
            self._expected[text] = self._subject.expected(text)
        return self._expected[text]

    def wrong(self, ids: Any, text: str) -> int:
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        return int(ids != self.expected(text))


def run_phase(
    turn: Callable[[str], Any],
    other: Callable[[int, str], Any],
    chat: Conversation,
    checker: Checker,
    warm_up: int,
    *,
    pause_s: float = 0.0,
    hits: Callable[[], int] | None = None,
    cache: Any = None,
) -> Phase:
    """``turn`` on each prompt of the conversation, ``other`` (its index, its
    prompt) on each other conversation's prompt between them. With ``hits``
    (the cache's counter), only the turns that hit are timed; with ``cache``,
    its checks' share of the whole run is measured."""
    cpu_when_idle()  # the last phase's background work is not this one's
    phase, began = Phase(), 0.0
    for i, prompt in enumerate(chat.prompts):
        if i == warm_up:
            began = time.process_time()
            phase.checks = Share.start(cache) if cache is not None else None
        if i:
            phase.wrong += checker.wrong(other(i - 1, chat.others[i - 1]), chat.others[i - 1])
        if pause_s:
            time.sleep(pause_s)
        counted = hits() if hits else 0
        cpu, wall, ids = timed(turn, prompt)
        hit = hits is not None and hits() > counted
        phase.wrong += checker.wrong(ids, prompt)
        if i:
            phase.could_hit += 1
            phase.hits += hit
        if i >= warm_up and (hits is None or hit):
            phase.cpu.append(cpu)
            phase.wall.append(wall)
    idle = cpu_when_idle()
    phase.whole_cpu = (idle - began) / (len(chat.prompts) - warm_up)
    if phase.checks is not None:
        phase.checks.stop(idle)
    return phase


def cache_phase(subject: Subject, chat: Conversation, checker: Checker, warm_up: int, form: str, *, pause_s: float = 0.0, misses: bool = False) -> Phase:
    """The conversation through a new ``PrefixTokenCache``: ``form`` "array"
    (``encode_array``) or "list" (``encode``); with ``misses``, each turn
    under a key the cache has never seen."""
    cache = mptok.PrefixTokenCache()
    encode = cache.encode_array if form == "array" else cache.encode
    fresh = itertools.count()

    def turn(prompt: str) -> Any:
        key = f"miss-{next(fresh)}" if misses else "conversation"
        return encode(subject.tokenizer, prompt, key=key)

    def other(index: int, prompt: str) -> Any:
        return encode(subject.tokenizer, prompt, key=f"other-{index % 2}")

    counter = None if misses else (lambda: cache.stats()["hits"])
    return run_phase(turn, other, chat, checker, warm_up, pause_s=pause_s, hits=counter, cache=cache)


@dataclass
class Row:
    """Every system on one conversation."""

    label: str
    engines: str  # the engines that load the tokenizer
    kind: str
    target: int
    tokens: int
    full: dict[str, Phase]  # `tokenizers` and each engine
    compact: Phase
    listed: Phase
    missed: Phase
    paused_compact: Phase
    paused_listed: Phase

    def fastest_ms(self, measure: str = "cpu_ms") -> float:
        """The cheaper exact engine's median (``measure``: "cpu_ms" or "wall_ms")."""
        return min(getattr(self.full[name], measure)() for name in ENGINES if name in self.full and not self.full[name].wrong)

    def segmented_ms(self) -> float:
        return self.full[SEGMENTED].cpu_ms() if SEGMENTED in self.full else float("nan")

    def wrong(self) -> int:
        cache = (self.compact, self.listed, self.missed, self.paused_compact, self.paused_listed)
        return sum(phase.wrong for phase in cache)

    def check_share(self) -> float:
        """The background checks' CPU over the cache's whole-run CPU, in the four whole-run phases."""
        shares = [p.checks for p in (self.compact, self.listed, self.paused_compact, self.paused_listed) if p.checks]
        cpu = sum(share.cpu for share in shares)
        return sum(share.checks for share in shares) / cpu if cpu > 0 else float("nan")


def tokenizers_phase(subject: Subject, chat: Conversation, checker: Checker, warm_up: int) -> Phase:
    """`tokenizers`' full tokenization of every prompt, which is also what every id is checked against."""
    phase = Phase()
    began = 0.0
    for i, prompt in enumerate(chat.prompts):
        if i == warm_up:
            began = time.process_time()
        if i:
            checker.expected(chat.others[i - 1])
        cpu, wall, _ = timed(checker.expected, prompt)
        if i >= warm_up:
            phase.cpu.append(cpu)
            phase.wall.append(wall)
    phase.whole_cpu = (time.process_time() - began) / (len(chat.prompts) - warm_up)
    return phase


def bench_row(subject: Subject, source: TextSource, kind: str, tokens: int, plan: Plan) -> Row:
    chat = conversation(subject, source, kind, tokens, plan, plan.turns)
    checker = Checker(subject)
    full = {"tokenizers": tokenizers_phase(subject, chat, checker, plan.warm_up)}
    for name, encode in subject.engines.items():
        full[name] = run_phase(encode, lambda _, prompt, encode=encode: encode(prompt), chat, checker, plan.warm_up)
    return Row(
        subject.label,
        subject.engine_names(),
        kind,
        tokens,
        len(checker.expected(chat.prompts[-1])),
        full,
        compact=cache_phase(subject, chat, checker, plan.warm_up, "array"),
        listed=cache_phase(subject, chat, checker, plan.warm_up, "list"),
        missed=cache_phase(subject, chat, checker, plan.warm_up, "array", misses=True),
        paused_compact=cache_phase(subject, chat, checker, plan.warm_up, "array", pause_s=plan.pause_s),
        paused_listed=cache_phase(subject, chat, checker, plan.warm_up, "list", pause_s=plan.pause_s),
    )


@dataclass
class HitRate:
    label: str
    kind: str
    engines: str
    phase: Phase


def family_hit_rate(subject: Subject, source: TextSource, kind: str, plan: Plan) -> HitRate:
    chat = conversation(subject, source, kind, plan.family_tokens, plan, plan.family_turns)
    phase = cache_phase(subject, chat, Checker(subject), plan.warm_up, "array")
    return HitRate(subject.label, kind, subject.engine_names(), phase)


# -- the report -------------------------------------------------------------------


def ms(value: float) -> str:
    return "-" if value != value else f"{value:.2f}"


def ratio(numerator: float, denominator: float) -> str:
    if numerator != numerator or denominator != denominator or not denominator:
        return "-"
    return f"{numerator / denominator:.2f}x"


def hits_cell(*phases: Phase) -> str:
    hits, could = sum(p.hits for p in phases), sum(p.could_hit for p in phases)
    return f"{hits}/{could}"


def engine_cell(row: Row, name: str, measure: str = "cpu_ms") -> str:
    phase = row.full.get(name)
    if phase is None:
        return "refused"
    return "differs" if phase.wrong else ms(getattr(phase, measure)())


def prompt_cells(row: Row) -> str:
    return f"| {row.label} | {row.kind} | {row.tokens:,} "


MAIN_HEADER = (
    "| tokenizer | workload | tokens | full: `tokenizers` | fastokens | fastokens + segment cache | gigatoken "
    "| mptok hit, compact | ÷ fastest | ÷ segment cache | mptok hit, `encode()` | ÷ fastest | `tokenizers` ÷ it "
    "| mptok miss (wall) | ÷ fastest (wall) | hits / could hit | wrong ids |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def hit_cells(row: Row, compact: Phase, listed: Phase) -> str:
    """A hit in the compact form and through ``encode()``, against the engines."""
    fastest, array, ids = row.fastest_ms(), compact.cpu_ms(), listed.cpu_ms()
    return f"| {ms(array)} | {ratio(array, fastest)} | {ratio(array, row.segmented_ms())} | {ms(ids)} | {ratio(ids, fastest)} "


def main_line(row: Row) -> str:
    return (
        prompt_cells(row)
        + f"| {engine_cell(row, 'tokenizers')} | {engine_cell(row, FASTOKENS)} | {engine_cell(row, SEGMENTED)} | {engine_cell(row, GIGATOKEN)} "
        + hit_cells(row, row.compact, row.listed)
        + f"| {ratio(row.full['tokenizers'].cpu_ms(), row.listed.cpu_ms())} "
        f"| {ms(row.missed.wall_ms())} | {ratio(row.missed.wall_ms(), row.fastest_ms('wall_ms'))} "
        f"| {hits_cell(row.compact, row.listed)} | {row.wrong()} |"
    )


WHOLE_HEADER = (
    "| tokenizer | workload | tokens | fastokens | fastokens + segment cache | gigatoken | mptok, compact | ÷ fastest "
    "| mptok, `encode()` | ÷ fastest | mptok, compact, paused | mptok, `encode()`, paused | checks ÷ mptok's CPU ≤ 5% |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def whole_line(row: Row) -> str:
    fastest = min(row.full[name].whole_ms() for name in ENGINES if name in row.full)
    return (
        prompt_cells(row)
        + f"| {engine_cell(row, FASTOKENS, 'whole_ms')} | {engine_cell(row, SEGMENTED, 'whole_ms')} | {engine_cell(row, GIGATOKEN, 'whole_ms')} "
        f"| {ms(row.compact.whole_ms())} | {ratio(row.compact.whole_ms(), fastest)} "
        f"| {ms(row.listed.whole_ms())} | {ratio(row.listed.whole_ms(), fastest)} "
        f"| {ms(row.paused_compact.whole_ms())} | {ms(row.paused_listed.whole_ms())} | {share_cell(row.check_share())} |"
    )


def share_cell(share: float) -> str:
    if share != share:
        return "-"
    return f"{share:.1%} {'✓' if share <= CHECK_SHARE_TARGET else '✗'}"


PAUSED_HEADER = (
    "| tokenizer | workload | tokens | mptok hit, compact | ÷ fastest | ÷ segment cache | mptok hit, `encode()` | ÷ fastest "
    "| hits / could hit | wrong ids |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def paused_line(row: Row) -> str:
    return (
        prompt_cells(row)
        + hit_cells(row, row.paused_compact, row.paused_listed)
        + f"| {hits_cell(row.paused_compact, row.paused_listed)} | {row.paused_compact.wrong + row.paused_listed.wrong} |"
    )


TARGETS_HEADER = (
    "| tokenizer | workload | tokens | compact ≤ 0.10x fastest | compact ≤ 0.25x segment cache "
    "| `encode()` ≤ 0.50x (50k) / 0.33x (200k) fastest | `tokenizers` ≥ 100x (50k) / 200x (200k) `encode()` "
    "| miss ≤ 1.10x fastest (wall) | hits ≥ 99% of could hit, both regimes |\n"
    "|---|---|---:|---|---|---|---|---|---|"
)


def target_cell(value: float, limit: float, at_most: bool = True) -> str:
    if value != value:
        return "- ✗"
    met = value <= limit if at_most else value >= limit
    return f"{value:.2f}x {'✓' if met else '✗'}"


def targets_line(row: Row) -> str:
    long = row.target > 100_000
    fastest = row.fastest_ms()
    phases = (row.compact, row.listed, row.paused_compact, row.paused_listed)
    hits, could = sum(p.hits for p in phases), sum(p.could_hit for p in phases)
    rate = f"{hits / could:.0%} {'✓' if hits >= 0.99 * could else '✗'}" if could else "-"
    return (
        prompt_cells(row)
        + f"| {target_cell(row.compact.cpu_ms() / fastest, 0.10)} | {target_cell(row.compact.cpu_ms() / row.segmented_ms(), 0.25)} "
        f"| {target_cell(row.listed.cpu_ms() / fastest, 1 / 3 if long else 0.5)} "
        f"| {target_cell(row.full['tokenizers'].cpu_ms() / row.listed.cpu_ms(), 200 if long else 100, at_most=False)} "
        f"| {target_cell(row.missed.wall_ms() / row.fastest_ms('wall_ms'), 1.1)} | {rate} |"
    )


HIT_RATE_HEADER = "| tokenizer | engines that load it | workload | hits / could hit | wrong ids |\n|---|---|---|---:|---:|"


def report(rows: Sequence[Row], rates: Sequence[HitRate], plan: Plan, subjects: Sequence[Subject]) -> tuple[str, str]:
    """(the preamble, the tables)."""
    cached = [p for row in rows for p in (row.compact, row.listed, row.paused_compact, row.paused_listed)]
    cached += [rate.phase for rate in rates]
    hits, could = sum(p.hits for p in cached), sum(p.could_hit for p in cached)
    preamble = f"""\
Each conversation: {plan.warm_up} warm-up turns, then {plan.turns} measured ones, each turn
1,100-1,300 characters longer than the last; between each two turns another
long conversation's prompt (from {plan.other_chars:,} characters, growing too) goes
through the same system. "chat": a chat template's output whose generation
prompt the next turn replaces; "plain": text cut at random character
positions. Every system runs the sequence in a phase of its own. Times are
medians in ms; CPU is the whole process's (`time.process_time`), so
fastokens' threads and the cache's count. A hit's medians are of the turns
that hit ("-": none did). "fastest" is the cheaper of fastokens and gigatoken on that
conversation (CPU; wall for a miss). The compact form is `encode_array` (the
int32 ids a frontend writes to JSON); `encode()` returns a `list[int]`.
fastokens' segment cache has {SEGMENT_CACHE_BYTES >> 20} MiB. The script's docstring
says exactly what is measured; the machine is shared, so read the ratios,
which are within one run."""
    parts = [
        "## Turns back to back, another conversation between each two",
        "",
        "Full tokenization and cache hits in ms of CPU, misses in ms of wall time.",
        "",
        MAIN_HEADER,
        *(main_line(row) for row in rows),
        "",
        "## Whole run: CPU per turn",
        "",
        "The process's CPU from the first measured turn until it is idle after the last, divided by the",
        "measured turns: each turn, the other conversation's prompt before it, and the background work",
        "they caused (ms). \"paused\": the same with the pause before each turn. \"checks\": the CPU of the",
        "cache's background checks (its checking thread's) over the cache's CPU in those four runs.",
        "",
        WHOLE_HEADER,
        *(whole_line(row) for row in rows),
        "",
        "A new tokenizer's first results are all checked, in full, whatever the budget: at start, a dozen",
        "prompts of 30,000 characters through a new cache (before the runs above), the checks took "
        + "; ".join(f"{s.first_checks.checks * 1e3:.0f} ms of CPU, {s.first_checks.percent()} of the CPU, for {s.label}" for s in subjects if s.first_checks)
        + ".",
        "",
        f"## Turns with a pause of {plan.pause_s} s before each",
        "",
        "Ratios against the engines' full tokenization of the back-to-back run.",
        "",
        PAUSED_HEADER,
        *(paused_line(row) for row in rows),
        "",
        "## Targets",
        "",
        "Hits in ms of CPU over the fastest engine's full tokenization, back to back.",
        "",
        TARGETS_HEADER,
        *(targets_line(row) for row in rows),
        "",
        "## Hit rates on every family",
        "",
        f"The other families: conversations of about {plan.family_tokens:,} tokens, {plan.warm_up + plan.family_turns} turns,",
        "back to back, another conversation between each two, through `encode_array`.",
        "",
        HIT_RATE_HEADER,
        *(f"| {row.label} | {row.engines} | {row.kind}, {row.target // 1000}k tokens | {hits_cell(row.compact, row.listed, row.paused_compact, row.paused_listed)} | {row.wrong()} |" for row in rows),
        *(f"| {rate.label} | {rate.engines} | {rate.kind} | {hits_cell(rate.phase)} | {rate.phase.wrong} |" for rate in rates),
        "",
        f"All turns that could hit: {hits}/{could} hit ({hits / max(could, 1):.1%}).",
    ]
    return preamble, "\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-report", action="store_true", help="print only; do not write docs/results/bench_cache.md")
    args = parse_args_with_smoke(parser, {"no_report": True})
    plan = SMOKE if args.smoke else Plan()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    source = TextSource(seed=0)
    rows: list[Row] = []
    subjects: list[Subject] = []
    for family in TIMED:
        subject = load_subject(family)
        subjects.append(subject)
        for tokens in plan.sizes:
            for kind in ("chat", "plain"):
                rows.append(bench_row(subject, source, kind, tokens, plan))
                print(main_line(rows[-1]), flush=True)
    rates: list[HitRate] = []
    for family in FAMILIES:
        if family in TIMED:
            continue
        subject = load_subject(family)
        for kind in ("chat", "plain"):
            rates.append(family_hit_rate(subject, source, kind, plan))
            print(f"{rates[-1].label} {kind}: {hits_cell(rates[-1].phase)} hits, {rates[-1].phase.wrong} wrong", flush=True)
    preamble, body = report(rows, rates, plan, subjects)
    print(body)
    if not args.no_report:
        path = write_report(
            "bench_cache",
            "Cache benchmark: a conversation's next turn, against the full tokenization servers run",
            body,
            preamble=preamble,
            packages=("mptok", "tokenizers", "transformers", "fastokens", "gigatoken"),
        )
        print(f"\nwritten to {path}")
    wrong = sum(row.wrong() for row in rows) + sum(rate.phase.wrong for rate in rates)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())

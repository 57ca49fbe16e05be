#!/usr/bin/env python3
"""What one served turn costs: `mptok serve` with the cache against the same server with the cache off.

A growing conversation's turn should cost its new text. This measures it end
to end: server CPU per turn of `mptok serve --frontends F` (every frontend
process and its children, every thread, from psutil before and after), with
the cache and with the cache off (`MPTOK_CACHE_MIN_CHARS` above every prompt,
so every prompt is tokenized in full by the fastest exact engine), at each of
--lengths.

The conversations are the replay's (``scripts.replay_bench``: real text, the
built-in DeepSeek V3 template, keyless: no session id, so mptok names each
conversation from its messages), built up to each length. Only their last
--turns turns are measured: every conversation's turn before them is sent
first, unmeasured (its one miss), then --clients threads send the measured
turns, a new connection per turn. Every answer is compared with full
tokenization of the rendered prompt, computed before any server starts.

The steady state is measured: each conversation's --warm-turns turns
before the measured ones are sent first, unmeasured, and the measured turns
start once the server is idle (a fast engine's first results in each process
are re-checked against `tokenizers` in the background; the checks that
sampling makes later are counted).

Run from the repository's root:

    make bench                                  # also the library benchmark (scripts.bench_cache)
    .venv/bin/python -m scripts.bench_turn --lengths 38000 --repeat 1 --no-write
    .venv/bin/python -m scripts.bench_turn --smoke

Writes the Markdown to stdout and (unless --no-write) docs/results/bench_turn.md.
Exit status 1 on any wrong id or failed request.
"""

from __future__ import annotations

import argparse
import array
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from mptok_harness.serve import Server, scrape, total
from scripts.replay_bench import (
    NO_CACHE_ENV,
    BuildParams,
    Conversation,
    ModeResult,
    Progress,
    Turn,
    build,
    BUILD_CACHE,
    collect,
    command_line,
    cpu_by_role,
    replay,
)
from scripts.report import REPO, write_report
from scripts.smoke import parse_args_with_smoke

import mptok

TITLE = "What a served turn costs"
ABOUT = """\
Server CPU per turn of `mptok serve --frontends F`: user + system CPU of the
supervisor and every frontend process with their children (every thread),
from psutil before and after the measured turns, divided by the turns. *cache*
is the server as it ships; *cache off* is the same server with
`MPTOK_CACHE_MIN_CHARS` above every prompt, so that every prompt is tokenized
in full by the fastest exact engine. The conversations are the replay's
(`scripts/replay_bench.py`): keyless agentic chats through the built-in
DeepSeek V3 template, `{"messages": [...], "add_generation_prompt": true}`, a
new connection per turn, about 300 tokens a turn; each conversation's turns
before the measured ones are sent first, unmeasured, and the measured turns
start once the server is idle (past the start-up re-checks of each process's
first fast results; the checks sampled later are counted). Every id is
compared with full tokenization of the rendered prompt.
"""
# Fast results re-checked against `tokenizers` in the background (each re-tokenizes a whole prompt).
CHECKS = "mptok_tokenizer_backend_checks_total"
MODES = ("keyless", "no-cache")  # replay_bench's names: cache on (no session id), cache off
LABELS = {"keyless": "cache", "no-cache": "cache off"}


def window(conv: Conversation, warm: int, turns: int) -> tuple[Conversation, Conversation]:
    """``conv`` cut to the ``warm`` turns before its last ``turns`` (the warm-up) and
    those turns, each part's first turn carrying all its ids (replay starts from none)."""
    expected, full = array.array("i"), []
    for turn in conv.turns:
        expected = conv.expected(turn, expected)
        full.append(expected)
    start = max(1, len(conv.turns) - turns)
    first = max(0, start - warm)

    def whole(i: int) -> Turn:
        return replace(conv.turns[i], reused=0, tail=full[i])

    return (
        replace(conv, turns=[whole(first), *conv.turns[first + 1 : start]]),
        replace(conv, turns=[whole(start), *conv.turns[start + 1 :]]),
    )


def wait_until_idle(pid: int, timeout_s: float = 120.0) -> None:
    """Wait until the server's processes spend under a tenth of a core for a second
    (the fast engines' first results are re-checked in the background, once per process)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = sum(cpu_by_role([pid]).values())
        time.sleep(1.0)
        if sum(cpu_by_role([pid]).values()) - before < 0.1:
            return


def run(mode: str, warm: list[Conversation], measured: list[Conversation], args: argparse.Namespace, workdir: Path) -> ModeResult:
    """One server of ``mode``: the warm-up turns, then the measured ones, counted alone."""
    env = NO_CACHE_ENV if mode == "no-cache" else {}
    serve_args = ("--frontends", str(args.frontends), "--tokenizer-backend", args.backend)
    progress = Progress(False)
    with Server(workdir / f"{mode}.log", *serve_args, env=env) as server:
        before = ModeResult(mode, "")
        replay(warm, server.port, args.clients, before, progress, [server.process.pid], args.frontends)
        collect(before, [server.port])
        wait_until_idle(server.process.pid)
        checks_before = total(scrape(server.port), CHECKS)
        result = ModeResult(mode, f"`mptok serve {' '.join(serve_args)}`")
        replay(measured, server.port, args.clients, result, progress, [server.process.pid], args.frontends)
        collect(result, [server.port])
        result.checks = total(scrape(server.port), CHECKS) - checks_before
    result.errors += before.errors
    result.failed += before.failed + (before.checked - before.exact)
    result.hits -= before.hits
    result.misses -= before.misses
    result.uncached -= before.uncached
    return result


def cpu_ms(r: ModeResult) -> float:
    return 1000 * r.server_cpu_s / max(1, r.checked)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frontends", type=int, default=4, help="F (default 4)")
    parser.add_argument("--clients", type=int, default=4, help="client threads (default 4)")
    parser.add_argument("--conversations", type=int, default=4, help="conversations at each length (default 4)")
    parser.add_argument("--lengths", default="38000,150000", help="tokens the conversations grow to, comma-separated (default 38000,150000)")
    parser.add_argument("--turns", type=int, default=40, help="measured turns per conversation (default 40)")
    parser.add_argument("--warm-turns", type=int, default=12, help="turns per conversation sent before the measured ones, unmeasured (default 12)")
    parser.add_argument("--delta-tokens", type=int, default=300, help="tokens added per turn (default 300)")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--backend", default="auto", help="--tokenizer-backend of both servers (default auto)")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each (length, mode), interleaved (default 2)")
    parser.add_argument("--jobs", type=int, default=2, help="processes computing the expected ids (default 2)")
    parser.add_argument("--no-write", action="store_true", help="do not write docs/results/bench_turn.md")
    smoke = {"frontends": 2, "conversations": 2, "lengths": "3000", "warm_turns": 2, "turns": 4, "clients": 2, "repeat": 1, "no_write": True}
    args = parse_args_with_smoke(parser, smoke)
    lengths = [int(n) for n in args.lengths.split(",") if n]
    tokenizer = mptok.load_tokenizer()
    from mptok.api.chat_template import ChatTemplate

    template = ChatTemplate.for_tokenizer(tokenizer)
    began = time.monotonic()
    results: dict[tuple[int, str], list[ModeResult]] = {}
    workloads = {}
    for length in lengths:
        params = BuildParams(args.conversations, length, args.delta_tokens, args.seed)
        conversations = build(tokenizer, template, params, Progress(True), args.jobs, BUILD_CACHE)
        cut = [window(c, args.warm_turns, args.turns) for c in conversations]
        workloads[length] = ([w for w, _ in cut], [m for _, m in cut])
    with tempfile.TemporaryDirectory(prefix="bench-turn-") as workdir:
        for run_index in range(args.repeat):
            for length in lengths:
                order = MODES if (run_index + lengths.index(length)) % 2 == 0 else MODES[::-1]
                for mode in order:
                    work = Path(workdir) / f"{length}-{run_index}"
                    work.mkdir(parents=True, exist_ok=True)
                    warm, measured = workloads[length]
                    r = run(mode, warm, measured, args, work)
                    results.setdefault((length, mode), []).append(r)
                    print(f"{length} {mode} run {run_index}: {cpu_ms(r):.2f} ms/turn, {r.exact}/{r.checked} exact", file=sys.stderr)
    markdown = table(lengths, results, workloads, args) + f"\n\nTotal run time {time.monotonic() - began:.0f} s.\n"
    print(markdown)
    if not args.no_write:
        path = write_report("bench_turn", TITLE, markdown, preamble=ABOUT, command=command_line("bench_turn", parser, args))
        print(f"report: {path.relative_to(REPO)}")
    wrong = sum(r.checked - r.exact + r.failed for rs in results.values() for r in rs)
    for rs in results.values():
        for r in rs:
            for error in r.errors[:5]:
                print(f"{r.mode}: {error}", file=sys.stderr)
    return 1 if wrong else 0


def table(lengths: list[int], results: dict, workloads: dict, args: argparse.Namespace) -> str:
    rows = [
        f"F = {args.frontends}, {args.conversations} conversations per length, the last {args.turns} turns of each measured "
        f"after {args.warm_turns} unmeasured, "
        f"{args.clients} client threads, {args.repeat} run(s) of each server, interleaved.",
        "",
        "| prompt tokens (measured turns) | server CPU ms per turn: cache | cache off | cache / cache off | hits | background re-checks: cache, cache off | checked exact |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    hit_ms = {}
    for length in lengths:
        measured = workloads[length][1]
        tokens = [t.tokens for c in measured for t in c.turns]
        on, off = results[(length, "keyless")], results[(length, "no-cache")]
        on_ms = statistics.median(cpu_ms(r) for r in on)
        off_ms = statistics.median(cpu_ms(r) for r in off)
        hit_ms[length] = on_ms
        hits, misses = sum(r.hits for r in on), sum(r.misses for r in on)
        exact = sum(r.exact for rs in (on, off) for r in rs)
        checked = sum(r.checked for rs in (on, off) for r in rs)
        rows.append(
            f"| {min(tokens):,}-{max(tokens):,} | {on_ms:.2f} ({', '.join(f'{cpu_ms(r):.2f}' for r in on)}) "
            f"| {off_ms:.2f} ({', '.join(f'{cpu_ms(r):.2f}' for r in off)}) | 1/{off_ms / on_ms:.1f} "
            f"| {100 * hits / max(1, hits + misses):.1f}% ({int(hits)} / {int(hits + misses)}) "
            f"| {int(sum(r.checks for r in on))}, {int(sum(r.checks for r in off))} | {exact} of {checked} |"
        )
    if len(lengths) > 1:
        rows += ["", f"A hit turn at {lengths[-1]:,} tokens costs {hit_ms[lengths[-1]] / hit_ms[lengths[0]]:.2f}x one at {lengths[0]:,}."]
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())

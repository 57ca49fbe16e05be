#!/usr/bin/env python3
"""The replay under a memory budget: where routing between frontends pays.

`make replay` gives every frontend room for every conversation, so a
cache per frontend without routing still finds an older version of almost
every conversation. In production the edge is capacity: F caches that do not
route keep each conversation F times, so under the same budget they hold 1/F
as many conversations; routed frontends keep each conversation once, at its
owner. This script replays many conversations at once (the turns
interleaved: turn 1 of every conversation, then turn 2, ..., each client
thread sending one turn of the next conversation in the queue) against
`mptok serve --cache-bytes B`, with the modes of scripts.replay_bench
(whose conversations, servers and checks it uses: every answer is compared
with the full tokenization computed before the replay).

The budget B is given as a fraction of ONE COPY: the bytes one cache
(`PrefixTokenCache`, default settings, no budget) holds after each
conversation's last prompt was tokenized in it once under its conversation
id, measured in this process before the replay (text, ids, keys,
bookkeeping, as the cache counts them). --budget 0.5 (the default)
gives each frontend room for half of the conversations: the working set is
2x what one frontend holds, and with F = 4, half of what the F frontends hold
together.

Per mode: hit rate, server tokenize ms p50/p99, end-to-end ms p50/p99,
requests/s, server CPU ms per turn (every server process, nginx included),
and at the end of the run each frontend's cache bytes and held-reply bytes
(`mptok_cache_bytes`, `mptok_held_fingerprint_bytes` from its /metrics), their
total across frontends against one copy. Then the targets against the
measurements they name. --repeat N runs the modes N times, one after
another: the table has a row per run, and the targets take the lowest hit
rate and the spread between runs.

Run from the repository's root:

    make replay-capacity                                     # the F = 4 table, the F = 8 table, the sweep
    .venv/bin/python -m scripts.capacity_replay --conversations 8 --target-tokens 6000 --no-write
    .venv/bin/python -m scripts.capacity_replay --sweep 0.25,0.5,1 --modes no-route,mptok
    .venv/bin/python -m scripts.capacity_replay --smoke      # F = 2, no-route and mptok, 4 short conversations, no report

--sweep runs the modes at each budget and plots hit rate against the budget
(docs/results/capacity_hit_rate.png). Unless --no-write, the Markdown goes
into docs/results/capacity_replay.md, in this run's section (one per F for
the table, one for the sweep; the others are kept). Exit status 1 on any
wrong id or failed request.
"""

from __future__ import annotations

import argparse
import array
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mptok.api.chat_template import ChatTemplate
from mptok.cache.config import DEFAULT_MAX_HELD_BYTES, CacheConfig, parse_bytes
from mptok.cache.prefix_cache import PrefixTokenCache
from scripts import replay_bench as rb
from scripts.percentiles import percentile
from scripts.report import RESULTS_DIR, write_report
from scripts.smoke import parse_args_with_smoke

MODES = ("no-cache", "no-route", "mptok", "sticky")
SWEEP_PLOT = RESULTS_DIR / "capacity_hit_rate.png"
TITLE = "The replay under a memory budget"
# The report's fixed part: what one copy is, what the budget is.
ABOUT = """\
Many conversations live at once, their turns interleaved (each client thread
sends one turn of the next conversation in the queue, so turn 1 of every
conversation comes before turn 2 of any), against `mptok serve --cache-bytes
B`, with the modes of [the replay](replay_bench.md); every answer is checked
against full tokenization computed before the replay. Every mode runs on
the fast backend (`auto` unless the command says otherwise: each frontend
takes the cheapest engine that gives identical ids on its start-up check;
the table names the engine each frontend used, from its `/metrics`), so
no-cache is every prompt tokenized in full by the fastest exact engine.

**One copy** is the unit of memory: the bytes one cache (`PrefixTokenCache`,
default settings, no budget) holds after each conversation's last prompt was
tokenized in it once under its conversation id (prompt text, ids, keys,
bookkeeping; no earlier versions), measured by the
script before the replay. Each frontend's budget is a fraction of it. The
bytes of each frontend are read from its `/metrics` at the end of the run:
`mptok_cache_bytes` (its cache) and `mptok_held_fingerprint_bytes` (the fingerprints
it holds for the conversations it routed); "all frontends' bytes / one copy"
is their sum over every frontend divided by one copy.
"""
MiB = 1024 * 1024


def one_copy(tokenizer: Any, template: ChatTemplate, conversations: list[rb.Conversation]) -> int:
    """Bytes one unbounded cache holds after each conversation's last prompt
    was tokenized in it once, under its conversation id (its ids checked)."""
    cache = PrefixTokenCache(CacheConfig(max_bytes=1 << 50, max_entries=max(1024, len(conversations))))
    for conv in conversations:
        expected = array.array("i")
        for turn in conv.turns:
            expected = conv.expected(turn, expected)
        last = conv.turns[-1]
        text = template.render(tokenizer, conv.messages[: last.messages], True)
        if array.array("i", cache.encode(tokenizer, text, conv.session)) != expected:
            raise AssertionError(f"one copy: wrong ids for {conv.session}")
    return cache.stats()["cached_bytes"]


@dataclass(frozen=True)
class Budget:
    fraction: float  # of one copy; NaN when given in bytes
    cache_bytes: int  # each frontend's --cache-bytes
    copy_bytes: int  # one copy, measured

    @property
    def label(self) -> str:
        return f"{self.fraction:g}x one copy" if self.fraction == self.fraction else f"{self.cache_bytes / MiB:.1f} MiB"


def budget_from(text: str, copy_bytes: int) -> Budget:
    """``0.5`` (a fraction of one copy) or a size in bytes (``64M``)."""
    try:
        fraction = float(text)
    except ValueError:
        return Budget(float("nan"), parse_bytes(text), copy_bytes)
    if fraction <= 0:
        raise ValueError(f"a budget must be positive, got {text}")
    return Budget(fraction, max(1, int(fraction * copy_bytes)), copy_bytes)


def run_at(
    budget: Budget,
    modes: list[str],
    conversations: list[rb.Conversation],
    args: argparse.Namespace,
    progress: rb.Progress,
    workdir: Path,
) -> list[rb.ModeResult]:
    """Every mode ``args.repeat`` times at ``budget``, turns interleaved."""
    env = {"MPTOK_CACHE_MAX_HELD_BYTES": str(parse_bytes(args.held_bytes))} if args.held_bytes else None
    results = []
    for mode in [mode for _ in range(args.repeat) for mode in modes]:
        work = workdir / f"{budget.cache_bytes}"
        results.append(
            rb.run_mode(
                mode, conversations, args.frontends, args.clients, work, progress,
                serve_args=("--cache-bytes", str(budget.cache_bytes)), env=env, interleave=True, backend=args.backend,
            )
        )
    return results


def mib_list(values: list[float]) -> str:
    return ", ".join(f"{v / MiB:.1f}" for v in values)


def held_of(r: rb.ModeResult) -> float:
    return sum(r.held_bytes)


def label(r: rb.ModeResult, results: list[rb.ModeResult]) -> str:
    """The mode, and which of its runs this is when it ran more than once."""
    runs = [other for other in results if other.mode == r.mode]
    return r.mode if len(runs) == 1 else f"{r.mode} (run {runs.index(r) + 1})"


def table(results: list[rb.ModeResult], conversations: list[rb.Conversation], copy_bytes: int) -> str:
    can_hit = sum(len(c.turns) - 1 for c in conversations)
    rows = [
        "| mode | backend (frontends) | hit rate (hits / turns that can hit) | server tokenize ms p50 / p99 | end-to-end ms p50 / p99 | requests/s | server CPU ms per turn "
        "| cache MiB per frontend | held fingerprints MiB per frontend | all frontends' bytes / one copy | checked exact |",
        "|---|---|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for r in results:
        held = mib_list(r.held_bytes) if held_of(r) else "0"
        rows.append(
            f"| {label(r, results)} | {rb.engines(r)} | {100 * r.hit_rate:.1f}% ({int(r.hits)} / {can_hit}) | {percentile(r.tokenize_ms, 0.5):.2f} / {percentile(r.tokenize_ms, 0.99):.1f} "
            f"| {percentile(r.e2e_ms, 0.5):.1f} / {percentile(r.e2e_ms, 0.99):.1f} | {r.requests / r.wall_s:.1f} "
            f"| {rb.cpu_per_turn_ms(r):.1f} | {mib_list(r.cache_bytes)} | {held} "
            f"| {(sum(r.cache_bytes) + held_of(r)) / copy_bytes:.2f} | {r.exact} of {r.checked} ({r.failed} failed) |"
        )
    return "\n".join(rows)


def targets(runs: dict[str, list[rb.ModeResult]], copy_bytes: int) -> str:
    """The capacity targets (routing keeps each conversation once, so it should
    hit where caches per frontend miss, in about one copy, run after run), each
    against the measurement it names: the hit rate is mptok's lowest run's."""
    if "mptok" not in runs:
        return ""
    rates = [r.hit_rate for r in runs["mptok"]]
    mptok = min(runs["mptok"], key=lambda r: r.hit_rate)
    rows = ["| target | measured | met |", "|---|---|---|"]
    others = [runs[m][0] for m in ("no-route",) if m in runs]
    hit = f"mptok {100 * mptok.hit_rate:.1f}%" + "".join(f"; {o.mode} {100 * o.hit_rate:.1f}%" for o in others)
    below = all(o.hit_rate <= mptok.hit_rate - 0.2 for o in others)
    rows.append(f"| mptok hit rate at least 95%, per-frontend caches well below | {hit} | {'yes' if mptok.hit_rate >= 0.95 and below else 'no'} |")
    if len(rates) > 1:
        spread = 100 * (max(rates) - min(rates))
        rows.append(
            f"| mptok hit rate at most 2 points apart between runs | {', '.join(f'{100 * rate:.1f}%' for rate in rates)} "
            f"({spread:.1f} points) | {'yes' if spread <= 2 else 'no'} |"
        )
    for other in others:
        ratio = rb.ratio_of(percentile(mptok.tokenize_ms, 0.5), percentile(other.tokenize_ms, 0.5))
        rows.append(
            f"| mptok tokenize p50 at most 0.5x {other.mode}'s | {percentile(mptok.tokenize_ms, 0.5):.2f} / "
            f"{percentile(other.tokenize_ms, 0.5):.2f} ms = {ratio:.2f}x | {'yes' if ratio <= 0.5 else 'no'} |"
        )
    held = held_of(mptok)
    ratio = (sum(mptok.cache_bytes) + held) / copy_bytes
    rows.append(
        f"| bytes across frontends per conversation at most 1.3x one copy | ({sum(mptok.cache_bytes) / MiB:.1f} MiB cached + "
        f"{held / MiB:.1f} MiB held fingerprints) / {copy_bytes / MiB:.1f} MiB = {ratio:.2f}x | {'yes' if ratio <= 1.3 else 'no'} |"
    )
    rows.append(rb.wrong_ids_row([r for results in runs.values() for r in results]))
    return "\n".join(rows)


def sweep_table(points: list[tuple[Budget, list[rb.ModeResult]]]) -> str:
    """Per budget and mode: hit rate, tokenize p50, bytes against one copy;
    for a routed mode also the turns that extended a copy kept where they
    landed (``mptok_kept_here_total``)."""
    modes = [r.mode for r in points[0][1]]
    routed = {i for i in range(len(modes)) if any(results[i].kept_here for _, results in points)}
    header = []
    for i, m in enumerate(modes):
        header.append(f"{m} hit rate | {m} tokenize p50 ms | {m} bytes / one copy")
        if i in routed:
            header.append(f"{m} turns extending a copy kept where they landed")
    rows = ["| per-frontend budget | " + " | ".join(header) + " |", "|---|" + "---:|" * (3 * len(modes) + len(routed))]
    for budget, results in points:
        cells = []
        for i, r in enumerate(results):
            cells += [f"{100 * r.hit_rate:.1f}%", f"{percentile(r.tokenize_ms, 0.5):.2f}", f"{(sum(r.cache_bytes) + held_of(r)) / budget.copy_bytes:.2f}"]
            if i in routed:
                cells.append(f"{int(r.kept_here)} of {r.requests}")
        rows.append(f"| {budget.label} ({budget.cache_bytes / MiB:.1f} MiB) | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot_sweep(points: list[tuple[Budget, list[rb.ModeResult]]], frontends: int, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (`make replay-capacity` installs it): no plot"
    fig, axis = plt.subplots(figsize=(6.5, 4.5))
    for index, mode in enumerate(r.mode for r in points[0][1]):
        xs = [b.fraction for b, _ in points]
        ys = [100 * results[index].hit_rate for _, results in points]
        axis.plot(xs, ys, marker="o", label=mode)
    axis.axvline(1 / frontends, color="grey", linestyle=":", label=f"1/F of one copy (F = {frontends})")
    axis.set_xscale("log", base=2)
    axis.set_xticks([b.fraction for b, _ in points], [f"{b.fraction:g}" for b, _ in points])
    axis.minorticks_off()
    axis.set_xlabel("each frontend's cache budget (fraction of one copy of all conversations)")
    axis.set_ylabel("hit rate %")
    axis.set_ylim(0, 102)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    axis.set_title("hit rate against the memory budget")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return f"plot: {path.relative_to(rb.REPO)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frontends", type=int, default=4, help="F: frontends / instances per mode (default 4)")
    rb.add_build_options(parser, conversations=64)
    parser.add_argument("--clients", type=int, default=4, help="client threads (default 4)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(rb.MODES)} (default {','.join(MODES)})")
    rb.add_backend_option(parser)
    parser.add_argument("--budget", default="0.5", help="each frontend's --cache-bytes: a fraction of one copy (default 0.5) or a size (64M)")
    parser.add_argument("--held-bytes", default=None, help="MPTOK_CACHE_MAX_HELD_BYTES for every frontend (default: mptok's)")
    parser.add_argument("--sweep", default=None, help="comma-separated budgets (fractions of one copy): run the modes at each and plot hit rate against the budget")
    parser.add_argument("--repeat", type=int, default=1, help="run the modes this many times, one after another; a row per run (default 1)")
    parser.add_argument("--no-write", action="store_true", help="do not write docs/results/capacity_replay.md or the plot")
    parser.add_argument("--quiet", action="store_true", help="no progress bar (there is none unless stderr is a terminal)")
    # The two modes the budget is about; the replay's smoke form runs every mode.
    smoke = {"frontends": 2, "conversations": 4, "target_tokens": 3_000, "clients": 2, "modes": "no-route,mptok", "no_write": True, "quiet": True}
    args = parse_args_with_smoke(parser, smoke)
    if args.held_bytes:
        try:
            parse_bytes(args.held_bytes)
        except ValueError as e:
            parser.error(f"--held-bytes: {e}")
    modes = list(dict.fromkeys(m for m in args.modes.split(",") if m))
    unknown = set(modes) - set(rb.MODES)
    if unknown:
        parser.error(f"unknown modes: {sorted(unknown)}")
    if any(m in ("no-route", "sticky") for m in modes) and rb.nginx_binary() is None:
        print("capacity_replay: nginx is not installed (apt-get install nginx-light)", file=sys.stderr)
        return 2
    progress = rb.Progress(not args.quiet)
    began = time.monotonic()
    tokenizer, template, conversations = rb.load_conversations(args, progress)
    copy_bytes = one_copy(tokenizer, template, conversations)
    try:
        budgets = [budget_from(b, copy_bytes) for b in (args.sweep or args.budget).split(",") if b]
    except ValueError as e:
        parser.error(str(e))
    if args.sweep and any(b.fraction != b.fraction for b in budgets):
        parser.error("--sweep takes fractions of one copy (0.25,0.5,1), not sizes")
    points = []
    with tempfile.TemporaryDirectory(prefix="capacity-replay-") as workdir:
        for budget in budgets:
            points.append((budget, run_at(budget, modes, conversations, args, progress, Path(workdir))))
    all_results = [r for _, results in points for r in results]
    oversubscribed = f" F = {args.frontends} frontends on {os.cpu_count()} CPUs: oversubscribed, every figure is from a machine with more busy processes than cores." if args.frontends > (os.cpu_count() or 1) else ""
    held = f"MPTOK_CACHE_MAX_HELD_BYTES={args.held_bytes}" if args.held_bytes else f"held fingerprints bounded by mptok's default, {DEFAULT_MAX_HELD_BYTES >> 20} MiB per frontend"
    header = (
        f"{rb.workload(conversations, args)} Turns interleaved across all conversations (each client sends one turn of the next "
        f"conversation in the queue); {args.repeat} run{'s' if args.repeat > 1 else ''} per mode. One copy (each conversation's last prompt once in one unbounded cache, "
        f"measured): {copy_bytes / MiB:.1f} MiB, {copy_bytes / len(conversations) / MiB:.2f} MiB per conversation; {held}.{oversubscribed} "
        f"Total run time {time.monotonic() - began:.0f} s.\n"
    )
    if args.sweep:
        markdown = header + "\n" + sweep_table(points) + "\n"
        name = "Hit rate against the budget"
    else:
        budget, results = points[0]
        runs: dict[str, list[rb.ModeResult]] = {}
        for r in results:
            runs.setdefault(r.mode, []).append(r)
        markdown = header + f"\nEach frontend's budget: {budget.label}, `--cache-bytes {budget.cache_bytes}` ({budget.cache_bytes / MiB:.1f} MiB).\n\n" + table(results, conversations, copy_bytes) + "\n\n" + rb.cpu_split(results) + "\n"
        if "mptok" in runs:
            mptok = runs["mptok"][0]
            markdown += (
                f"\n{rb.owner_split(mptok)} Of the {int(mptok.routed)} routed prompts, {int(mptok.routed_since)} were sent as the "
                f"characters after a fingerprint the asker held (`mptok_routed_since_total`), the rest whole.\n"
            )
        goals = targets(runs, copy_bytes)
        if goals:
            aside = "" if args.frontends == 4 else f"\nThe targets are set for F = 4; at F = {args.frontends}, for reference:\n"
            markdown += aside + "\n" + goals + "\n"
        name = f"F = {args.frontends}"
    print(markdown)
    if not args.no_write:
        if args.sweep:
            drawn = plot_sweep(points, args.frontends, SWEEP_PLOT)
            print(drawn)
            if drawn.startswith("plot:"):
                markdown += f"\n![hit rate against each frontend's budget, for caches per frontend and mptok]({SWEEP_PLOT.name})\n"
        path = write_report(
            "capacity_replay", TITLE, markdown, command=rb.command_line("capacity_replay", parser, args),
            extra={"nginx": rb.nginx_version()}, section=name, preamble=ABOUT, packages=rb.PACKAGES,
        )  # fmt: skip
        print(f"report: {path.relative_to(rb.REPO)}")
    return rb.report_errors(all_results)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Benchmark: a render tier beside its anchors, on keyless agentic chats, at several concurrencies.

Five render services of one model directory (``mptok_harness.vllm``), all
running at once (each idle while another is measured):

- ``vllm``: ``vllm launch render``, one process, as it is;
- ``fastokens``: the same with ``VLLM_USE_FASTOKENS=1``;
- ``vllm-rs``: ``vllm-rs render``, vLLM's Rust render server (the
  executable vLLM's wheel ships; fastokens inside), one process;
- ``nginx-2x-fastokens``: two of ``fastokens`` behind an nginx round robin (a
  Service of replicas);
- ``mptok-render``: ``mptok render --frontends 2``.

The chats are agentic (a shared system prompt, tool calls and their outputs,
no session id) and grow to about ``--target-tokens``. At each concurrency C,
C client threads each run their own chats turn after turn (fresh chats per
C, the same for every service), every request ``/v1/chat/completions/render``
on a new connection. Reported per service and C: render p50/p99 (all turns
and later turns: each chat's last half), requests/s over the run's wall
time, CPU seconds per request of the service's processes (nginx included),
mptok's hits from its ``/metrics`` over the turns that can hit, and every
answer against ``vllm``'s for the same request: its ids, and the rest of it
(every other field, value and their order) byte for byte. The clients share the
machine with the services. Writes ``docs/results/bench_render.md``.

Every service but ``vllm-rs`` runs vLLM's own Python renderer, so an id or
an answer unlike ``vllm``'s there is a defect and the run exits 1. ``vllm-rs`` renders
with its own template engine and request handling: where its ids differ,
the report counts them and shows its first difference, decoded beside
vLLM's, as a fact about the baseline.

``--long``: the lengths coding agents send (``scripts/lengths.py``: 40k to
180k tokens, median about 70k, about 1,000 tokens a turn). An agent at such
a length has a long session behind it, and a client that resumes it sends
its long prefix first: each chat is sent from ``--long-turns`` turns before
its end (the prefix the agent resumes at, new to every service), not from
its first turn, which would spend the run on short prompts. Each client
thread runs one chat of every length, in an order rotated by its index, so
every thread carries the same work until the end and the concurrency stays
C. The model directory and every service take a context of
``LONG_CONTEXT`` tokens. Writes ``docs/results/bench_render_long.md``.

    .venv-vllm-0.34.0/bin/python -m scripts.bench_render              # about 12 minutes on 2 cores
    .venv-vllm-0.34.0/bin/python -m scripts.bench_render --target-tokens 70000 --concurrency 8
    .venv-vllm-0.34.0/bin/python -m scripts.bench_render --long       # about 30 minutes on 2 cores
    .venv-vllm-0.34.0/bin/python -m scripts.bench_render --long --smoke  # two short lengths at C=2, no report
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import re
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from mptok.render.options import SPARES
from mptok_harness.nginx import Nginx, render_nginx
from mptok_harness.serve import free_port, request, scrape
from mptok_harness.vllm import RENDER, MptokRender, VllmRsRender, VllmServer, write_model_dir
from mptok_harness.vllm_requests import TOOLS, agent_turns, text_source
from scripts.lengths import LONG_DELTA_TOKENS, LONG_TARGETS, SMOKE_LONG_TARGETS
from scripts.percentiles import percentile
from scripts.report import print_report
from scripts.smoke import parse_args_with_smoke

REPO = Path(__file__).resolve().parents[1]
REPORT = REPO / "docs" / "results" / "bench_render.md"
NGINX_TEMPLATE = REPO / "deploy" / "nginx-sticky.conf"
SERVICES = ("vllm", "fastokens", "vllm-rs", "nginx-2x-fastokens", "mptok-render")
OWN_RENDERER = ("vllm-rs",)  # not vLLM's Python renderer: its ids are compared and reported, not required equal
# Characters of these chats per token of the embedded tokenizer: at 3.3, 33
# turns of 4000 characters reached 32.7k tokens where --target-tokens asked
# for 40k.
CHARS_PER_TOKEN = 4.0
FASTOKENS = {"VLLM_USE_FASTOKENS": "1"}
PATH = "/v1/chat/completions/render"
TITLE = "A render tier beside its anchors: vllm launch render, with fastokens, vllm-rs render, two behind nginx, mptok render"
LONG_TITLE = "A render tier beside its anchors at coding-agent lengths"
CONTEXT = 131072  # the model directory's context and every service's --max-model-len
LONG_CONTEXT = 196608  # --long: the longest chat (about 181k tokens) and a margin
# --long: the characters of text a turn adds (agent_turns: a tool output, or
# an answer and a user message): about LONG_DELTA_TOKENS tokens of this text
# (measured with the model's tokenizer: a chat of 180 turns ends near 180k).
LONG_TURN_CHARS = 4450
# vLLM's request ids are random (a client names none here).
RANDOM_REQUEST_ID = re.compile(rb'"(chatcmpl|cmpl)-[0-9a-f]{16,32}"')
PACKAGES = ("mptok", "vllm", "transformers", "tokenizers", "fastokens", "gigatoken")


def agent_chat(seed: int, target_tokens: int, turn_chars: int, system: str) -> list[bytes]:
    """One keyless agent's request bodies, turn by turn (JSON), growing to about ``target_tokens``."""
    turns = max(2, int(target_tokens * CHARS_PER_TOKEN / turn_chars))
    return chat_bodies(seed, turns, turn_chars, system)


def resumed_chat(seed: int, target_tokens: int, sent_turns: int, system: str) -> list[bytes]:
    """The last ``sent_turns`` request bodies of a keyless agent's chat that
    grows by about ``LONG_DELTA_TOKENS`` a turn to about ``target_tokens``:
    the agent resumed at a long prefix, the rest of its session not sent."""
    turns = max(sent_turns, round(target_tokens / LONG_DELTA_TOKENS))
    return chat_bodies(seed, turns, LONG_TURN_CHARS, system, first=turns - sent_turns)


def chat_bodies(seed: int, turns: int, turn_chars: int, system: str, first: int = 0) -> list[bytes]:
    """The JSON bodies of turns ``first`` to ``turns`` of agent ``seed``'s chat, ``system`` its system prompt."""
    bodies = []
    for turn, messages in enumerate(agent_turns(seed, turns, turn_chars)):
        if turn < first:
            continue
        messages[0] = {"role": "system", "content": system}
        bodies.append(json.dumps({"messages": messages, "tools": TOOLS, "tool_choice": "none"}).encode())
    return bodies


def long_workload(concurrency: int, targets: tuple[int, ...], sent_turns: int, system: str) -> list[list[bytes]]:
    """``concurrency`` threads' chats for --long: chat ``i`` runs on thread
    ``i % concurrency`` (``drive``), so thread ``w`` runs one chat of every
    length of ``targets``, starting at the ``w``-th."""
    chats = []
    for index in range(concurrency * len(targets)):
        worker, rank = index % concurrency, index // concurrency
        target = targets[(worker + rank) % len(targets)]
        chats.append(resumed_chat(1000 * concurrency + index, target, sent_turns, system))
    return chats


@dataclass
class Service:
    """One render service: the port clients use and the processes whose CPU it costs."""

    name: str
    port: int
    model: str
    roots: list[int] = field(default_factory=list)  # pids whose trees are the service

    def processes(self) -> list[psutil.Process]:
        found = []
        for pid in self.roots:
            try:
                root = psutil.Process(pid)
                found += [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
        return found

    def cpu_s(self) -> float:
        total = 0.0
        for process in self.processes():
            try:
                times = process.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system + times.children_user + times.children_system
        return total


@dataclass(frozen=True)
class AnsweredIds:
    """An answer's ``token_ids`` as vLLM wrote them: their count and a digest of their JSON text.

    The Python services answer through vLLM's own JSON response, ``vllm-rs``
    through its own (without spaces): equal ids are equal text once spaces
    are removed, and a difference in the text is counted as wrong ids. The
    clients share the machine's cores with the services: parsing each
    answer's 400 KB of JSON into a list and an array cost a client 6 ms a
    request at the coding-agent lengths, as much CPU as the service under
    test spends on some requests; slicing and hashing the ids' text costs a
    fraction of a millisecond.
    """

    tokens: int
    digest: bytes
    # The answer but its ids, its random request id masked: equal for two
    # answers with the same fields and values in the same order, byte for byte.
    rest: bytes = field(default=b"", compare=False)

    @classmethod
    def of(cls, answer: bytes, field: bytes = b'"token_ids"') -> AnsweredIds:
        field_at = answer.index(field)
        start = answer.index(b"[", field_at)
        end = answer.index(b"]", start)  # a flat list of ints: its first "]" closes it
        text = answer[start + 1 : end].replace(b" ", b"")
        rest = hashlib.blake2b(RANDOM_REQUEST_ID.sub(rb'"\1-"', answer[:start] + answer[end:]), digest_size=16).digest()
        return cls(text.count(b",") + 1 if text.strip() else 0, hashlib.blake2b(text, digest_size=16).digest(), rest)


@dataclass
class Run:
    """One service at one concurrency."""

    seconds: list[float] = field(default_factory=list)
    later: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    wrong: int = 0
    first_wrong: bytes | None = None  # the first request whose ids differ from vLLM's
    unlike: int = 0  # answers with vLLM's ids whose other fields, values or order differ from vLLM's answer
    failed: int = 0
    hits: float = float("nan")


def drive(
    service: Service,
    chats: list[list[bytes]],
    concurrency: int,
    expected: dict[tuple[int, int], AnsweredIds],
    record: bool,
    path: str = PATH,
    field: bytes = b'"token_ids"',
) -> Run:
    """Chats ``chats`` split over ``concurrency`` threads, each turn after turn, each turn a POST to ``path``
    whose answer holds the ids in ``field``; a request that fails (a status but 200, a connection error) counts as failed."""
    run = Run()
    lock = threading.Lock()
    model = json.dumps(service.model)

    def client(worker: int) -> None:
        for chat in range(worker, len(chats), concurrency):
            turns = chats[chat]
            for turn, body in enumerate(turns):
                payload = b'{"model": ' + model.encode() + b", " + body[1:]
                started = time.perf_counter()
                try:
                    status, answer, _ = request(service.port, "POST", path, payload, timeout_s=300)
                except OSError:
                    status, answer = 0, b""
                elapsed = time.perf_counter() - started
                ids = AnsweredIds.of(answer, field) if status == 200 else None
                with lock:
                    if ids is None:
                        run.failed += 1
                        continue
                    run.seconds.append(elapsed)
                    if turn >= len(turns) // 2:
                        run.later.append(elapsed)
                    if record:
                        expected[(chat, turn)] = ids
                    elif ids != expected[(chat, turn)]:
                        run.wrong += 1
                        run.first_wrong = run.first_wrong or payload
                    elif ids.rest != expected[(chat, turn)].rest:
                        run.unlike += 1

    cpu_before = service.cpu_s()
    client_before = time.process_time()
    began = time.perf_counter()
    threads = [threading.Thread(target=client, args=(w,)) for w in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    run.wall_s = time.perf_counter() - began
    run.cpu_s = service.cpu_s() - cpu_before
    run.client_cpu_s = time.process_time() - client_before
    return run


def first_difference(reference: Service, other: Service, payload: bytes, model_dir: Path, window: int = 12) -> str:
    """Where ``other``'s ids for ``payload`` first differ from ``reference``'s, decoded: ``ref | other``."""
    from transformers import AutoTokenizer

    ids = [json.loads(request(service.port, "POST", PATH, payload, timeout_s=300)[1])["token_ids"] for service in (reference, other)]
    at = next((i for i, pair in enumerate(zip(*ids)) if pair[0] != pair[1]), min(map(len, ids)))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return " | ".join(f"`{tokenizer.decode(answer[max(0, at - window) : at + window])!r}`" for answer in ids)


def mptok_hits(service: Service) -> float:
    return sum(value for name, _, value in scrape(service.port) if name == "mptok_cache_hits_total")


def measured(
    label: str,
    service: Service,
    chats: list[list[bytes]],
    concurrency: int,
    expected: dict[tuple[int, int], AnsweredIds],
    record: bool,
    count_hits: bool,
    path: str = PATH,
    field: bytes = b'"token_ids"',
) -> Run:
    """``drive``, with the cache hits it made when ``count_hits`` (mptok's counter), printed in one line as ``label``."""
    before = mptok_hits(service) if count_hits else 0.0
    run = drive(service, chats, concurrency, expected, record, path, field)
    if count_hits:
        time.sleep(1.0)  # the counters reach /metrics every 0.5 s
        run.hits = mptok_hits(service) - before
    print(f"{label}: p50 {percentile(run.seconds, 0.5) * 1000:.1f} ms, "
          f"{len(run.seconds) / run.wall_s:.1f} req/s, wrong {run.wrong}, failed {run.failed}", flush=True)  # fmt: skip
    return run


def report_row(
    label: str, name: str, run: Run, chats: list[list[bytes]], count_hits: bool, client_cpu: bool, unlike: bool = False
) -> str:
    """A report's table row of ``run`` over ``chats``: latencies, requests/s, CPU per request (the client's
    too when ``client_cpu``), the hits of the turns that can hit when ``count_hits``, wrong, answers unlike
    vLLM's besides their ids when ``unlike``, failed."""
    can_hit = sum(len(chat) for chat in chats) - len(chats)
    hits = f"{run.hits:.0f} of {can_hit} ({run.hits / can_hit:.0%})" if count_hits else ""
    client = f" | {run.client_cpu_s / max(1, len(run.seconds)) * 1000:.1f}" if client_cpu else ""
    return (
        f"| {label} | {name} | {percentile(run.seconds, 0.5) * 1000:.1f} | {percentile(run.seconds, 0.99) * 1000:.1f} "
        f"| {percentile(run.later, 0.5) * 1000:.1f} | {len(run.seconds) / run.wall_s:.1f} "
        f"| {run.cpu_s / max(1, len(run.seconds)) * 1000:.1f}{client} | {hits} | {run.wrong} |"
        f"{f' {run.unlike} |' if unlike else ''} {run.failed} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-tokens", type=int, default=40_000)
    parser.add_argument("--turn-chars", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--chats-per-client", type=int, default=1)
    parser.add_argument(
        "--long", action="store_true",
        help=f"chats at coding-agent lengths ({', '.join(f'{t // 1000}k' for t in LONG_TARGETS)} tokens), each resumed "
        "--long-turns turns before its end, one of each length per client thread; writes docs/results/bench_render_long.md",
    )  # fmt: skip
    parser.add_argument("--long-turns", type=int, default=10, help="--long: the turns each chat sends (default 10)")
    parser.add_argument("--report-dir", type=Path, default=REPORT.parent)
    parser.add_argument("--no-write", action="store_true", help="print the report, write no file")
    smoke = {"concurrency": [2], "target_tokens": 6_000, "long_turns": 3, "no_write": True}
    args = parse_args_with_smoke(parser, smoke)

    system = "You are a coding agent. " + text_source(1)(3000)
    if args.long:
        targets = SMOKE_LONG_TARGETS if args.smoke else LONG_TARGETS
        workloads = {c: long_workload(c, targets, args.long_turns, system) for c in args.concurrency}
    else:
        workloads = {
            c: [agent_chat(1000 * c + n, args.target_tokens, args.turn_chars, system) for n in range(c * args.chats_per_client)]
            for c in args.concurrency
        }
    context = LONG_CONTEXT if args.long else CONTEXT
    results: dict[str, dict[int, Run]] = defaultdict(dict)
    differences: dict[str, str] = {}  # service -> its first difference from vLLM's ids
    lengths: dict[tuple[int, int, int], int] = {}  # (C, chat, turn) -> prompt tokens
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model_dir(Path(tmp) / "model", context=context)
        started: list[Any] = []
        try:
            plain = VllmServer(model, Path(tmp) / "vllm.log", mptok=False, api_servers=1, command=RENDER, max_model_len=context)
            fast = VllmServer(model, Path(tmp) / "fastokens.log", mptok=False, api_servers=1, command=RENDER, env=FASTOKENS, max_model_len=context)
            replicas = [
                VllmServer(model, Path(tmp) / f"replica{i}.log", mptok=False, api_servers=1, command=RENDER, env=FASTOKENS, max_model_len=context)
                for i in range(2)
            ]
            rust = VllmRsRender(model, Path(tmp) / "vllm-rs.log", max_model_len=context)
            tier = MptokRender(model, Path(tmp) / "mptok-render.log", frontends=2, max_model_len=context)
            for server in (plain, fast, rust, *replicas, tier):
                started.append(server.launch())
            for server in started:
                server.wait_started(900)
            tier.wait_spares_ready(SPARES, 900)
            nginx_port = free_port()
            config = render_nginx(NGINX_TEMPLATE, f"127.0.0.1:{nginx_port}", [f"127.0.0.1:{r.port}" for r in replicas], round_robin=True)
            nginx = Nginx(Path(tmp) / "nginx", config, nginx_port)
            started.append(nginx)
            services = {
                "vllm": Service("vllm", plain.port, plain.model, [plain.process.pid]),
                "fastokens": Service("fastokens", fast.port, fast.model, [fast.process.pid]),
                "vllm-rs": Service("vllm-rs", rust.port, rust.model, [rust.process.pid]),
                "nginx-2x-fastokens": Service(
                    "nginx-2x-fastokens", nginx_port, plain.model, [nginx.process.pid, *(r.process.pid for r in replicas)]
                ),
                "mptok-render": Service("mptok-render", tier.port, tier.model, [tier.process.pid]),
            }
            for concurrency, chats in workloads.items():
                expected: dict[tuple[int, int], AnsweredIds] = {}
                for name in SERVICES:
                    results[name][concurrency] = measured(
                        f"C={concurrency} {name}", services[name], chats, concurrency, expected, name == "vllm", name == "mptok-render"
                    )
                    run = results[name][concurrency]
                    if run.first_wrong and name not in differences:
                        differences[name] = first_difference(services["vllm"], services[name], run.first_wrong, model)
                lengths.update({(concurrency, chat, turn): ids.tokens for (chat, turn), ids in expected.items()})
        finally:
            for server in reversed(started):
                server.stop()
    body = _report(results, workloads, lengths, differences, args)
    if args.no_write:
        print(body)
    else:
        print_report(
            LONG_TITLE if args.long else TITLE, body, python=f".venv-vllm-{importlib.metadata.version('vllm')}/bin/python", packages=PACKAGES,
            directory=args.report_dir, file="bench_render_long" if args.long else None,
        )  # fmt: skip
    return 1 if any(
        run.failed or ((run.wrong or run.unlike) and name not in OWN_RENDERER) for name, runs in results.items() for run in runs.values()
    ) else 0


def _report(
    results: dict[str, dict[int, Run]], workloads: dict[int, list[list[bytes]]], lengths: dict[tuple[int, int, int], int],
    differences: dict[str, str], args: Any,
) -> str:
    rows = []
    for concurrency, chats in workloads.items():
        for name in SERVICES:
            rows.append(
                report_row(str(concurrency), name, results[name][concurrency], chats, name == "mptok-render", client_cpu=True, unlike=True)
            )
    ratios = []
    for concurrency in workloads:
        rate = {name: len(results[name][concurrency].seconds) / results[name][concurrency].wall_s for name in SERVICES}
        cpu = {name: results[name][concurrency].cpu_s / max(1, len(results[name][concurrency].seconds)) for name in SERVICES}
        ratios.append(
            f"- C={concurrency}: mptok render {rate['mptok-render'] / rate['fastokens']:.2f}x the requests/s of vLLM with "
            f"fastokens, {rate['mptok-render'] / rate['nginx-2x-fastokens']:.2f}x two of them behind nginx, "
            f"{rate['mptok-render'] / rate['vllm-rs']:.2f}x vllm-rs render, "
            f"{rate['mptok-render'] / rate['vllm']:.2f}x vLLM without fastokens; vllm-rs render "
            f"{rate['vllm-rs'] / rate['fastokens']:.2f}x vLLM with fastokens. CPU per request: mptok render "
            f"{cpu['mptok-render'] / cpu['vllm-rs']:.2f}x vllm-rs render's, {cpu['mptok-render'] / cpu['fastokens']:.2f}x vLLM with "
            "fastokens'."
        )
    chats_per_c = ", ".join(f"{len(chats)} at C={c}" for c, chats in workloads.items())
    tokens = list(lengths.values())
    if args.long:
        targets = SMOKE_LONG_TARGETS if args.smoke else LONG_TARGETS
        sent = len(next(iter(workloads.values()))[0])
        last = [n for (_, _, turn), n in lengths.items() if turn == sent - 1]
        first = [n for (_, _, turn), n in lengths.items() if turn == 0]
        chats = (
            f"Keyless agentic chats (shared system prompt, tool calls and outputs, no session id) at coding-agent lengths: "
            f"chats growing by about {LONG_DELTA_TOKENS:,} tokens a turn to {min(last):,}-{max(last):,} prompt tokens "
            f"(median {statistics.median(last):,.0f}; one chat of each of {', '.join(f'{t // 1000}k' for t in targets)} "
            f"tokens per client thread, "
            f"in an order rotated by the thread's index). Each chat is resumed at a long prefix, as a client resuming an "
            f"agent's session sends it: its last {sent} turns, the first of them ({min(first):,}-{max(first):,} tokens) "
            f"new to every service, so {sent - 1} of its {sent} turns can hit; the requests' median is "
            f"{statistics.median(tokens):,.0f} tokens. {chats_per_c}, each client thread running its chats one after "
            f"another, turn after turn,"
        )
    else:
        chats = (
            f"Keyless agentic chats (shared system prompt, tool calls and outputs, no session id) of "
            f"{len(next(iter(workloads.values()))[0])} turns growing to {max(tokens):,} prompt tokens "
            f"({min(tokens):,} at the first turn); {chats_per_c}, each client thread running its chats turn after turn,"
        )
    return "\n".join(
        [
            f"{chats} every request `{PATH}` on a new connection. Every service runs while another is measured (idle). "
            "CPU per request: user + system seconds of the service's processes (nginx included) over the run, per request. "
            "The clients run on the same machine, on the same two cores (client CPU: the benchmark process's, per request); "
            "each compares an answer's ids with vLLM's by the digest of their JSON text, and the rest of the answer (every "
            "other field, value and their order; the random request id masked) by the digest of its bytes (`AnsweredIds`).",
            "",
            "| C | service | render p50 ms | p99 ms | later turns p50 ms | requests/s | CPU ms/request | client CPU ms/request "
            "| mptok hits | ids unlike vLLM's | other fields unlike vLLM's | failed |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
            *rows,
            "",
            *ratios,
            "",
            *(
                f"- {name}'s ids differ from vLLM's on {sum(run.wrong for run in results[name].values())} of "
                f"{sum(len(run.seconds) for run in results[name].values())} answers; the first difference, vLLM's "
                f"ids | {name}'s, decoded: {difference}"
                for name, difference in differences.items()
            ),
            "",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())

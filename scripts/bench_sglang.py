#!/usr/bin/env python3
"""Benchmark: SGLang with ``mptok sglang`` beside stock SGLang, on keyless agentic chats, two tokenizer workers.

Three services of one model directory (``mptok_harness.sglang``), each with
``--tokenizer-worker-num 2``, started one after the other (an SGLang server
holds several GB; two at once do not fit beside the clients on a small
machine):

- ``huggingface``: stock SGLang (its default tokenizer backend, with
  ``parallel_prompt_encode``, on by default from 32,768 characters);
- ``fastokens``: stock SGLang with ``--tokenizer-backend fastokens``, and
  ``SGLANG_PARALLEL_PROMPT_ENCODE=0``: in SGLang 0.5.23
  ``parallel_prompt_encode`` fails on fastokens' tokenizer (its
  post-processor has no ``num_special_tokens_to_add``), so every chat of
  32,768 characters or more gets a 500 without it;
- ``mptok``: ``mptok sglang`` with the same arguments.

The workloads are ``scripts/bench_render.py``'s: keyless agentic chats (a
shared system prompt, tool calls and outputs, no session id) growing to
about ``--target-tokens``, and at the lengths coding agents send
(``scripts/lengths.py``: 40k to 180k tokens, median about 70k, each chat
resumed ``--long-turns`` turns before its end). C client threads each run
their chats turn after turn, every request ``/v1/tokenize`` with the chat's
messages and tools (SGLang's render-only chat endpoint: the template and
the tokenization, no engine) on a new connection. Reported per service and
workload: tokenize p50/p99 (all turns and later turns: each chat's last
half), requests/s over the run's wall time, CPU seconds per request of the
service's processes, mptok's hits from its ``/metrics`` over the turns that
can hit, and every answer's ids against the first service's for the same
request (``--services`` orders them). Writes ``docs/results/bench_sglang.md``.

    .venv-sglang/bin/python -m scripts.bench_sglang            # about 15 minutes on 2 cores
    .venv-sglang/bin/python -m scripts.bench_sglang --smoke    # short chats, C=2, no report
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from mptok_harness.sglang import SglangServer, write_model_dir
from mptok_harness.vllm_requests import text_source
from scripts.bench_render import LONG_CONTEXT, AnsweredIds, Run, Service, agent_chat, long_workload, measured, report_row
from scripts.lengths import LONG_DELTA_TOKENS, LONG_TARGETS, SMOKE_LONG_TARGETS
from scripts.percentiles import percentile
from scripts.report import print_report
from scripts.smoke import parse_args_with_smoke

SERVICES = ("huggingface", "fastokens", "mptok")
PATH = "/v1/tokenize"
WORKERS = 2
TITLE = "SGLang with mptok sglang beside stock SGLang (huggingface, fastokens), two tokenizer workers"
PACKAGES = ("mptok", "sglang", "transformers", "tokenizers", "fastokens", "gigatoken")
FIELD = b'"tokens"'


def server_for(name: str, model: Path, log: Path) -> SglangServer:
    if name == "fastokens":
        return SglangServer(
            model, log, mptok=False, workers=WORKERS, extra_args=("--tokenizer-backend", "fastokens"),
            env={"SGLANG_PARALLEL_PROMPT_ENCODE": "0"},
        )  # fmt: skip
    return SglangServer(model, log, mptok=name == "mptok", workers=WORKERS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-tokens", type=int, default=40_000)
    parser.add_argument("--turn-chars", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--long-turns", type=int, default=10, help="the turns each coding-agent chat sends (default 10)")
    parser.add_argument(
        "--services", type=lambda text: text.split(","), default=list(SERVICES),
        help=f"the services in the order they run, the first the ids' reference (default {','.join(SERVICES)})",
    )  # fmt: skip
    parser.add_argument("--report-dir", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "results")
    parser.add_argument("--no-write", action="store_true", help="print the report, write no file")
    smoke = {"concurrency": 2, "target_tokens": 6_000, "long_turns": 3, "no_write": True}
    args = parse_args_with_smoke(parser, smoke)

    system = "You are a coding agent. " + text_source(1)(3000)
    c = args.concurrency
    workloads = {
        f"~{args.target_tokens // 1000}k": [agent_chat(1000 * c + n, args.target_tokens, args.turn_chars, system) for n in range(c)],
        "coding-agent": long_workload(c, SMOKE_LONG_TARGETS if args.smoke else LONG_TARGETS, args.long_turns, system),
    }
    if sorted(args.services) != sorted(SERVICES):
        parser.error(f"--services orders {', '.join(SERVICES)}")
    results: dict[str, dict[str, Run]] = {name: {} for name in SERVICES}
    lengths: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model_dir(Path(tmp) / "model", context=LONG_CONTEXT)
        expected: dict[str, dict[tuple[int, int], AnsweredIds]] = {w: {} for w in workloads}
        for name in args.services:
            server = server_for(name, model, Path(tmp) / f"{name}.log")
            try:
                server.start()
                service = Service(name, server.port, server.model, [server.process.pid])
                for workload, chats in workloads.items():
                    results[name][workload] = measured(
                        f"{workload} {name}", service, chats, c, expected[workload], name == args.services[0], name == "mptok", PATH, FIELD
                    )
            finally:
                server.stop()
        for workload in workloads:
            lengths[workload] = [ids.tokens for ids in expected[workload].values()]
    body = _report(results, workloads, lengths, args)
    if args.no_write:
        print(body)
    else:
        print_report(TITLE, body, python=".venv-sglang/bin/python", packages=PACKAGES, directory=args.report_dir)
    return 1 if any(run.wrong or run.failed for runs in results.values() for run in runs.values()) else 0


def _report(results: dict[str, dict[str, Run]], workloads: dict[str, list[list[bytes]]], lengths: dict[str, list[int]], args: Any) -> str:
    rows, ratios = [], []
    for workload, chats in workloads.items():
        for name in SERVICES:
            rows.append(report_row(workload, name, results[name][workload], chats, name == "mptok", client_cpu=False))
        rate = {name: len(results[name][workload].seconds) / results[name][workload].wall_s for name in SERVICES}
        later = {name: percentile(results[name][workload].later, 0.5) for name in SERVICES}
        ratios.append(
            f"- {workload}: mptok {rate['mptok'] / rate['fastokens']:.2f}x the requests/s of SGLang with fastokens and "
            f"{rate['mptok'] / rate['huggingface']:.2f}x stock huggingface; later-turn p50 "
            f"{later['fastokens'] / later['mptok']:.2f}x faster than fastokens', {later['huggingface'] / later['mptok']:.2f}x "
            f"faster than huggingface's."
        )
    describe = []
    for workload, tokens in lengths.items():
        describe.append(f"{workload}: {len(workloads[workload])} chats, {sum(len(c) for c in workloads[workload])} requests of "
                        f"{min(tokens):,}-{max(tokens):,} tokens (median {statistics.median(tokens):,.0f})")  # fmt: skip
    return "\n".join(
        [
            f"Keyless agentic chats (shared system prompt, tool calls and outputs, no session id), C={args.concurrency} "
            f"client threads each running its chats turn after turn, every request `{PATH}` with the chat's messages and "
            f"tools on a new connection, against SGLang with `--tokenizer-worker-num {WORKERS}` on CPU. "
            f"{'; '.join(describe)}. The coding-agent chats grow by about {LONG_DELTA_TOKENS:,} tokens a turn, each "
            f"resumed {args.long_turns} turns before its end (its first request new to every service). Services run one "
            "at a time. CPU per request: user + system seconds of the service's processes over the run, per request. "
            f"The clients run on the same two cores. Ids are compared with {args.services[0]}'s by the digest of their JSON text. "
            "SGLang with fastokens runs with `SGLANG_PARALLEL_PROMPT_ENCODE=0`: in SGLang 0.5.23 its `parallel_prompt_encode` "
            "fails on fastokens' tokenizer (a 500 for every chat of 32,768 characters or more).",
            "",
            "| workload | service | tokenize p50 ms | p99 ms | later turns p50 ms | requests/s | CPU ms/request "
            f"| mptok hits | ids unlike {args.services[0]}'s | failed |",
            "|---|---|---:|---:|---:|---:|---:|---|---:|---:|",
            *rows,
            "",
            *ratios,
            "",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())

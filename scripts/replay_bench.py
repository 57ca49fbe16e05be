#!/usr/bin/env python3
"""Replay agentic conversations over HTTP against four ways of serving them.

Is mptok's routing between frontends worth it, compared with no cache, a
cache per frontend without routing, and sticky routing by a real nginx?
Each conversation is built from real text (``mptok_harness.texts``: fixed by
the installed versions, never by an edit of this repository): a system
prompt and answers from the READMEs of mptok's dependencies and the system's
license texts, a task, tool outputs from the standard library's sources and
the dependencies' file lists, each about --delta-tokens long, until the
rendered prompt reaches --target-tokens. Every turn is sent as {"messages": [...],
"add_generation_prompt": true} through the built-in DeepSeek V3 chat template,
so a prompt ends in the generation prompt "<｜Assistant｜>"; when a tool
output follows a tool output (about a third of the turns), the next turn's
text replaces that generation prompt with "<｜User｜>..." (a rewrite, not an
extension). The expected ids of every turn (the template rendered locally,
then `tokenizer(text, add_special_tokens=False)`) are computed before any
server starts (in --jobs processes, each conversation from its own random
stream), and EVERY answer is compared with them. They are kept in
.cache/replay/ under a digest of everything they depend on (the options
that shape the conversations, the source texts, the tokenizer, the chat
template, the code that builds them), so a run with the same inputs reads
them back; --no-build-cache computes them again.

Modes (F = --frontends):

  no-cache-tokenizers
            `mptok serve --frontends F --tokenizer-backend tokenizers` with
            MPTOK_CACHE_MIN_CHARS=10**12: every prompt "too short", tokenized in
            full by `tokenizers` (the old baseline: a frontend without a fast
            engine; the supervisor's environment reaches the spawned frontends,
            checked by the uncached counter)
  no-cache  the same with the fast backend (--backend): every prompt tokenized
            in full by the fastest exact engine (what vLLM's fastokens switch
            gives; a "too short" prompt goes through the cache's backend)
  no-route  F x `mptok serve --frontends 1` on F ports behind nginx round robin
            (mptok serve has no switch to turn routing off; a cache per
            frontend that only sees the turns that land on it)
  mptok     `mptok serve --frontends F`: one listening socket + mptok's routing
  keyless   the same server, the same conversations sent without X-Session-Id:
            routed by the identity mptok derives from each chat's messages up to
            its first user message (what an OpenAI SDK client gets)
  sticky    F x `mptok serve --frontends 1` behind nginx with
            `hash $http_x_session_id consistent;` (deploy/nginx-sticky.conf)
  mptok-always, mptok-never
            mptok with `--routing always` (every turn to its owner) or
            `--routing never` (a cache per frontend on one port); only when
            --modes names them

Every mode but no-cache-tokenizers runs on --backend (default auto: each
frontend takes the cheapest engine that passes its start-up check); the
table names the engine every frontend used, from the
`mptok_tokenizer_backend_*` gauges of its /metrics, and the fast engines'
background re-checks that found a difference (there must be none).

Every turn is a new HTTP connection (to nginx in no-route/sticky, straight to
the port otherwise); --clients threads replay the conversations, each one
conversation at a time, turn after turn. Per mode: server-side tokenize ms
p50/p99 (each answer's `Server-Timing: tokenize;dur=...`: the time from the
parsed request to the ids, routing included, no HTTP, no JSON, no chat
template), end-to-end ms p50/p99 (client clock, connect to last byte, JSON
parse excluded), requests/s (turns / wall time of the mode), server CPU ms
per turn (every server process, nginx included, from psutil), hit rate
(hits / (hits + misses) from /metrics), and checked-exact.

Every mode runs --repeat times (3), the runs interleaved (each round starts
with another mode, every other round backwards) and their samples pooled: on this 2-core machine one run's
p50 moves by 10-20% from run to run, and where nginx's consistent-hash ring
puts 8 conversations changes with the instances' ports. Under the table:
mptok's turns split by whether their connection reached the conversation's
owner, and the replay's targets against the measurements they name.

Run from the repository's root:

    make replay                                              # about 7 minutes on 2 cores
    .venv/bin/python -m scripts.replay_bench --modes mptok,sticky --repeat 1 --no-write
    .venv/bin/python -m scripts.replay_bench --conversations 16 --clients 8 --target-tokens 60000
    .venv/bin/python -m scripts.replay_bench --smoke         # every mode, F = 2, 2 short conversations, no report
    make replay-long                                         # --long: coding-agent lengths, docs/results/replay_long.md

Writes the Markdown to stdout and (unless --no-write) the report
docs/results/replay_bench.md (replay_long.md with --long) and a PNG beside it (server tokenize ms and
end-to-end ms against prompt tokens, a line per mode; matplotlib comes with
`make replay`). A progress bar goes to stderr when it is a terminal. Exit
status 1 on any wrong id or failed request.
"""

from __future__ import annotations

import argparse
import array
import collections
import contextlib
import hashlib
import inspect
import multiprocessing
import os
import pickle
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psutil

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import mptok  # noqa: E402
from mptok.api.affinity import chat_identity  # noqa: E402
from mptok.api.chat_template import ChatTemplate  # noqa: E402
from mptok.core.settings import CHOICES  # noqa: E402
from mptok_harness.nginx import Nginx, nginx_binary, render_nginx  # noqa: E402
from mptok_harness.serve import Server, free_port, request, scrape, total, wait_for_snapshots  # noqa: E402
from mptok_harness.texts import license_texts, package_descriptions, package_file_lists, stdlib_sources  # noqa: E402
from scripts.lengths import LONG_DELTA_TOKENS, LONG_TARGETS, SMOKE_LONG_TARGETS  # noqa: E402
from scripts.percentiles import percentile  # noqa: E402
from scripts.report import REPO, RESULTS_DIR, write_report  # noqa: E402
from scripts.smoke import parse_args_with_smoke  # noqa: E402

STICKY_TEMPLATE = REPO / "deploy" / "nginx-sticky.conf"
PLOT = RESULTS_DIR / "replay_bench.png"
LONG_TITLE = "The replay at coding-agent lengths"
BUILD_CACHE = REPO / ".cache" / "replay"
MODES = ("no-cache-tokenizers", "no-cache", "no-route", "mptok", "keyless", "sticky", "mptok-always", "mptok-never")
# Run only when --modes names them: mptok under the routing policy an operator
# can set instead of the default ("kept"), for comparing the policies.
POLICY_MODES = {"mptok-always": "always", "mptok-never": "never"}
DEFAULT_MODES = tuple(m for m in MODES if m not in POLICY_MODES)
TITLE = "The replay: the same conversations served six ways"
# The report's fixed part: what the modes and the columns are.
ABOUT = """\
Multi-turn agentic conversations (a system prompt, a task, then answers and
tool outputs of equal size; the sizes are in the line under the command) sent as
`{"messages": [...], "add_generation_prompt": true}` through the built-in
DeepSeek V3 template, a new connection per turn. When a tool output follows
a tool output, the next turn replaces the previous generation prompt
`<｜Assistant｜>` with `<｜User｜>...` (a rewrite, not an extension). Every
answer is compared with full tokenization computed before any server starts.

| mode | what runs |
|---|---|
| no-cache-tokenizers | `mptok serve --frontends F --tokenizer-backend tokenizers` with `MPTOK_CACHE_MIN_CHARS=10^12`: every prompt counts as too short and is tokenized in full by `tokenizers` (a frontend without a fast engine) |
| no-cache | the same on the fast backend: every prompt tokenized in full by the fastest exact engine (what vLLM's fastokens switch gives a frontend) |
| no-route | F separate `mptok serve --frontends 1` behind nginx round robin: a cache per frontend that sees only the turns that land on it |
| mptok | `mptok serve --frontends F`: the frontends accept from one listening socket, mptok routes each conversation to its owner |
| keyless | the same server, the conversations sent without `X-Session-Id`: routed by the identity mptok derives from the messages |
| sticky | the same F instances behind nginx with `hash $http_x_session_id consistent;` (`deploy/nginx-sticky.conf`) |
| mptok-always, mptok-never | `mptok serve --frontends F --routing always` (every turn sent to its conversation's owner) or `--routing never` (a cache per frontend behind one port); run when `--modes` names them |

Every mode but no-cache-tokenizers runs on the fast backend (`auto` unless
the command says otherwise: each frontend takes the cheapest engine that
gives identical ids on its start-up check). *Backend*: the engine each
frontend tokenized with, from its `/metrics` (`mptok_tokenizer_backend_*`),
over every run, and the background re-checks of fast results that found a
difference (`mptok_tokenizer_backend_mismatches_total`).
*Server tokenize ms*: each answer's `Server-Timing: tokenize;dur=...`, from
the parsed request to the ids, routing included, HTTP, JSON and the chat
template excluded. *End-to-end*: the client's clock, connect to last byte.
*requests/s*: turns / wall time of the mode. *Server CPU ms per turn*: user
+ system CPU of every server process (supervisors, frontends, nginx), from
psutil. *Hit rate*: hits / (hits + misses) from `/metrics`. *Turns per
instance*: the turns each `mptok serve` tokenized, run by run. The client
threads share the machine's cores with the servers, so the latencies include
queueing.
"""
NO_CACHE_ENV = {"MPTOK_CACHE_MIN_CHARS": str(10**12)}
NO_CACHE_MODES = ("no-cache-tokenizers", "no-cache")
# The engines a frontend's /metrics can name (mptok_tokenizer_backend_<engine>).
ENGINE_GAUGES = ("tokenizers", "fastokens", "gigatoken")
# The packages whose versions shape the replay's figures (its report's header).
PACKAGES = ("mptok", "tokenizers", "transformers", "fastokens", "gigatoken")
# Prompts a frontend's cache handled: its share of the conversations' work.
CACHE_WORK = ("mptok_cache_hits_total", "mptok_cache_misses_total", "mptok_cache_uncached_total")


# -- the conversations ------------------------------------------------------------


@dataclass
class Turn:
    messages: int  # this turn's prompt: the conversation's first ``messages`` messages
    tokens: int  # how many ids it has
    reused: int  # its ids: the previous turn's first ``reused`` ids, then ``tail``
    tail: array.array  # int32 ids
    rewrite: bool  # this turn's text replaces the previous one's generation prompt


@dataclass
class Conversation:
    """A conversation's messages and, per turn, how its expected ids follow
    from the previous turn's: kept this way (not as each turn's body and ids)
    so that 64 conversations of 38k tokens fit in memory and on disk."""

    session: str
    derived: str = ""  # the identity mptok derives when no session id is sent
    messages: list[dict[str, str]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)

    def body(self, turn: Turn) -> bytes:
        return orjson.dumps({"messages": self.messages[: turn.messages], "add_generation_prompt": True})

    @staticmethod
    def expected(turn: Turn, previous: array.array) -> array.array:
        """``turn``'s expected ids, given the previous turn's (empty for the first)."""
        return previous[: turn.reused] + turn.tail


def sources() -> dict[str, str]:
    """Real text, the same until an installed version changes: prose, listings, code."""
    readmes = package_descriptions()
    return {"system": readmes, "prose": readmes + "\n" + license_texts(), "logs": package_file_lists(), "code": stdlib_sources()}


@dataclass(frozen=True)
class BuildParams:
    count: int
    target_tokens: int
    delta_tokens: int
    seed: int
    shared_system: bool = False
    # Per-conversation lengths, used in turn instead of target_tokens when given.
    targets: tuple[int, ...] = ()

    def target_of(self, index: int) -> int:
        return self.targets[index % len(self.targets)] if self.targets else self.target_tokens


class _Builder:
    """Builds conversation ``index`` of ``params``: its own random stream,
    so conversations can be built in any order, in parallel processes."""

    def __init__(self, tokenizer: Any, template: ChatTemplate, params: BuildParams, text: dict[str, str]):
        self.tokenizer, self.template, self.params, self.text = tokenizer, template, params, text
        self.chars_per_token = {}
        for name, body in text.items():
            sample = body[:100_000]
            self.chars_per_token[name] = len(sample) / len(tokenizer(sample, add_special_tokens=False)["input_ids"])
        self.fleet_system = self._chunk(random.Random(params.seed), "system", 1500)

    def _chunk(self, rng: random.Random, name: str, tokens: int) -> str:
        n = int(tokens * self.chars_per_token[name])
        body = self.text[name]
        start = rng.randrange(max(1, len(body) - n))
        return body[start : start + n]

    def __call__(self, index: int) -> Conversation:
        params, rng = self.params, random.Random(f"{self.params.seed}:{index}")
        messages = [
            {"role": "system", "content": self.fleet_system if params.shared_system else self._chunk(rng, "system", 1500)},
            {"role": "user", "content": "Task: find out why the build log shows these warnings and fix them.\n" + self._chunk(rng, "logs", 200)},
        ]
        conv = Conversation(session=f"replay-{params.seed}-{index}", derived=chat_identity(messages), messages=messages)
        last_role = "user"
        previous = array.array("i")
        target = params.target_of(index)
        while not conv.turns or conv.turns[-1].tokens < target:
            # After an answer: a tool output. After a tool output: an answer (2/3) or
            # another tool output (1/3, which rewrites the generation prompt).
            if last_role == "user" and conv.turns and rng.random() < 2 / 3:
                messages.append({"role": "assistant", "content": self._chunk(rng, "prose", params.delta_tokens)})
                last_role, rewrite = "assistant", False
            elif conv.turns:
                rewrite = last_role == "user"
                tool = rng.choice(("code", "code", "logs"))
                name = "read_file" if tool == "code" else "shell"
                messages.append({"role": "user", "content": f"<tool_output name=\"{name}\">\n{self._chunk(rng, tool, params.delta_tokens)}\n</tool_output>"})
                last_role = "user"
            else:
                rewrite = False
            rendered = self.template.render(self.tokenizer, messages, True)
            expected = array.array("i", self.tokenizer(rendered, add_special_tokens=False)["input_ids"])
            reused = shared_ids(previous, expected)
            conv.turns.append(Turn(len(messages), len(expected), reused, expected[reused:], rewrite))
            previous = expected
        return conv


def shared_ids(a: array.array, b: array.array) -> int:
    """How many ids ``a`` and ``b`` share at their start (bisected in C-level slices)."""
    low, high = 0, min(len(a), len(b))
    if a[:high] == b[:high]:
        return high
    while high - low > 1:  # a[:low] == b[:low], a[:high] != b[:high]
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low


_building: _Builder | None = None  # the builder a forked worker inherits


def _build_in_worker(index: int) -> Conversation:
    return _building(index)


def build(
    tokenizer: Any,
    template: ChatTemplate,
    params: BuildParams,
    progress: Progress,
    jobs: int = 1,
    cache_dir: Path | None = None,
) -> list[Conversation]:
    """The conversations of ``params`` and their expected ids (full
    tokenization of every turn, in ``jobs`` forked processes). With
    ``cache_dir``, kept there under a digest of everything the ids depend on
    (the parameters, the source texts, the tokenizer, the chat template), so
    a second run with the same inputs reads them back instead."""
    global _building
    text = sources()
    path = None
    if cache_dir is not None:
        path = cache_dir / f"conversations-{build_digest(tokenizer, template, params, text)}.pickle"
        if path.exists():
            with open(path, "rb") as f:
                return pickle.load(f)
    _building = _Builder(tokenizer, template, params, text)
    conversations: list[Conversation] = []
    try:
        if jobs > 1:
            with multiprocessing.get_context("fork").Pool(jobs) as pool:
                for conv in pool.imap(_build_in_worker, range(params.count)):
                    conversations.append(conv)
                    progress.update("building conversations", len(conversations), params.count)
        else:
            for index in range(params.count):
                conversations.append(_building(index))
                progress.update("building conversations", len(conversations), params.count)
    finally:
        _building = None
    progress.done()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        with open(partial, "wb") as f:
            pickle.dump(conversations, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(partial, path)
    return conversations


def build_digest(tokenizer: Any, template: ChatTemplate, params: BuildParams, text: dict[str, str]) -> str:
    """What the conversations and their expected ids depend on, hashed."""
    digest = hashlib.sha256(repr(params).encode())
    for name in sorted(text):
        digest.update(name.encode() + b"\0" + text[name].encode("utf-8", "surrogatepass") + b"\0")
    digest.update(tokenizer.backend_tokenizer.to_str().encode())
    digest.update(repr((template.source, template.origin)).encode())
    digest.update(inspect.getsource(sys.modules[ChatTemplate.__module__]).encode())
    for how in (BuildParams, _Builder, Turn, Conversation, shared_ids):  # how they are built
        digest.update(inspect.getsource(how).encode())
    return digest.hexdigest()[:24]


# -- progress -----------------------------------------------------------------


class Progress:
    """One line on stderr, redrawn: label [#####.....] n/total. Only when
    ``enabled`` and stderr is a terminal: in a log file each redraw would be
    a line of its own."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and sys.stderr.isatty()
        self._lock = threading.Lock()

    def update(self, label: str, n: int, of: int) -> None:
        if not self.enabled:
            return
        width = 30
        filled = min(width, int(width * n / max(1, of)))
        with self._lock:
            sys.stderr.write(f"\r{label:<40} [{'#' * filled}{'.' * (width - filled)}] {n}/{of}   ")
            sys.stderr.flush()

    def done(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


# -- one mode -------------------------------------------------------------------


@dataclass
class ModeResult:
    mode: str
    how: str
    requests: int = 0
    checked: int = 0
    exact: int = 0
    failed: int = 0
    wall_s: float = 0.0
    e2e_ms: list[float] = field(default_factory=list)
    tokenize_ms: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    # mptok mode: whether each turn's connection reached its conversation's owner.
    at_owner: list[bool] = field(default_factory=list)
    server_cpu_s: float = float("nan")
    # The same CPU seconds by the process's role: "frontends", "supervisors", "nginx".
    cpu_roles: collections.Counter = field(default_factory=collections.Counter)
    hits: float = 0.0
    misses: float = 0.0
    uncached: float = 0.0
    routed: float = 0.0
    routed_since: float = 0.0  # routed prompts sent as the characters after a held fingerprint
    kept_here: float = 0.0  # prompts extended where they landed, from a copy kept there (mptok_kept_here_total)
    # mptok mode: sums and counts of mptok_route_seconds and mptok_peer_serve_seconds.
    route_s: float = 0.0
    route_calls: float = 0.0
    serve_s: float = 0.0
    serve_calls: float = 0.0
    route_failures: float = 0.0
    per_instance_turns: list[float] = field(default_factory=list)
    # At the end of the run, per frontend (/metrics): what its cache holds,
    # and the fingerprints it holds of routed conversations (mptok_held_fingerprint_bytes).
    cache_bytes: list[float] = field(default_factory=list)
    held_bytes: list[float] = field(default_factory=list)
    runs: list[list[float]] = field(default_factory=list)  # per_instance_turns of each pooled run
    # How many frontends tokenized with each engine (summed over pooled runs),
    # and the fast results a background re-check found different.
    engines: collections.Counter = field(default_factory=collections.Counter)
    mismatches: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.hits / (self.hits + self.misses) if self.hits + self.misses else 0.0


def pooled(runs: list[ModeResult]) -> ModeResult:
    """One mode's repeated runs as one: samples pooled, counts summed."""
    if len(runs) == 1:
        return runs[0]
    merged = ModeResult(runs[0].mode, runs[0].how, server_cpu_s=0.0)
    for r in runs:
        for name in ("requests", "checked", "exact", "failed", "wall_s", "server_cpu_s", "hits", "misses", "uncached", "routed", "routed_since", "kept_here", "route_s", "route_calls", "serve_s", "serve_calls", "route_failures", "mismatches"):
            setattr(merged, name, getattr(merged, name) + getattr(r, name))
        merged.e2e_ms += r.e2e_ms
        merged.tokenize_ms += r.tokenize_ms
        merged.tokens += r.tokens
        merged.at_owner += r.at_owner
        merged.errors += r.errors
        merged.engines += r.engines
        merged.cpu_roles += r.cpu_roles
    merged.runs = [r.per_instance_turns for r in runs]
    return merged


@dataclass
class _Cursor:
    """Where one conversation's replay is: its next turn and the ids expected of the last."""

    conv: Conversation
    next: int = 0
    expected: array.array = field(default_factory=lambda: array.array("i"))


def replay(
    conversations: list[Conversation],
    port: int,
    clients: int,
    result: ModeResult,
    progress: Progress,
    server_pids: list[int],
    frontends: int = 1,
    interleave: bool = False,
) -> None:
    """Replay every conversation against ``port``; ``server_pids`` are the roots of
    the process trees whose CPU time is the mode's server CPU; ``frontends`` is
    how many share the port (one per instance behind nginx).

    Each client thread takes a conversation and sends its turns one after
    the other; with ``interleave`` it sends one turn and puts the
    conversation back at the end of the queue, so every conversation is
    live at once (turn 1 of each, then turn 2, ...) and the caches must hold
    all of them; a conversation never has two turns in flight."""
    keyless = result.mode == "keyless"
    queue = collections.deque(_Cursor(c) for c in conversations)
    lock = threading.Lock()
    returned = threading.Condition(lock)  # a conversation came back to the queue, or finished
    unfinished = len(conversations)
    total_turns = sum(len(c.turns) for c in conversations)

    def client() -> None:
        nonlocal unfinished
        while True:
            with lock:
                # An empty queue with conversations out: they come back (interleaved).
                while not queue and unfinished:
                    returned.wait()
                if not queue:
                    return
                cursor = queue.popleft()
            conv = cursor.conv
            while cursor.next < len(conv.turns):
                turn = conv.turns[cursor.next]
                cursor.expected = conv.expected(turn, cursor.expected)
                cursor.next += 1
                body = conv.body(turn)
                started = time.perf_counter()
                try:
                    session = {} if keyless else {"X-Session-Id": conv.session}
                    status, payload, headers = request(port, "POST", "/tokenize", body, session, timeout_s=120.0)
                    elapsed = time.perf_counter() - started
                    answer = orjson.loads(payload) if status == 200 else None
                    ids = answer["tokens"] if answer is not None else None
                    tokenize_ms = server_timing(headers, "tokenize")
                except Exception as e:  # noqa: BLE001 - counted and reported
                    status, ids, elapsed, tokenize_ms = None, None, time.perf_counter() - started, None
                    with lock:
                        result.errors.append(f"{type(e).__name__}: {e}")
                with lock:
                    result.requests += 1
                    if ids is None:
                        result.failed += 1
                        if status is not None:
                            result.errors.append(f"HTTP {status}: {payload[:200]!r}")
                    else:
                        result.checked += 1
                        result.exact += array.array("i", ids) == cursor.expected
                        result.e2e_ms.append(elapsed * 1000)
                        result.tokenize_ms.append(tokenize_ms)
                        result.tokens.append(turn.tokens)
                        owner = mptok.owner_of(conv.derived if keyless else conv.session, frontends)
                        result.at_owner.append(answer["frontend"] == owner)
                    done = result.requests
                    if cursor.next == len(conv.turns):
                        unfinished -= 1
                        returned.notify_all()
                    elif interleave:
                        queue.append(cursor)
                        returned.notify()
                progress.update(f"replaying: {result.mode}", done, total_turns)
                if interleave:
                    break

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    cpu_before = cpu_by_role(server_pids)
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result.wall_s = time.perf_counter() - began
    spent = cpu_by_role(server_pids)
    spent.subtract(cpu_before)
    result.cpu_roles = collections.Counter({role: seconds for role, seconds in spent.items() if seconds > 0})
    result.server_cpu_s = sum(result.cpu_roles.values())
    progress.done()


def server_timing(headers: dict[str, str], metric: str) -> float:
    """The ``dur`` of ``metric`` in a Server-Timing header (ms); NaN if absent."""
    match = re.search(rf"(?:^|,)\s*{metric};dur=([0-9.]+)", headers.get("server-timing", ""))
    return float(match.group(1)) if match else float("nan")


def cpu_by_role(pids: list[int]) -> collections.Counter:
    """User + system CPU seconds so far of ``pids`` and all their descendants,
    by role: an nginx tree is "nginx"; any other root is a supervisor
    ("supervisors") and its descendants "frontends" (their helpers included)."""
    seen: set[int] = set()
    spent: collections.Counter = collections.Counter()
    for pid in pids:
        try:
            root = psutil.Process(pid)
            nginx = "nginx" in root.name()
            tree = [(root, "nginx" if nginx else "supervisors")]
            tree += [(child, "nginx" if nginx else "frontends") for child in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for process, role in tree:
            if process.pid in seen:
                continue
            seen.add(process.pid)
            with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
                times = process.cpu_times()
                spent[role] += times.user + times.system
    return spent


def collect(result: ModeResult, ports: list[int]) -> None:
    """Counters from every instance's /metrics, once every frontend's snapshot holds the replay."""
    wait_for_snapshots()
    samples = []
    for port in ports:
        mine = scrape(port)
        # One port: one instance of F frontends, whose cache work is split by frontend.
        labels = sorted({ls["frontend"] for n, ls, _ in mine if n == "mptok_cache_hits_total"}, key=int) if len(ports) == 1 else [None]
        for frontend in labels:
            only = {"frontend": frontend} if frontend is not None else {}
            result.per_instance_turns.append(sum(total(mine, name, **only) for name in CACHE_WORK))
            result.cache_bytes.append(total(mine, "mptok_cache_bytes", **only))
            result.held_bytes.append(total(mine, "mptok_held_fingerprint_bytes", **only))
        samples += mine
    result.hits = total(samples, "mptok_cache_hits_total")
    result.misses = total(samples, "mptok_cache_misses_total")
    result.uncached = total(samples, "mptok_cache_uncached_total")
    result.routed = total(samples, "mptok_routed_total")
    result.routed_since = total(samples, "mptok_routed_since_total")
    result.kept_here = total(samples, "mptok_kept_here_total")
    result.route_s = total(samples, "mptok_route_seconds_sum")
    result.route_calls = total(samples, "mptok_route_seconds_count")
    result.serve_s = total(samples, "mptok_peer_serve_seconds_sum")
    result.serve_calls = total(samples, "mptok_peer_serve_seconds_count")
    result.route_failures = total(samples, "mptok_route_failures_total")
    for engine in ENGINE_GAUGES:
        result.engines[engine] += int(total(samples, f"mptok_tokenizer_backend_{engine}"))
    result.mismatches = total(samples, "mptok_tokenizer_backend_mismatches_total")


def run_mode(
    mode: str,
    conversations: list[Conversation],
    frontends: int,
    clients: int,
    workdir: Path,
    progress: Progress,
    serve_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    interleave: bool = False,
    backend: str = "auto",
) -> ModeResult:
    """Start ``mode``'s servers (each ``mptok serve`` also gets ``serve_args``,
    ``env`` and ``--tokenizer-backend backend``, or ``tokenizers`` in
    no-cache-tokenizers), replay ``conversations`` against them, collect
    /metrics, stop them."""
    logs = workdir / mode
    logs.mkdir(parents=True, exist_ok=True)
    serve_args = ("--tokenizer-backend", "tokenizers" if mode == "no-cache-tokenizers" else backend, *serve_args)
    extra = " ".join(serve_args)
    if mode in POLICY_MODES:
        serve_args = (*serve_args, "--routing", POLICY_MODES[mode])
        extra = " ".join(serve_args)
    if mode in (*NO_CACHE_MODES, "mptok", "keyless", *POLICY_MODES):
        no_cache = mode in NO_CACHE_MODES
        how = f"`mptok serve --frontends {frontends} {extra}`" + (" with MPTOK_CACHE_MIN_CHARS=10^12" if no_cache else "")
        result = ModeResult(mode, how)
        server_env = dict(env or {}, **(NO_CACHE_ENV if no_cache else {}))  # the supervisor's environment reaches the frontends
        with Server(logs / "serve.log", "--frontends", str(frontends), *serve_args, env=server_env) as server:
            replay(conversations, server.port, clients, result, progress, [server.process.pid], frontends, interleave)
            collect(result, [server.port])
        return result
    round_robin = mode == "no-route"
    how = f"nginx ({'round robin' if round_robin else 'hash $http_x_session_id consistent'}) -> {frontends} x `mptok serve --frontends 1 {extra}`"
    result = ModeResult(mode, how)
    servers: list[Server] = []
    try:
        for i in range(frontends):
            servers.append(Server(logs / f"serve-{i}.log", "--frontends", "1", *serve_args, wait_ready=False, env=env))
        for server in servers:
            server.wait_for_log(r"event=ready ")
        port = free_port()
        config = render_nginx(STICKY_TEMPLATE, f"127.0.0.1:{port}", [f"127.0.0.1:{s.port}" for s in servers], round_robin)
        with Nginx(logs / "nginx", config, port) as nginx:
            replay(conversations, port, clients, result, progress, [nginx.process.pid] + [s.process.pid for s in servers], interleave=interleave)
        collect(result, [s.port for s in servers])
    finally:
        for server in servers:
            server.kill()
    return result


# -- report ----------------------------------------------------------------------


def table(results: list[ModeResult], conversations: list[Conversation]) -> str:
    can_hit = sum(len(c.turns) - 1 for c in conversations)
    rows = [
        "| mode | how | backend (frontends) | server tokenize ms p50 / p99 | end-to-end ms p50 / p99 | requests/s | server CPU ms per turn | hit rate (hits / (hits+misses)) | hits / turns that can hit | turns per instance | checked exact |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in results:
        rows.append(
            f"| {r.mode} | {r.how} | {engines(r)} | {percentile(r.tokenize_ms, 0.5):.2f} / {percentile(r.tokenize_ms, 0.99):.1f} "
            f"| {percentile(r.e2e_ms, 0.5):.1f} / {percentile(r.e2e_ms, 0.99):.1f} "
            f"| {r.requests / r.wall_s:.1f} | {cpu_per_turn_ms(r):.1f} "
            f"| {100 * r.hit_rate:.1f}% ({int(r.hits)} / {int(r.hits + r.misses)}; uncached {int(r.uncached)}) "
            f"| {int(r.hits)} / {can_hit * max(1, len(r.runs))} | {instances(r)} | {r.exact} of {r.checked} ({r.failed} failed) |"
        )
    return "\n".join(rows)


def cpu_split(results: list[ModeResult]) -> str:
    """Each mode's server CPU ms per turn by the processes' role."""
    parts = []
    for r in results:
        per_turn = {role: 1000 * seconds / max(1, r.requests) for role, seconds in r.cpu_roles.items()}
        parts.append(f"{r.mode} " + ", ".join(f"{role} {ms:.2f}" for role, ms in sorted(per_turn.items())))
    return "Server CPU ms per turn by process: " + "; ".join(parts) + "."


def engines(r: ModeResult) -> str:
    """The engines the mode's frontends tokenized with, over its runs: "fastokens 12"
    (and "mismatches N" if a background re-check found a fast result different)."""
    named = ", ".join(f"{engine} {count}" for engine, count in r.engines.most_common() if count) or "not reported"
    return named + (f"; mismatches {int(r.mismatches)}" if r.mismatches else "")


def instances(r: ModeResult) -> str:
    runs = r.runs or [r.per_instance_turns]
    return " / ".join(", ".join(str(int(t)) for t in run) for run in runs)


def landed(r: ModeResult, *, at_owner: bool) -> list[int]:
    """Indices of the turns whose connection reached (or did not reach) their conversation's owner."""
    return [i for i, at in enumerate(r.at_owner) if at == at_owner]


def owner_split(r: ModeResult) -> str:
    """mptok's turns by where their connection landed: at the owner, or routed there."""
    parts = []
    for here, what in ((True, "reached the conversation's owner"), (False, "reached another frontend and were routed to the owner")):
        chosen = landed(r, at_owner=here)
        parts.append(
            f"{len(chosen)} turns {what}: server tokenize p50 {percentile([r.tokenize_ms[i] for i in chosen], 0.5):.2f} ms, "
            f"end-to-end p50 {percentile([r.e2e_ms[i] for i in chosen], 0.5):.1f} ms"
        )
    crossing = ""
    if r.route_calls:
        # Per routed prompt: its owner may have answered two calls (a held
        # version it no longer had, then the whole prompt). Calls whose asker
        # gave up are served too: their work is in the sum, said below.
        route_ms, serve_ms = 1000 * r.route_s / r.route_calls, 1000 * r.serve_s / r.route_calls
        crossing = (
            f" A routed prompt took {route_ms:.2f} ms on average from choosing its owner to holding the ids "
            f"(`mptok_route_seconds`), of which the owner's own work was {serve_ms:.2f} ms "
            f"({int(r.serve_calls)} calls served for {int(r.route_calls)} prompts, `mptok_peer_serve_seconds`): "
            f"the crossing (liveness check, transport, wake-ups, waits for the GIL in two processes) "
            f"cost {route_ms - serve_ms:.2f} ms."
        )
        if r.route_failures:
            crossing += f" ({int(r.route_failures)} routed calls failed; the owner's work for them counts above.)"
    if r.kept_here:
        crossing += f" {int(r.kept_here)} turns extended a copy kept where they landed (`mptok_kept_here_total`)."
    work = [sum(per_run) for per_run in zip(*r.runs)] if r.runs else r.per_instance_turns
    busiest = f" The busiest frontend did {100 * max(work) / sum(work):.0f}% of the cache work." if sum(work) else ""
    return (
        f"{r.mode}, by where the kernel put the connection: {'; '.join(parts)} "
        f"(`mptok_routed_total`, prompts a peer tokenized: {int(r.routed)}).{crossing}{busiest}"
    )


def targets(by_mode: dict[str, list[ModeResult]]) -> str:
    """The replay's targets for mptok (what would make routing clearly worth
    it beside the fast engines), each against the measurement it names: the
    comparisons are with the modes on the fast backend; no-cache-tokenizers
    is the old baseline."""
    if "mptok" not in by_mode:
        return ""
    mptok = pooled(by_mode["mptok"])
    rows = ["| target | measured | met |", "|---|---|---|"]
    rows.append(f"| mptok hit rate at least 97% | {100 * mptok.hit_rate:.1f}% | {'yes' if mptok.hit_rate >= 0.97 else 'no'} |")
    if "no-cache-tokenizers" in by_mode:
        full, cached = percentile(pooled(by_mode["no-cache-tokenizers"]).tokenize_ms, 0.5), percentile(mptok.tokenize_ms, 0.5)
        speedup = ratio_of(full, cached)
        rows.append(
            f"| server tokenize p50 at least 20x lower than no-cache-tokenizers | {full:.2f} / {cached:.2f} ms = {speedup:.1f}x "
            f"| {'yes' if speedup >= 20 else 'no'} |"
        )
    # Every alternative a user has but sticky nginx (keyless is mptok itself).
    rivals = [pooled(by_mode[m]) for m in (*NO_CACHE_MODES, "no-route") if m in by_mode]
    if rivals:
        for what, value_of, unit, digits in (
            ("server tokenize p50", lambda r: percentile(r.tokenize_ms, 0.5), "ms", 2),
            ("server CPU per turn", cpu_per_turn_ms, "ms", 1),
        ):
            mine = value_of(mptok)
            met = all(mine <= value_of(r) for r in rivals)
            rows.append(
                f"| mptok's {what} no worse than {', '.join(r.mode for r in rivals)}'s | mptok {mine:.{digits}f} {unit}; "
                + "; ".join(f"{r.mode} {value_of(r):.{digits}f}" for r in rivals)
                + f" | {'yes' if met else 'no'} |"
            )
    if "sticky" in by_mode:
        sticky = pooled(by_mode["sticky"])
        cpu = ratio_of(cpu_per_turn_ms(mptok), cpu_per_turn_ms(sticky))
        rows.append(
            f"| server CPU per turn at most 1.1x sticky nginx's | {cpu_per_turn_ms(mptok):.1f} / {cpu_per_turn_ms(sticky):.1f} ms "
            f"= {cpu:.2f}x | {'yes' if cpu <= 1.1 else 'no'} |"
        )
        each = [ratio_of(percentile(m.e2e_ms, 0.5), percentile(s.e2e_ms, 0.5)) for m, s in zip(by_mode["mptok"], by_mode["sticky"])]
        rows.append(
            f"| end-to-end p50 at most 1.15x sticky nginx's, run by run | {percentile(mptok.e2e_ms, 0.5):.1f} / "
            f"{percentile(sticky.e2e_ms, 0.5):.1f} ms pooled; run by run {', '.join(f'{x:.2f}x' for x in each)} "
            f"| {'yes' if all(x <= 1.15 for x in each) else 'no'} |"
        )
        throughput = ratio_of(mptok.requests / mptok.wall_s, sticky.requests / sticky.wall_s)
        rows.append(
            f"| requests/s at least 0.95x sticky nginx's | {mptok.requests / mptok.wall_s:.1f} / {sticky.requests / sticky.wall_s:.1f} "
            f"= {throughput:.2f}x | {'yes' if throughput >= 0.95 else 'no'} |"
        )
    rows.append(wrong_ids_row([pooled(runs) for runs in by_mode.values()]))
    untimed = {mode: sum(ms != ms for r in runs for ms in r.tokenize_ms) for mode, runs in by_mode.items()}
    if any(untimed.values()):
        rows.append(f"\nAnswers without a Server-Timing header, left out of the tokenize percentiles: {untimed}.")
    return "\n".join(rows)


def cpu_per_turn_ms(r: ModeResult) -> float:
    """Server CPU ms per turn: every server process's, nginx included."""
    return 1000 * r.server_cpu_s / max(1, r.requests)


def wrong_ids_row(results: list[ModeResult]) -> str:
    """The target row "0 wrong ids in every mode" (a failed request counts against it too)."""
    wrong = {r.mode: r.checked - r.exact for r in results}
    failed = sum(r.failed for r in results)
    measured = ", ".join(f"{mode} {n}" for mode, n in wrong.items()) + (f"; {failed} failed requests" if failed else "")
    return f"| 0 wrong ids in every mode | {measured} | {'yes' if not any(wrong.values()) and not failed else 'no'} |"


def crossing_targets(by_mode: dict[str, list[ModeResult]], clients: int) -> str:
    """The routed turns' targets: what a turn that lands on a non-owner
    costs, and what routing buys against a cache per frontend and against
    sticky nginx."""
    routed_mode = next((mode for mode in ("mptok", "keyless") if mode in by_mode), None)
    if routed_mode is None:
        return ""
    mptok = pooled(by_mode[routed_mode])
    owner = percentile([mptok.tokenize_ms[i] for i in landed(mptok, at_owner=True)], 0.5)
    routed = percentile([mptok.tokenize_ms[i] for i in landed(mptok, at_owner=False)], 0.5)
    limit = 1.0 if clients > 1 else 0.3
    rows = [
        f"| target for routed turns ({routed_mode}) | measured | met |",
        "|---|---|---|",
        f"| routed turns' tokenize p50 at most {limit} ms above owner-reached ({clients} client{'s' if clients > 1 else ''}) "
        f"| {routed:.2f} - {owner:.2f} = {routed - owner:.2f} ms | {'yes' if routed - owner <= limit else 'no'} |",
    ]
    if "no-route" in by_mode:
        spread = pooled(by_mode["no-route"])
        tokenize = ratio_of(percentile(mptok.tokenize_ms, 0.5), percentile(spread.tokenize_ms, 0.5))
        throughput = ratio_of(mptok.requests / mptok.wall_s, spread.requests / spread.wall_s)
        rows += [
            f"| tokenize p50 at most 0.7x no-route's | {tokenize:.2f}x | {'yes' if tokenize <= 0.7 else 'no'} |",
            f"| requests/s at least 1.2x no-route's | {throughput:.2f}x | {'yes' if throughput >= 1.2 else 'no'} |",
        ]
    return "\n".join(rows)


def ratio_of(a: float, b: float) -> float:
    """a / b, NaN (never met) when either is missing or b is 0."""
    return a / b if b > 0 and a == a else float("nan")


def plot(results: list[ModeResult], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (`make replay` installs it): no plot"
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for axis, values_of, label in (
        (axes[0], lambda r: r.tokenize_ms, "server tokenize ms (median)"),
        (axes[1], lambda r: r.e2e_ms, "end-to-end ms (median)"),
    ):
        for r in results:
            bins: dict[int, list[float]] = {}
            for tokens, ms in zip(r.tokens, values_of(r)):
                bins.setdefault(tokens // 2000, []).append(ms)
            xs = sorted(bins)
            axis.plot([2 * x + 1 for x in xs], [percentile(bins[x], 0.5) for x in xs], marker=".", label=r.mode)
        axis.set_xlabel("prompt tokens (thousands, 2k bins)")
        axis.set_ylabel(label)
        axis.set_yscale("log")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    axes[0].set_title("tokenize time against prompt size")
    axes[1].set_title("client-side latency against prompt size")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return f"plot: {path.relative_to(REPO)}"


def add_build_options(parser: argparse.ArgumentParser, conversations: int) -> None:
    """The options that say which conversations are built (``load_conversations``)."""
    parser.add_argument("--conversations", type=int, default=conversations, help=f"conversations replayed in each mode (default {conversations})")
    parser.add_argument("--target-tokens", type=int, default=38_000, help="a conversation grows to this many tokens (default 38000)")
    parser.add_argument("--delta-tokens", type=int, default=300, help="tokens added per turn (default 300)")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--shared-system", action="store_true", help="every conversation gets the same system prompt (an agent fleet), each its own first user message")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes computing the expected ids (default: one per CPU)")
    parser.add_argument(
        "--no-build-cache", action="store_true",
        help=f"compute the conversations and their expected ids again instead of reading them from {BUILD_CACHE.relative_to(REPO)}/ "
        "(kept there under a digest of the build options, the source texts, the tokenizer and the chat template)",
    )


def add_backend_option(parser: argparse.ArgumentParser) -> None:
    """--backend: what every mode but no-cache-tokenizers tokenizes with (``run_mode``'s ``backend``)."""
    parser.add_argument(
        "--backend", default="auto", choices=[c for c in CHOICES if c != "tokenizers"],
        help="--tokenizer-backend of every mode but no-cache-tokenizers (default auto: the cheapest exact engine per frontend)",
    )


def load_conversations(args: argparse.Namespace, progress: Progress) -> tuple[Any, ChatTemplate, list[Conversation]]:
    """The tokenizer, its chat template and the conversations ``add_build_options`` named."""
    tokenizer = mptok.load_tokenizer()
    template = ChatTemplate.for_tokenizer(tokenizer)
    targets = () if not getattr(args, "long", False) else SMOKE_LONG_TARGETS if getattr(args, "smoke", False) else LONG_TARGETS
    params = BuildParams(args.conversations, args.target_tokens, args.delta_tokens, args.seed, args.shared_system, targets)
    conversations = build(tokenizer, template, params, progress, args.jobs, None if args.no_build_cache else BUILD_CACHE)
    return tokenizer, template, conversations


def command_line(module: str, parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The command that reproduces this run, from the repository's root
    (options left at their defaults omitted)."""
    return f".venv/bin/python -m scripts.{module}" + "".join(
        f" --{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in vars(args).items()
        if k not in ("no_write", "quiet", "jobs", "no_build_cache") and v != parser.get_default(k)
    )


def workload(conversations: list[Conversation], args: argparse.Namespace) -> str:
    """The conversations and the load, in a sentence or two (the report's
    header names the machine)."""
    turns = sum(len(c.turns) for c in conversations)
    rewrites = sum(t.rewrite for c in conversations for t in c.turns)
    sizes = [c.turns[-1].tokens for c in conversations]
    return (
        f"F = {args.frontends}, {len(conversations)} conversations x {turns // len(conversations)} turns on average "
        f"({turns} turns per mode and run, {rewrites} of them rewriting the previous generation prompt), growing by about "
        f"{args.delta_tokens} tokens a turn to {min(sizes):,}-{max(sizes):,} tokens (median {statistics.median(sizes):,.0f}); "
        f"{args.clients} client threads, a new connection per turn; "
        f"expected ids computed locally before the replay."
    )


def report_errors(results: list[ModeResult]) -> int:
    """Print the first errors of each mode; 1 if any answer was wrong or failed, else 0."""
    for r in results:
        for error in r.errors[:5]:
            print(f"{r.mode}: {error}", file=sys.stderr)
    return 1 if sum(r.checked - r.exact + r.failed for r in results) else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frontends", type=int, default=4, help="F: frontends / instances per mode (default 4)")
    add_build_options(parser, conversations=8)
    parser.add_argument("--clients", type=int, default=4, help="client threads (default 4)")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated subset of {','.join(MODES)}")
    add_backend_option(parser)
    parser.add_argument("--repeat", type=int, default=3, help="run the modes this many times, interleaved; samples are pooled (default 3)")
    parser.add_argument("--no-write", action="store_true", help="do not write docs/results/replay_bench.md or the plot")
    parser.add_argument("--quiet", action="store_true", help="no progress bar (there is none unless stderr is a terminal)")
    parser.add_argument(
        "--long", action="store_true",
        help=f"conversations at coding-agent lengths ({', '.join(f'{t // 1000}k' for t in LONG_TARGETS)} tokens, "
        f"{LONG_DELTA_TOKENS} a turn unless --delta-tokens says otherwise); writes docs/results/replay_long.md",
    )  # fmt: skip
    smoke = {"frontends": 2, "conversations": 2, "target_tokens": 3_000, "clients": 2, "repeat": 1, "no_write": True, "quiet": True}
    args = parse_args_with_smoke(parser, smoke)
    if args.long and args.delta_tokens == parser.get_default("delta_tokens"):
        args.delta_tokens = LONG_DELTA_TOKENS
    if args.long and args.smoke and args.modes == parser.get_default("modes"):
        args.modes = "no-route,mptok"  # --smoke runs every mode already; this is the per-length code path
    modes = list(dict.fromkeys(m for m in args.modes.split(",") if m))
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes: {sorted(unknown)}")
    if any(m in ("no-route", "sticky") for m in modes) and nginx_binary() is None:
        print("replay_bench: nginx is not installed (apt-get install nginx-light)", file=sys.stderr)
        return 2
    progress = Progress(not args.quiet)
    began = time.monotonic()
    _, _, conversations = load_conversations(args, progress)
    by_mode: dict[str, list[ModeResult]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory(prefix="replay-bench-") as workdir:
        for run in range(args.repeat):
            # Each run starts with another mode, and every other run goes
            # backwards, so no mode always runs first, last, or right after
            # the same other mode (the machine's speed drifts over minutes).
            order = modes[run % len(modes):] + modes[: run % len(modes)]
            for mode in reversed(order) if run % 2 else order:
                work = Path(workdir) / f"run-{run}"
                by_mode[mode].append(run_mode(mode, conversations, args.frontends, args.clients, work, progress, backend=args.backend))
    results = [pooled(by_mode[mode]) for mode in modes]
    markdown = (
        f"{workload(conversations, args)} "
        f"{f'{args.repeat} runs of every mode, interleaved, samples pooled. ' if args.repeat > 1 else ''}"
        f"Total run time {time.monotonic() - began:.0f} s.\n\n"
    )
    markdown += table(results, conversations) + "\n\n" + cpu_split(results) + "\n"
    for routed in ("mptok", "keyless"):
        if routed in by_mode:
            markdown += "\n" + owner_split(results[modes.index(routed)]) + "\n"
    goals = targets(by_mode)
    if goals:
        markdown += "\n" + goals + "\n"
    crossing = crossing_targets(by_mode, args.clients)
    if crossing:
        markdown += "\n" + crossing + "\n"
    print(markdown)
    if not args.no_write:
        name = "replay_long" if args.long else "replay_bench"
        plot_path = PLOT.with_name(f"{name}.png")
        drawn = plot(results, plot_path)
        print(drawn)
        if drawn.startswith("plot:"):
            markdown += f"\n![server tokenize ms and end-to-end ms against prompt tokens, a line per mode]({plot_path.name})\n"
        path = write_report(
            "replay_bench", LONG_TITLE if args.long else TITLE, markdown, preamble=ABOUT, file=name,
            command=command_line("replay_bench", parser, args), extra={"nginx": nginx_version()}, packages=PACKAGES,
        )  # fmt: skip
        print(f"report: {path.relative_to(REPO)}")
    return report_errors(results)


def nginx_version() -> str:
    binary = nginx_binary()
    if binary is None:
        return "absent"
    out = subprocess.run([binary, "-v"], capture_output=True, text=True).stderr
    return out.strip().split("/")[-1]


if __name__ == "__main__":
    # Run as the module scripts.capacity_replay imports, so that the
    # conversations pickled in .cache/replay/ name their classes the same way.
    from scripts import replay_bench

    sys.exit(replay_bench.main())

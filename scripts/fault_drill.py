#!/usr/bin/env python3
"""Fault drill: kill and stop `mptok serve` frontends under load, and check every id.

Why it exists: the tests (tests/test_faults.py, tests/test_serve.py) check
each fault alone, through counters. An operator wants to know what faults
do to a loaded server: with F = 4 frontends, no wrong ids, no failed
requests except those the killed frontend itself had accepted, and no
request slower than the route timeout + 100 ms. This script measures that.

It starts `mptok serve --frontends F` (scripts/supervise.py, in its own
process group, always stopped at exit, Ctrl-C included), waits for the
ready line, and runs K client threads. Each runs multi-turn chats
(mptok_harness.growing_chats: the standard library's sources between the
embedded tokenizer's chat markers, about 2k growing to 8k tokens, each
prompt ending in a generation prompt the next turn replaces; an
X-Session-Id header, a new HTTP connection per request). During
the load it SIGKILLs one frontend (pids: the supervisor's psutil children,
named by its frontend_ready log lines), lets the supervisor restart it, then
SIGSTOPs another for --stop-seconds and SIGCONTs it. Every answer is
compared with the drill's own full tokenization, computed before the load
(`tokenizer(text, add_special_tokens=...)["input_ids"]`; a prompt's
add_special_tokens defaults to true, docs/SERVE.md). It prints a Markdown
report, writes it to docs/results/fault_drill.md (unless --no-write), and
exits 1 on any wrong id or any failure the kill does not explain, 2 if the
drill itself could not run. Run from the repository's root:

    make drill                                         # F=4, 8 clients, 40 s, then the other phases
    .venv/bin/python -m scripts.fault_drill --smoke    # every phase, F=2, a few seconds each, no report
    .venv/bin/python -m scripts.fault_drill --help

A failure is put down to the kill (kind a) when the connection was lost
(reset, closed without an answer, refused, cut short), the request started
before the killed process had gone and ended after the kill; all other
failures are kind b.

Then, against `mptok serve --frontends 2`: an overload phase, a
burst of --burst requests of --burst-chars characters each (distinct texts,
so no cache hits), all released at once, while GET /health is timed every
50 ms; and a hostile phase: --good-clients run checked conversations for
--flood-seconds alone, then as long again while --attackers threads flood
the server with malformed bodies, huge ids, cut-off bodies and slowloris
headers (scripts.drill_overload). It reports the burst's answers and
longest wait, /health's worst time, the good clients' latency without and
during the flood, every 5xx other than 503, restarts and the frontends' RSS
growth. It also exits 1 on any wrong id, any burst request not answered 200
or 503, any 5xx other than 503, any restart or any failed good request in
the hostile phase. `--phases` picks the phases to run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import http.client
import json
import math
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import mptok  # noqa: E402
from mptok.routing.liveness import FALLBACK_REASONS  # noqa: E402
from mptok.supervise.options import ServeOptions  # noqa: E402
from mptok_harness.families import CHAT_MARKERS  # noqa: E402
from mptok_harness.growing_chats import growing_chat  # noqa: E402
from mptok_harness.serve import Server, request, scrape, total  # noqa: E402
from mptok_harness.texts import stdlib_sources as corpus  # noqa: E402
from scripts.drill_overload import Answer, Flood, HealthProbe, frontends_rss, run_burst, server_errors, summarize_statuses  # noqa: E402
from scripts.percentiles import percentile  # noqa: E402
from scripts.report import REPO, write_report  # noqa: E402
from scripts.smoke import parse_args_with_smoke  # noqa: E402

MIN_TOKENS, MAX_TOKENS = 2_000, 8_000
TURNS = 21  # a growing chat adds about 300 tokens a turn
EMBEDDED_MARKERS = CHAT_MARKERS["deepseek"]  # the embedded tokenizer is DeepSeek's
TARGET_MARGIN_S = 0.1  # the target: no request slower than the route timeout + 100 ms
KILL_AT, STOP_AT = 0.25, 0.6  # fractions of --duration
GONE_TIMEOUT_S = 5.0  # the supervisor sees a SIGKILLed frontend exit within this
RESTART_GRACE_S = 60.0  # how long after the load a restart is still waited for
STARTUP_TIMEOUT_S = 180.0
CLOCK_SLACK_S = 0.05  # between our clocks and the kernel's teardown of a killed socket
# A connection the killed frontend had accepted ends in one of these.
CONNECTION_LOST = (ConnectionError, http.client.RemoteDisconnected, http.client.IncompleteRead)


# -- the conversations -----------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    """One turn: its text and the ids the drill's own tokenizer gives it."""

    text: str
    expected: list[int]
    add_special_tokens: bool  # true is /tokenize's default for a prompt: then the field is left out
    turn: int

    @property
    def body(self) -> dict[str, Any]:
        return {"prompt": self.text} if self.add_special_tokens else {"prompt": self.text, "add_special_tokens": False}

    @property
    def kind(self) -> str:
        turn = "turn 1" if self.turn == 0 else "turn 2+"
        return f"{turn}, add_special_tokens={'true (default)' if self.add_special_tokens else 'false'}"


def build_conversations(tokenizer: Any, count: int, seed: int) -> list[list[Prompt]]:
    """``count`` chats of TURNS prompts from random places in the stdlib sources,
    growing from about MIN_TOKENS to MAX_TOKENS; half send add_special_tokens=false."""
    text = corpus()
    rng = random.Random(seed)

    def count_tokens(sample: str) -> int:
        return len(tokenizer(sample, add_special_tokens=False)["input_ids"])

    conversations = []
    for index in range(count):
        start = rng.randrange(len(text) // 2)  # the second half leaves room for any chat here
        chat = growing_chat(text[start:], count_tokens, EMBEDDED_MARKERS, MAX_TOKENS, TURNS)
        special = index % 2 == 0
        conversations.append(
            [
                Prompt(prompt, tokenizer(prompt, add_special_tokens=special)["input_ids"], special, turn)
                for turn, prompt in enumerate(chat.prompts)
            ]
        )
    return conversations


# -- the load --------------------------------------------------------------------


@dataclass
class Result:
    """One /tokenize request as the client saw it (times: time.monotonic())."""

    prompt: Prompt
    started: float
    ended: float
    status: int | None = None
    frontend: int | None = None  # the frontend that answered
    error: BaseException | str | None = None
    wrong: bool = False

    @property
    def latency(self) -> float:
        return self.ended - self.started

    @property
    def failed(self) -> bool:
        return self.error is not None


def send(port: int, session: str, prompt: Prompt, timeout_s: float) -> Result:
    """POST one prompt on a new connection and check its ids."""
    started = time.monotonic()
    try:
        status, payload, _ = request(port, "POST", "/tokenize", prompt.body, {"X-Session-Id": session}, timeout_s)
    except (OSError, http.client.HTTPException) as e:
        return Result(prompt, started, time.monotonic(), error=e)
    result = Result(prompt, started, time.monotonic(), status=status)
    if status != 200:
        result.error = f"HTTP {status}: {payload[:200]!r}"
        return result
    try:
        answer = json.loads(payload)
        result.frontend = answer["frontend"]
        result.wrong = answer["tokens"] != prompt.expected
    except (ValueError, KeyError, TypeError) as e:
        result.error = f"unreadable answer: {type(e).__name__}: {e}"
    return result


@dataclass
class Load:
    """K client threads, each running conversations one turn after another until
    ``deadline``, ``stop`` or its share of ``max_requests``."""

    port: int
    conversations: list[list[Prompt]]
    clients: int
    deadline: float
    max_requests: int
    timeout_s: float
    stop: threading.Event = field(default_factory=threading.Event)
    results: list[Result] = field(default_factory=list)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for client in range(self.clients):
            thread = threading.Thread(target=self._client, args=(client,), name=f"drill-client-{client}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def join(self) -> None:
        """Wait for every client (each ends within one request timeout of the deadline)."""
        give_up = max(self.deadline, time.monotonic()) + self.timeout_s + 5.0
        for thread in self._threads:
            thread.join(max(0.0, give_up - time.monotonic()))

    def _running(self, sent: int) -> bool:
        return not self.stop.is_set() and time.monotonic() < self.deadline and sent < self.max_requests // self.clients

    def _client(self, client: int) -> None:
        sent = 0
        for number in range(self.max_requests):
            conversation_ = self.conversations[(client + number * self.clients) % len(self.conversations)]
            session = f"drill-{client}-{number}"
            for prompt in conversation_:
                if not self._running(sent):
                    return
                self.results.append(send(self.port, session, prompt, self.timeout_s))
                sent += 1


# -- the faults ------------------------------------------------------------------


@dataclass
class Timeline:
    """When the drill did what (time.monotonic()), and to which frontend."""

    load_start: float
    kill_id: int | None = None
    kill_pid: int | None = None
    kill_at: float | None = None
    kill_wall: float | None = None  # time.time() at the kill, to read the log's clock
    gone_at: float | None = None  # the supervisor's frontend_exited line: every fd of the process closed
    back_at: float | None = None  # the supervisor's frontend_ready line of the new process
    back_pid: int | None = None
    stop_id: int | None = None
    stop_pid: int | None = None
    stop_at: float | None = None
    cont_at: float | None = None
    load_end: float | None = None

    def phase(self, t: float) -> str:
        """The last fault event at or before ``t``."""
        events = [
            (self.kill_at, f"after SIGKILL of frontend {self.kill_id}"),
            (self.back_at, f"after frontend {self.kill_id} is back"),
            (self.stop_at, f"while frontend {self.stop_id} is stopped"),
            (self.cont_at, f"after SIGCONT of frontend {self.stop_id}"),
        ]
        current = "before the faults"
        for at, name in sorted((e for e in events if e[0] is not None), key=lambda e: e[0]):
            if at <= t:
                current = name
        return current

    def killed_accepted(self, result: Result) -> bool:
        """Kind (a): a lost connection that the killed process may have accepted."""
        if self.kill_at is None or not isinstance(result.error, CONNECTION_LOST):
            return False
        gone = self.gone_at if self.gone_at is not None else self.kill_at + GONE_TIMEOUT_S
        return result.started <= gone + CLOCK_SLACK_S and result.ended >= self.kill_at


def frontend_pids(server: Server) -> dict[int, int]:
    """Live frontend pid by id: the supervisor's psutil children, named by its frontend_ready lines
    (its other child, multiprocessing's resource tracker, has none)."""
    supervisor = psutil.Process(server.process.pid)
    children = set()
    for child in supervisor.children():
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.status() != psutil.STATUS_ZOMBIE:
                children.add(child.pid)
    return {frontend: pid for frontend, pid in server.frontend_pids().items() if pid in children}


def _log_time(stamp: str) -> float:
    """A log line's UTC time (``2026-11-30T02:30:57.766Z``) as time.time()."""
    parsed = datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ")
    return parsed.replace(tzinfo=datetime.timezone.utc).timestamp()


def wait_for_killed(server: Server, timeline: Timeline, event: str, pid: str, after: int, timeout_s: float) -> tuple[float, int] | None:
    """When (our monotonic clock) the supervisor logged ``event`` for the killed frontend id
    with a pid matching the regex ``pid``, and that pid; None if not within ``timeout_s``."""
    if timeout_s <= 0:
        return None
    pattern = rf"(?m)^(\S+) level=\w+ role=supervisor pid=\d+ event={event} frontend={timeline.kill_id} pid=({pid})\b"
    try:
        match = server.wait_for_log(pattern, timeout_s=timeout_s, after=after)
    except AssertionError:  # not yet, or the server exited: the report says so
        return None
    return timeline.kill_at + (_log_time(match.group(1)) - timeline.kill_wall), int(match.group(2))


def wait_gone(server: Server, timeline: Timeline, after: int) -> None:
    """The supervisor's frontend_exited line for the killed pid. Its sentinel (a pipe) reads
    as closed only once every thread has exited and every fd, the listening socket
    included, is closed; psutil says zombie earlier, while threads still tear down."""
    seen = wait_for_killed(server, timeline, "frontend_exited", str(timeline.kill_pid), after, GONE_TIMEOUT_S)
    if seen is not None:
        timeline.gone_at = seen[0]


def wait_back(server: Server, timeline: Timeline, after: int, timeout_s: float) -> None:
    """The supervisor's frontend_ready line of the killed frontend's new process."""
    if timeline.back_at is None:
        seen = wait_for_killed(server, timeline, "frontend_ready", rf"(?!{timeline.kill_pid}\b)\d+", after, timeout_s)
        if seen is not None:
            timeline.back_at, timeline.back_pid = seen


def run_faults(server: Server, load: Load, timeline: Timeline, duration: float, stop_seconds: float, rng: random.Random) -> int:
    """SIGKILL one frontend at KILL_AT of the load, SIGSTOP another at STOP_AT for
    ``stop_seconds`` (always SIGCONTed). Returns the log offset at the kill."""
    load.stop.wait(max(0.0, timeline.load_start + KILL_AT * duration - time.monotonic()))
    pids = frontend_pids(server)
    if len(pids) < 2:
        raise RuntimeError(f"need two live frontends, found {pids}")
    timeline.kill_id, timeline.stop_id = rng.sample(sorted(pids), 2)
    timeline.kill_pid = pids[timeline.kill_id]
    offset = len(server.log())
    timeline.kill_wall, timeline.kill_at = time.time(), time.monotonic()
    os.kill(timeline.kill_pid, signal.SIGKILL)
    wait_gone(server, timeline, offset)
    stop_at = timeline.load_start + STOP_AT * duration
    wait_back(server, timeline, offset, stop_at - time.monotonic())  # stop only after the restart, if it is in time
    load.stop.wait(max(0.0, stop_at - time.monotonic()))
    if load.stop.is_set():
        return offset
    timeline.stop_pid = frontend_pids(server).get(timeline.stop_id)
    if timeline.stop_pid is None:
        raise RuntimeError(f"frontend {timeline.stop_id} is not running; cannot stop it")
    try:
        os.kill(timeline.stop_pid, signal.SIGSTOP)
        timeline.stop_at = time.monotonic()
        load.stop.wait(stop_seconds)
    finally:
        os.kill(timeline.stop_pid, signal.SIGCONT)
        timeline.cont_at = time.monotonic()
    return offset


# -- running it ------------------------------------------------------------------


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """No SIGINT/SIGTERM while cleaning up, so a second Ctrl-C cannot leave processes behind."""
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def running_server(log_path: Path, serve_args: list[str]) -> Iterator[Server]:
    """`mptok serve` in its own process group, ready; stopped (the whole group) however we leave."""
    server = Server(log_path, *serve_args, wait_ready=False)
    try:
        server.wait_for_log(r"event=ready ", timeout_s=STARTUP_TIMEOUT_S)
        yield server
    finally:
        with signals_ignored():
            server.kill()


@dataclass
class Drill:
    """What one run produced."""

    args: argparse.Namespace
    command: list[str]
    timeline: Timeline
    results: list[Result]
    metrics: list[tuple[str, dict[str, str], float]]


def run(args: argparse.Namespace, conversations: list[list[Prompt]], log_path: Path) -> Drill:
    serve_args = ["--frontends", str(args.frontends), "--route-timeout", f"{args.route_timeout:g}"]
    with running_server(log_path, serve_args) as server:
        command = ["mptok", "serve", "--port", str(server.port), *serve_args]
        print(f"server ready: {' '.join(command)}; load for {args.duration:g} s", file=sys.stderr)
        timeline = Timeline(load_start=time.monotonic())
        load = Load(
            server.port,
            conversations,
            args.clients,
            deadline=timeline.load_start + args.duration,
            max_requests=args.max_requests,
            timeout_s=args.route_timeout + args.stop_seconds + 30.0,
        )
        load.start()
        try:
            offset = run_faults(server, load, timeline, args.duration, args.stop_seconds, random.Random(args.seed))
            load.join()
        finally:
            load.stop.set()
        timeline.load_end = time.monotonic()
        wait_back(server, timeline, offset, RESTART_GRACE_S)
        metrics = scrape(server.port)
    return Drill(args, command, timeline, list(load.results), metrics)


# -- the report ------------------------------------------------------------------


def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None or math.isnan(seconds) else f"{seconds * 1e3:,.1f} ms"


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def describe_error(error: BaseException | str | None) -> str:
    return error if isinstance(error, str) else f"{type(error).__name__}: {error}"


def answered_by(result: Result, t: Timeline) -> str:
    if result.failed:
        return "failed"
    return f"frontend {result.frontend}" + (" (the stopped one)" if result.frontend == t.stop_id else "")


def describe_slowest(result: Result, t: Timeline) -> str:
    return f"{ms(result.latency)}: {result.prompt.kind}, started {t.phase(result.started)}, answered by {answered_by(result, t)}"


def timeline_rows(t: Timeline) -> list[list[Any]]:
    def at(when: float | None) -> str:
        return "n/a" if when is None else f"{when - t.load_start:.2f}"

    back = "not back" if t.back_at is None else f"ready again as pid {t.back_pid}, {t.back_at - t.kill_at:.2f} s after the kill"
    events = [
        (t.load_start, "load starts"),
        (t.kill_at, f"SIGKILL frontend {t.kill_id} (pid {t.kill_pid})"),
        (t.gone_at, f"pid {t.kill_pid} gone (supervisor's frontend_exited line)"),
        (t.back_at, f"frontend {t.kill_id} {back} (supervisor's frontend_ready line)"),
        (t.stop_at, f"SIGSTOP frontend {t.stop_id} (pid {t.stop_pid})"),
        (t.cont_at, f"SIGCONT frontend {t.stop_id}"),
        (t.load_end, "load ends"),
    ]
    return [[at(when), what] for when, what in sorted(events, key=lambda e: math.inf if e[0] is None else e[0])]


def slow_groups(drill: Drill, limit_s: float) -> list[list[Any]]:
    """Requests over ``limit_s`` by phase, kind and who answered."""
    t = drill.timeline
    groups: Counter[tuple[str, str, str]] = Counter()
    worst: dict[tuple[str, str, str], float] = {}
    for r in drill.results:
        if r.latency <= limit_s:
            continue
        key = (t.phase(r.started), r.prompt.kind, answered_by(r, t))
        groups[key] += 1
        worst[key] = max(worst.get(key, 0.0), r.latency)
    return [[*key, n, ms(worst[key])] for key, n in groups.most_common()]


def phase_rows(drill: Drill) -> list[list[Any]]:
    by_phase: dict[str, list[Result]] = {}
    for r in sorted(drill.results, key=lambda r: r.started):
        by_phase.setdefault(drill.timeline.phase(r.started), []).append(r)
    rows = []
    for phase, results in by_phase.items():
        latencies = [r.latency for r in results if not r.failed]
        failures = sum(r.failed for r in results)
        rows.append([phase, len(results), failures, ms(percentile(latencies, 0.5)), ms(percentile(latencies, 0.99)), ms(max(latencies, default=None))])
    return rows


def metrics_rows(samples: list[tuple[str, dict[str, str], float]]) -> list[list[Any]]:
    rows = [[f"mptok_route_fallbacks_total{{reason=\"{r}\"}}", int(total(samples, "mptok_route_fallbacks_total", reason=r))] for r in FALLBACK_REASONS]
    for name in ("mptok_routed_total", "mptok_route_failures_total", "mptok_taken_over_here_total", "mptok_frontend_restarts_total", "mptok_frontend_up"):
        rows.append([name, int(total(samples, name))])
    return rows


def report(drill: Drill) -> tuple[str, bool]:
    """The Markdown report, and whether the drill passed (no wrong ids, no failure of kind b)."""
    args, t, results = drill.args, drill.timeline, drill.results
    limit_s = args.route_timeout + TARGET_MARGIN_S
    failed = [r for r in results if r.failed]
    kind_a = [r for r in failed if t.killed_accepted(r)]
    kind_b = [r for r in failed if not t.killed_accepted(r)]
    wrong = sum(r.wrong for r in results)
    latencies = [r.latency for r in results if not r.failed]
    worst = max(results, key=lambda r: r.latency, default=None)
    max_latency = worst.latency if worst else math.nan
    passed = wrong == 0 and not kind_b
    fast = not math.isnan(max_latency) and max_latency <= limit_s
    over = "" if fast else f" ({ms(max_latency - limit_s)} over)"
    out = [
        "## mptok fault drill",
        "",
        f"`{' '.join(drill.command)}`; {args.clients} clients, {args.duration:g} s, stop {args.stop_seconds:g} s, "
        f"prompts {MIN_TOKENS:,} to {MAX_TOKENS:,} tokens over {TURNS} turns, {args.conversations} texts, "
        f"a new connection per request. Shared 2-core machine: latencies are noisy.",
        "",
        table(["t (s)", "event"], timeline_rows(t)),
        "",
        table(
            ["measurement", "value"],
            [
                ["requests", len(results)],
                ["failed, accepted by the killed frontend (a)", len(kind_a)],
                ["failed, other (b)", len(kind_b)],
                ["wrong ids", wrong],
                ["latency p50 / p99 / max (answered)", f"{ms(percentile(latencies, 0.5))} / {ms(percentile(latencies, 0.99))} / {ms(max(latencies, default=None))}"],
                ["slowest request", "n/a" if worst is None else describe_slowest(worst, t)],
                ["killed frontend back after", "not back" if t.back_at is None else f"{t.back_at - t.kill_at:.2f} s"],
            ],
        ),
        "",
        table(
            ["target (F = 4)", "measured", "met"],
            [
                ["0 wrong ids", wrong, "yes" if wrong == 0 else "**no**"],
                ["0 failures but those the killed frontend had accepted", len(kind_b), "yes" if not kind_b else "**no**"],
                [f"no request over route timeout + 100 ms ({ms(limit_s)})", f"max {ms(max_latency)}{over}", "yes" if fast else "**no**"],
            ],
        ),
        "",
        "Latency by phase (a request belongs to the last fault event before it started):",
        "",
        table(["phase", "requests", "failed", "p50", "p99", "max"], phase_rows(drill)),
    ]
    slow = slow_groups(drill, limit_s)
    if slow:
        out += ["", f"Requests over {ms(limit_s)}:", "", table(["phase", "kind", "answered by", "requests", "max"], slow)]
    if failed:
        rows = [["a" if r in kind_a else "b", f"{r.started - t.load_start:.3f}", f"{r.ended - t.load_start:.3f}", describe_error(r.error)] for r in failed[:20]]
        out += ["", f"Failures (first {len(rows)} of {len(failed)}):", "", table(["kind", "started (s)", "ended (s)", "error"], rows)]
    out += [
        "",
        "Counters from /metrics after the load, summed over frontends (the killed process's own counters went with it):",
        "",
        table(["series", "value"], metrics_rows(drill.metrics)),
    ]
    return "\n".join(out), passed


# -- overload and hostile clients -------------------------------------------------------

BURST_TARGET_S = 5.0  # the target: every burst request answered (200 or 503) within this
BURST_MIN_SERVED = 8
HEALTH_TARGET_S = 1.0
ABUSE_FRONTENDS = 2  # the overload targets are set for `mptok serve --frontends 2`


@dataclass
class Overload:
    """The burst: its answers, /health's latencies meanwhile, wrong ids among the 200s."""

    chars: int
    answers: list[Answer]
    health: list[float]
    health_failures: list[str]
    wrong: int
    rss_before: int
    rss_after: int

    def count(self, status: int) -> int:
        return sum(a.status == status for a in self.answers)

    @property
    def longest_wait(self) -> float:
        return max(a.latency for a in self.answers)

    @property
    def unanswered(self) -> list[Answer]:
        """Requests that got neither a 200 nor a 503 in the error shape with Retry-After."""
        return [
            a for a in self.answers
            if not (a.status == 200 or (a.status == 503 and a.error_shaped and a.retry_after is not None))
        ]  # fmt: skip


@dataclass
class Hostile:
    """Good clients without and during a flood of bad requests."""

    good: list[Result]
    flood_start: float
    flood_end: float
    flood: Flood
    rss_before: int
    rss_at_flood: int  # the good clients fill the cache too: growth before the flood is the baseline
    rss_after: int

    def good_during(self, flooded: bool) -> list[Result]:
        if flooded:
            return [r for r in self.good if self.flood_start <= r.started < self.flood_end]
        return [r for r in self.good if r.started < self.flood_start]


@dataclass
class Abuse:
    """What the overload and hostile phases produced, on one server."""

    command: list[str]
    overload: Overload | None
    hostile: Hostile | None
    metrics: list[tuple[str, dict[str, str], float]]


def burst_texts(count: int, chars: int, seed: int) -> list[str]:
    text = corpus()
    rng = random.Random(seed)
    return [text[start : start + chars] for start in (rng.randrange(len(text) - chars) for _ in range(count))]


def run_overload(server: Server, args: argparse.Namespace, tokenizer: Any) -> Overload:
    texts = burst_texts(args.burst, args.burst_chars, args.seed)
    pids = list(frontend_pids(server).values())
    rss_before = frontends_rss(pids)
    print(f"overload: {args.burst} requests of {args.burst_chars:,} characters at once", file=sys.stderr)
    probe = HealthProbe(server.port).start()
    try:
        time.sleep(0.5)  # /health before the burst, for comparison
        answers = run_burst(server.port, texts, timeout_s=120.0)
        time.sleep(0.5)
    finally:
        probe.stop()
    rss_after = frontends_rss(pids)
    wrong = sum(
        json.loads(a.payload)["tokens"] != tokenizer(t)["input_ids"] for a, t in zip(answers, texts) if a.status == 200
    )
    return Overload(args.burst_chars, answers, probe.latencies, probe.failures, wrong, rss_before, rss_after)


def run_hostile(server: Server, args: argparse.Namespace, conversations: list[list[Prompt]]) -> Hostile:
    pids = list(frontend_pids(server).values())
    rss_before = frontends_rss(pids)
    print(f"hostile: {args.good_clients} good clients, {args.flood_seconds:g} s alone, then as long with {args.attackers} attackers", file=sys.stderr)
    start = time.monotonic()
    load = Load(server.port, conversations, args.good_clients, deadline=start + 2 * args.flood_seconds, max_requests=args.max_requests, timeout_s=60.0)
    load.start()
    flood = Flood(server.port, args.attackers, args.seed)
    try:
        load.stop.wait(args.flood_seconds)
        rss_at_flood = frontends_rss(pids)
        flood_start = time.monotonic()
        flood.start()
        load.stop.wait(max(0.0, start + 2 * args.flood_seconds - time.monotonic()))
    finally:
        flood.stop()
        flood_end = time.monotonic()
        load.join()
        load.stop.set()
    return Hostile(list(load.results), flood_start, flood_end, flood, rss_before, rss_at_flood, frontends_rss(pids))


def run_abuse(args: argparse.Namespace, conversations: list[list[Prompt]], tokenizer: Any, log_path: Path) -> Abuse:
    serve_args = ["--frontends", str(ABUSE_FRONTENDS)]
    with running_server(log_path, serve_args) as server:
        command = ["mptok", "serve", "--port", str(server.port), *serve_args]
        overload = run_overload(server, args, tokenizer) if "overload" in args.phases else None
        hostile = run_hostile(server, args, conversations) if "hostile" in args.phases else None
        metrics = scrape(server.port)
    return Abuse(command, overload, hostile, metrics)


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def latency_row(name: str, results: list[Result]) -> list[Any]:
    latencies = [r.latency for r in results if not r.failed]
    return [
        name, len(results), sum(r.failed for r in results), sum(r.wrong for r in results),
        ms(percentile(latencies, 0.5)), ms(percentile(latencies, 0.99)), ms(max(latencies, default=None)),
    ]  # fmt: skip


def abuse_report(abuse: Abuse, args: argparse.Namespace) -> tuple[str, bool]:
    """The Markdown report of the overload and hostile phases, and whether they passed."""
    metric_5xx = sum(v for n, ls, v in abuse.metrics if n == "mptok_http_requests_total" and ls.get("code", "").startswith("5") and ls["code"] != "503")
    restarts = int(total(abuse.metrics, "mptok_frontend_restarts_total"))
    out = ["## Overload and hostile clients", "", f"`{' '.join(abuse.command)}`, defaults otherwise. Shared 2-core machine: latencies are noisy.", ""]
    targets: list[list[Any]] = []
    passed = restarts == 0 and metric_5xx == 0
    o = abuse.overload
    if o is not None:
        served, refused = o.count(200), o.count(503)
        health_worst = max(o.health, default=math.nan)
        served_waits = [a.latency for a in o.answers if a.status == 200]
        out += [
            table(
                ["overload: a burst of requests at once", "value"],
                [
                    ["requests, characters each", f"{len(o.answers)}, {o.chars:,}"],
                    ["served (200) / refused (503, Retry-After) / other", f"{served} / {refused} / {len(o.unanswered)}"],
                    ["longest wait (any answer) / longest wait of a 200", f"{ms(o.longest_wait)} / {ms(max(served_waits, default=None))}"],
                    ["server's tokenization of a 200 (Server-Timing) p50 / max", f"{ms(percentile([a.tokenize_s for a in o.answers if a.tokenize_s is not None], 0.5))} / {ms(max((a.tokenize_s for a in o.answers if a.tokenize_s is not None), default=None))}"],
                    ["503 answers' waits p50 / max", f"{ms(percentile([a.latency for a in o.answers if a.status == 503], 0.5))} / {ms(max((a.latency for a in o.answers if a.status == 503), default=None))}"],
                    ["/health every 50 ms: probes, worst, failures", f"{len(o.health)}, {ms(health_worst)}, {len(o.health_failures)}"],
                    ["wrong ids among the 200s", o.wrong],
                    ["frontends' RSS before / after", f"{mib(o.rss_before)} / {mib(o.rss_after)}"],
                ],
            ),
            "",
        ]
        targets += [
            [f"every burst request answered 200 or 503 within {BURST_TARGET_S:g} s", f"{len(o.answers) - len(o.unanswered)} of {len(o.answers)}, longest {ms(o.longest_wait)}", "yes" if not o.unanswered and o.longest_wait <= BURST_TARGET_S else "**no**"],
            [f"at least {BURST_MIN_SERVED} served", served, "yes" if served >= BURST_MIN_SERVED else "**no**"],
            [f"/health within {HEALTH_TARGET_S:g} s throughout", ms(health_worst), "yes" if health_worst <= HEALTH_TARGET_S and not o.health_failures else "**no**"],
        ]
        passed = passed and not o.unanswered and o.wrong == 0
    h = abuse.hostile
    if h is not None:
        quiet, flooded = h.good_during(False), h.good_during(True)
        good_5xx = sum(r.status is not None and 500 <= r.status != 503 for r in h.good)
        flood_5xx = server_errors(h.flood.statuses)
        failed = sum(r.failed for r in h.good)
        wrong = sum(r.wrong for r in h.good)
        out += [
            table(["good clients", "requests", "failed", "wrong ids", "p50", "p99", "max"], [latency_row("without the flood", quiet), latency_row("during the flood", flooded)]),
            "",
            table(
                ["flood", "value"],
                [
                    ["attackers, seconds", f"{args.attackers}, {h.flood_end - h.flood_start:.1f}"],
                    ["sent by kind", summarize_statuses(h.flood.sent)],
                    ["what they got back", summarize_statuses(h.flood.statuses)],
                    ["frontends' RSS: start / flood starts / flood ends", f"{mib(h.rss_before)} / {mib(h.rss_at_flood)} / {mib(h.rss_after)}"],
                    ["RSS growth without / during the flood (the cache fills in both)", f"{mib(h.rss_at_flood - h.rss_before)} / {mib(h.rss_after - h.rss_at_flood)}"],
                ],
            ),
            "",
        ]
        p99_quiet = percentile([r.latency for r in quiet if not r.failed], 0.99)
        p99_flood = percentile([r.latency for r in flooded if not r.failed], 0.99)
        targets += [
            ["good clients: 0 wrong ids, 0 failures", f"{wrong} wrong, {failed} failed", "yes" if wrong == failed == 0 else "**no**"],
            ["good clients' p99 during the flood against without it", f"{ms(p99_flood)} against {ms(p99_quiet)} ({p99_flood / p99_quiet:.2f}x)", "(reported)"],
            ["0 answers 5xx other than 503 (attackers, good clients)", flood_5xx + good_5xx, "yes" if flood_5xx + good_5xx == 0 else "**no**"],
        ]
        passed = passed and wrong == 0 and failed == 0 and flood_5xx + good_5xx == 0
    targets += [
        ["0 answers 5xx other than 503 (the server's /metrics)", int(metric_5xx), "yes" if metric_5xx == 0 else "**no**"],
        ["0 restarts", restarts, "yes" if restarts == 0 else "**no**"],
    ]
    out += [table(["target", "measured", "met"], targets)]
    return "\n".join(out), passed


# -- the command -----------------------------------------------------------------


# Every phase, a few seconds each, on the smallest server that has one
# frontend to kill and another to stop.
SMOKE = {
    "frontends": 2, "clients": 2, "duration": 8.0, "stop_seconds": 1.0, "conversations": 2,
    "burst": 4, "burst_chars": 50_000, "good_clients": 1, "attackers": 2, "flood_seconds": 2.0, "no_write": True,
}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Exit status: 0 passed, 1 wrong ids or failures of kind b, 2 the drill could not run.")
    parser.add_argument("--frontends", type=int, default=4, help="frontends of mptok serve (default: %(default)s)")
    parser.add_argument("--clients", type=int, default=8, help="client threads (default: %(default)s)")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of load (default: %(default)s)")
    parser.add_argument("--stop-seconds", type=float, default=3.0, help="seconds the second frontend stays SIGSTOPped (default: %(default)s)")
    parser.add_argument("--route-timeout", type=float, default=ServeOptions.route_timeout_s, help="passed to mptok serve (default: %(default)s)")
    parser.add_argument("--max-requests", type=int, default=20_000, help="requests at most, over all clients (default: %(default)s)")
    parser.add_argument("--conversations", type=int, default=16, help="distinct conversation texts, tokenized before the load (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=5, help="picks the texts and the frontends to kill and stop (default: %(default)s)")
    parser.add_argument("--log", type=Path, help="keep the server's log here (default: a temporary file, removed)")
    parser.add_argument("--phases", default="kill,overload,hostile", help="comma-separated, of kill, overload, hostile (default: %(default)s)")
    parser.add_argument("--burst", type=int, default=60, help="requests in the overload burst (default: %(default)s)")
    parser.add_argument("--burst-chars", type=int, default=400_000, help="characters of each burst request (default: %(default)s)")
    parser.add_argument("--good-clients", type=int, default=4, help="client threads of the hostile phase (default: %(default)s)")
    parser.add_argument("--attackers", type=int, default=8, help="attacker threads of the flood (default: %(default)s)")
    parser.add_argument("--flood-seconds", type=float, default=15.0, help="seconds without the flood, then with it (default: %(default)s)")
    parser.add_argument("--no-write", action="store_true", help="print the report only, do not write docs/results/fault_drill.md")
    args = parse_args_with_smoke(parser, SMOKE, argv)
    args.phases = set(args.phases.split(","))
    if not args.phases or not args.phases <= {"kill", "overload", "hostile"}:
        parser.error("--phases takes kill, overload and hostile, comma-separated")
    if args.burst < 1 or args.burst_chars < 1 or args.good_clients < 1 or args.attackers < 1 or not args.flood_seconds > 0:
        parser.error("--burst, --burst-chars, --good-clients, --attackers and --flood-seconds must be more than 0")
    if args.frontends < 2 or args.clients < 1 or args.conversations < 1 or args.max_requests < args.clients:
        parser.error("need --frontends >= 2, --clients >= 1, --conversations >= 1, --max-requests >= --clients")
    if not (args.duration > 0 and args.stop_seconds > 0 and args.route_timeout > 0):
        parser.error("--duration, --stop-seconds and --route-timeout must be more than 0")
    return args


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupted)
    drill = abuse = None
    try:
        tokenizer = mptok.load_tokenizer()
        print(f"tokenizing {args.conversations} conversations of {TURNS} turns locally...", file=sys.stderr)
        conversations = build_conversations(tokenizer, args.conversations, args.seed)
        with tempfile.TemporaryDirectory(prefix="mptok-drill-") as tmp:
            log_path = args.log or Path(tmp) / "serve.log"
            abuse_log = log_path.with_name(log_path.stem + "-abuse" + log_path.suffix)
            current = log_path
            try:
                if "kill" in args.phases:
                    drill = run(args, conversations, log_path)
                if args.phases & {"overload", "hostile"}:
                    current = abuse_log
                    abuse = run_abuse(args, conversations, tokenizer, abuse_log)
            except (AssertionError, RuntimeError, psutil.Error, OSError) as e:
                tail = current.read_text(errors="replace")[-2000:] if current.exists() else ""
                print(f"fault drill could not run: {type(e).__name__}: {e}\n{tail}", file=sys.stderr)
                return 2
    except KeyboardInterrupt:
        print("fault drill interrupted; the server was stopped", file=sys.stderr)
        return 130
    passed, parts = True, []
    if drill is not None:
        text, passed = report(drill)
        parts.append(text)
    if abuse is not None:
        text, abuse_passed = abuse_report(abuse, args)
        parts.append(text)
        passed = passed and abuse_passed
    markdown = "\n\n".join(parts)
    print(markdown)
    if not args.no_write:
        path = write_report("fault_drill", "The fault drill", markdown, preamble=__doc__.split("\n\n")[1])
        print(f"report: {path.relative_to(REPO)}")
    return 0 if passed else 1

if __name__ == "__main__":
    sys.exit(main())

"""A real ``mptok serve`` for the tests and the scripts: a subprocess, its log, and plain HTTP to it.

``Server`` starts the supervisor (``scripts/supervise.py``) in its own process
group with its stderr in a file, waits (bounded) for the ready line, and on
``kill()`` stops it with SIGTERM, then SIGKILLs the whole group and
removes its ipc dir, so a failing test leaves nothing behind. ``request`` opens a new connection for every request, as separate
clients would, so the kernel spreads them over the frontends.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from mptok.supervise.snapshots import SUPERVISOR_SNAPSHOT, SnapshotDir
from mptok_harness.checks import HANG_GUARD_S, wait_until

REPO = Path(__file__).resolve().parents[1]
SUPERVISE = str(REPO / "scripts" / "supervise.py")


def free_port() -> int:
    """A port nobody listens on now (bound to port 0, read, closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(
    port: int,
    method: str,
    path: str,
    body: bytes | str | dict | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 60.0,
    *,
    host: str = "127.0.0.1",
) -> tuple[int, bytes, dict[str, str]]:
    """One request to ``host:port`` on a new connection; returns (status, body, lower-cased headers)."""
    if isinstance(body, dict):
        body = json.dumps(body, ensure_ascii=False)
    if isinstance(body, str):
        body = body.encode("utf-8")
    connection = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, response.read(), {k.lower(): v for k, v in response.getheaders()}
    finally:
        connection.close()


def tokenize(port: int, body: dict, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """POST /tokenize; fails the test unless the answer is 200."""
    status, payload, _ = request(port, "POST", "/tokenize", body, headers)
    assert status == 200, (status, payload[:500])
    return json.loads(payload)


_SAMPLE = re.compile(r'^(\w+)(?:\{([^}]*)\})? (\S+)$')


def scrape(port: int, *, host: str = "127.0.0.1") -> list[tuple[str, dict[str, str], float]]:
    """GET /metrics, parsed into (name, labels, value) samples."""
    status, payload, _ = request(port, "GET", "/metrics", host=host)
    assert status == 200, f"/metrics answered {status}: {payload[:300]!r}"
    samples = []
    for line in payload.decode().splitlines():
        match = _SAMPLE.match(line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            samples.append((match.group(1), labels, float(match.group(3))))
    return samples


_T = TypeVar("_T")


def settled(read: Callable[[], _T], timeout_s: float = 10.0, interval_s: float = 0.6) -> _T:
    """``read()`` once two reads ``interval_s`` apart agree, or the last one at ``timeout_s``
    (an engine plugin copies its counters to /metrics every 0.5 s)."""
    deadline = time.monotonic() + timeout_s
    value = read()
    while time.monotonic() < deadline:
        time.sleep(interval_s)
        previous, value = value, read()
        if value == previous:
            break
    return value


def wait_for_snapshots(*servers: Server, timeout_s: float = HANG_GUARD_S) -> None:
    """Wait until every frontend that is up in ``servers`` (default: every
    server this process runs) has written a metrics snapshot since the call:
    a scrape after it holds every count made before it, and no snapshot
    written mid-request. Each writes one every SNAPSHOT_INTERVAL_S, so this
    returns within about that; it fails after ``timeout_s``."""
    before = {server: server.snapshot_versions() for server in (servers or tuple(_RUNNING))}

    def all_rewritten() -> bool:
        for server, versions in before.items():
            now = server.snapshot_versions()
            # A frontend that went down meanwhile writes nothing until its restart: not waited for.
            if any(frontend in now and now[frontend] in (None, version) for frontend, version in versions.items()):
                return False
        return True

    wait_until(all_rewritten, "a metrics snapshot from every frontend", timeout_s)


def total(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """Sum of ``name`` over every frontend (and any label not given)."""
    return sum(v for n, ls, v in samples if n == name and all(ls.get(k) == want for k, want in labels.items()))


# Every Server of this process not yet killed: what wait_for_snapshots waits on by default.
_RUNNING: weakref.WeakSet[Server] = weakref.WeakSet()
# Seconds from launch to ready of each Server this process started, newest
# last, by its number of frontends (they start at once, so more take longer
# on a machine with fewer cores).
_STARTS: dict[str, list[float]] = {}
# A start-up bound this many times the slowest of the last few starts, and never under the floor.
_STARTUP_MARGIN = 3
_STARTS_CONSIDERED = 5
_STARTUP_FLOOR_S = 10.0


def startup_timeout_s(tmp_dir: Path, frontends: int) -> float:
    """A ``--startup-timeout`` for a server of ``frontends`` frontends, for a
    test that needs one shorter than the default: a margin over the slowest
    start of a server of as many frontends this process has seen lately, so
    that it follows the machine's load instead of a fixed guess (one such
    server is started to measure if none was). Starts of larger servers are
    not considered: their frontends share the cores, and would stretch the
    bound (and a test that waits all of it) for nothing."""
    if not _STARTS.get(str(frontends)):
        Server(tmp_dir / "startup-probe.log", "--frontends", str(frontends)).kill()
    return max(_STARTUP_FLOOR_S, _STARTUP_MARGIN * max(_STARTS[str(frontends)][-_STARTS_CONSIDERED:]))


def _ready_bound_s(frontends: str) -> float:
    """How long a start of a server of ``frontends`` frontends is waited for:
    the hang guard, or the margin over the slowest of such starts lately
    where that is longer (a machine busy enough to stretch starts that far
    is not a hang)."""
    return max([HANG_GUARD_S] + [_STARTUP_MARGIN * s for s in _STARTS.get(frontends, [])[-_STARTS_CONSIDERED:]])


def _frontends_of(args: Sequence[str]) -> str:
    """The ``--frontends`` value in a server's arguments ("" for the default)."""
    for flag, value in zip(args, args[1:]):
        if flag == "--frontends":
            return value
    return ""


class Server:
    """One ``mptok serve`` subprocess; use as a context manager.

    ``command`` is what starts it (default: this interpreter on
    scripts/supervise.py); ``--port`` and ``args`` follow it."""

    def __init__(
        self,
        log_path: Path,
        *args: str,
        wait_ready: bool = True,
        env: dict[str, str] | None = None,
        command: Sequence[str] = (sys.executable, SUPERVISE),
    ):
        self.log_path = log_path
        self.port = free_port()
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(
            [*command, "--port", str(self.port), *args],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
        )
        _RUNNING.add(self)
        if wait_ready:
            launched = time.monotonic()
            self.wait_for_log(r"event=ready ", _ready_bound_s(_frontends_of(args)))
            _STARTS.setdefault(_frontends_of(args), []).append(time.monotonic() - launched)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, pattern: str, timeout_s: float = HANG_GUARD_S, after: int = 0) -> re.Match:
        """The first match of ``pattern`` in the log from offset ``after``; fails after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            match = re.compile(pattern).search(self.log(), after)
            if match:
                return match
            if self.process.poll() is not None:
                raise AssertionError(f"server exited with {self.process.returncode}:\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} in the log after {timeout_s} s:\n{self.log()[-3000:]}")
            time.sleep(0.05)

    def frontend_pids(self) -> dict[int, int]:
        """The latest ready pid of each frontend id, from the supervisor's log lines."""
        pids = {}
        for frontend, pid in re.findall(r"role=supervisor .*event=frontend_ready frontend=(\d+) pid=(\d+)", self.log()):
            pids[int(frontend)] = int(pid)
        return pids

    def ipc_dir(self) -> str:
        return re.search(r"event=starting .*ipc_dir=(\S+)", self.log()).group(1)

    def snapshot_versions(self) -> dict[str, tuple[int, int] | None]:
        """Each frontend that is up (by the supervisor's snapshot): which
        version of its metrics snapshot is on disk (inode and mtime; every
        write replaces the file), None before its first. Empty while the
        server is not running or not started."""
        match = re.search(r"event=starting .*ipc_dir=(\S+)", self.log())
        if match is None or self.process.poll() is not None:
            return {}
        ipc_dir = match.group(1)
        up = SnapshotDir(ipc_dir).read_all().get(SUPERVISOR_SNAPSHOT, {}).get("up", {})
        versions: dict[str, tuple[int, int] | None] = {}
        for frontend, is_up in up.items():
            if not is_up:
                continue
            try:
                status = os.stat(os.path.join(ipc_dir, f"metrics-{frontend}.json"))
                versions[frontend] = (status.st_ino, status.st_mtime_ns)
            except FileNotFoundError:
                versions[frontend] = None
        return versions

    def wait(self, timeout_s: float = HANG_GUARD_S) -> int:
        return self.process.wait(timeout_s)

    def kill(self) -> None:
        """Stop the server: SIGTERM (bounded wait), then SIGKILL the whole process group
        (supervisor, frontends, their helpers), then remove an ipc dir left behind."""
        _RUNNING.discard(self)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                pass
        if _group_alive(self.process.pid):
            for signum in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(self.process.pid, signum)
                except ProcessLookupError:
                    break
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()
        match = re.search(r"event=starting .*ipc_dir=(\S+)", self.log())
        if match:
            shutil.rmtree(match.group(1), ignore_errors=True)


def serving(tmp_path_factory: Any, name: str, *args: str) -> Iterator[Server]:
    """A module fixture's server: ``mptok serve args``, its log in a new temporary directory ``name``."""
    with Server(tmp_path_factory.mktemp(name) / "serve.log", *args) as server:
        yield server


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False

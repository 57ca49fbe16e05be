"""The overload and hostile-client tools of the fault drill (scripts.fault_drill).

What do load and bad actors do to `mptok serve`? A burst of long
prompts far beyond what the frontends can tokenize in time, and floods of
cheap bad requests next to good clients. This module makes that traffic and
measures it; scripts.fault_drill runs it against a server and writes the report.

- ``run_burst``: N threads, each with its own long prompt (no cache hits),
  released at once, a new connection each; meanwhile ``HealthProbe`` times
  GET /health every 50 ms.
- ``Flood``: attacker threads sending malformed bodies, huge ids and
  numbers, bodies cut off mid-way, and slowloris connections that trickle a
  header byte now and then; every status they get back is tallied.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

PROBE_INTERVAL_S = 0.05
SLOWLORIS_SOCKETS = 50  # per slowloris thread
SLOWLORIS_TRICKLE_S = 0.5


# -- the burst -------------------------------------------------------------------


@dataclass
class Answer:
    """One request as its client saw it (times: time.monotonic())."""

    started: float
    ended: float
    status: int | None = None
    error: str | None = None
    retry_after: str | None = None
    server_timing: str | None = None
    payload: bytes = b""

    @property
    def tokenize_s(self) -> float | None:
        """The server's own tokenization time of a 200 (its Server-Timing header)."""
        if self.server_timing is None or "dur=" not in self.server_timing:
            return None
        return float(self.server_timing.split("dur=", 1)[1]) / 1000

    @property
    def latency(self) -> float:
        return self.ended - self.started

    @property
    def error_shaped(self) -> bool:
        """Whether a non-200 body is mptok's error shape with the answer's own code."""
        try:
            body = json.loads(self.payload)
            return body.get("object") == "error" and body.get("code") == self.status
        except (ValueError, AttributeError):
            return False


def post(port: int, body: bytes, timeout_s: float) -> Answer:
    """POST /tokenize on a new connection."""
    started = time.monotonic()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        connection.request("POST", "/tokenize", body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        payload = response.read()
        return Answer(
            started,
            time.monotonic(),
            response.status,
            retry_after=response.getheader("Retry-After"),
            server_timing=response.getheader("Server-Timing"),
            payload=payload,
        )
    except (OSError, http.client.HTTPException) as e:
        return Answer(started, time.monotonic(), error=f"{type(e).__name__}: {e}")
    finally:
        connection.close()


class HealthProbe:
    """GET /health every PROBE_INTERVAL_S on a new connection, in a thread, until ``stop()``."""

    def __init__(self, port: int, timeout_s: float = 30.0):
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._port, self._timeout_s = port, timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drill-health", daemon=True)

    def start(self) -> HealthProbe:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self._timeout_s + 5)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            connection = http.client.HTTPConnection("127.0.0.1", self._port, timeout=self._timeout_s)
            try:
                connection.request("GET", "/health")
                status = connection.getresponse().status
                if status != 200:
                    self.failures.append(f"HTTP {status}")
            except (OSError, http.client.HTTPException) as e:
                self.failures.append(f"{type(e).__name__}: {e}")
            finally:
                connection.close()
            self.latencies.append(time.monotonic() - started)
            self._stop.wait(PROBE_INTERVAL_S)


def run_burst(port: int, texts: list[str], timeout_s: float) -> list[Answer]:
    """Every text as its own request, all released at once; answers in text order."""
    bodies = [json.dumps({"prompt": text}).encode() for text in texts]
    answers: list[Answer | None] = [None] * len(bodies)
    gate = threading.Barrier(len(bodies) + 1)

    def client(index: int) -> None:
        gate.wait()
        answers[index] = post(port, bodies[index], timeout_s)

    threads = [threading.Thread(target=client, args=(i,), name=f"drill-burst-{i}", daemon=True) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    gate.wait()
    for thread in threads:
        thread.join(timeout_s + 5)
    return [a if a is not None else Answer(0.0, timeout_s, error="client thread did not finish") for a in answers]


def frontends_rss(pids: list[int]) -> int:
    """Resident bytes of these processes, summed (a vanished one counts 0)."""
    rss = 0
    for pid in pids:
        try:
            rss += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return rss


# -- the flood -------------------------------------------------------------------


def _request_bytes(body: bytes, declared: int | None = None, path: str = "/tokenize") -> bytes:
    length = len(body) if declared is None else declared
    head = f"POST {path} HTTP/1.1\r\nHost: drill\r\nContent-Type: application/json\r\nContent-Length: {length}\r\nConnection: close\r\n\r\n"
    return head.encode("ascii") + body


def malformed_body(rng: random.Random) -> bytes:
    """A whole request whose body is not a valid /tokenize body."""
    choices: list[Callable[[], bytes]] = [
        lambda: b'{"prompt": "unterminated',
        lambda: bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))),
        lambda: b"[" * 3000 + b"]" * 3000,
        lambda: b'{"prompt": "\\ud800"}',
        lambda: b'{"messages": [' + b'{"role": "user"},' * 50 + b'{"role": 5}]}',
        lambda: b'{"prompt": 5, "messages": "both"}',
        lambda: b'{"messages": []}',
    ]
    return _request_bytes(rng.choice(choices)())


def huge_ids(rng: random.Random) -> bytes:
    """A request with a huge conversation id (1 MiB), huge numbers, or huge token ids
    to detokenize (an endpoint vLLM has; 404 where mptok has not)."""
    choices: list[Callable[[], bytes]] = [
        lambda: _request_bytes(json.dumps({"prompt": "hi", "conversation_id": "c" * (1 << 20)}).encode()),
        lambda: _request_bytes(b'{"prompt": "hi", "add_special_tokens": ' + b"9" * 4000 + b"}"),
        lambda: _request_bytes(b'{"prompt": 1e999999}'),
        lambda: _request_bytes(json.dumps({"tokens": [2**63, -1, 10**30, 2**31]}).encode(), path="/detokenize"),
    ]
    return rng.choice(choices)()


def cut_off(rng: random.Random) -> tuple[bytes, bool]:
    """A request whose body stops half-way; the client then leaves (True) or half-closes (False)."""
    body = json.dumps({"prompt": "x" * rng.randrange(100, 5000)}).encode()
    return _request_bytes(body[: len(body) // 2], declared=len(body)), rng.random() < 0.5


@dataclass
class Flood:
    """Attacker threads against ``port`` until ``stop()``; ``statuses`` tallies what they got back
    ("no answer" when the connection closed first, "error: X" when it failed)."""

    port: int
    attackers: int
    seed: int
    statuses: Counter[str] = field(default_factory=Counter)
    sent: Counter[str] = field(default_factory=Counter)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Flood:
        kinds = ["slowloris", "malformed", "huge_ids", "cut_off"]
        for index in range(self.attackers):
            kind = kinds[index % len(kinds)]
            target = self._slowloris if kind == "slowloris" else self._cheap
            thread = threading.Thread(target=target, args=(kind, random.Random(self.seed + index)), name=f"drill-{kind}-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def _tally(self, kind: str | None, outcome: str | None) -> None:
        with self._lock:
            if kind is not None:
                self.sent[kind] += 1
            if outcome is not None:
                self.statuses[outcome] += 1

    def _cheap(self, kind: str, rng: random.Random) -> None:
        while not self._stop.is_set():
            leave = True
            if kind == "malformed":
                data = malformed_body(rng)
            elif kind == "huge_ids":
                data = huge_ids(rng)
            else:
                data, leave = cut_off(rng)
            self._tally(kind, self._exchange(data, cut=kind == "cut_off", leave=leave))

    def _exchange(self, data: bytes, *, cut: bool, leave: bool) -> str:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=30) as sock:
                sock.sendall(data)
                if cut and leave:
                    return "left"
                if cut:
                    sock.shutdown(socket.SHUT_WR)
                received = _read_until_closed(sock)
        except OSError as e:
            return f"error: {type(e).__name__}"
        return _status_of(received)

    def _slowloris(self, kind: str, rng: random.Random) -> None:
        """Keep SLOWLORIS_SOCKETS connections trickling a header byte every SLOWLORIS_TRICKLE_S;
        a connection the server closes is tallied and replaced."""
        connections: list[_SlowConnection] = []
        try:
            while not self._stop.is_set():
                while len(connections) < SLOWLORIS_SOCKETS:
                    try:
                        connections.append(_SlowConnection(self.port))
                    except OSError as e:
                        self._tally(kind, f"error: {type(e).__name__}")
                        break
                    self._tally(kind, None)
                for connection in list(connections):
                    if not connection.trickle():
                        connection.sock.close()
                        connections.remove(connection)
                        self._tally(None, _status_of(bytes(connection.received)))
                self._stop.wait(SLOWLORIS_TRICKLE_S)
        finally:
            for connection in connections:
                connection.sock.close()
                self._tally(None, "slowloris still open at the end")


class _SlowConnection:
    """A connection sending its request head one byte at a time (it never ends)."""

    HEAD = b"POST /tokenize HTTP/1.1\r\nHost: drill\r\nX-Slow: " + b"s" * 100_000

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.sock.setblocking(False)
        self.sent = 0
        self.received = bytearray()

    def trickle(self) -> bool:
        """Read what came back, send the next byte; False once the server has closed."""
        try:
            while chunk := self.sock.recv(65536):
                self.received += chunk
            return False
        except BlockingIOError:
            pass
        except OSError:
            return False
        try:
            self.sent += self.sock.send(self.HEAD[self.sent : self.sent + 1])
        except BlockingIOError:
            pass
        except OSError:
            return False
        return True


def _read_until_closed(sock: socket.socket) -> bytes:
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def _status_of(received: bytes) -> str:
    if received.startswith(b"HTTP/1.1 ") and len(received) >= 12:
        return received[9:12].decode("ascii", "replace")
    return "no answer"


def summarize_statuses(statuses: Counter[str]) -> str:
    return ", ".join(f"{status}: {count:,}" for status, count in sorted(statuses.items()))


def server_errors(statuses: Counter[str]) -> int:
    """Answers 500-599 other than 503."""
    return sum(n for status, n in statuses.items() if status.isdigit() and status.startswith("5") and status != "503")


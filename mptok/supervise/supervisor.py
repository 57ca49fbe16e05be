"""Start N frontends on one port, keep them running, stop them cleanly: ``mptok serve``'s and ``mptok render``'s.

The supervisor owns what the frontends share: the port's one listening
socket, the private ipc directory and the authkey (32 random bytes, a
spawn-context Process argument: never argv, environment, logs or a file).
Start-up, restarts (back-off, crash loops given up and tried again, late
frontends killed), warm spares and the stop: docs/ARCHITECTURE.md's Lifecycles;
hung frontends: ``mptok.supervise.heartbeat``. Every wait in here has a
deadline. The frontends are started from the supervisor's main thread, so that
the kernel's parent-death signal (``mptok.supervise.lifeline``) comes only when
the supervisor itself dies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import multiprocessing
import multiprocessing.connection
import secrets
import signal
import socket
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from mptok.core.settings import engine_memo_dir
from mptok.routing.policy import routing_policy
from mptok.supervise import heartbeat
from mptok.supervise.logfmt import log_event
from mptok.supervise.options import ServeOptions, Use
from mptok.supervise.port import listening_socket
from mptok.supervise.run_dir import RunDir, sweep_stale
from mptok.supervise.snapshots import SUPERVISOR_SNAPSHOT, SnapshotDir

__all__ = [
    "EXIT_ALL_GIVEN_UP", "EXIT_CANNOT_START", "EXIT_OK", "FrontendKind", "ServeOptions", "StartupError", "StopSignals",
    "Supervisor",
]

logger = logging.getLogger("mptok.supervisor")

EXIT_OK = 0
EXIT_CANNOT_START = 2
EXIT_ALL_GIVEN_UP = 3

# A frontend that has not exited this long after its graceful timeout is killed.
_EXIT_MARGIN_S = 5.0
# A warm spare has only its id to take and its port to listen on; one that is
# not ready within this (stopped, stuck) is killed as a late start is.
_ACTIVATION_TIMEOUT_S = 30.0
_JOIN_AFTER_KILL_S = 5.0
# The first restart's back-off; it doubles with each exit in the window.
_FIRST_RESTART_DELAY_S = 0.25
_MAX_RESTART_DELAY_S = 8.0


class StartupError(Exception):
    """The server cannot start; the message is one line, for the operator."""


class RestartPolicy:
    """Back-off and crash-loop limit for one frontend id: ``delay_after_exit(now)`` is the wait before a restart,
    doubling from ``first_delay_s`` with each exit in the window (at most ``_MAX_RESTART_DELAY_S``), or None once
    more than ``max_restarts`` exits fell within ``window_s``: a crash loop."""

    def __init__(self, max_restarts: int, window_s: float, first_delay_s: float):
        self._max_restarts = max_restarts
        self._window_s = window_s
        self._first_delay_s = first_delay_s
        self._exits: deque[float] = deque()

    def forget_exits(self) -> None:
        """Start counting afresh (a given-up frontend tried again)."""
        self._exits.clear()

    def delay_after_exit(self, now: float) -> float | None:
        self._exits.append(now)
        while self._exits and self._exits[0] < now - self._window_s:
            self._exits.popleft()
        if len(self._exits) > self._max_restarts:
            return None
        return min(self._first_delay_s * 2 ** (len(self._exits) - 1), _MAX_RESTART_DELAY_S)

    @property
    def recent_exits(self) -> int:
        return len(self._exits)


class FrontendKind(Protocol):
    """What the supervisor runs in each slot.

    ``check`` runs before anything starts and raises ``StartupError`` with
    one line for the operator. ``target`` names the process's entry point
    (``"module:function"``, imported in the child only: the supervisor never
    loads what a frontend runs) and its first argument (picklable); the
    process calls it as ``function(settings, authkey, conn, listener)``
    (``listener``: the port's listening socket, to accept from once it
    serves) and sends ``("ready", pid)`` or ``("failed", reason)`` on
    ``conn``. ``exited`` runs once a process of this kind has been reaped.
    ``hang_timeout_s``: how long a ready process may go without a beat
    (``mptok.supervise.heartbeat``); None if it does not beat.

    ``standby``: processes start with ``frontend_id`` None and a two-way
    pipe, send ``("standby", pid)`` once built, and take the id of
    ``("serve", frontend_id)`` when it arrives (at once for a slot's
    process, later for a spare). ``spares``: how many to keep waiting.
    """

    hang_timeout_s: float | None
    standby: bool
    spares: int

    def check(self, options: ServeOptions) -> None: ...

    def target(self, frontend_id: int | None, ipc_dir: str, options: ServeOptions) -> tuple[str, Any]: ...

    def exited(self, pid: int, ipc_dir: str) -> None: ...


@dataclass
class _Child:
    """A started process and the supervisor's end of its pipe; as is, a spare (started without a frontend id,
    ``FrontendKind.standby``) until a slot takes it."""

    process: Any = None
    conn: Any = None
    pid: int | None = None
    started_at: float = 0.0  # monotonic
    ready: bool = False  # a slot's process serves; a spare stands by: built, waiting for its id
    failure: str | None = None  # what the process said when it could not start


@dataclass(kw_only=True)
class _Slot(_Child):
    """One frontend id: its current process (if any) and its history."""

    frontend_id: int
    policy: RestartPolicy
    restarts: int = 0
    restart_at: float | None = None
    ready_by: float = float("inf")  # monotonic; a process not ready by then is killed
    given_up: bool = False
    times_given_up: int = 0
    last_exit: int | None = None


class StopSignals:
    """SIGTERM/SIGINT as a flag plus a readable socket, so waits wake up at once. Process-wide: entering
    installs the handlers and the wakeup fd (from the main thread: ``mptok.supervise.run``); leaving restores them."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.reader, self._writer = socket.socketpair()
        self.reader.setblocking(False)
        self._writer.setblocking(False)
        self._previous_fd: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        self._previous_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self._previous_fd is not None:
            signal.set_wakeup_fd(self._previous_fd)
        self.reader.close()
        self._writer.close()

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self.reader.recv(512):
                pass

    def _handle(self, signum: int, frame: Any) -> None:
        self.received.append(signum)


class Supervisor:
    """Runs one ``mptok serve``: ``run()`` returns the process exit status."""

    def __init__(self, options: ServeOptions, signals: StopSignals, kind: FrontendKind):
        """``signals`` must be entered (installed) for as long as ``run()`` runs;
        ``kind`` is what each slot runs (``mptok serve``'s frontends, ``mptok render``'s processes)."""
        self.options = options
        self._kind = kind
        self._ctx = multiprocessing.get_context("spawn")
        self._authkey = secrets.token_bytes(32)
        self._slots = [
            _Slot(frontend_id=i, policy=RestartPolicy(options.max_restarts, options.restart_window_s, _FIRST_RESTART_DELAY_S))
            for i in range(options.frontends)
        ]
        self._listener: socket.socket | None = None  # the port's one listening socket, every frontend's
        self._ipc_dir: str | None = None
        self._snapshots: SnapshotDir | None = None
        self._signals = signals
        self._serving = False  # after start-up: exits are restarted, not fatal
        self._spares: list[_Child] = []
        self._spare_policy = RestartPolicy(options.max_restarts, options.restart_window_s, _FIRST_RESTART_DELAY_S)
        self._spares_at: float | None = None  # monotonic; when missing spares may be started

    def run(self) -> int:
        """Start, serve until a signal (or every frontend is given up), stop; ``StartupError`` when it cannot
        start, once everything it started is stopped and removed."""
        with contextlib.ExitStack() as cleanup:
            cleanup.enter_context(self._preflight())  # closed last: the port is free once everything stopped
            sweep_stale()
            run_dir = RunDir()  # mode 0700
            cleanup.callback(run_dir.close)
            self._ipc_dir = run_dir.path
            options = self.options
            log_event(logger, logging.INFO, "starting", frontends=options.frontends, host=options.host, port=options.port, ipc_dir=self._ipc_dir)
            self._snapshots = SnapshotDir(self._ipc_dir)
            cleanup.callback(self._stop_all)
            self._start_all()
            return self._serve()

    def _preflight(self) -> socket.socket:
        """Check everything that can be checked before a process starts; the port's listening socket."""
        options = self.options
        if options.frontends < 1:
            raise StartupError(f"--frontends must be at least 1, got {options.frontends}")
        _check_environment(options)
        self._kind.check(options)
        try:
            # Listening, not only bound: a bind alone would not see a listener that set SO_REUSEADDR.
            self._listener = listening_socket(options.host, options.port)
        except OSError as e:
            raise StartupError(f"cannot bind {options.host}:{options.port}: {e.strerror or e}") from None
        # From here on, the options name the port actually bound (not 0).
        self.options = dataclasses.replace(options, port=self._listener.getsockname()[1])
        return self._listener

    def _start_all(self) -> None:
        for slot in self._slots:
            self._spawn(slot)
        deadline = time.monotonic() + self.options.startup_timeout_s
        while not all(slot.ready for slot in self._slots):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = [s.frontend_id for s in self._slots if not s.ready]
                raise StartupError(f"frontends {late} not ready after --startup-timeout {self.options.startup_timeout_s:g} s")
            self._wait(min(remaining, 1.0))
            if self._signals.received:
                raise StartupError(f"stopped by signal {signal.Signals(self._signals.received[0]).name} during start-up")
            for slot in self._slots:
                if slot.process is None:
                    reason = slot.failure or f"exited with {_describe_exit(slot.last_exit)}"
                    raise StartupError(f"frontend {slot.frontend_id} failed to start: {reason}")
        self._serving = True
        self._spares_at = time.monotonic()
        url = f"http://{self.options.host}:{self.options.port}"
        pids = ",".join(str(s.pid) for s in self._slots)
        log_event(logger, logging.INFO, "ready", msg=f"ready: {len(self._slots)} frontends on {url}", url=url, pids=pids, ipc_dir=self._ipc_dir)

    def _start_process(self, frontend_id: int | None, name: str) -> _Child:
        """A started process of the kind (``frontend_id`` None: a standby one)."""
        assert self._ipc_dir is not None
        entry_point, settings = self._kind.target(frontend_id, self._ipc_dir, self.options)
        parent_conn, child_conn = self._ctx.Pipe(duplex=self._kind.standby)
        # The listener crosses as a duplicate descriptor (multiprocessing's socket reduction).
        process = self._ctx.Process(
            target=run_entry_point, args=(entry_point, settings, self._authkey, child_conn, self._listener), name=name
        )
        process.start()
        child_conn.close()
        return _Child(process, parent_conn, process.pid, time.monotonic())

    def _spawn(self, slot: _Slot) -> None:
        """Give ``slot`` a process: a spare if there is one (a warm one first), else a new one."""
        now = time.monotonic()
        child = next((s for s in self._spares if s.ready), self._spares[0] if self._spares else None)
        if child is None:
            child = self._start_process(None if self._kind.standby else slot.frontend_id, f"mptok-frontend-{slot.frontend_id}")
            ready_by, how = now + self.options.startup_timeout_s, "new process"
        else:
            self._spares.remove(child)
            if child.ready:
                ready_by, how = now + min(_ACTIVATION_TIMEOUT_S, self.options.startup_timeout_s), "warm spare"
            else:
                ready_by, how = child.started_at + self.options.startup_timeout_s, "spare still starting"
        if self._kind.standby and child.conn is not None:
            # A process that died meanwhile has its exit handled by _wait.
            with contextlib.suppress(OSError):
                child.conn.send(("serve", slot.frontend_id))
        slot.process, slot.conn, slot.pid = child.process, child.conn, child.pid
        slot.ready, slot.failure, slot.restart_at = False, None, None
        slot.started_at, slot.ready_by = now, ready_by
        log_event(logger, logging.INFO, "frontend_started", frontend=slot.frontend_id, pid=child.pid, restarts=slot.restarts, start=how)
        self._publish()

    def _keep_spares(self, now: float) -> None:
        """Start the spares that are missing, once start-up is over and unless spares are backing off."""
        if self._spares_at is None or now < self._spares_at:
            return
        while len(self._spares) < self._kind.spares:
            self._spares.append(self._start_process(None, "mptok-spare"))
            log_event(logger, logging.INFO, "spare_started", pid=self._spares[-1].pid)

    def _serve(self) -> int:
        while not self._signals.received:
            if all(slot.given_up for slot in self._slots):
                log_event(logger, logging.CRITICAL, "all_frontends_given_up", action="exiting", status=EXIT_ALL_GIVEN_UP)
                return EXIT_ALL_GIVEN_UP
            now = time.monotonic()
            for slot in self._slots:
                if slot.restart_at is not None and slot.restart_at <= now:
                    if slot.given_up:
                        slot.given_up = False
                        slot.policy.forget_exits()
                        reason = f"--given-up-retry {self.options.given_up_retry_s:g} s passed"
                        log_event(logger, logging.WARNING, "frontend_retry", frontend=slot.frontend_id, times_given_up=slot.times_given_up,
                                  reason=reason)  # fmt: skip
                    slot.restarts += 1
                    self._spawn(slot)
                elif slot.process is not None and not slot.ready and now >= slot.ready_by:
                    # A restarted frontend gets startup_timeout_s to be ready, as at start-up (a warm spare, less).
                    self._kill(slot, "frontend_start_timeout", f"not ready {now - slot.started_at:.1f} s after it was started")
                elif slot.ready:
                    self._kill_if_hung(slot)
            for spare in self._spares:
                if not spare.ready and now - spare.started_at >= self.options.startup_timeout_s:
                    self._kill(spare, "spare_start_timeout", f"not standing by after --startup-timeout {self.options.startup_timeout_s:g} s")
            self._keep_spares(now)
            pending = [s.restart_at for s in self._slots if s.restart_at is not None]
            if self._spares_at is not None and len(self._spares) < self._kind.spares:
                pending.append(self._spares_at)
            self._wait(min([1.0, *(max(0.0, t - now) for t in pending)]))
        log_event(logger, logging.INFO, "stopping", signal=signal.Signals(self._signals.received[0]).name)
        return EXIT_OK

    def _kill_if_hung(self, slot: _Slot) -> None:
        timeout_s = self._kind.hang_timeout_s
        if timeout_s is None or slot.process is None or self._ipc_dir is None:
            return
        age = heartbeat.age_s(self._ipc_dir, slot.frontend_id)
        if age is None or age < timeout_s:
            return
        reason = f"no heartbeat for {age:.1f} s (--hang-timeout {timeout_s:g} s): stopped, or its event loop stuck"
        self._kill(slot, "frontend_hung", reason)
        slot.ready = False  # down until its restart is ready
        self._publish()

    def _kill(self, child: _Child, event: str, reason: str) -> None:
        if isinstance(child, _Slot):
            who, action = {"frontend": child.frontend_id}, "killing it; its exit counts as a crash"
            child.ready_by = float("inf")  # killed once; its exit is handled as any other
        else:
            who, action = {}, "killing it"
            child.started_at = float("inf")  # killed once; its exit is handled by _wait
        log_event(logger, logging.ERROR, event, **who, pid=child.pid, reason=reason, action=action)
        with contextlib.suppress(ProcessLookupError, ValueError):
            child.process.kill()

    def _wait(self, timeout_s: float) -> None:
        """Wait for a signal, a message from a child, or a child's exit; handle what came."""
        children = [child for child in [*self._slots, *self._spares] if child.process is not None]
        messages = {child.conn: child for child in children if not child.ready and child.conn is not None}
        sentinels = [child.process.sentinel for child in children]
        for ready in multiprocessing.connection.wait([self._signals.reader, *messages, *sentinels], timeout_s):
            if ready is self._signals.reader:
                self._signals.drain()
            elif ready in messages:
                self._on_message(messages[ready])
        # Exits last: a child's last message ("failed") is read before its exit.
        for child in children:
            if child.process is None or child.process.is_alive():
                continue
            if isinstance(child, _Slot):
                self._on_exit(child)
            else:
                self._on_spare_exit(child)

    def _on_message(self, child: _Child) -> None:
        try:
            message = child.conn.recv()
        except (EOFError, OSError):  # its exit follows
            child.conn.close()
            child.conn = None
            return
        slot = child if isinstance(child, _Slot) else None
        if message[0] == "failed":
            child.failure = message[1]
            if slot is not None:
                log_event(logger, logging.ERROR, "frontend_start_failed", frontend=slot.frontend_id, pid=slot.pid, error=message[1])
            else:
                log_event(logger, logging.ERROR, "spare_start_failed", pid=child.pid, error=message[1])
        elif message[0] == ("ready" if slot is not None else "standby"):  # a slot's process stands by, unseen, first
            child.ready = True
            if slot is not None:
                log_event(logger, logging.INFO, "frontend_ready", frontend=slot.frontend_id, pid=message[1], restarts=slot.restarts)
            else:
                log_event(logger, logging.INFO, "spare_ready", pid=child.pid, after_s=f"{time.monotonic() - child.started_at:.1f}")
            self._publish()

    def _on_spare_exit(self, spare: _Child) -> None:
        """A spare that exits is replaced after a back-off; spares that crash-loop pause for ``given_up_retry_s``."""
        self._spares.remove(spare)
        exitcode = self._reap(spare)
        self._publish()
        if self._signals.received:
            return
        now = time.monotonic()
        delay = self._spare_policy.delay_after_exit(now)
        fields = {"pid": spare.pid, "exit": _describe_exit(exitcode), "error": spare.failure}
        if delay is None:
            self._spare_policy.forget_exits()
            delay = self.options.given_up_retry_s
            log_event(
                logger, logging.CRITICAL, "spares_paused", **fields,
                reason=f"spares crash loop: more than --max-restarts {self.options.max_restarts} exits within {self.options.restart_window_s:g} s",
                action=f"no spares for {delay:g} s (--given-up-retry); a frontend that exits meanwhile restarts cold",
            )
        else:
            log_event(logger, logging.ERROR, "spare_exited", **fields, restart_in_s=f"{delay:g}")
        self._spares_at = now + delay

    def _reap(self, child: _Child) -> int | None:
        """Release ``child``'s process (once it has exited) and its pipe; its exit code, None while it runs."""
        exitcode = child.process.exitcode
        if child.conn is not None:
            child.conn.close()
        if exitcode is not None:
            child.process.close()
        if child.pid is not None and self._ipc_dir is not None:
            self._kind.exited(child.pid, self._ipc_dir)
        return exitcode

    def _on_exit(self, slot: _Slot) -> None:
        if slot.conn is not None and slot.conn.poll(0):
            self._on_message(slot)  # its last message ("failed") before its exit
        slot.last_exit = self._reap(slot)
        slot.process, slot.conn, slot.ready = None, None, False
        self._publish()
        if self._signals.received or not self._serving:
            return
        delay = slot.policy.delay_after_exit(time.monotonic())
        fields = {"frontend": slot.frontend_id, "pid": slot.pid, "exit": _describe_exit(slot.last_exit)}
        if delay is None:
            slot.given_up = True
            slot.times_given_up += 1
            slot.restart_at = time.monotonic() + self.options.given_up_retry_s
            log_event(
                logger, logging.CRITICAL, "frontend_given_up", **fields,
                reason=f"crash loop: {slot.policy.recent_exits} exits within {self.options.restart_window_s:g} s "
                f"(--max-restarts {self.options.max_restarts})",
                action=f"not restarting it for {self.options.given_up_retry_s:g} s (--given-up-retry); the other "
                "frontends take its conversations meanwhile; read its last log lines and fix the cause",
                retry_in_s=f"{self.options.given_up_retry_s:g}",
            )  # fmt: skip
            self._publish()
            return
        slot.restart_at = time.monotonic() + delay
        log_event(logger, logging.ERROR, "frontend_exited", **fields, restart_in_s=f"{delay:g}", recent_exits=slot.policy.recent_exits)

    def _stop_all(self) -> None:
        """SIGTERM every frontend and spare, wait (bounded), SIGKILL stragglers, reap them all."""
        running = [child for child in [*self._slots, *self._spares] if child.process is not None]
        for child in running:
            with contextlib.suppress(ProcessLookupError, ValueError):
                child.process.terminate()
        deadline = time.monotonic() + self.options.graceful_timeout_s + _EXIT_MARGIN_S
        for child in running:
            child.process.join(max(0.0, deadline - time.monotonic()))
        stragglers = [child for child in running if child.process.is_alive()]
        for child in stragglers:
            log_event(logger, logging.WARNING, "frontend_killed", frontend=_named(child), pid=child.pid, reason="did not stop in time")
            child.process.kill()
        deadline = time.monotonic() + _JOIN_AFTER_KILL_S
        for child in stragglers:
            child.process.join(max(0.0, deadline - time.monotonic()))
        for child in running:
            exitcode = self._reap(child)
            log_event(logger, logging.INFO, "frontend_stopped", frontend=_named(child), pid=child.pid, exit=_describe_exit(exitcode))
            child.process, child.conn, child.ready = None, None, False
        self._spares = []
        log_event(logger, logging.INFO, "stopped")

    def _publish(self) -> None:
        if self._snapshots is None:
            return
        snapshot = {
            "up": {str(s.frontend_id): int(s.ready) for s in self._slots},
            "restarts": {str(s.frontend_id): s.restarts for s in self._slots},
            "given_up": {str(s.frontend_id): int(s.given_up) for s in self._slots},
            "spares": sum(spare.ready for spare in self._spares),
        }
        with contextlib.suppress(OSError):
            self._snapshots.write(SUPERVISOR_SNAPSHOT, snapshot)


def run_entry_point(entry_point: str, *args: Any) -> None:
    """Every supervised process's spawn target: import ``"module:function"`` here, in the child, and call it."""
    module, function = entry_point.split(":")
    getattr(importlib.import_module(module), function)(*args)


def _check_environment(options: ServeOptions) -> None:
    """Refuse a bad ``MPTOK_*`` variable once, here, in one line: every
    frontend reads the same environment and would fail on it as it starts."""
    # Imported here: importing the supervisor loads no part of the cache, and
    # its configuration alone loads no tokenizer, numpy or engine.
    from mptok.cache.config import CacheConfig

    try:
        CacheConfig.from_env(**options.arguments_for(Use.CACHE))
        routing_policy(options.routing)
        engine_memo_dir()
    except ValueError as e:
        raise StartupError(str(e)) from None


def _named(child: _Child) -> int | str:
    """How a stop's log lines name ``child``: its frontend id, or "spare"."""
    return child.frontend_id if isinstance(child, _Slot) else "spare"


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-exitcode).name}"
        return f"signal {-exitcode}"
    return f"code {exitcode}"

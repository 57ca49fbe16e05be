"""Real frontend processes in one ipc dir, for the routing and fault tests.

Each child (forked from a fork server that imported this module) runs ``TokenizationOwners`` over the real
``PrefixTokenCache`` and the embedded tokenizer, and obeys commands the test
sends over a pipe. ``FrontendPool`` kills whatever it started on teardown
(SIGCONT first, so that a stopped child can die), so a failing test leaves
no process behind. Every wait on a child is bounded by ``HANG_GUARD_S``: a
broken test fails instead of hanging; no test asserts on durations.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import mptok
from mptok.cache.loading import _import_transformers_quietly
from mptok.engines import choice
from mptok.routing.owners import ServerLimits, TokenizationOwners, lower_switch_interval
from mptok_harness.checks import HANG_GUARD_S, expected_ids, wait_until, warm_up

# What every frontend child imports, imported here: the children are forked
# from a server that imported this module (``FrontendPool``).
_import_transformers_quietly()
from transformers import PreTrainedTokenizerFast  # noqa: E402, F401

AUTHKEY = b"mptok-test-authkey"


def key_owned_by(owner: int, num_frontends: int, prefix: str, *, then: int | None = None) -> str:
    """A conversation key whose owner is ``owner`` (and whose next frontend is ``then``)."""
    from mptok.routing.router import owner_order

    for i in range(100_000):
        key = f"{prefix}-{i}"
        order = owner_order(key, num_frontends)
        if order[0] == owner and (then is None or order[1] == then):
            return key
    raise AssertionError("no such key")


def _run_encode(encoder: Any, tokenizer: Any, key: str | None, text: str) -> tuple:
    try:
        return ("ok", encoder.encode(tokenizer, text, key=key))
    except Exception as e:
        return ("raised", type(e).__name__, str(e))


def _run_encode_together(barrier: threading.Barrier, encoder: Any, tokenizer: Any, key: str | None, text: str) -> tuple:
    barrier.wait(HANG_GUARD_S)
    return _run_encode(encoder, tokenizer, key, text)


def _reply_when_done(reply: Callable[[Any], None], futures: list[concurrent.futures.Future]) -> None:
    reply(("done", [f.result() for f in futures]))


# ctypes.PyDLL keeps the GIL during the call: like a long native call that
# never releases it.
_native_sleep = ctypes.PyDLL(None).sleep


def _in_native_sleep(pid: int) -> bool:
    """Whether ``pid``'s main thread is blocked in a sleep (seen by the kernel)."""
    with open(f"/proc/{pid}/wchan") as f:
        return f.read().endswith("nanosleep")


def frontend_main(conn: Any, ipc_dir: str, frontend_id: int, num_frontends: int, options: dict) -> None:
    """Body of a frontend child: serve, route, and answer the test's commands."""
    lower_switch_interval()  # as mptok serve's frontends do
    tokenizer = mptok.load_tokenizer()
    cache = mptok.PrefixTokenCache()
    limits = ServerLimits(**options.pop("limits", {}))
    warm = options.pop("warm_up", True)
    try:
        owners = TokenizationOwners(
            ipc_dir, frontend_id, num_frontends, cache, tokenizer, authkey=AUTHKEY, limits=limits, **options
        )
    except Exception as e:
        conn.send(("failed", type(e).__name__, str(e)))
        return
    if warm:
        # Starts the tokenizer as a serving frontend does; without it, the
        # owner starts as a library user's would.
        warm_up(cache, tokenizer)
    send_lock = threading.Lock()

    def reply(message: Any) -> None:
        with send_lock:
            conn.send(message)

    reply(("ready", os.getpid()))
    pool = concurrent.futures.ThreadPoolExecutor(64)
    while True:
        try:
            command, *args = conn.recv()
        except EOFError:
            break
        if command == "encode":
            reply(_run_encode(owners, tokenizer, *args))
        elif command == "encode_many":
            items, threads = args
            barrier = threading.Barrier(min(threads, len(items)))
            with concurrent.futures.ThreadPoolExecutor(threads) as batch:
                futures = [batch.submit(_run_encode_together, barrier, owners, tokenizer, *item) for item in items]
                reply([f.result() for f in futures])
        elif command == "encode_async":
            # Answered later with ("done", results), while the loop goes on.
            futures = [pool.submit(_run_encode, owners, tokenizer, *item) for item in args[0]]
            pool.submit(_reply_when_done, reply, futures)
        elif command == "stats":
            reply({"routing": owners.stats(), "cache": cache.stats()})
        elif command == "hold_gil":
            reply("holding")
            _native_sleep(args[0])
        elif command == "close":
            owners.close()
            reply(
                {
                    # The backends' checker is the process's, not the owners'.
                    "threads": [
                        t.name
                        for t in threading.enumerate()
                        if t.name.startswith("mptok") and t.name != choice.VERIFIER_THREAD
                    ],
                    "socket_exists": os.path.exists(os.path.join(ipc_dir, f"tokenize-{frontend_id}.sock")),
                }
            )
        elif command == "exit":
            break
    owners.close()
    pool.shutdown(wait=False)


class Frontend:
    """The test's handle on one frontend child."""

    def __init__(self, ctx: Any, ipc_dir: str, frontend_id: int, num_frontends: int, options: dict):
        self.frontend_id = frontend_id
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=frontend_main,
            args=(child_conn, ipc_dir, frontend_id, num_frontends, options),
            name=f"frontend-{frontend_id}",
            daemon=True,
        )
        self.process.start()
        child_conn.close()
        self.pid: int | None = None

    def wait_ready(self) -> None:
        reply = self.recv()
        if reply[0] != "ready":
            raise RuntimeError(f"frontend {self.frontend_id} did not start: {reply}")
        self.pid = reply[1]

    def send(self, *command: Any) -> None:
        self._conn.send(command)

    def recv(self, timeout_s: float = HANG_GUARD_S) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"frontend {self.frontend_id} did not answer in {timeout_s} s")
        return self._conn.recv()

    def call(self, *command: Any, timeout_s: float = HANG_GUARD_S) -> Any:
        self.send(*command)
        return self.recv(timeout_s)

    def encode(self, key: str | None, text: str) -> list[int]:
        reply = self.call("encode", key, text)
        if reply[0] != "ok":
            raise AssertionError(f"frontend {self.frontend_id} raised {reply}")
        return reply[1]

    def stats(self) -> dict:
        return self.call("stats")

    def hold_gil(self, seconds: int) -> None:
        """Have the child hold its GIL for ``seconds``, as a native call that
        never releases it would: its threads answer nothing meanwhile.
        Returns once the hold has begun. The command's reply comes just
        before the hold, and a peer's call taken in between would be
        answered; so the hold is seen from outside, in the kernel."""
        assert self.call("hold_gil", seconds) == "holding"
        wait_until(lambda: _in_native_sleep(self.process.pid), f"frontend {self.frontend_id} to hold its GIL")

    def signal(self, signum: int) -> None:
        os.kill(self.process.pid, signum)

    def kill(self) -> None:
        if self.process.is_alive():
            for signum in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(self.process.pid, signum)
                except ProcessLookupError:
                    break
        self.process.join(10)
        self._conn.close()


class FrontendPool:
    """Starts frontends in one ipc dir and kills them all at ``close()``."""

    def __init__(self, ipc_dir: str):
        os.makedirs(ipc_dir, mode=0o700, exist_ok=True)
        self.ipc_dir = ipc_dir
        # Children forked from a server that imported this module, and with
        # it mptok and transformers, once: a spawned child spent most of a
        # second of CPU on those imports at every start.
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload([__name__])
        self._started: list[Frontend] = []

    def start(self, ids: list[int], num_frontends: int, **options: Any) -> list[Frontend]:
        frontends = self.launch(ids, num_frontends, **options)
        for frontend in frontends:
            frontend.wait_ready()
        return frontends

    def launch(self, ids: list[int], num_frontends: int, **options: Any) -> list[Frontend]:
        """Start frontends without waiting for them to be ready."""
        frontends = [Frontend(self._ctx, self.ipc_dir, i, num_frontends, dict(options)) for i in ids]
        self._started.extend(frontends)
        return frontends

    def start_scripted_owner(self, frontend_id: int, delay_s: float) -> "ScriptedOwner":
        """An owner whose answers a test scripts (see ``scripted_owner_main``)."""
        owner = ScriptedOwner(self._ctx, self.ipc_dir, frontend_id, delay_s)
        self._started.append(owner)  # type: ignore[arg-type]
        owner.wait_ready()
        return owner

    def start_failing(self, frontend_id: int, num_frontends: int, **options: Any) -> tuple:
        """Start a frontend expected to fail at start-up; returns its error reply."""
        frontend = Frontend(self._ctx, self.ipc_dir, frontend_id, num_frontends, dict(options))
        self._started.append(frontend)
        return frontend.recv()

    def close(self) -> None:
        for frontend in self._started:
            frontend.kill()


SLOW_MARKER = "[slow]"


def scripted_owner_main(conn: Any, ipc_dir: str, frontend_id: int, delay_s: float) -> None:
    """An owner that keeps no prompt it could extend and takes ``delay_s`` over any text with ``SLOW_MARKER``.

    It answers with the tokenizer's own ids, so what a peer gets is exact
    whichever way the prompt went; what the test sees is how many calls a
    prompt took, through the peer's counters.
    """
    from mptok.core.protocol import PeerReply, PeerRequest
    from mptok.routing.liveness import publish
    from mptok.transport import serve_encode, socket_path

    tokenizer = mptok.load_tokenizer()

    def answer(request: PeerRequest) -> PeerReply | None:
        if SLOW_MARKER in request.text:
            time.sleep(delay_s)
        if request.delta:
            return None
        return PeerReply(True, expected_ids(tokenizer, request.text))

    address = socket_path(ipc_dir, frontend_id)
    manager = serve_encode(address, answer, AUTHKEY)
    publish(ipc_dir, frontend_id, address)
    conn.send(("ready", os.getpid()))
    with contextlib.suppress(EOFError):
        conn.recv()
    manager.shutdown()


class ScriptedOwner(Frontend):
    def __init__(self, ctx: Any, ipc_dir: str, frontend_id: int, delay_s: float):
        self.frontend_id = frontend_id
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=scripted_owner_main, args=(child_conn, ipc_dir, frontend_id, delay_s), daemon=True
        )
        self.process.start()
        child_conn.close()
        self.pid = None

"""One render process of ``mptok render``: vLLM's own ``vllm launch render``, on a port it shares.

The process runs vLLM's command line (``vllm_command``) with two names of
vLLM's render entry module wrapped for the time of the call
(``VllmRenderHooks``), nothing else: ``setup_server`` returns the
supervisor's listening socket; ``serve_http`` stands by (vLLM's app,
renderer and the plugin's cache built and warm) until the supervisor gives
the process its frontend id, then takes that seat and serves vLLM's app
behind the hit path, the session-header middleware and ``RenderGate``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import io
import multiprocessing
import os
import socket
import sys
from collections.abc import Iterator
from typing import Any

from mptok.render.frontends import RenderSettings, prometheus_dir
from mptok.render.gate import RenderGate
from mptok.render.hits import RenderHits
from mptok.render.options import MODE
from mptok.supervise.admission import Admission
from mptok.supervise.heartbeat import Heartbeat
from mptok.supervise.lifeline import stop_with_parent
from mptok.supervise.options import Use
from mptok.supervise.snapshots import SnapshotDir
from mptok.vllm.session import SessionHeaders

_STARTED_POLL_S = 0.05


def vllm_command(settings: RenderSettings) -> list[str]:
    """The ``vllm`` command line this process runs (without the program name)."""
    options = settings.options
    args = list(options.vllm_args)
    if "--tokenizer-mode" not in {arg.partition("=")[0] for arg in args}:
        args += ["--tokenizer-mode", MODE]
    return ["launch", "render", options.model, "--host", options.serve.host, "--port", str(options.serve.port), *args]


class VllmRenderHooks:
    """vLLM's render entry with its socket shared and its app gated, while ``installed()``; ``ready_sent`` once
    the supervisor was told the process serves, ``standing_by`` while it waits for its frontend id."""

    def __init__(self, settings: RenderSettings, authkey: bytes, conn: Any, listener: socket.socket) -> None:
        self._settings = settings
        self._authkey = authkey
        self._conn = conn
        self._listener = listener
        self.ready_sent = False
        self.standing_by = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        from mptok.vllm.compat import HOOKS, RENDER_HOOKS, check_vllm

        check_vllm(HOOKS + RENDER_HOOKS)  # refused here, by name, rather than failing inside vLLM
        from vllm.entrypoints.launchers.render import entry

        setup_server, serve_http = entry.setup_server, entry.serve_http

        def shared_setup_server(args: Any, *, reuse_port: bool) -> Any:
            # vLLM's own checks and start log, on a throwaway port: the process accepts from the supervisor's listening socket.
            throwaway = copy.copy(args)
            throwaway.port = 0
            listen_address, sock = setup_server(throwaway, reuse_port=False)
            sock.close()
            return f"{listen_address.rpartition(':')[0]}:{args.port}", self._listener

        entry.setup_server, entry.serve_http = shared_setup_server, functools.partial(self._serve, serve_http)
        try:
            yield
        finally:
            entry.setup_server, entry.serve_http = setup_server, serve_http

    async def _serve(self, serve_http: Any, app: Any, sock: Any, **kwargs: Any) -> Any:
        frontend_id = await self._frontend_id()
        options = self._settings.options.serve
        multiprocessing.current_process().name = f"mptok-frontend-{frontend_id}"
        from mptok.front.engine_tokens import Seat, take_seat

        take_seat(Seat(frontend_id, options.frontends, self._settings.ipc_dir, self._authkey, options.arguments_for(Use.ROUTING)))
        # vLLM has built its middleware stack already (add_middleware would refuse): the hit path and the gate go
        # around it; the hit path's renders see the session header as vLLM's own requests do.
        stack = RenderHits(app.middleware_stack or app.build_middleware_stack(), app)
        app.middleware_stack = RenderGate(SessionHeaders(stack), Admission(options.max_in_flight), SnapshotDir(self._settings.ipc_dir))
        serving = asyncio.ensure_future(serve_http(app, sock, **kwargs))
        heartbeat = Heartbeat(self._settings.ipc_dir, frontend_id)
        try:
            while not serving.done():
                server = getattr(app.state, "server", None)
                if server is not None and server.started:
                    heartbeat.start()
                    self._conn.send(("ready", os.getpid()))
                    self.ready_sent = True
                    break
                await asyncio.sleep(_STARTED_POLL_S)
            return await serving
        finally:
            heartbeat.stop()

    async def _frontend_id(self) -> int:
        """Tell the supervisor this process is built, then wait (on the event loop, no thread) for its id."""
        self._conn.send(("standby", os.getpid()))
        loop = asyncio.get_running_loop()
        readable: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not readable.done():
                readable.set_result(None)

        self.standing_by = True
        loop.add_reader(self._conn.fileno(), wake)
        try:
            await readable
        finally:
            loop.remove_reader(self._conn.fileno())
        self.standing_by = False  # not reached when a SIGTERM interrupts the wait: render_main reads it
        message = self._conn.recv()  # EOFError: the supervisor is gone
        assert message[0] == "serve", message
        return int(message[1])


def render_main(settings: RenderSettings, authkey: bytes, conn: Any, listener: socket.socket) -> None:
    """Body of a render process, the supervisor's spawn target (``FrontendKind.standby``: ``conn`` is two-way);
    ``("failed", reason)`` and exit 1 if vLLM does not start, exit 0 when a spare is stopped while it waits."""
    # Read by prometheus_client when it is first imported (vLLM imports it).
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = prometheus_dir(settings.ipc_dir)
    _make_metric_files(prometheus_dir(settings.ipc_dir))
    parent = multiprocessing.parent_process()
    stop_with_parent(parent.pid if parent is not None else os.getppid())
    from mptok.front.engine_tokens import stand_by

    stand_by()
    hooks = VllmRenderHooks(settings, authkey, conn, listener)
    try:
        status = _run_vllm(vllm_command(settings), hooks)
    except BaseException as e:
        if hooks.ready_sent:
            raise
        if hooks.standing_by and isinstance(e, KeyboardInterrupt):
            raise SystemExit(0) from None  # a spare stopped (SIGTERM) before it had an id
        status = f"{type(e).__name__}: {e}"
    if hooks.ready_sent:
        raise SystemExit(0 if status in (None, 0) else 1)
    with contextlib.suppress(OSError):
        conn.send(("failed", f"vllm launch render did not start: {status}"))
    raise SystemExit(1)


def _make_metric_files(directory: str) -> None:
    """This process's prometheus_client value files, made whole before any metric exists.

    prometheus_client creates a value file empty and sizes it after; a
    ``/metrics`` read in between fails (``struct.error``: a 500). Made here
    zeroed at their final size (no values yet) and moved into place, a read
    only ever sees whole files. A file left by a dead process of the same
    pid is kept: its counters are part of the totals."""
    from prometheus_client.metrics import Gauge
    from prometheus_client.mmap_dict import _INITIAL_MMAP_SIZE

    kinds = ["counter", "histogram", "summary", *(f"gauge_{mode}" for mode in sorted(Gauge._MULTIPROC_MODES))]
    for kind in kinds:
        path = os.path.join(directory, f"{kind}_{os.getpid()}.db")
        if os.path.exists(path):
            continue
        with open(f"{path}.part", "wb") as made:
            made.truncate(_INITIAL_MMAP_SIZE)
        os.replace(f"{path}.part", path)


def _run_vllm(argv: list[str], hooks: VllmRenderHooks) -> int | str | None:
    """vLLM's CLI on ``argv``; its exit status, or for an argument error argparse's message."""
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *argv]
    errors = _Tee(sys.stderr)
    with hooks.installed(), contextlib.redirect_stderr(errors):
        try:
            main()
        except SystemExit as e:
            if e.code not in (None, 0) and not hooks.ready_sent:
                return errors.last_line or f"exit status {e.code}"
            return e.code if isinstance(e.code, int) or e.code is None else str(e.code)
    return None


class _Tee(io.TextIOBase):
    """Writes through to ``stream``, remembering the last line (``last_line``: argparse's error)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.last_line = ""

    def write(self, text: str) -> int:
        self.last_line = next((line for line in reversed(text.splitlines()) if line.strip()), self.last_line)
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()

    def fileno(self) -> int:
        return self._stream.fileno()

"""One tokenization frontend process of ``mptok serve``: HTTP in, exact token ids out.

The supervisor (``mptok.supervisor``) starts N of these; each binds the same
port with SO_REUSEPORT, so the kernel spreads connections over them, and
each serves its ``PrefixTokenCache`` to the others through
``TokenizationOwners``, so a conversation is tokenized by the frontend whose
cache holds it wherever its request lands. The HTTP side is FastAPI on
uvicorn, as in vLLM and SGLang; everything that costs CPU (parsing,
rendering the chat template, tokenizing, possibly waiting on a peer, and
serializing the ids with orjson) runs in ``TokenizeService``'s bounded
thread pool (``mptok.tokenize_service``), never on the event loop, so
``/health`` and ``/metrics`` answer while prompts tokenize. This module is
the HTTP app and the process's lifecycle.

Endpoints: ``POST /tokenize`` (shaped like vLLM's), ``GET /health``,
``GET /metrics`` (every frontend's counters, see ``mptok.metrics``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from mptok.chat_template import ChatTemplate
from mptok.logfmt import configure_logging, log_event
from mptok.metrics import PeriodicTask, SnapshotDir, render_prometheus
from mptok.tokenize_request import RequestError, error_body
from mptok.tokenize_service import Answer, TokenizeService

logger = logging.getLogger("mptok.frontend")

# Headers that name the conversation when the body does not ("conversation_id").
CONVERSATION_HEADERS = ("x-session-id", "x-correlation-id")


@dataclass(frozen=True)
class FrontendSettings:
    """What one frontend process needs to start; picklable (it crosses the spawn pipe).

    The authkey is not in here: it travels as its own Process argument and
    is never logged.
    """

    frontend_id: int
    num_frontends: int
    host: str
    port: int
    ipc_dir: str
    tokenizer: str | None
    chat_template: str | None  # the template's source, read by the supervisor
    max_prompt_chars: int
    threads: int
    affinity_chars: int
    route_timeout_s: float
    route_backoff_s: float
    graceful_timeout_s: float
    cache_bytes: int | None = None  # None: CacheConfig's (MPTOK_CACHE_MAX_BYTES or its default)


# -- HTTP ------------------------------------------------------------------------


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"the body has {declared} bytes; at most {limit} are read")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"the body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def build_app(service: TokenizeService, snapshots: SnapshotDir, publish_own: Callable[[], None]) -> FastAPI:
    """The ASGI app of one frontend. ``publish_own()`` writes this frontend's snapshot now."""
    app = FastAPI(title="mptok frontend", docs_url=None, redoc_url=None, openapi_url=None)
    pid = os.getpid()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        key = next((request.headers[h] for h in CONVERSATION_HEADERS if request.headers.get(h)), None)
        try:
            body = await _read_body(request, service.max_body_bytes)
            answer = await asyncio.wrap_future(service.submit(body, key))
        except RequestError as e:
            answer = Answer(e.status, error_body(e.status, e.message))
        service.count_request("/tokenize", answer.status)
        headers = None
        if answer.tokenize_s is not None:
            # The same interval as mptok_tokenize_seconds, for one request.
            headers = {"Server-Timing": f"tokenize;dur={answer.tokenize_s * 1000:.3f}"}
        return Response(answer.payload, status_code=answer.status, headers=headers, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        service.count_request("/health", 200)
        return Response(
            orjson.dumps({"status": "ok", "frontend": service.frontend_id, "pid": pid}),
            media_type="application/json",
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        service.count_request("/metrics", 200)
        text = await asyncio.to_thread(_render_all, snapshots, publish_own)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _render_all(snapshots: SnapshotDir, publish_own: Callable[[], None]) -> str:
    publish_own()
    return render_prometheus(snapshots.read_all())


def tcp_socket(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not listening yet), SO_REUSEADDR set.

    With ``reuse_port`` it joins the port's SO_REUSEPORT group, as every
    frontend does; without, the bind fails while anyone listens on the port,
    which is how the supervisor checks that the port is free.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


# -- the process ---------------------------------------------------------------


class _StopRequests:
    """SIGTERM/SIGINT before uvicorn takes them over (and after: uvicorn re-raises
    what it caught once it has shut down; the default action would kill the
    process before it closes its owner socket)."""

    def __init__(self) -> None:
        self.requested = False
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True


class Frontend:
    """One frontend's resources, opened in ``__init__`` and released by ``close()`` in reverse.

    Startup order: tokenizer, chat template, cache (its backend built before
    anything is served), the bound (not yet listening) port,
    ``TokenizationOwners`` (peers may route here from now on), the thread
    pool, the metrics snapshot thread. ``serve()`` then listens and reports
    ready. ``close()`` after serving: write the last snapshot, wait for
    tokenizations (bounded), stop serving peers, close the port.
    """

    def __init__(self, settings: FrontendSettings, authkey: bytes):
        import mptok
        from mptok.routing import TokenizationOwners

        self.settings = settings
        self._parent_pid = os.getppid()
        self._server: Any = None
        self._stack = contextlib.ExitStack()
        try:
            tokenizer = mptok.load_tokenizer(settings.tokenizer)
            template = ChatTemplate.for_tokenizer(tokenizer, settings.chat_template)
            budget = {} if settings.cache_bytes is None else {"max_bytes": settings.cache_bytes}
            cache = mptok.PrefixTokenCache(mptok.CacheConfig.from_env(**budget))
            # Builds the process-wide tokenizer backend (about a second) before
            # peers can route here, or their first call could time out on it;
            # on a throwaway cache, so that the served one counts only requests.
            mptok.PrefixTokenCache().encode_local(tokenizer, "warm up")
            self.socket = self._stack.enter_context(
                tcp_socket(settings.host, settings.port, reuse_port=True)
            )
            self.owners = self._stack.enter_context(
                TokenizationOwners(
                    settings.ipc_dir,
                    settings.frontend_id,
                    settings.num_frontends,
                    cache,
                    tokenizer,
                    authkey=authkey,
                    timeout_s=settings.route_timeout_s,
                    backoff_s=settings.route_backoff_s,
                )
            )
            self.service = TokenizeService(
                settings.frontend_id,
                tokenizer,
                cache,
                template,
                max_prompt_chars=settings.max_prompt_chars,
                threads=settings.threads,
                affinity_chars=settings.affinity_chars,
            )
            self._stack.callback(self.service.close, settings.graceful_timeout_s)
            self._snapshots = SnapshotDir(settings.ipc_dir)
            self._started = time.time()
            self._housekeeping = PeriodicTask(f"mptok-metrics-{settings.frontend_id}", self._tick)
            self._housekeeping.start()
            self._stack.callback(self._housekeeping.stop)
            self.app = build_app(self.service, self._snapshots, self._publish)
        except BaseException:
            self._stack.close()
            raise

    async def serve(self, ready: Any, stop: _StopRequests) -> None:
        """Listen, send ``("ready", pid)`` on ``ready``, serve until SIGTERM/SIGINT, drain."""
        import uvicorn

        config = uvicorn.Config(
            self.app,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=self.settings.graceful_timeout_s,
        )
        self._server = uvicorn.Server(config)
        if stop.requested:
            return
        serving = asyncio.create_task(self._server.serve(sockets=[self.socket]))
        while not self._server.started and not serving.done():
            await asyncio.sleep(0.01)
        if stop.requested:  # came before uvicorn installed its handlers, so it landed in ours
            self._server.should_exit = True
        if self._server.started:
            ready.send(("ready", os.getpid()))
            log_event(logger, logging.INFO, "frontend_ready", url=f"http://{self.settings.host}:{self.settings.port}")
        await serving

    def close(self) -> None:
        self._stack.close()

    def _publish(self) -> None:
        self._snapshots.write(
            self.settings.frontend_id,
            {
                "frontend": self.settings.frontend_id,
                "pid": os.getpid(),
                "started": self._started,
                "routing": self.owners.stats(),
                "routing_seconds": self.owners.timings(),
                **self.service.snapshot(),
            },
        )

    def _tick(self) -> None:
        self._publish()
        if os.getppid() != self._parent_pid and self._server is not None and not self._server.should_exit:
            log_event(logger, logging.ERROR, "supervisor_gone", parent_pid=self._parent_pid, action="shutting down")
            self._server.should_exit = True


def frontend_main(settings: FrontendSettings, authkey: bytes, ready: Any) -> None:
    """Body of a frontend process (the supervisor's spawn target).

    Sends ``("ready", pid)`` once its port listens and it serves its peers,
    or ``("failed", one_line_reason)`` and exits 1 if it cannot start.
    """
    configure_logging("frontend", settings.frontend_id)
    stop = _StopRequests()
    try:
        frontend = Frontend(settings, authkey)
    except Exception as e:
        log_event(logger, logging.ERROR, "frontend_failed", error=f"{type(e).__name__}: {e}")
        with contextlib.suppress(OSError):
            ready.send(("failed", f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    try:
        asyncio.run(frontend.serve(ready, stop))
    finally:
        frontend.close()
        log_event(logger, logging.INFO, "frontend_stopped")

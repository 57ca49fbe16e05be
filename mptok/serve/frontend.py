"""One tokenization frontend process of ``mptok serve``: HTTP in, exact token ids out.

The supervisor starts N of these on the port's one listening socket; each
serves its ``PrefixTokenCache`` to the others through
``TokenizationOwners``. The HTTP side is a small ASGI app on uvicorn's
httptools protocol (no framework: its routing and request objects cost more
than the answer); everything that costs CPU runs in ``TokenizeService``'s
bounded thread pool, never on the event loop, so ``/health`` and
``/metrics`` answer while prompts tokenize.

Endpoints: ``POST /tokenize`` and ``POST /detokenize`` (vLLM's contract),
the opt-in ``GET /tokenizer_info``, ``GET /health``, ``GET /metrics``
(every frontend's counters, ``mptok.supervise.metrics``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import orjson
import uvicorn

from mptok.api.affinity import header_conversation_id
from mptok.api.asgi import Receive, Scope, Send, read_body, respond
from mptok.api.chat_template import ChatTemplate
from mptok.api.tokenize_request import RequestError, error_body
from mptok.api.vllm_contract import resolve_max_model_len, tokenizer_info_payload
from mptok.core.periodic import PeriodicTask
from mptok.routing.owners import lower_switch_interval
from mptok.core.deadline import Deadline
from mptok.serve.http_protocol import ARRIVED_SCOPE_KEY, REFUSED_SCOPE_KEY, UNPARSED_PATH, guarded_protocol
from mptok.serve.launch import FrontendSettings
from mptok.serve.service import Answer, TokenizeService
from mptok.supervise.lifeline import stop_with_parent
from mptok.supervise.logfmt import configure_logging, log_event
from mptok.supervise.metrics import render_prometheus
from mptok.supervise.options import Use
from mptok.supervise.snapshots import SNAPSHOT_INTERVAL_S, SnapshotDir

logger = logging.getLogger("mptok.frontend")

# What the owner's close gets at least, however much of the stop budget is left.
_OWNERS_CLOSE_FLOOR_S = 0.5

# mptok_http_requests_total's code for a request whose client went away unanswered (nginx's).
CLIENT_GONE = 499


Handler = Callable[[Scope, Receive], Awaitable[Answer]]


async def _send(send: Send, answer: Answer) -> None:
    headers = [(b"content-type", answer.media_type), *answer.headers]
    if answer.tokenize_s is not None:
        # The same interval as mptok_tokenize_seconds, for one request.
        headers.append((b"server-timing", f"tokenize;dur={answer.tokenize_s * 1000:.3f}".encode()))
    await respond(send, answer.status, answer.payload, headers, answer.retry_after_s)


def _header(scope: Scope, name: str) -> str | None:
    wanted = name.encode("latin-1")
    return next((value.decode("latin-1") for key, value in scope["headers"] if key == wanted), None)


def build_app(
    service: TokenizeService, snapshots: SnapshotDir, publish_own: Callable[[], None], tokenizer_info_payload: bytes | None = None
) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """The ASGI app of one frontend: a table of (method, path) to handler, no framework
    in between. ``publish_own()`` writes this frontend's snapshot now;
    ``GET /tokenizer_info`` exists only when ``tokenizer_info_payload`` is given."""
    pid = os.getpid()

    async def answered(scope: Scope, receive: Receive, work: Callable[[bytes], Awaitable[Answer | None]]) -> Answer:
        """``work``'s answer to the body, read while the request holds an ``Admission`` place;
        ``CLIENT_GONE`` when nobody is left to answer (uvicorn drops what is sent)."""
        answer: Answer | None
        limit = service.max_body_bytes
        try:
            with service.admission.place():
                declared = _header(scope, "content-length") or ""
                if declared.isdigit() and int(declared) > limit:
                    raise RequestError(413, f"the body has {declared} bytes; at most {limit} are read")
                body = await read_body(receive, limit)
                answer = None if body is None else await work(body)
        except RequestError as e:
            answer = Answer.of_error(e)
        return Answer(CLIENT_GONE, b"") if answer is None else answer

    async def tokenize(scope: Scope, receive: Receive) -> Answer:
        key = header_conversation_id(lambda name: _header(scope, name))
        # One deadline from the request's first byte: the queue wait and the route take what is left.
        arrived = scope.get(ARRIVED_SCOPE_KEY)
        deadline = Deadline.after(service.queue_timeout_s) if arrived is None else Deadline(arrived + service.queue_timeout_s)

        async def answer(body: bytes) -> Answer | None:
            gone = asyncio.ensure_future(_client_gone(receive))  # the service skips work whose client has gone
            try:
                return await service.answer(body, key, gone, deadline)
            finally:
                gone.cancel()

        return await answered(scope, receive, answer)

    async def detokenize(scope: Scope, receive: Receive) -> Answer:
        return await answered(scope, receive, lambda body: asyncio.wrap_future(service.submit_detokenize(body)))

    async def tokenizer_info(scope: Scope, receive: Receive) -> Answer:
        return Answer(200, tokenizer_info_payload or b"")

    async def health(scope: Scope, receive: Receive) -> Answer:
        return Answer(200, orjson.dumps({"status": "ok", "frontend": service.frontend_id, "pid": pid}))

    async def metrics(scope: Scope, receive: Receive) -> Answer:
        text = await asyncio.to_thread(_render_all, snapshots, publish_own)
        return Answer(200, text.encode(), media_type=b"text/plain; version=0.0.4; charset=utf-8")

    routes: dict[str, tuple[str, Handler]] = {
        "/tokenize": ("POST", tokenize),
        "/detokenize": ("POST", detokenize),
        "/health": ("GET", health),
        "/metrics": ("GET", metrics),
    }
    if tokenizer_info_payload is not None:
        routes["/tokenizer_info"] = ("GET", tokenizer_info)

    def refused(status: int, path: str, message: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> Answer:
        # An unknown path is counted as "-", so that clients cannot mint label values.
        service.count_request(path, status)
        return Answer(status, error_body(status, message), headers=headers)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        route = routes.get(path)
        try:
            if route is None:
                reply = refused(404, UNPARSED_PATH, f"no endpoint {path[:200]!r}")
            elif method != route[0] and not (method == "HEAD" and route[0] == "GET"):
                reply = refused(405, path, f"{method[:20]} {path}: Method Not Allowed", ((b"allow", route[0].encode()),))
            elif route[0] == "GET":
                service.count_request(path, 200)  # before /metrics renders, so that a scrape counts itself
                reply = await route[1](scope, receive)
            else:
                reply = await route[1](scope, receive)
                if reply.status != CLIENT_GONE or REFUSED_SCOPE_KEY not in scope:  # else the protocol answered and counted it
                    service.count_request(path, reply.status)
        except Exception as error:
            # A bug: answered in the error shape, then re-raised, so uvicorn logs the traceback.
            await _send(send, refused(500, UNPARSED_PATH, f"internal error: {type(error).__name__}"))
            raise
        await _send(send, reply)

    return app


async def _client_gone(receive: Receive) -> None:
    """Returns once the client has disconnected; call only after the body was read."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _render_all(snapshots: SnapshotDir, publish_own: Callable[[], None]) -> str:
    publish_own()
    return render_prometheus(snapshots.read_all())


class Frontend:
    """One frontend's resources, opened in ``__init__`` (peers may route here once
    ``TokenizationOwners`` is open) and released by ``close()`` in reverse."""

    def __init__(self, settings: FrontendSettings, authkey: bytes, listener: socket.socket):
        from mptok.cache.loading import load_tokenizer
        from mptok.cache.config import CacheConfig
        from mptok.cache.prefix_cache import PrefixTokenCache
        from mptok.routing.owners import TokenizationOwners

        self.settings = settings
        options = settings.options
        self._server: Any = None
        self._stop_deadline: float | None = None
        self._stack = contextlib.ExitStack()
        try:
            cache_config = CacheConfig.from_env(**options.arguments_for(Use.CACHE))
            tokenizer = load_tokenizer(options.tokenizer, backend=cache_config.tokenizer_backend)
            template = ChatTemplate.for_tokenizer(tokenizer, settings.chat_template)
            # load_tokenizer has built the cache's tokenizer copy, and
            # TokenizationOwners runs it once before peers can see this owner.
            cache = PrefixTokenCache(cache_config)
            self.socket = self._stack.enter_context(listener)
            self.owners = self._stack.enter_context(
                TokenizationOwners(
                    settings.ipc_dir, settings.frontend_id, options.frontends, cache, tokenizer,
                    authkey=authkey, **options.arguments_for(Use.ROUTING),
                )
            )
            # Runs before the context's own close (a no-op then): with what is left of the stop's budget.
            self._stack.callback(lambda: self.owners.close(max(_OWNERS_CLOSE_FLOOR_S, self._budget_left())))
            self.service = TokenizeService(
                settings.frontend_id, tokenizer, cache, template,
                **{**options.arguments_for(Use.SERVICE), "max_model_len": resolve_max_model_len(options.max_model_len, tokenizer)},
                routing=self.owners, warm=self.owners.warm_thread,
            )
            self._stack.callback(lambda: self.service.close(self._budget_left()))
            self._snapshots = SnapshotDir(settings.ipc_dir)
            self._started = time.time()
            self._housekeeping = PeriodicTask(f"mptok-metrics-{settings.frontend_id}", self._publish, SNAPSHOT_INTERVAL_S)
            self._housekeeping.start()
            self._stack.callback(self._housekeeping.stop)
            info = tokenizer_info_payload(tokenizer, template) if options.enable_tokenizer_info_endpoint else None
            self.app = build_app(self.service, self._snapshots, self._publish, info)
        except BaseException:
            self._stack.close()
            raise

    async def serve(self, ready: Any, stop_signals: list[int]) -> None:
        """Accept, send ``("ready", pid)`` on ``ready``, serve until SIGTERM/SIGINT, drain.

        ``stop_signals`` are those that came before uvicorn took the handlers over.
        """
        options = self.settings.options
        config = uvicorn.Config(
            self.app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=options.graceful_timeout_s,
            http=guarded_protocol(options.read_timeout_s, options.max_connections, self.service.count_request),
        )
        self._server = _StopNotingServer(config)
        if stop_signals:
            return
        serving = asyncio.create_task(self._server.serve(sockets=[self.socket]))
        while not self._server.started and not serving.done():
            await asyncio.sleep(0.01)
        if stop_signals:  # came before uvicorn installed its handlers, so it landed in ours
            self._server.should_exit = True
        if self._server.started:
            ready.send(("ready", os.getpid()))
            log_event(
                logger, logging.INFO, "frontend_ready", url=f"http://{options.host}:{options.port}",
                routing=self.owners.policy, loop=type(asyncio.get_running_loop()).__module__.split(".")[0],
            )
        await serving

    def close(self) -> None:
        """Release everything within one budget, ``graceful_timeout_s`` from the stop signal, so
        that the supervisor's kill margin covers the whole stop: uvicorn spends what in-flight
        requests need, the pool and the owner what is left (the owner at least
        ``_OWNERS_CLOSE_FLOOR_S``, to end its peers' connections cleanly)."""
        began = getattr(self._server, "stop_began", None) or time.monotonic()
        self._stop_deadline = began + self.settings.options.graceful_timeout_s
        self._stack.close()

    def _budget_left(self) -> float:
        if self._stop_deadline is None:
            return self.settings.options.graceful_timeout_s
        return max(0.0, self._stop_deadline - time.monotonic())

    def _publish(self) -> None:
        snapshot = {"pid": os.getpid(), "started": self._started, "routing_seconds": self.owners.timings(), **self.service.snapshot()}
        self._snapshots.write(self.settings.frontend_id, snapshot)


class _StopNotingServer(uvicorn.Server):
    """uvicorn's ``Server``, noting when a stop signal first came (``stop_began``, monotonic)."""

    stop_began: float | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.stop_began is None:
            self.stop_began = time.monotonic()
        super().handle_exit(sig, frame)


def run_event_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` to completion on uvloop's event loop where uvloop is installed, else on
    asyncio's own: uvicorn's ``loop="auto"`` choice, which never applies to a loop run here."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


def frontend_main(settings: FrontendSettings, authkey: bytes, ready: Any, listener: socket.socket) -> None:
    """Body of a frontend process (the supervisor's spawn target): sends ``("ready", pid)``
    once it accepts from ``listener`` and serves its peers, or ``("failed", one_line_reason)``
    and exits 1. If the supervisor dies, the kernel sends this process SIGTERM
    (``mptok.supervise.lifeline``), and it stops as if the supervisor had stopped it.
    """
    # What is process-wide is set here, not by the components.
    configure_logging("frontend", settings.frontend_id)
    # SIGTERM/SIGINT before uvicorn takes them over, and after: uvicorn re-raises what it caught
    # once it has shut down, and the default action would kill the process before its owner closes.
    stop_signals: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, frame: stop_signals.append(signum))
    lower_switch_interval()
    parent = multiprocessing.parent_process()
    supervisor_pid = parent.pid if parent is not None else os.getppid()
    stop_with_parent(supervisor_pid)
    try:
        frontend = Frontend(settings, authkey, listener)
    except Exception as e:
        log_event(logger, logging.ERROR, "frontend_failed", error=f"{type(e).__name__}: {e}")
        with contextlib.suppress(OSError):
            ready.send(("failed", f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    try:
        run_event_loop(frontend.serve(ready, stop_signals))
    finally:
        frontend.close()
        if os.getppid() != supervisor_pid:
            log_event(logger, logging.ERROR, "supervisor_gone", supervisor_pid=supervisor_pid, action="stopped")
        log_event(logger, logging.INFO, "frontend_stopped")

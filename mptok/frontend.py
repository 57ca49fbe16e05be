"""One tokenization frontend process of ``mptok serve``: HTTP in, exact token ids out.

The supervisor (``mptok.supervisor``) starts N of these; each binds the same
port with SO_REUSEPORT, so the kernel spreads connections over them, and
each serves its ``PrefixTokenCache`` to the others through
``TokenizationOwners``, so a conversation is tokenized by the frontend whose
cache holds it wherever its request lands. The HTTP side is FastAPI on
uvicorn, as in vLLM and SGLang; everything that costs CPU (parsing,
rendering the chat template, tokenizing, possibly waiting on a peer, and
serializing the ids with orjson) runs in a bounded thread pool, never on the
event loop, so ``/health`` and ``/metrics`` answer while prompts tokenize.

Endpoints: ``POST /tokenize`` (shaped like vLLM's), ``GET /health``,
``GET /metrics`` (every frontend's counters, see ``mptok.metrics``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from mptok.chat_template import ChatTemplate, ChatTemplateError
from mptok.logfmt import configure_logging, log_event
from mptok.metrics import Histogram, PeriodicTask, SnapshotDir, render_prometheus

logger = logging.getLogger("mptok.frontend")

# Headers that name the conversation when the body does not ("conversation_id").
CONVERSATION_HEADERS = ("x-session-id", "x-correlation-id")
# Two different texts whose tokenizations, with and without special tokens,
# reveal what the post-processor adds around a single sequence.
_SENTINELS = ("Hello world", "x = 1;\n\n\t\u00e9\U0001f642 end")
# JSON may spell one character as a 12-byte surrogate-pair escape; bodies
# larger than this many bytes per allowed prompt character are refused unread.
_BODY_BYTES_PER_CHAR = 12
_BODY_OVERHEAD_BYTES = 1 << 20


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
    route_timeout_s: float
    route_backoff_s: float
    graceful_timeout_s: float


@dataclass(frozen=True)
class Answer:
    """A /tokenize response: status, JSON body, and for a tokenized prompt
    the seconds from the parsed request to its ids (template rendering
    excluded, routing included)."""

    status: int
    payload: bytes
    tokenize_s: float | None = None


class RequestError(Exception):
    """A client's mistake: answered with ``status`` and ``message``, never a 500."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


# -- the request ---------------------------------------------------------------


@dataclass(frozen=True)
class TokenizeRequest:
    """A validated ``POST /tokenize`` body: exactly one of ``prompt`` and ``messages``."""

    prompt: str | None
    messages: list[dict[str, Any]] | None
    add_generation_prompt: bool
    add_special_tokens: bool
    conversation_id: str | None


def parse_tokenize_request(body: bytes, header_conversation_id: str | None) -> TokenizeRequest:
    """Parse and type-check a body the way vLLM's ``/tokenize`` reads it; ``RequestError`` (400) if wrong.

    ``add_special_tokens`` defaults to true for a prompt and false for
    messages, ``add_generation_prompt`` to true; ``conversation_id`` in the
    body wins over the header's.
    """
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise RequestError(400, f"the body is not valid JSON: it is not UTF-8 (byte {bad.start})") from None
        if "surrogate" in str(e):
            raise RequestError(
                400, f"the body has a lone UTF-16 surrogate (\\ud800-\\udfff) in a string; text must be valid Unicode ({e})"
            ) from None
        raise RequestError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise RequestError(400, f"the body must be a JSON object, not {_json_type(data)}")
    has_prompt, has_messages = "prompt" in data, "messages" in data
    if has_prompt == has_messages:
        raise RequestError(400, 'give exactly one of "prompt" (a string) and "messages" (a list of messages)')
    conversation_id = _optional(data, "conversation_id", str, None) or header_conversation_id or None
    if has_prompt:
        prompt = data["prompt"]
        if not isinstance(prompt, str):
            raise RequestError(400, f'"prompt" must be a string, not {_json_type(prompt)}')
        return TokenizeRequest(
            prompt=prompt,
            messages=None,
            add_generation_prompt=False,
            add_special_tokens=_optional(data, "add_special_tokens", bool, True),
            conversation_id=conversation_id,
        )
    return TokenizeRequest(
        prompt=None,
        messages=_check_messages(data["messages"]),
        add_generation_prompt=_optional(data, "add_generation_prompt", bool, True),
        add_special_tokens=_optional(data, "add_special_tokens", bool, False),
        conversation_id=conversation_id,
    )


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, f'"messages" must be a non-empty list, not {_json_type(messages)}')
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(400, f"messages[{i}] must be an object, not {_json_type(message)}")
        for field in ("role", "content"):
            if not isinstance(message.get(field), str):
                raise RequestError(400, f'messages[{i}]["{field}"] must be a string, not {_json_type(message.get(field))}')
    return messages


def _optional(data: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise RequestError(400, f'"{name}" must be a {_JSON_NAMES[kind]}, not {_json_type(value)}')
    return value


_JSON_NAMES = {str: "string", bool: "boolean", int: "number", float: "number", list: "list", dict: "object"}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return _JSON_NAMES.get(type(value), type(value).__name__)


def error_body(status: int, message: str) -> bytes:
    """An error in vLLM's shape: ``{"object": "error", "message", "type", "code"}``."""
    kind = {400: "BadRequestError", 413: "RequestTooLarge", 503: "ServiceUnavailable"}.get(status, "InternalServerError")
    return orjson.dumps({"object": "error", "message": message, "type": kind, "code": status})


# -- tokenizing ----------------------------------------------------------------


@dataclass(frozen=True)
class SpecialTokenFrame:
    """The ids the tokenizer's post-processor puts around one sequence.

    The cache only knows ``add_special_tokens=False``. For ``True`` the ids
    are ``prefix + ids + suffix`` when the post-processor adds fixed ids
    around the sequence; ``derive`` proves that on two different texts and
    returns None otherwise (then prompts are tokenized in full).
    """

    prefix: tuple[int, ...]
    suffix: tuple[int, ...]

    @classmethod
    def derive(cls, tokenizer: Any, sentinels: tuple[str, ...] = _SENTINELS) -> SpecialTokenFrame | None:
        frames = set()
        for text in sentinels:
            with_special = list(tokenizer(text, add_special_tokens=True)["input_ids"])
            without = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            frame = cls._split(with_special, without)
            if frame is None:
                return None
            frames.add(frame)
        return frames.pop() if len(frames) == 1 else None

    @classmethod
    def _split(cls, with_special: list[int], without: list[int]) -> SpecialTokenFrame | None:
        n = len(without)
        for start in range(len(with_special) - n + 1):
            if with_special[start : start + n] == without:
                return cls(tuple(with_special[:start]), tuple(with_special[start + n :]))
        return None


class TokenizeService:
    """Turns a ``/tokenize`` body into a JSON answer, in a bounded thread pool.

    Everything a request costs runs in the pool's ``threads`` workers.
    Returned ids always equal ``tokenizer(text, add_special_tokens=...)
    ["input_ids"]`` for the rendered text. ``close()`` lets running work
    finish for at most ``timeout_s`` and refuses new work.
    """

    def __init__(
        self,
        frontend_id: int,
        tokenizer: Any,
        cache: Any,
        template: ChatTemplate,
        *,
        max_prompt_chars: int,
        threads: int,
    ):
        self.frontend_id = frontend_id
        self.max_prompt_chars = max_prompt_chars
        self.max_body_bytes = max_prompt_chars * _BODY_BYTES_PER_CHAR + _BODY_OVERHEAD_BYTES
        self._tokenizer = tokenizer
        self._cache = cache
        self._template = template
        self._frame = SpecialTokenFrame.derive(tokenizer)
        # transformers' __call__ is not thread-safe ("Already borrowed"); it is
        # only called when the cache cannot serve add_special_tokens=True.
        self._direct_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=f"tokenize-{frontend_id}")
        self._in_flight: set[concurrent.futures.Future] = set()
        self._in_flight_lock = threading.Lock()
        self.tokenize_seconds = Histogram()
        self._requests: Counter[str] = Counter()
        self._requests_lock = threading.Lock()
        log_event(
            logger,
            logging.INFO,
            "special_tokens",
            mode="cache" if self._frame is not None else "full",
            prefix=list(self._frame.prefix) if self._frame else "",
            suffix=list(self._frame.suffix) if self._frame else "",
            chat_template=template.origin,
        )

    def submit(self, body: bytes, header_conversation_id: str | None) -> concurrent.futures.Future:
        """A future of an ``Answer``; raises ``RequestError`` (503) once closed."""
        try:
            future = self._pool.submit(self._answer, body, header_conversation_id)
        except RuntimeError:
            raise RequestError(503, "this frontend is shutting down; retry") from None
        with self._in_flight_lock:
            self._in_flight.add(future)
        future.add_done_callback(self._done)
        return future

    def tokenize(self, text: str, add_special_tokens: bool, key: str | None) -> list[int]:
        """Exactly ``tokenizer(text, add_special_tokens=...)["input_ids"]``, through the cache when it can."""
        if not add_special_tokens:
            return self._cache.encode(self._tokenizer, text, key=key)
        if self._frame is not None and text:
            return [*self._frame.prefix, *self._cache.encode(self._tokenizer, text, key=key), *self._frame.suffix]
        with self._direct_lock:
            return list(self._tokenizer(text, add_special_tokens=True)["input_ids"])

    def count_request(self, path: str, status: int) -> None:
        with self._requests_lock:
            self._requests[f"{path} {status}"] += 1

    def snapshot(self) -> dict[str, Any]:
        with self._requests_lock:
            requests = dict(self._requests)
        return {
            "cache": self._cache.stats(),
            "tokenize_seconds": self.tokenize_seconds.snapshot(),
            "requests": requests,
        }

    def close(self, timeout_s: float) -> None:
        with self._in_flight_lock:
            pending = set(self._in_flight)
        _, not_done = concurrent.futures.wait(pending, timeout=timeout_s)
        if not_done:
            log_event(logger, logging.WARNING, "abandoned_tokenizations", count=len(not_done), after_s=timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _done(self, future: concurrent.futures.Future) -> None:
        with self._in_flight_lock:
            self._in_flight.discard(future)

    def _answer(self, body: bytes, header_conversation_id: str | None) -> Answer:
        try:
            request = parse_tokenize_request(body, header_conversation_id)
            text = self._text_of(request)
            started = time.perf_counter()
            ids = self.tokenize(text, request.add_special_tokens, request.conversation_id)
            tokenize_s = time.perf_counter() - started
            self.tokenize_seconds.observe(tokenize_s)
        except RequestError as e:
            return Answer(e.status, error_body(e.status, e.message))
        except Exception as e:
            log_event(logger, logging.ERROR, "tokenize_failed", error=f"{type(e).__name__}: {e}")
            return Answer(500, error_body(500, f"tokenization failed: {type(e).__name__}"))
        payload = orjson.dumps({"tokens": ids, "count": len(ids), "frontend": self.frontend_id})
        return Answer(200, payload, tokenize_s)

    def _text_of(self, request: TokenizeRequest) -> str:
        if request.prompt is not None:
            text = request.prompt
        else:
            assert request.messages is not None
            if sum(len(m["content"]) for m in request.messages) > self.max_prompt_chars:
                raise self._too_long("the messages' contents")
            try:
                text = self._template.render(self._tokenizer, request.messages, request.add_generation_prompt)
            except ChatTemplateError as e:
                raise RequestError(400, str(e)) from None
        if len(text) > self.max_prompt_chars:
            raise self._too_long("the prompt")
        return text

    def _too_long(self, what: str) -> RequestError:
        return RequestError(413, f"{what} exceeds --max-prompt-chars={self.max_prompt_chars} characters")


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
            cache = mptok.PrefixTokenCache()
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

"""What ``mptok serve`` does around each request, added around vLLM's own render app.

vLLM's render app answers every request it gets, however many wait.
``RenderGate``, the outermost ASGI middleware of each render process's app,
adds what ``mptok serve``'s frontends do and nothing else: admission for
every POST (from its first byte to its last answer byte; beyond
``--max-in-flight``, 503 with ``Retry-After`` at once, in vLLM's error
shape), and on ``GET /metrics`` the supervisor's series after vLLM's own
answer (asked for uncompressed, so that it can be extended). Everything
else reaches vLLM untouched.
"""

from __future__ import annotations

import contextlib
from typing import Any

from mptok.api.asgi import Message, Receive, Scope, Send, respond
from mptok.api.tokenize_request import RequestError, error_body
from mptok.supervise.admission import Admission
from mptok.supervise.metrics import render_supervisor
from mptok.supervise.snapshots import SUPERVISOR_SNAPSHOT, SnapshotDir

METRICS_PATH = "/metrics"


class RenderGate:
    """ASGI middleware: admission for POSTs, the supervisor's series on ``/metrics``."""

    def __init__(self, app: Any, admission: Admission, snapshots: SnapshotDir) -> None:
        self.app = app
        self._admission = admission
        self._snapshots = snapshots

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        http = scope.get("type") == "http"
        if http and scope.get("method") == "POST":
            with contextlib.ExitStack() as place:
                try:
                    place.enter_context(self._admission.place())
                except RequestError as e:
                    await respond(send, e.status, error_body(e.status, e.message), [(b"content-type", b"application/json")], e.retry_after_s)
                    return
                await self.app(scope, receive, send)
        elif http and scope.get("method") == "GET" and scope.get("path") == METRICS_PATH:
            await self._metrics(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope = {**scope, "headers": [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"accept-encoding"]}
        start: Message | None = None
        body: list[bytes] = []

        async def collect(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body":
                body.append(message.get("body", b""))
                if not message.get("more_body", False):
                    await self._send_metrics(send, start, b"".join(body))
            else:
                await send(message)

        await self.app(scope, receive, collect)

    async def _send_metrics(self, send: Send, start: Message | None, text: bytes) -> None:
        assert start is not None, "a body before the response's start"
        if start["status"] == 200:
            supervisor = self._snapshots.read_all().get(SUPERVISOR_SNAPSHOT)
            if supervisor is not None:
                text += render_supervisor(supervisor).encode() + b"\n"
        await respond(send, start["status"], text, [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"])

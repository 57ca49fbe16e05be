"""uvicorn's fastest HTTP/1.1 protocol (httptools, llhttp in C) with the guards a server facing any client needs.

uvicorn's ``HttpToolsProtocol`` bounds no header block (llhttp has no limit
of its own); no request's arrival (its keep-alive timer is cancelled by
every byte and not armed for a new connection, so a client sending a byte
now and then holds a connection forever: slowloris); and no number of
connections but the file limit (``limit_concurrency`` answers a plain-text
503, ``/health`` too). It answers malformed HTTP with a plain-text 400.

``guarded_protocol(...)`` returns a subclass that adds a header block limit
(``MAX_HEADER_BYTES``, 431 beyond it), a deadline for each request to
arrive whole (408), a cap on open connections (503 at once), mptok's JSON
error shape for these and for malformed HTTP (400), and a lingering close
after them: the write side is shut, what the client still sends is dropped
for at most ``LINGER_S``, then the socket is closed, so the answer reaches
a client that is still sending.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from mptok.api.tokenize_request import RETRY_AFTER_S, error_body

logger = logging.getLogger("mptok.frontend")

# A header block (request line and headers) larger than this is answered 431.
MAX_HEADER_BYTES = 16 * 1024
_HEADER_BLOCK_TOO_LARGE = f"the request's header block exceeds {MAX_HEADER_BYTES} bytes"
# After an error answer, how long what the client still sends is read and dropped.
LINGER_S = 2.0
# The path label of answers given before a request was parsed (mptok_http_requests_total).
UNPARSED_PATH = "-"
# Set in the ASGI scope of a request answered here while the app was reading its body
# (the app then reads a disconnect, and must not count the request again).
REFUSED_SCOPE_KEY = "mptok.refused_status"
# Set in the ASGI scope of every request: ``time.monotonic()`` when its first byte arrived.
ARRIVED_SCOPE_KEY = "mptok.arrived"


class _HeaderBlockTooLarge(Exception):
    """Raised from a parser callback: llhttp stops, and ``data_received`` answers 431."""


def error_response(status: int, message: str, retry_after_s: int | None = None) -> bytes:
    """A whole HTTP/1.1 response in mptok's error shape that closes the connection."""
    body = error_body(status, message)
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "content-type: application/json", f"content-length: {len(body)}", "connection: close"]
    if retry_after_s is not None:
        head.append(f"retry-after: {retry_after_s}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` with a header limit, a request deadline, a connection cap and answers that arrive.

    uvicorn makes one per connection, on the event loop: nothing here needs a lock.
    """

    read_timeout_s: float
    max_connections: int
    count: Callable[[str, int], None]

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._lingering = False
        self._arriving = False  # a request has begun and not arrived whole
        self._heading = False  # ... and its header block is not complete
        self._header_bytes = 0
        self._header_too_large = False
        self._cycle_is_current = False  # self.cycle is the arriving (or last arrived) request's
        self._began = 0.0  # time.monotonic() at the arriving request's first byte

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._refuse(503, f"this frontend has {self.max_connections} open connections (--max-connections); retry", RETRY_AFTER_S)
        else:
            self._arm()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # read and dropped: the answer is sent, the socket closes soon
        heading = self._heading
        if heading:
            self._header_bytes += len(data)
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._unsupported_upgrade_warning()  # no WebSocket here; the request is answered as plain HTTP
        except httptools.HttpParserError as e:
            if self._header_too_large:
                self._refuse(431, _HEADER_BLOCK_TOO_LARGE)
            else:
                self._refuse(400, f"malformed HTTP request: {e}")
            return
        if self._lingering or self.transport.is_closing():
            return
        if self._heading and not heading:
            self._header_bytes += len(data)  # began in this chunk: counts what came before it too
        if self._heading and self._header_bytes > MAX_HEADER_BYTES:
            self._refuse(431, _HEADER_BLOCK_TOO_LARGE)
        elif self._arriving:
            self._arm()  # a request is arriving: its deadline runs from its first byte
        else:
            self._disarm()  # arrived whole (the app answers it), or nothing is arriving

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arriving = self._heading = True
        self._began = time.monotonic()
        self._header_bytes = 0
        self._cycle_is_current = False

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._heading = False
        super().on_headers_complete()
        self.cycle.scope[ARRIVED_SCOPE_KEY] = self._began  # type: ignore[typeddict-unknown-key]
        self._cycle_is_current = True

    def on_message_complete(self) -> None:
        self._arriving = False
        super().on_message_complete()

    def shutdown(self) -> None:
        if self._lingering:
            self.transport.close()
        else:
            super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _count_header_bytes(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > MAX_HEADER_BYTES:
            self._header_too_large = True
            raise _HeaderBlockTooLarge

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.read_timeout_s, self._on_deadline)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _on_deadline(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        # (If the app answered already, refusing early, this just closes.)
        self._refuse(408, f"the request did not arrive whole within --read-timeout={self.read_timeout_s:g} s")

    def _refuse(self, status: int, message: str, retry_after_s: int | None = None) -> None:
        """Answer ``status`` in mptok's error shape, then close the connection lingering."""
        self._disarm()
        current = self.cycle if self._cycle_is_current else None
        if current is not None and current.response_started:
            self.transport.close()  # this request is answered already: a second answer would corrupt the stream
            return
        self._lingering = True
        if self.flow is not None:
            self.flow.resume_reading()  # uvicorn may have paused reading: what comes now is dropped
        path = UNPARSED_PATH
        if current is not None and not current.response_complete:
            path = current.scope["path"]
            current.scope[REFUSED_SCOPE_KEY] = status  # type: ignore[typeddict-unknown-key]
            # The app may be waiting for the body: it now reads a disconnect and stops.
            current.disconnected = True
            current.message_event.set()
        self.count(path, status)
        logger.debug("refused status=%d message=%s", status, message)
        self.transport.write(error_response(status, message, retry_after_s))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)


def guarded_protocol(read_timeout_s: float, max_connections: int, count: Callable[[str, int], None]) -> type[GuardedHttpToolsProtocol]:
    """The protocol class to give ``uvicorn.Config(http=...)``; ``count(path, status)``
    is told of every answer given here (not by the app)."""
    settings = {"read_timeout_s": read_timeout_s, "max_connections": max_connections, "count": staticmethod(count)}
    return type("ConfiguredGuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), settings)

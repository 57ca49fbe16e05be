"""uvicorn's HTTP/1.1 protocol (h11) with the guards a server facing any client needs.

What uvicorn 0.54 with h11 does on its own, seen against ``mptok serve``:

- A header block over h11's limit (``h11_max_incomplete_event_size``, 16 KiB
  by default) raises ``RemoteProtocolError`` with ``error_status_hint=431``;
  uvicorn answers a plain-text 400 and closes the socket with the rest of
  the request unread, so the kernel sends a reset and the client usually
  sees ``ECONNRESET``, not the answer.
- Nothing bounds the time a request takes to arrive: the keep-alive timer
  is cancelled by every byte received and is not armed for a new
  connection, so a client sending a header byte now and then holds a
  connection (a file descriptor) forever (slowloris).
- Nothing bounds the number of connections but the process's file limit
  (``limit_concurrency`` answers a plain-text 503 and also refuses
  ``/health``).

``guarded_protocol(...)`` returns an ``H11Protocol`` subclass that adds: a
deadline for each request to arrive whole, headers and body (408 after
it); a cap on open connections (503 at once beyond it); mptok's JSON error
shape for these and for malformed HTTP (400) and oversized headers (431);
and a lingering close after them: the write side is shut, what the client
still sends is read and dropped for at most ``LINGER_S``, then the socket
is closed, so the answer reaches a client that is still sending.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from mptok.api.tokenize_request import RETRY_AFTER_S, error_body

logger = logging.getLogger("mptok.frontend")

# h11's own default; a header block larger than this is answered 431.
MAX_HEADER_BYTES = 16 * 1024
# After an error answer, how long what the client still sends is read and dropped.
LINGER_S = 2.0
# The path label of answers given before a request was parsed (mptok_http_requests_total).
UNPARSED_PATH = "-"
# Set in the ASGI scope of a request answered here while the app was reading its body
# (the app then reads a disconnect, and must not count the request again).
REFUSED_SCOPE_KEY = "mptok.refused_status"


class _Connection(h11.Connection):
    """An h11 connection that remembers the protocol error it raised, for its status hint."""

    last_error: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.last_error = e
            raise


def error_response(status: int, message: str, retry_after_s: int | None = None) -> bytes:
    """A whole HTTP/1.1 response in mptok's error shape that closes the connection."""
    body = error_body(status, message)
    head = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
    ]
    if retry_after_s is not None:
        head.append(f"retry-after: {retry_after_s}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body


class GuardedH11Protocol(H11Protocol):
    """``H11Protocol`` with a request deadline, a connection cap and answers that arrive.

    Configured by ``guarded_protocol``; uvicorn makes one per connection, on
    the event loop, so nothing here needs a lock.
    """

    read_timeout_s: float
    max_connections: int
    count: Callable[[str, int], None]

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.conn = _Connection(h11.SERVER, MAX_HEADER_BYTES)
        self._deadline: asyncio.TimerHandle | None = None
        self._lingering = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._refuse(503, f"this frontend has {self.max_connections} open connections (--max-connections); retry", RETRY_AFTER_S)
        else:
            self._arm()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # read and dropped: the answer is sent, the socket closes soon
        super().data_received(data)
        if self._lingering or self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.SEND_BODY or (state is h11.IDLE and self.conn.trailing_data[0]):
            self._arm()  # a request is arriving: its deadline runs from its first byte
        elif state is h11.IDLE:
            self._disarm()  # between requests (a refused body was drained): the next one gets the whole time
            self._arm()
        else:
            self._disarm()  # arrived whole: the app answers it

    def send_400_response(self, msg: str) -> None:
        """uvicorn calls this when h11 cannot parse the request."""
        error = self.conn.last_error
        if error is not None and error.error_status_hint == 431:
            self._refuse(431, f"the request's header block exceeds {MAX_HEADER_BYTES} bytes")
        else:
            self._refuse(400, f"malformed HTTP request: {error or msg}")

    def shutdown(self) -> None:
        if self._lingering:
            self.transport.close()
        else:
            super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

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
        if self.conn.our_state in (h11.SEND_BODY, h11.DONE, h11.MUST_CLOSE):
            self.transport.close()  # this request is answered already: a second answer would corrupt the stream
            return
        self._lingering = True
        if self.flow is not None:
            self.flow.resume_reading()  # uvicorn may have paused reading: what comes now is dropped
        path = UNPARSED_PATH
        if self.cycle is not None and not self.cycle.response_complete:
            path = self.cycle.scope["path"]
            self.cycle.scope[REFUSED_SCOPE_KEY] = status  # type: ignore[typeddict-unknown-key]
            # The app may be waiting for the body: it now reads a disconnect and stops.
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.count(path, status)
        logger.debug("refused status=%d message=%s", status, message)
        self.transport.write(error_response(status, message, retry_after_s))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)


def _not_an_invalid_request_warning(record: logging.LogRecord) -> bool:
    """uvicorn logs a WARNING for every request h11 cannot parse, so a flood of bad
    requests would flood the log; they are counted instead (``path="-"``)."""
    return record.getMessage() != "Invalid HTTP request received."


def guarded_protocol(
    read_timeout_s: float, max_connections: int, count: Callable[[str, int], None]
) -> type[GuardedH11Protocol]:
    """The protocol class to give ``uvicorn.Config(http=...)``; ``count(path, status)``
    is told of every answer given here (not by the app)."""
    logging.getLogger("uvicorn.error").addFilter(_not_an_invalid_request_warning)  # added once, however often called
    return type(
        "ConfiguredGuardedH11Protocol",
        (GuardedH11Protocol,),
        {"read_timeout_s": read_timeout_s, "max_connections": max_connections, "count": staticmethod(count)},
    )

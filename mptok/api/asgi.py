"""The ASGI pieces both of mptok's HTTP apps use: ``mptok serve``'s and the render tier's."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from mptok.api.tokenize_request import RequestError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


async def read_body(receive: Receive, limit: int | None = None) -> bytes | None:
    """The body, or None if the client disconnected before it arrived whole; beyond ``limit`` bytes, a 413."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            raise RequestError(413, f"the body exceeds {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def respond(send: Send, status: int, body: bytes, headers: Iterable[tuple[bytes, bytes]], retry_after_s: int | None = None) -> None:
    """Sends a whole response: ``headers``, its content-length and any ``Retry-After``, then ``body``."""
    head = [(b"content-length", str(len(body)).encode()), *headers]
    if retry_after_s is not None:
        head.append((b"retry-after", str(retry_after_s).encode()))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})

"""HTTP/1.1 spoken by hand over a socket, for requests no well-behaved client sends.

The fuzz, edge and admission tests need requests cut off, malformed,
trickled or held open; ``http.client`` cannot send those. ``RawClient`` writes
bytes as given and reads what comes back; ``statuses`` finds the answers in
what was read.
"""

from __future__ import annotations

import json
import re
import socket

_STATUS_LINE = re.compile(rb"HTTP/1\.1 (\d{3}) ")


class RawClient:
    """One TCP connection to ``127.0.0.1:port``; every wait is bounded by ``timeout_s``."""

    def __init__(self, port: int, timeout_s: float = 30.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)

    def send(self, data: bytes) -> RawClient:
        self.sock.sendall(data)
        return self

    def read_all(self) -> bytes:
        """Everything until the server closes (a timeout raises ``socket.timeout``)."""
        chunks = []
        while True:
            try:
                chunk = self.sock.recv(65536)
            except ConnectionResetError:
                break  # counted by the caller: what came before is kept
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)

    def read_response(self) -> bytes:
        """One whole response (its head and a Content-Length body), or what came before the server closed."""
        data = b""
        while True:
            head_end = data.find(b"\r\n\r\n")
            if head_end >= 0 and len(data) >= head_end + 4 + _content_length(data[:head_end]):
                return data
            chunk = self.sock.recv(65536)
            if not chunk:
                return data
            data += chunk

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def post_head(path: str, length: int, extra: str = "") -> bytes:
    """The head of a POST with a JSON body of ``length`` bytes."""
    return (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n{extra}\r\n"
    ).encode("ascii")


def statuses(received: bytes) -> list[int]:
    """The status of every response at the start of ``received`` or after a complete one."""
    found, at = [], 0
    while (match := _STATUS_LINE.match(received, at)) is not None:
        found.append(int(match.group(1)))
        head_end = received.find(b"\r\n\r\n", at)
        if head_end < 0:
            break
        at = head_end + 4 + _content_length(received[at:head_end])
    return found


def error_of(received: bytes) -> dict:
    """The JSON body of the first response."""
    head, _, rest = received.partition(b"\r\n\r\n")
    return json.loads(rest[: _content_length(head)])


def _content_length(head: bytes) -> int:
    match = re.search(rb"(?im)^content-length: *(\d+)\r?$", head)
    return int(match.group(1)) if match else 0

"""The wire both ends of a routed call speak: where, how framed, within what time.

An owner (``mptok.transport.owner``) and its peers (``mptok.transport.proxy``)
speak the ``multiprocessing.managers`` protocol over a Unix socket in the ipc
directory. This module holds what both ends share: the socket's path, the
errors a call can end in, ``ServerLimits`` (what a peer may cost an owner),
and ``TimedConnection`` (the owner's end: ``PeerConnection``), which moves
the bytes of ``mptok.core.protocol``'s two records and nothing else, every
message by the ``mptok.core.deadline.Deadline`` its call was given.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

from mptok.core.deadline import Deadline

SOCKET_NAME = "tokenize-{}.sock"
# The well-known ident under which an owner publishes its ``encode`` service, so a
# peer needs no ``create`` round trip (and holds no reference) to call it.
ENCODE_TYPEID = "Encode"
# sun_path holds 108 bytes on Linux, the terminating NUL included.
MAX_UNIX_PATH_BYTES = 107
# The largest message either end reads: a 200k-token prompt and its ids are a
# few MB; the cap only keeps a peer from making the other end allocate GBs.
MAX_MESSAGE_BYTES = 1 << 28
# How long closing an end (its connections, its serving threads) may wait.
CLOSE_TIMEOUT_S = 5.0

_SHORT_HEADER = struct.Struct("!i")
_LONG_HEADER = struct.Struct("!iQ")
_LENGTH_ONLY = struct.Struct("!Q")
_TIMEVAL = struct.Struct("@ll")  # struct timeval on Linux
# A 150k-character prompt pickles to about 150 KB to 450 KB, its 38k ids to
# about 150 KB: both fit whole in the socket buffers and, after the first
# such message, in the inbox.
_SOCKET_BUFFER_BYTES = 4 << 20
_INBOX_BYTES = 64 << 10
_MAX_INBOX_BYTES = 1 << 20
# A header alone never makes a buffer larger than this: a longer message's
# buffer grows as its bytes arrive (at most the connection's message cap).
_FIRST_READ_BYTES = 4 << 20
# A kernel timeout armed for a deadline is re-armed once it is this much older
# than the time left: a read or write then ends at most this late.
_REARM_AFTER_S = 0.01


def socket_path(ipc_dir: str, frontend_id: int) -> str:
    """Where frontend ``frontend_id`` serves its cache."""
    return os.path.join(ipc_dir, SOCKET_NAME.format(frontend_id))


class TransportError(Exception):
    """A call to an owner produced no ids; the caller tokenizes the prompt itself."""


class OwnerTimeout(TransportError):
    """The owner did not answer by the deadline; the connection was dropped."""


class OwnerUnreachable(TransportError):
    """No usable connection: nothing listening, refused, wrong authkey, or lost."""


class OwnerError(TransportError):
    """The owner answered, but not with ids (it could not tokenize the prompt, say)."""


class MessageTooLarge(OSError):
    """A message longer than the connection accepts; the connection was shut down unread."""


class _NoGlobalsUnpickler(pickle.Unpickler):
    """Unpickles plain data only: requests and replies need no globals, and
    refusing them keeps an authenticated peer from running code on load."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused to load global {module}.{name}")


class _MessageReader:
    """A message's bytes, where they arrived, as the file the unpickler reads:
    views, never copies, so each object unpickled is copied once, from the
    message into itself (``readinto`` fills a large bytes object, a reply's ids)."""

    def __init__(self, view: memoryview):
        self._view = view
        self._at = 0

    def read(self, n: int = -1) -> memoryview:
        end = len(self._view) if n < 0 else min(len(self._view), self._at + n)
        start, self._at = self._at, end
        return self._view[start:end]

    def readinto(self, buffer: Any) -> int:
        with memoryview(buffer) as target:
            n = min(len(target), len(self._view) - self._at)
            target[:n] = self._view[self._at : self._at + n]
        self._at += n
        return n

    def readline(self) -> memoryview:
        rest = self._view[self._at :]
        end = bytes(rest[:256]).find(b"\n")  # pickles of these protocols have no long lines
        return self.read(len(rest) if end < 0 else end + 1)


class _MessagePieces:
    """A message as the pickler writes it, the pieces not copied: a buffer of 64
    KiB or more (a reply's ids, ``PeerReply.to_wire``'s ``PickleBuffer``)
    comes to ``write`` as it is; the bytes are those ``pickle.dumps`` makes."""

    def __init__(self) -> None:
        self.pieces: list[memoryview] = []
        self.nbytes = 0

    def write(self, piece: Any) -> int:
        view = memoryview(piece).cast("B")
        self.pieces.append(view)
        self.nbytes += len(view)
        return len(view)


class TimedConnection:
    """A manager connection on a Unix socket whose every message ends by ``deadline``.

    It frames messages as ``Connection`` does and has the part of its surface
    that the stdlib's handshake and ``Server.serve_client`` use. ``recv``
    refuses messages longer than ``max_message_bytes`` (``MessageTooLarge``),
    length headers no sender writes (``OSError``: a negative length would be read
    as a message of bytes taken from the next one) and pickles that reference
    globals (``pickle.UnpicklingError``), shutting the connection down after a
    refused frame; no buffer beyond ``_FIRST_READ_BYTES`` is allocated on the
    word of a header alone.

    ``deadline`` (``Deadline.never()``: no limit) bounds every read and write, so
    that a peer that trickles a message cannot hold it past the deadline: each
    message checks the time left, and the kernel's SO_RCVTIMEO/SO_SNDTIMEO are set
    once per deadline (not ``settimeout()``, which polls before every call). Every socket call
    releases the GIL, which a busy process may take long to give back
    (docs/ROUTING.md, "The GIL"), so a message costs as few calls as possible:
    one ``sendmsg`` out, a large buffer in it sent from where it is, and
    usually one ``recv_into`` in, into a buffer kept from message to message.
    """

    def __init__(self, sock: socket.socket, max_message_bytes: int):
        sock.settimeout(None)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            # The kernel caps the size at net.core.[wr]mem_max; a smaller
            # buffer only costs more calls.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER_BYTES)
        self._sock = sock
        self._max_message_bytes = max_message_bytes
        # Bytes read but not yet consumed are self._inbox[self._start:self._end].
        self._inbox = bytearray(_INBOX_BYTES)
        self._start = self._end = 0
        self.deadline = Deadline.never()
        # Per direction: the deadline its kernel timeout was set for, and when
        # (a new socket has none: as if set for no deadline).
        never = self.deadline
        self._armed: dict[int, tuple[Deadline, float]] = {socket.SO_RCVTIMEO: (never, 0.0), socket.SO_SNDTIMEO: (never, 0.0)}

    def send(self, obj: Any) -> None:
        message = _MessagePieces()
        pickle.Pickler(message, pickle.HIGHEST_PROTOCOL).dump(obj)
        self._send_pieces(message.pieces, message.nbytes)

    def recv(self) -> Any:
        # Unpickled where the bytes arrived (the inbox, or a large message's
        # own buffer): a large bytes object in it is copied once, into itself.
        size = self._message_size()
        message = self._take_view(size) if size <= len(self._inbox) else memoryview(self._read_large(size))
        with message as view:
            return _NoGlobalsUnpickler(_MessageReader(view)).load()

    def send_bytes(self, buf: bytes) -> None:
        self._send_pieces([memoryview(buf).cast("B")], len(buf))

    def recv_bytes(self, maxlength: int | None = None) -> bytes | bytearray:
        """The next message; ``MessageTooLarge`` (and the connection shut down) past ``maxlength``
        (default: the connection's cap)."""
        size = self._message_size(maxlength)
        return self._take(size) if size <= len(self._inbox) else self._read_large(size)

    def _message_size(self, maxlength: int | None = None) -> int:
        """The next message's length, from its header (see ``recv_bytes``)."""
        (size,) = _SHORT_HEADER.unpack(self._take(_SHORT_HEADER.size))
        if size == -1:
            (size,) = _LENGTH_ONLY.unpack(self._take(_LENGTH_ONLY.size))
        elif size < 0:
            self.shutdown()
            raise OSError(f"length header {size}: not a message")
        limit = self._max_message_bytes if maxlength is None else min(maxlength, self._max_message_bytes)
        if size > limit:
            self.shutdown()  # the body is still in the stream, which is therefore useless
            raise MessageTooLarge(f"message of {size} bytes, longer than {limit}")
        return size

    def shutdown(self) -> None:
        """Wake any thread blocked on this connection; it then sees EOF."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._sock.close()

    def _send_pieces(self, pieces: list[memoryview], n: int) -> None:
        """One message of ``n`` bytes, its header and then ``pieces``, in one
        ``sendmsg`` unless the buffers are full: then the rest as they drain."""
        header = _SHORT_HEADER.pack(n) if n <= 0x7FFFFFFF else _LONG_HEADER.pack(-1, n)
        unsent = [memoryview(header), *pieces]
        try:
            while unsent:
                self._arm(socket.SO_SNDTIMEO)
                sent = self._sock.sendmsg(unsent)
                while unsent and sent >= len(unsent[0]):
                    sent -= len(unsent.pop(0))
                if unsent:
                    unsent[0] = unsent[0][sent:]
        except BlockingIOError as e:  # what SO_SNDTIMEO raises
            raise TimeoutError("send timed out") from e

    def _read_large(self, size: int) -> bytearray:
        # Larger than the inbox: what the inbox holds, then the rest in place,
        # in a buffer that grows only as the bytes arrive.
        data = bytearray(min(size, _FIRST_READ_BYTES))
        got = self._end - self._start
        data[:got] = self._inbox[self._start : self._end]
        self._start = self._end = 0
        if len(self._inbox) < _MAX_INBOX_BYTES:
            self._inbox = bytearray(min(_MAX_INBOX_BYTES, 2 * size))
        while got < size:
            if got == len(data):
                data.extend(bytes(min(size, 2 * got) - got))
            with memoryview(data) as view:
                self._read_exactly(view[got:], got)
            got = len(data)
        return data

    def _take(self, size: int) -> bytes:
        """The next ``size`` bytes of the stream (``size`` <= the inbox)."""
        with self._take_view(size) as view:
            return view.tobytes()

    def _take_view(self, size: int) -> memoryview:
        """A view of the next ``size`` bytes of the stream in the inbox (``size`` <= the inbox),
        to release before the next read."""
        if self._end - self._start < size:
            self._fill(size)
        start = self._start
        self._start += size
        return memoryview(self._inbox)[start : self._start]

    def _fill(self, size: int) -> None:
        """Have at least ``size`` bytes in the inbox: one read of whatever has arrived, then the rest."""
        held = self._end - self._start
        if self._start:
            self._inbox[:held] = self._inbox[self._start : self._end]
            self._start, self._end = 0, held
        with memoryview(self._inbox) as view:
            if held == 0:
                # Blocks until the message starts, and takes as much of it as
                # has arrived: often all of it.
                self._end += self._read_some(view, 0)
            if self._end < size:
                self._read_exactly(view[self._end : size], self._end)
                self._end = size

    def _read_some(self, view: memoryview, already: int, flags: int = 0) -> int:
        self._arm(socket.SO_RCVTIMEO)
        try:
            n = self._sock.recv_into(view, 0, flags)
        except BlockingIOError as e:  # what SO_RCVTIMEO raises
            raise TimeoutError("receive timed out") from e
        if n == 0:
            if already == 0:
                raise EOFError
            raise OSError("got end of file during message")
        return n

    def _read_exactly(self, view: memoryview, already: int) -> None:
        # MSG_WAITALL: one call unless the timeout or a signal cuts it short.
        got = 0
        while got < len(view):
            got += self._read_some(view[got:], already + got, socket.MSG_WAITALL)

    def _arm(self, option: int) -> None:
        """Check the deadline; set ``option`` to the time left unless it is set for this deadline already."""
        left = self.deadline.left_or_raise()
        now = time.monotonic()
        armed_for, armed_at = self._armed[option]
        if armed_for == self.deadline and (not self.deadline.bounded or now - armed_at < _REARM_AFTER_S):
            return
        if not self.deadline.bounded:
            timeval = _TIMEVAL.pack(0, 0)  # no timeout
        else:
            seconds = int(left)
            timeval = _TIMEVAL.pack(seconds, max(1, int((left - seconds) * 1e6)))
        self._sock.setsockopt(socket.SOL_SOCKET, option, timeval)
        self._armed[option] = (self.deadline, now)


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on what peers may cost an owner.

    max_connections: connections served at once (one thread each, most of
        them idle persistent connections); one more is closed at once and
        its peer tokenizes locally.
    handshake_timeout_s: time a new connection has to authenticate and ask
        for ``accept_connection``; a silent or slow client is dropped then.
    message_timeout_s: time to read one request, once its first byte has
        arrived, and to write one reply.
    idle_timeout_s: an authenticated connection with no request for this long
        is closed (peers reconnect transparently); None keeps it until
        shutdown.
    max_message_bytes: largest request accepted.
    close_timeout_s: how long ``shutdown()`` waits for serving threads.
    """

    max_connections: int = 512
    handshake_timeout_s: float = 5.0
    message_timeout_s: float = 30.0
    idle_timeout_s: float | None = 600.0
    max_message_bytes: int = MAX_MESSAGE_BYTES
    close_timeout_s: float = CLOSE_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.max_message_bytes < 1024:
            raise ValueError("max_connections must be >= 1 and max_message_bytes >= 1024")
        for name in ("handshake_timeout_s", "message_timeout_s", "close_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ServerLimits.{name} must be > 0")
        if self.idle_timeout_s is not None and not self.idle_timeout_s > 0:
            raise ValueError("ServerLimits.idle_timeout_s must be > 0 or None")


class PeerConnection(TimedConnection):
    """The owner's end of a peer's connection.

    One deadline bounds the handshake. Once serving, the wait for the first
    byte of the next request has the idle timeout, and the rest of a request
    (its header included) and a reply each the message timeout; a failure
    inside a request ends the connection with ``EOFError`` (the stream cannot
    be resynchronised), which ends the manager's serve loop. ``close()`` only
    shuts the socket down: the descriptor stays open until the listener has
    forgotten the connection (its ``shutdown()`` could otherwise hit a reused
    descriptor number); ``release()`` closes.
    """

    def __init__(self, sock: socket.socket, limits: ServerLimits):
        super().__init__(sock, limits.max_message_bytes)
        self._limits = limits
        self._serving = False
        self.deadline = Deadline.after(limits.handshake_timeout_s)

    def start_serving(self) -> None:
        self._serving = True

    def close(self) -> None:
        self.shutdown()

    def release(self) -> None:
        super().close()

    def recv(self) -> Any:
        if not self._serving:
            return super().recv()
        self.deadline = Deadline.after(self._limits.idle_timeout_s)
        try:
            if self._end == self._start:
                self._fill(1)  # the first byte of the next request
        except OSError as e:  # TimeoutError included: idle for too long
            raise EOFError(f"no request: {e!r}") from e
        # From its first byte on, a request (its header too) has the message
        # timeout: a half-sent header does not hold the thread until idle.
        self.deadline = Deadline.after(self._limits.message_timeout_s)
        try:
            return super().recv()
        except MessageTooLarge:
            raise
        except (OSError, EOFError) as e:  # a bad header, or one or a body that never ended
            self.shutdown()
            raise EOFError(f"no whole request: {e!r}") from e

    def send(self, obj: Any) -> None:
        if self._serving:
            self.deadline = Deadline.after(self._limits.message_timeout_s)
        super().send(obj)

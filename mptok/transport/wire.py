"""The wire both ends of a routed call speak: where, how framed, within what time.

An owner (``mptok.transport.owner``) and its peers
(``mptok.transport.proxy``) speak the ``multiprocessing.managers`` protocol
over a Unix socket in the ipc directory. This module holds what both ends
share: the socket's path, the errors a call can end in, and
``TimedConnection``, the manager ``Connection`` redone so that every read
and write ends by a deadline, messages are capped in size, and unpickling
refuses globals, so a request cannot run code in the owner (nor a reply in
the peer).

Token ids cross as native int32 bytes (``pack_int32``): building a
38k-element list costs as much as the rest of the call, so only the asking
side builds one.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import pickle
import socket
import stat
import struct
import time
from typing import Any

from mptok.core.ids import INT32
from mptok.transport.mp_private import HookedConnection

SOCKET_NAME = "tokenize-{}.sock"
# The well-known ident under which an owner publishes its cache service, so a
# peer needs no ``create`` round trip (and holds no reference) to call it.
ENCODE_TYPEID = "PrefixTokenCache"
# sun_path holds 108 bytes on Linux, the terminating NUL included.
MAX_UNIX_PATH_BYTES = 107
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


def socket_path(ipc_dir: str, frontend_id: int) -> str:
    """Where frontend ``frontend_id`` serves its cache."""
    return os.path.join(ipc_dir, SOCKET_NAME.format(frontend_id))


def secure_ipc_dir(path: str) -> str:
    """Create ``path`` (mode 0700) if missing and check that only this user can enter it.

    With the authkey, the directory is what keeps other users away from the
    sockets in it. Raises ``PermissionError`` if ``path`` is a symbolic link
    (its target is whatever the link says today, not a directory this user
    made), if another user owns it, or if group or others have any access to
    it; ``NotADirectoryError`` if it is not a directory. The checks are made
    on the opened directory itself, so a path swapped between the check and
    the open cannot pass. Returns the absolute path.
    """
    path = os.path.abspath(path)
    with contextlib.suppress(FileExistsError):
        os.makedirs(path, mode=0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if os.path.islink(path):
            raise PermissionError(f"ipc dir {path} is a symbolic link; give mptok a real directory") from None
        if e.errno == errno.ENOTDIR:
            raise NotADirectoryError(f"ipc dir {path} is not a directory") from None
        raise
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid != os.geteuid():
        raise PermissionError(
            f"ipc dir {path} belongs to uid {st.st_uid}, not to this process's uid "
            f"{os.geteuid()}; give mptok a directory of its own"
        )
    if st.st_mode & 0o077:
        raise PermissionError(
            f"ipc dir {path} has mode {stat.S_IMODE(st.st_mode):04o}: group and others "
            f"must have no access to it (chmod 700 {path})"
        )
    return path


def open_private_file(path: str, flags: int) -> int:
    """Open (or create, mode 0600) a regular file of this user at ``path``, never through a link.

    Raises ``PermissionError`` if ``path`` is a symbolic link or anything but
    a regular file of this user: in the private ipc dir only a bug or
    another program of this user plants one, and following it would make
    mptok write wherever it points.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PermissionError(f"{path} is a symbolic link; mptok refuses to follow it") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise PermissionError(f"{path} is not a regular file of uid {os.geteuid()}; mptok refuses to use it")
    return fd


class TransportError(Exception):
    """A call to an owner produced no ids; the caller tokenizes the prompt itself."""


class OwnerTimeout(TransportError):
    """The owner did not answer by the deadline; the connection was dropped."""


class OwnerUnreachable(TransportError):
    """No usable connection: nothing listening, refused, wrong authkey, or lost."""


class OwnerError(TransportError):
    """The owner answered, but not with ids (it could not tokenize the prompt, say)."""


class MessageTooLarge(OSError):
    """A message longer than the connection accepts; its body was left unread."""


class BadFrame(OSError):
    """A length header no sender of this protocol writes (a negative length, say)."""


def time_left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


class _NoGlobalsUnpickler(pickle.Unpickler):
    """Unpickles plain data only; a reference to any class or function is refused.

    Requests and replies are tuples of str, bytes, None and dicts, which need
    no globals. Refusing them is what keeps an authenticated peer from running
    code by sending a pickle that calls something on load.
    """

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused to load global {module}.{name}")


class TimedConnection(HookedConnection):
    """A manager ``Connection`` whose every read and write ends by ``deadline``.

    The stock ``Connection`` blocks in ``os.read``/``os.write`` with no
    timeout. This one keeps its socket blocking and, before each read or
    write, sets the kernel's SO_RCVTIMEO/SO_SNDTIMEO to the time left before
    ``deadline`` (None: no limit), so a message is bounded as a whole however
    the peer trickles it, and a step past the deadline raises
    ``TimeoutError``. ``recv()`` refuses messages longer than
    ``max_message_bytes`` (``MessageTooLarge``), length headers that no
    sender writes (``BadFrame``: a negative length would otherwise be read
    as a message of bytes taken from the next one), and pickles that
    reference globals (``pickle.UnpicklingError``). After either refusal the
    stream is useless and the connection is shut down. No buffer larger
    than ``_FIRST_READ_BYTES`` is allocated on the word of a header alone.

    Every socket call releases the GIL, and in a process whose main thread
    runs Python it may take a switch interval or far longer to get it back
    (see ``mptok.routing``), so a message costs as few calls as possible:
    one ``sendmsg`` out, with send and receive buffers large enough to hold
    it whole, and usually one ``recv_into`` in, into a buffer kept from
    message to message (grown to twice the largest message, up to
    ``_MAX_INBOX_BYTES``) that takes the length header and the body
    together; whatever is missing then comes in one ``MSG_WAITALL`` read.
    Kernel timeouts rather than ``settimeout()`` for the same reason: a
    socket with a Python timeout polls before every read and write.
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
        self.deadline: float | None = None
        super().__init__(sock.fileno())

    def shutdown(self) -> None:
        """Wake any thread blocked on this connection; it then sees EOF."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def recv(self) -> Any:
        self.ensure_readable()
        buf = self.read_frame(self._max_message_bytes)
        if buf is None:
            # The body is still in the stream, which is therefore useless.
            self.shutdown()
            raise MessageTooLarge(f"message longer than {self._max_message_bytes} bytes")
        return _NoGlobalsUnpickler(buf).load()

    # Connection's I/O primitives (through HookedConnection), redone on the
    # socket with deadlines and the same framing: a "!i" length, or -1 and a
    # "!Q" length.

    def write_frame(self, buf: bytes) -> None:
        n = len(buf)
        header = _SHORT_HEADER.pack(n) if n <= 0x7FFFFFFF else _LONG_HEADER.pack(-1, n)
        self._arm(socket.SO_SNDTIMEO)
        try:
            sent = self._sock.sendmsg([header, buf])
        except BlockingIOError as e:
            raise TimeoutError("send timed out") from e
        if sent < len(header) + n:
            self.write_all(memoryview(header + bytes(buf))[sent:])

    def write_all(self, buf: bytes) -> None:
        with memoryview(buf) as view:
            while view:
                self._arm(socket.SO_SNDTIMEO)
                try:
                    view = view[self._sock.send(view) :]
                except BlockingIOError as e:
                    raise TimeoutError("send timed out") from e

    def has_buffered_bytes(self) -> bool:
        return self._end > self._start

    def read_frame(self, maxsize: int | None) -> io.BytesIO | None:
        size = self.read_length()
        if maxsize is not None and size > maxsize:
            return None
        return self.read_body(size)

    def read_length(self) -> int:
        """The next message's length, from its header."""
        (size,) = _SHORT_HEADER.unpack(self._take(_SHORT_HEADER.size))
        if size == -1:
            (size,) = _LENGTH_ONLY.unpack(self._take(_LENGTH_ONLY.size))
        elif size < 0:
            self.shutdown()
            raise BadFrame(f"length header {size}: not a message")
        return size

    def read_body(self, size: int) -> io.BytesIO:
        if size <= len(self._inbox):
            return io.BytesIO(self._take(size))
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
        return io.BytesIO(data)

    def wait_for_message(self) -> None:
        """Block until the next message's first byte has arrived."""
        if self._end == self._start:
            self._fill(1)

    def _take(self, size: int) -> bytes:
        """The next ``size`` bytes of the stream (``size`` <= the inbox)."""
        if self._end - self._start < size:
            self._fill(size)
        start = self._start
        self._start += size
        with memoryview(self._inbox) as view:
            return view[start : self._start].tobytes()

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
                self._end += self._read_some(view[held:], held)
            if self._end < size:
                self._read_exactly(view[self._end : size], self._end)
                self._end = size

    def _read_some(self, view: memoryview, already: int, flags: int = 0) -> int:
        self._arm(socket.SO_RCVTIMEO)
        try:
            n = self._sock.recv_into(view, 0, flags)
        except BlockingIOError as e:
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
        left = time_left(self.deadline)
        if left is None:
            timeval = _TIMEVAL.pack(0, 0)  # no timeout
        else:
            seconds = int(left)
            timeval = _TIMEVAL.pack(seconds, max(1, int((left - seconds) * 1e6)))
        self._sock.setsockopt(socket.SOL_SOCKET, option, timeval)

    def close_handle(self) -> None:
        self._sock.close()


def left_or_zero(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def pack_int32(ids: Any) -> bytes:
    """Native int32 bytes of ``ids``: a list, or any buffer of 4-byte ints
    (a numpy int32 array, ``array('i')``), copied as it is."""
    if not isinstance(ids, list):
        view = memoryview(ids)
        if view.format == INT32 and view.ndim == 1:
            return view.tobytes()
        ids = list(ids)
    # About 2.5x faster than array("i", ids).tobytes(), whose constructor
    # parses every element generically (0.26 vs 0.65 ms for 38k ids), and
    # than struct.pack(fmt, *ids), which copies the arguments once more.
    return struct.Struct(f"{len(ids)}{INT32}").pack(*ids)

"""Serve one frontend's prefix-token cache to the other frontends of a server.

With several frontend processes behind one port, the kernel hands the turns
of a conversation to different processes, each with its own
``PrefixTokenCache``. The frontend that owns a conversation
(``mptok.routing``) therefore serves its cache to its peers, and a peer asks
the owner to tokenize that conversation's prompts rather than tokenizing a
200k-token history from scratch.

The shape is ``multiprocessing.managers``: a ``BaseManager`` subclass serves
the cache's ``encode`` on a Unix socket, and peers call it through
authenticated proxies speaking the manager wire protocol (the mutual HMAC
authkey handshake, pickled ``(ident, method, args, kwds)`` requests,
``('#RETURN', result)`` replies). The stock machinery cannot run inside a
serving frontend as it is, so this module keeps the protocol, the registry
and the per-request dispatch (``Server.serve_client``) and replaces the rest:

* ``Server.serve_forever`` and its accept loop (which reset sys.stdout,
  call ``sys.exit()``, spin at 100% CPU once the listener is shut down, and
  start one thread per connection without limit) -> ``_Acceptor``: threads
  of this process, a SOMAXCONN backlog, a connection cap, and a shutdown
  that wakes and joins everything.
* ``Server.handle_request`` -> a handshake bounded in time, after which a
  peer may only ask for ``accept_connection``; on an accepted connection
  only the exposed ``encode`` is dispatched (none of the ``#GETVALUE``,
  ``__repr__`` fallbacks, no ``create``, ``shutdown`` or ``debug_info``).
* ``Connection``, which reads and writes with no timeout ->
  ``_TimedConnection``: every read and write ends by a deadline, messages are
  capped in size, and unpickling refuses globals, so a request cannot run
  code in the owner (nor a reply in the peer).
* ``BaseProxy`` (three handshakes per proxy for create/incref/decref,
  finalizers that hang against a stopped owner, one connection per thread
  shared by every proxy) -> ``EncodeProxy``: one persistent connection per
  thread per owner, no reference counting, every step bounded, and a
  connection that timed out is dropped.
* ``BaseManager._registry``, shared by every manager of a class in a
  process -> ``TokenizeManager.for_owner()``, a subclass per owner.

Token ids cross as native int32 bytes (``array('i')``): building a
38k-element list costs as much as the rest of the call, so only the asking
side builds one.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import logging
import os
import pickle
import socket
import stat
import struct
import threading
import time
import weakref
from array import array
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from multiprocessing import AuthenticationError, connection, process
from multiprocessing.managers import BaseManager, Server, State
from typing import Any

from mptok.counting import Counters, Histogram
from mptok.peer import PeerReply

logger = logging.getLogger(__name__)

SOCKET_NAME = "tokenize-{}.sock"
# The well-known ident under which an owner publishes its cache service, so a
# peer needs no ``create`` round trip (and holds no reference) to call it.
ENCODE_TYPEID = "PrefixTokenCache"
_ACCEPT_CONNECTION = "accept_connection"
# sun_path holds 108 bytes on Linux, the terminating NUL included.
_MAX_UNIX_PATH_BYTES = 107
_INT32 = "i"
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


def socket_path(ipc_dir: str, frontend_id: int) -> str:
    """Where frontend ``frontend_id`` serves its cache."""
    return os.path.join(ipc_dir, SOCKET_NAME.format(frontend_id))


def secure_ipc_dir(path: str) -> str:
    """Create ``path`` (mode 0700) if missing and check that only this user can enter it.

    With the authkey, the directory is what keeps other users away from the
    sockets in it. Raises ``PermissionError`` if another user owns it or if
    group or others have any access to it, ``NotADirectoryError`` if it is
    not a directory. Returns the absolute path.
    """
    path = os.path.abspath(path)
    with contextlib.suppress(FileExistsError):
        os.makedirs(path, mode=0o700)
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"ipc dir {path} is not a directory")
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


class TransportError(Exception):
    """A call to an owner produced no ids; the caller tokenizes the prompt itself."""


class OwnerTimeout(TransportError):
    """The owner did not answer by the deadline; the connection was dropped."""


class OwnerUnreachable(TransportError):
    """No usable connection: nothing listening, refused, wrong authkey, or lost."""


class OwnerError(TransportError):
    """The owner answered, but not with ids (it could not tokenize the prompt, say)."""


class OwnerAlreadyServing(RuntimeError):
    """A live process already serves this socket path."""


class MessageTooLarge(OSError):
    """A message longer than the connection accepts; its body was left unread."""


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
    max_message_bytes: int = 1 << 28
    close_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.max_message_bytes < 1024:
            raise ValueError("max_connections must be >= 1 and max_message_bytes >= 1024")
        for name in ("handshake_timeout_s", "message_timeout_s", "close_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ServerLimits.{name} must be > 0")
        if self.idle_timeout_s is not None and not self.idle_timeout_s > 0:
            raise ValueError("ServerLimits.idle_timeout_s must be > 0 or None")


def _time_left(deadline: float | None) -> float | None:
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


class _TimedConnection(connection.Connection):
    """A manager ``Connection`` whose every read and write ends by ``deadline``.

    The stock ``Connection`` blocks in ``os.read``/``os.write`` with no
    timeout. This one keeps its socket blocking and, before each read or
    write, sets the kernel's SO_RCVTIMEO/SO_SNDTIMEO to the time left before
    ``deadline`` (None: no limit), so a message is bounded as a whole however
    the peer trickles it, and a step past the deadline raises
    ``TimeoutError``. ``recv()`` refuses messages longer than
    ``max_message_bytes`` (``MessageTooLarge``) and pickles that reference
    globals (``pickle.UnpicklingError``).

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
        self._check_closed()
        self._check_readable()
        buf = self._recv_bytes(self._max_message_bytes)
        if buf is None:
            # The body is still in the stream, which is therefore useless.
            self.shutdown()
            raise MessageTooLarge(f"message longer than {self._max_message_bytes} bytes")
        return _NoGlobalsUnpickler(buf).load()

    # Connection's I/O primitives, redone on the socket with deadlines and
    # the same framing: a "!i" length, or -1 and a "!Q" length.

    def _send_bytes(self, buf: bytes) -> None:
        n = len(buf)
        header = _SHORT_HEADER.pack(n) if n <= 0x7FFFFFFF else _LONG_HEADER.pack(-1, n)
        self._arm(socket.SO_SNDTIMEO)
        try:
            sent = self._sock.sendmsg([header, buf])
        except BlockingIOError as e:
            raise TimeoutError("send timed out") from e
        if sent < len(header) + n:
            self._send(memoryview(header + bytes(buf))[sent:])

    def _send(self, buf: bytes, write: object = None) -> None:
        with memoryview(buf) as view:
            while view:
                self._arm(socket.SO_SNDTIMEO)
                try:
                    view = view[self._sock.send(view) :]
                except BlockingIOError as e:
                    raise TimeoutError("send timed out") from e

    def _poll(self, timeout: float) -> bool:
        return self._end > self._start or super()._poll(timeout)

    def _recv_bytes(self, maxsize: int | None = None) -> io.BytesIO | None:
        size = self._recv_length()
        if maxsize is not None and size > maxsize:
            return None
        return self._recv(size)

    def _recv_length(self) -> int:
        (size,) = _SHORT_HEADER.unpack(self._take(_SHORT_HEADER.size))
        if size == -1:
            (size,) = _LENGTH_ONLY.unpack(self._take(_LENGTH_ONLY.size))
        return size

    def _recv(self, size: int, read: object = None) -> io.BytesIO:
        if size <= len(self._inbox):
            return io.BytesIO(self._take(size))
        # Larger than the inbox: what the inbox holds, then the rest in place.
        data = bytearray(size)
        got = self._end - self._start
        data[:got] = self._inbox[self._start : self._end]
        self._start = self._end = 0
        if len(self._inbox) < _MAX_INBOX_BYTES:
            self._inbox = bytearray(min(_MAX_INBOX_BYTES, 2 * size))
        with memoryview(data) as view:
            self._read_exactly(view[got:], got)
        return io.BytesIO(data)

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
        left = _time_left(self.deadline)
        if left is None:
            timeval = _TIMEVAL.pack(0, 0)  # no timeout
        else:
            seconds = int(left)
            timeval = _TIMEVAL.pack(seconds, max(1, int((left - seconds) * 1e6)))
        self._sock.setsockopt(socket.SOL_SOCKET, option, timeval)

    def _close(self, _close: object = None) -> None:
        self._sock.close()


class _PeerConnection(_TimedConnection):
    """The owner's end of a peer's connection.

    During the handshake one deadline bounds everything. Once serving, the
    wait for the next request is bounded by the idle timeout, and reading a
    request (once it has begun) and writing a reply each get their own
    message timeout. A failure inside a request ends the connection with
    ``EOFError`` (the stream cannot be resynchronised), which ends the
    manager's serve loop.

    ``close()`` only shuts the socket down: the manager's serve loop closes
    connections itself, and the descriptor must stay open until the acceptor
    has forgotten the connection, or its ``shutdown()`` could hit a
    descriptor number that something else has reused. ``release()`` closes.
    """

    def __init__(self, sock: socket.socket, limits: ServerLimits):
        super().__init__(sock, limits.max_message_bytes)
        self._limits = limits
        self._serving = False
        self.deadline = time.monotonic() + limits.handshake_timeout_s

    def start_serving(self) -> None:
        self._serving = True

    def close(self) -> None:
        self.shutdown()

    def release(self) -> None:
        super().close()

    def _recv_bytes(self, maxsize: int | None = None) -> io.BytesIO | None:
        if not self._serving:
            return super()._recv_bytes(maxsize)
        idle = self._limits.idle_timeout_s
        self.deadline = None if idle is None else time.monotonic() + idle
        try:
            size = self._recv_length()
        except OSError as e:  # TimeoutError included: idle for too long
            raise EOFError(f"no request: {e!r}") from e
        if maxsize is not None and size > maxsize:
            return None
        self.deadline = time.monotonic() + self._limits.message_timeout_s
        try:
            return self._recv(size)
        except (OSError, EOFError) as e:
            self.shutdown()
            raise EOFError(f"connection ended inside a request: {e!r}") from e

    def _send_bytes(self, buf: bytes) -> None:
        if self._serving:
            self.deadline = time.monotonic() + self._limits.message_timeout_s
        super()._send_bytes(buf)


# What an owner runs for a peer: ``answer(text, key, since, shared_chars)``,
# as ``PrefixTokenCache.encode_for_peer`` with its tokenizer bound.
PeerAnswer = Callable[[str, "str | None", "int | None", int], "PeerReply | None"]


def answer_in_full(encode: Callable[[str, str | None], list[int]]) -> PeerAnswer:
    """A ``PeerAnswer`` for an ``encode(text, key) -> ids`` that keeps no versions."""

    def answer(text: str, key: str | None, since: int | None, shared_chars: int) -> PeerReply | None:
        return None if since is not None else PeerReply(0, 0, encode(text, key))

    return answer


class _EncodeService:
    """The object an owner serves: ``encode`` and nothing else.

    ``encode(text, key, since, shared_chars)`` returns ``(version, reused,
    ids as native int32 bytes)``; None when ``since`` names a version the
    owner cannot rebuild the prompt from (the peer then sends the whole
    text); or a str saying why the owner could not tokenize the text (the
    peer then tokenizes it itself and reports its own error). It never
    raises, so a reply never carries an exception object, which the peer
    would refuse to unpickle.
    """

    def __init__(self, answer: PeerAnswer):
        self._answer = answer
        self.counters = Counters(("served", "served_since", "serve_errors"))
        # The owner's own work per answered call, without the transport:
        # beside the peers' mptok_route_seconds, what a crossing costs.
        self.timings = {"serve_seconds": Histogram()}

    def encode(
        self, text: object, key: object = None, since: object = None, shared_chars: object = 0
    ) -> tuple[int, int, bytes] | str | None:
        if (
            not isinstance(text, str)
            or not (key is None or isinstance(key, str))
            or not (since is None or type(since) is int)
            or type(shared_chars) is not int
        ):
            self.counters.add("serve_errors")
            return "encode takes (text: str, key: str | None, since: int | None, shared_chars: int)"
        started = time.perf_counter()
        try:
            reply = self._answer(text, key, since, shared_chars)
            packed = None if reply is None else (reply.version, reply.reused, _pack_int32(reply.ids))
        except Exception as e:
            self.counters.add("serve_errors")
            logger.debug("could not tokenize a prompt for a peer: %r", e)
            return f"{type(e).__name__}: {e}"
        self.timings["serve_seconds"].observe(time.perf_counter() - started)
        self.counters.add("served")
        if since is not None and packed is not None:
            self.counters.add("served_since")
        return packed


class _OwnerServer(Server):
    """The manager ``Server`` of one owner: authenticates peers, dispatches their calls.

    Reuses ``Server.serve_client``, the per-request dispatch with its check
    of exposed methods. Replaces ``__init__``, which binds a ``Listener``
    with a fixed backlog (``_SocketFile`` binds the socket here), and
    ``handle_request``/``accept_connection``. Every registered typeid is
    instantiated once, when the server is built, and published under its
    typeid as ident: peers need no ``create`` and hold no references.
    """

    public = (_ACCEPT_CONNECTION,)
    # Server answers '#GETVALUE' (the pickled object itself), '__str__' and
    # '__repr__' for any method name that is not exposed. Peers get none.
    fallback_mapping: dict[str, Callable[..., Any]] = {}

    def __init__(self, registry: dict[str, tuple], address: str, authkey: bytes):
        # Not Server.__init__: see the class docstring.
        self.registry = registry
        self.address = address
        self.authkey = process.AuthenticationString(authkey)
        self.mutex = threading.Lock()
        self.stop_event = threading.Event()
        self.id_to_refcount: dict[str, int] = {}
        self.id_to_local_proxy_obj: dict[str, tuple] = {}
        self.id_to_obj: dict[str, tuple] = {"0": (None, ())}
        for typeid, (make, exposed, _method_to_typeid, _proxytype) in registry.items():
            if not exposed:
                raise ValueError(f"register {typeid!r} with the methods it exposes")
            self.id_to_obj[typeid] = (make(), frozenset(exposed), None)
        self.counters = Counters(("handshake_failures", "refused_requests"))

    def handle_request(self, conn: _PeerConnection) -> None:
        """Authenticate ``conn`` before its deadline, then serve it until it ends."""
        try:
            connection.deliver_challenge(conn, self.authkey)
            connection.answer_challenge(conn, self.authkey)
            _, funcname, _, _ = conn.recv()
        except Exception as e:
            # Wrong authkey, silence, garbage, a malformed or refused pickle:
            # whatever an unauthenticated client did, it is just dropped.
            self.counters.add("handshake_failures")
            logger.debug("dropped a connection to %s during the handshake: %r", self.address, e)
            return
        if funcname != _ACCEPT_CONNECTION:
            self.counters.add("refused_requests")
            with contextlib.suppress(Exception):
                conn.send(("#TRACEBACK", f"{funcname!r} refused: peers may only call encode"))
            return
        self.accept_connection(conn)

    def accept_connection(self, c: _PeerConnection, name: str | None = None) -> None:
        """Serve ``c``'s calls until EOF, an I/O timeout or ``stop_event``.

        Unlike ``Server.accept_connection``, the thread is not renamed after
        the name the peer sent.
        """
        c.start_serving()
        c.send(("#RETURN", None))
        # serve_client ends its thread with sys.exit() on EOF or a failed send.
        with contextlib.suppress(SystemExit):
            self.serve_client(c)


class _Acceptor:
    """Accepts connections on a listening socket and serves each on its own thread.

    At most ``limits.max_connections`` are served at once: one more is closed
    at once (its peer sees EOF and tokenizes locally) instead of getting a
    thread, or waiting in the backlog until its handshake times out.
    """

    def __init__(
        self,
        listener: socket.socket,
        handle: Callable[[_PeerConnection], None],
        limits: ServerLimits,
        name: str,
    ):
        self._listener = listener
        self._handle = handle
        self._limits = limits
        self._name = name
        self._lock = threading.Lock()
        self._conns: set[_PeerConnection] = set()
        self._threads: set[threading.Thread] = set()
        self._closing = threading.Event()
        self.counters = Counters(("accepted", "refused"))
        # Daemon threads: a frontend that exits without closing must not hang
        # in interpreter shutdown on a peer's idle connection.
        self._thread = threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True)
        self._thread.start()

    def active_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def close(self, timeout_s: float) -> bool:
        """Stop accepting, end every connection and join every thread within ``timeout_s``.

        Returns whether every thread ended in time (threads still busy in a
        tokenization end when it does, without touching the connection).
        """
        deadline = time.monotonic() + timeout_s
        self._closing.set()
        # close() alone does not wake a thread blocked in accept() on Linux.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._thread.join(_left_or_zero(deadline))
        with self._lock:
            # Under the lock: a serving thread forgets its connection under
            # it before closing the descriptor.
            for conn in self._conns:
                conn.shutdown()
            threads = list(self._threads)
        for thread in threads:
            thread.join(_left_or_zero(deadline))
        alive = [t.name for t in [self._thread, *threads] if t.is_alive()]
        if alive:
            logger.warning("%s: threads still running after close: %s", self._name, alive)
        return not alive

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError as e:
                if self._closing.is_set():
                    return
                # EMFILE and the like: pause instead of spinning on the error
                # as Server.accepter does.
                logger.warning("%s: accept failed: %r", self._name, e)
                self._closing.wait(0.1)
                continue
            self._start_serving(sock)

    def _start_serving(self, sock: socket.socket) -> None:
        with self._lock:
            if self._closing.is_set() or len(self._threads) >= self._limits.max_connections:
                thread = None
            else:
                thread = threading.Thread(
                    target=self._serve, args=(sock,), name=f"{self._name}-peer", daemon=True
                )
                self._threads.add(thread)
                try:
                    # Started under the lock so that close() never joins a
                    # thread that has not started.
                    thread.start()
                except RuntimeError:
                    self._threads.discard(thread)
                    thread = None
        if thread is None:
            self.counters.add("refused")
            sock.close()
        else:
            self.counters.add("accepted")

    def _serve(self, sock: socket.socket) -> None:
        conn = _PeerConnection(sock, self._limits)
        with self._lock:
            self._conns.add(conn)
            closing = self._closing.is_set()
        try:
            if not closing:
                self._handle(conn)
        except Exception:
            logger.exception("%s: serving a peer failed", self._name)
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())
            conn.release()


def _left_or_zero(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


class _SocketFile:
    """The owner's listening Unix socket, claimed for as long as it is open.

    A lock file beside the socket, held with ``flock`` (which the kernel
    releases when its holder exits, however it exits), says whether a live
    owner holds the path. If one does, opening raises ``OwnerAlreadyServing``
    instead of unlinking a live owner's socket; if none does, a socket file
    left at the path is stale and is replaced. The lock file stays behind
    (unlinking it would let two owners lock two different files). A child
    forked without exec inherits the lock; it is released only when both
    have exited.
    """

    def __init__(self, path: str):
        if len(os.fsencode(path)) > _MAX_UNIX_PATH_BYTES:
            raise ValueError(f"socket path {path!r} is too long for a Unix socket; use a shorter ipc dir")
        self.path = path
        self._lock_fd = _lock_or_raise(path + ".lock", path)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self.sock.bind(path)
                os.chmod(path, 0o600)
                self._inode = os.stat(path).st_ino
                # Every tokenizing thread of every peer may connect at once;
                # a Unix connect to a full backlog blocks or fails at once.
                self.sock.listen(socket.SOMAXCONN)
            except BaseException:
                self.sock.close()
                raise
        except BaseException:
            os.close(self._lock_fd)
            raise

    def close(self) -> None:
        """Close the socket, remove its file if it is still ours, release the path."""
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        os.close(self._lock_fd)


def _lock_or_raise(lock_path: str, path: str) -> int:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise OwnerAlreadyServing(
            f"{path} is served by a live process (pid {holder}, holding {lock_path}); "
            "stop it first or give this frontend another id"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


class TokenizeManager(BaseManager):
    """A ``BaseManager`` that serves its registered objects from this process's threads.

    ``start()`` binds the Unix socket at ``address`` (0600; raises
    ``OwnerAlreadyServing`` if a live process serves it) and returns once it
    listens; unlike ``BaseManager.start()`` it spawns no process: the objects
    served live here. ``shutdown()`` stops accepting, ends every connection,
    joins every thread within ``limits.close_timeout_s`` and removes the
    socket file. ``with manager:`` does both.

    ``register()`` writes a registry shared by every manager of the class in
    the process: register on a class from ``for_owner()``, one per owner.
    Peers reach the objects with ``EncodeProxy``, not with ``connect()``.
    """

    def __init__(self, address: str, authkey: bytes, limits: ServerLimits | None = None, *, name: str = "mptok-owner"):
        if not isinstance(authkey, bytes) or not authkey:
            raise ValueError("authkey must be non-empty bytes")
        super().__init__(address=address, authkey=authkey)
        self._limits = limits if limits is not None else ServerLimits()
        self._name = name
        self._lifecycle = threading.Lock()
        self._server: _OwnerServer | None = None
        self._socket: _SocketFile | None = None
        self._acceptor: _Acceptor | None = None

    @classmethod
    def for_owner(cls) -> type[TokenizeManager]:
        """A new subclass with an empty registry of its own."""
        return type(cls.__name__, (cls,), {"_registry": {}, "__module__": cls.__module__})

    def get_server(self) -> _OwnerServer:
        # BaseManager.get_server() builds a stock Server whatever _Server says.
        return _OwnerServer(self._registry, self._address, bytes(self._authkey))

    def start(self) -> None:  # type: ignore[override]
        """Start serving from this process; returns once the socket listens."""
        with self._lifecycle:
            if self._state.value != State.INITIAL:
                raise RuntimeError("a TokenizeManager starts once")
            server = self.get_server()
            self._socket = _SocketFile(self._address)
            self._server = server
            self._acceptor = _Acceptor(self._socket.sock, server.handle_request, self._limits, self._name)
            self._state.value = State.STARTED

    def shutdown(self) -> bool:  # type: ignore[override]
        """Stop serving (idempotent). Returns whether every thread ended in time."""
        with self._lifecycle:
            if self._state.value != State.STARTED:
                self._state.value = State.SHUTDOWN
                return True
            self._state.value = State.SHUTDOWN
            assert self._server is not None and self._acceptor is not None and self._socket is not None
            self._server.stop_event.set()
            joined = self._acceptor.close(self._limits.close_timeout_s)
            self._socket.close()
            return joined

    def connect(self) -> None:
        raise NotImplementedError("peers call a TokenizeManager through EncodeProxy")

    def stats(self) -> dict[str, int]:
        """Counters of the server and of the objects it serves that have them."""
        stats: dict[str, int] = {}
        if self._server is None or self._acceptor is None:
            return stats
        stats.update(self._server.counters.snapshot())
        stats.update(self._acceptor.counters.snapshot())
        stats["active_connections"] = self._acceptor.active_connections()
        for entry in self._server.id_to_obj.values():
            counters = getattr(entry[0], "counters", None)
            if isinstance(counters, Counters):
                stats.update(counters.snapshot())
        return stats

    def timings(self) -> dict[str, dict[str, Any]]:
        """Histogram snapshots (``Histogram.snapshot()``) of the objects served that keep them."""
        timings: dict[str, dict[str, Any]] = {}
        if self._server is None:
            return timings
        for entry in self._server.id_to_obj.values():
            for name, histogram in getattr(entry[0], "timings", {}).items():
                timings[name] = histogram.snapshot()
        return timings


def serve_encode(
    address: str,
    answer: PeerAnswer,
    authkey: bytes,
    limits: ServerLimits | None = None,
    *,
    name: str = "mptok-owner",
) -> TokenizeManager:
    """Serve ``answer`` as ``encode`` at ``address`` to peers that know ``authkey``.

    Returns the started manager; ``shutdown()`` it when done. ``answer`` is
    called on the manager's threads, concurrently.
    """
    manager_class = TokenizeManager.for_owner()
    service = _EncodeService(answer)
    manager_class.register(ENCODE_TYPEID, callable=lambda: service, exposed=("encode",), create_method=False)
    manager = manager_class(address, authkey, limits, name=name)
    manager.start()
    return manager


class _StaleConnection(OwnerUnreachable):
    """A reused connection turned out dead: the owner restarted or closed it idle."""


class _Link:
    """One thread's authenticated connection to one owner.

    ``in_use`` is held by the owning thread for the length of a call, and by
    ``EncodeProxy.close()`` to close the connection; ``abort()`` only wakes a
    call, so it needs no more than the short ``_guard``, which also keeps it
    from shutting down a descriptor that ``close()`` has released.
    """

    def __init__(self, conn: _TimedConnection, incarnation: Hashable):
        self.conn: _TimedConnection | None = conn
        self.incarnation = incarnation
        self.in_use = threading.Lock()
        self._guard = threading.Lock()

    def abort(self) -> None:
        with self._guard:
            if self.conn is not None:
                self.conn.shutdown()

    def close(self) -> None:
        with self._guard:
            conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()


class EncodeProxy:
    """Calls one owner's ``encode`` over the manager protocol, from any number of threads.

    Each thread keeps one authenticated connection to the owner and reuses
    it. Every step (connect, authkey handshake, request, reply) ends by the
    call's deadline, ``timeout_s`` after the call starts; a call that times
    out drops its connection, so a late reply is never read as the answer to
    a later call. A reused connection that turns out dead (the owner
    restarted, or closed it idle) is replaced once, transparently, within the
    same deadline. ``incarnation``, any hashable naming the owner process the
    caller expects, drops connections made to an owner since replaced.

    ``encode`` raises ``OwnerTimeout``, ``OwnerUnreachable`` or ``OwnerError``
    and nothing else, whatever the owner does.
    """

    def __init__(self, address: str, authkey: bytes, timeout_s: float = 5.0, *, max_reply_bytes: int = 1 << 28):
        if not isinstance(authkey, bytes) or not authkey:
            raise ValueError("authkey must be non-empty bytes")
        if not timeout_s > 0:
            raise ValueError("timeout_s must be > 0")
        self.address = address
        self._authkey = authkey
        self._timeout_s = timeout_s
        self._max_reply_bytes = max_reply_bytes
        self._local = threading.local()
        self._links_lock = threading.Lock()
        # Weak: a thread's link goes (and its socket closes) with the thread.
        self._links: weakref.WeakSet[_Link] = weakref.WeakSet()
        self._closed = False

    def encode(self, text: str, key: str | None = None, *, incarnation: Hashable = None) -> list[int]:
        """The owner's ids for ``text`` (its cache extends conversation ``key``)."""
        reply = self.encode_since(text, key, incarnation=incarnation)
        if reply is None:
            raise OwnerError(f"{self.address} asked for a version it was not given")
        return reply.ids

    def encode_since(
        self,
        text: str,
        key: str | None = None,
        *,
        since: int | None = None,
        shared_chars: int = 0,
        incarnation: Hashable = None,
    ) -> PeerReply | None:
        """The owner's reply for a prompt of conversation ``key``.

        Without ``since``, ``text`` is the whole prompt. With it, the caller
        holds the ids of the conversation's version ``since`` and ``text``
        is the prompt after its first ``shared_chars`` characters, which it
        shares with that version (see ``PrefixTokenCache.encode_for_peer``);
        None means the owner cannot rebuild the prompt from that version.
        """
        deadline = time.monotonic() + self._timeout_s
        args = (text, key, since, shared_chars)
        link = self._reusable_link(incarnation)
        if link is not None:
            try:
                return self._call(link, args, deadline)
            except _StaleConnection:
                pass
        return self._call(self._open(incarnation, deadline), args, deadline)

    def close(self, timeout_s: float = 5.0) -> None:
        """Close every thread's connection; calls in flight and later calls fail at once."""
        with self._links_lock:
            self._closed = True
            links = list(self._links)
        for link in links:
            link.abort()
        deadline = time.monotonic() + timeout_s
        for link in links:
            if link.in_use.acquire(timeout=_left_or_zero(deadline)):
                try:
                    link.close()
                finally:
                    link.in_use.release()

    def _reusable_link(self, incarnation: Hashable) -> _Link | None:
        link: _Link | None = getattr(self._local, "link", None)
        if link is None:
            return None
        if link.conn is None or link.incarnation != incarnation:
            self._local.link = None
            with link.in_use:
                link.close()
            return None
        return link

    def _call(self, link: _Link, args: tuple, deadline: float) -> PeerReply | None:
        with link.in_use:
            conn = link.conn
            if conn is None:
                raise _StaleConnection(f"connection to {self.address} was closed")
            try:
                conn.deadline = deadline
                conn.send((ENCODE_TYPEID, "encode", args, {}))
                kind, result = conn.recv()
            except (pickle.UnpicklingError, ValueError, TypeError) as e:
                # A whole message that is not a reply: the stream is intact.
                raise OwnerError(f"{self.address} sent no reply: {e!r}") from e
            except Exception as e:
                link.close()
                raise self._failure(e, "call", stale=_StaleConnection) from e
        return _reply_from(self.address, kind, result)

    def _open(self, incarnation: Hashable, deadline: float) -> _Link:
        if self._closed:
            raise OwnerUnreachable("proxy closed")
        conn = self._connect(deadline)
        link = _Link(conn, incarnation)
        with self._links_lock:
            if self._closed:
                link.close()
                raise OwnerUnreachable("proxy closed")
            self._links.add(link)
        self._local.link = link
        return link

    def _connect(self, deadline: float) -> _TimedConnection:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(_time_left(deadline))
            sock.connect(self.address)
            conn = _TimedConnection(sock, self._max_reply_bytes)
            conn.deadline = deadline
            connection.answer_challenge(conn, self._authkey)
            connection.deliver_challenge(conn, self._authkey)
            conn.send((None, _ACCEPT_CONNECTION, ("mptok-peer",), {}))
            kind, result = conn.recv()
            if kind != "#RETURN":
                raise OwnerUnreachable(f"{self.address} refused the connection: {result!r:.200}")
        except Exception as e:
            sock.close()
            raise self._failure(e, "connection", stale=OwnerUnreachable) from e
        return conn

    def _failure(self, e: Exception, step: str, *, stale: type[OwnerUnreachable]) -> TransportError:
        """What a failed ``step`` means to the caller; ``stale`` is for a lost connection."""
        if isinstance(e, TransportError):
            return e
        if isinstance(e, TimeoutError):
            return OwnerTimeout(f"{step} with {self.address}: no answer within {self._timeout_s} s")
        if isinstance(e, MessageTooLarge):
            return OwnerError(f"{self.address}: {e}")
        if isinstance(e, AuthenticationError):
            return OwnerUnreachable(
                f"{step} with {self.address} failed: the authkey was refused, or it is not an owner ({e})"
            )
        if isinstance(e, (EOFError, OSError)):
            return stale(f"{step} with {self.address} failed: {e!r}")
        return OwnerUnreachable(f"{step} with {self.address} failed: {e!r}")


def _pack_int32(ids: list[int]) -> bytes:
    # About 2.5x faster than array("i", ids).tobytes(), whose constructor
    # parses every element generically (0.26 vs 0.65 ms for 38k ids), and
    # than struct.pack(fmt, *ids), which copies the arguments once more.
    return struct.Struct(f"{len(ids)}{_INT32}").pack(*ids)


def _reply_from(address: str, kind: object, result: object) -> PeerReply | None:
    if kind == "#RETURN" and result is None:
        return None
    if (
        kind == "#RETURN"
        and isinstance(result, tuple)
        and len(result) == 3
        and type(result[0]) is int
        and type(result[1]) is int
        and result[1] >= 0
        and isinstance(result[2], bytes)
    ):
        ids = array(_INT32)
        try:
            ids.frombytes(result[2])
        except ValueError as e:
            raise OwnerError(f"{address} sent {len(result[2])} bytes, not int32 ids") from e
        return PeerReply(result[0], result[1], ids.tolist())
    if kind == "#RETURN" and isinstance(result, str):
        raise OwnerError(f"{address} could not tokenize the prompt: {result}")
    raise OwnerError(f"{address} answered {kind!r}: {str(result)[:200]}")

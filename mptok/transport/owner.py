"""The owner's side: serve this frontend's cache to its peers from this process's threads.

``serve_encode`` starts a ``TokenizeManager`` (a ``BaseManager`` subclass)
that binds the owner's Unix socket and answers the peers' ``encode`` calls
on threads of the serving frontend. It keeps the manager's registry and its
per-request dispatch (``Server.serve_client``) and replaces what cannot run
inside a serving frontend:

* ``Server.serve_forever`` and its accept loop (which reset sys.stdout,
  call ``sys.exit()``, spin at 100% CPU once the listener is shut down, and
  start one thread per connection without limit) -> ``_Acceptor``: threads
  of this process, a SOMAXCONN backlog, a connection cap, and a shutdown
  that wakes and joins everything.
* ``Server.handle_request`` -> a handshake bounded in time, after which a
  peer may only ask for ``accept_connection``; on an accepted connection
  only the exposed ``encode`` is dispatched (none of the ``#GETVALUE``,
  ``__repr__`` fallbacks, no ``create``, ``shutdown`` or ``debug_info``).
* ``BaseManager._registry``, shared by every manager of a class in a
  process -> ``TokenizeManager.for_owner()``, a subclass per owner.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import connection, process
from multiprocessing.managers import BaseManager, Server, State
from typing import Any

from mptok.counting import Counters, Histogram
from mptok.peer import PeerReply
from mptok.transport.wire import (
    ACCEPT_CONNECTION,
    ENCODE_TYPEID,
    MAX_UNIX_PATH_BYTES,
    TimedConnection,
    left_or_zero,
    open_private_file,
    pack_int32,
)

logger = logging.getLogger(__name__)


class OwnerAlreadyServing(RuntimeError):
    """A live process already serves this socket path."""


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


class _PeerConnection(TimedConnection):
    """The owner's end of a peer's connection.

    During the handshake one deadline bounds everything. Once serving, the
    wait for the first byte of the next request is bounded by the idle
    timeout, and reading the rest of a request (its length header included)
    and writing a reply each get their own message timeout. A failure inside a request ends the connection with
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
            self._wait_for_message()
        except OSError as e:  # TimeoutError included: idle for too long
            raise EOFError(f"no request: {e!r}") from e
        # From its first byte on, a request (its header too) has the message
        # timeout: a half-sent header does not hold the thread until idle.
        self.deadline = time.monotonic() + self._limits.message_timeout_s
        try:
            size = self._recv_length()
        except OSError as e:  # a bad header, or one that never ended
            raise EOFError(f"no request: {e!r}") from e
        if maxsize is not None and size > maxsize:
            return None
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
# as ``mptok.peer.answer_peer`` with its cache and tokenizer bound.
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
            packed = None if reply is None else (reply.version, reply.reused, pack_int32(reply.ids))
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

    public = (ACCEPT_CONNECTION,)
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
        if funcname != ACCEPT_CONNECTION:
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
        self._thread.join(left_or_zero(deadline))
        with self._lock:
            # Under the lock: a serving thread forgets its connection under
            # it before closing the descriptor.
            for conn in self._conns:
                conn.shutdown()
            threads = list(self._threads)
        for thread in threads:
            thread.join(left_or_zero(deadline))
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


class _SocketFile:
    """The owner's listening Unix socket, claimed for as long as it is open.

    A lock file beside the socket, held with ``flock`` (which the kernel
    releases when its holder exits, however it exits), says whether a live
    owner holds the path. If one does, opening raises ``OwnerAlreadyServing``
    instead of unlinking a live owner's socket; if none does, a socket file
    left at the path is stale and is replaced. ``close()`` removes the lock
    file too, while still holding it: whoever opened the file before it was
    removed sees, once it holds the lock, that the path no longer names its
    file, and starts over on the path's new file. Only a process killed
    while serving leaves its lock file (harmless: the next owner takes it).
    The lock file is never followed through a symbolic link. A child forked
    without exec inherits the lock; it is released only when both have
    exited.
    """

    def __init__(self, path: str):
        if len(os.fsencode(path)) > MAX_UNIX_PATH_BYTES:
            raise ValueError(f"socket path {path!r} is too long for a Unix socket; use a shorter ipc dir")
        self.path = path
        self._lock_path = path + ".lock"
        self._lock_fd = _lock_or_raise(self._lock_path, path)
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
            self._release_lock()
            raise

    def close(self) -> None:
        """Close the socket, remove its file if it is still ours, release the path."""
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            if os.lstat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        self._release_lock()

    def _release_lock(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            if os.lstat(self._lock_path).st_ino == os.fstat(self._lock_fd).st_ino:
                os.unlink(self._lock_path)
        os.close(self._lock_fd)


def _lock_or_raise(lock_path: str, path: str) -> int:
    """Hold ``lock_path``'s file with ``flock``; the fd is returned once the path names it."""
    while True:
        fd = open_private_file(lock_path, os.O_RDWR | os.O_CREAT)
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
        try:
            current = os.lstat(lock_path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(fd).st_ino:
            break
        # The previous holder removed the file between our open and our lock.
        os.close(fd)
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

    def shutdown(self, timeout_s: float | None = None) -> bool:  # type: ignore[override]
        """Stop serving (idempotent) within ``timeout_s`` (default: ``limits.close_timeout_s``).

        Returns whether every thread ended in time.
        """
        with self._lifecycle:
            if self._state.value != State.STARTED:
                self._state.value = State.SHUTDOWN
                return True
            self._state.value = State.SHUTDOWN
            assert self._server is not None and self._acceptor is not None and self._socket is not None
            self._server.stop_event.set()
            joined = self._acceptor.close(self._limits.close_timeout_s if timeout_s is None else timeout_s)
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

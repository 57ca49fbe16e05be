"""The owner's listener: its Unix socket file, the accept loop, and the cap on connections.

Everything about the socket and the threads that serve its connections,
and nothing about the manager protocol spoken on them
(``mptok.transport.owner`` plugs it in). ``Listener`` replaces
``Server.serve_forever`` and its accept loop (docs/ROUTING.md, "The manager").
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable

from mptok.core.counting import Counters
from mptok.core.deadline import Deadline
from mptok.core.file_locks import try_lock
from mptok.core.private_files import open_private_file
from mptok.transport.wire import MAX_UNIX_PATH_BYTES, PeerConnection, ServerLimits

logger = logging.getLogger(__name__)


class OwnerAlreadyServing(RuntimeError):
    """A live process already serves this socket path."""


class Listener:
    """Listens at ``path`` and serves each connection with ``handle`` on a thread of its own.

    Opening claims the path (``_SocketFile``: raises ``OwnerAlreadyServing``
    while a live process serves it). At most ``limits.max_connections`` are
    served at once: one more is closed at once (its peer sees EOF and
    tokenizes locally) instead of getting a thread, or waiting in the
    backlog until its handshake times out. ``close()`` ends it all.
    """

    def __init__(self, path: str, handle: Callable[[PeerConnection], None], limits: ServerLimits, name: str):
        self._file = _SocketFile(path)
        self._listener = self._file.sock
        self._handle = handle
        self._limits = limits
        self._name = name
        self._lock = threading.Lock()
        self._conns: set[PeerConnection] = set()
        self._threads: set[threading.Thread] = set()
        self._closing = threading.Event()
        self.counters = Counters(("accepted", "refused"))
        # Daemon threads: a frontend that exits without closing must not hang
        # in interpreter shutdown on a peer's idle connection.
        self._thread = threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True)
        try:
            self._thread.start()
        except BaseException:
            self._file.close()
            raise

    def stats(self) -> dict[str, int]:
        """Connections accepted, refused (beyond the cap) and served now (``active_connections``)."""
        with self._lock:
            active = len(self._conns)
        return {**self.counters.snapshot(), "active_connections": active}

    def close(self, timeout_s: float) -> bool:
        """Stop accepting, end every connection, join every thread within
        ``timeout_s``, free the path; returns whether every thread ended in time
        (one still in a tokenization ends when it does, touching nothing)."""
        deadline = Deadline.after(timeout_s)
        self._closing.set()
        # close() alone does not wake a thread blocked in accept() on Linux.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._thread.join(deadline.left())
        with self._lock:
            # Under the lock: a serving thread forgets its connection under
            # it before closing the descriptor.
            for conn in self._conns:
                conn.shutdown()
            threads = list(self._threads)
        for thread in threads:
            thread.join(deadline.left())
        self._file.close()
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
                thread = threading.Thread(target=self._serve, args=(sock,), name=f"{self._name}-peer", daemon=True)
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
        conn = PeerConnection(sock, self._limits)
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

    A lock file beside the socket, held with ``flock`` (released by the kernel however its holder
    exits), says whether a live owner holds the path: if one does, opening raises ``OwnerAlreadyServing``
    instead of unlinking a live owner's socket; else a socket file left at the path is stale and replaced.
    ``close()`` removes the lock file while still holding it, so whoever opened it before sees, once it
    holds the lock, that the path no longer names its file, and starts over. The lock file is never
    followed through a link. A child forked without exec inherits the lock: it is released only when
    both have exited.
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


def is_served(path: str) -> bool:
    """Whether a live process serves ``path`` now (holds its lock file): a look
    before claiming it, which a claim made meanwhile may still beat."""
    try:
        fd = open_private_file(path + ".lock", os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        return not try_lock(fd, shared=True)
    finally:
        os.close(fd)


def _lock_or_raise(lock_path: str, path: str) -> int:
    """Hold ``lock_path``'s file with ``flock``; the fd is returned once the path names it."""
    while True:
        fd = open_private_file(lock_path, os.O_RDWR | os.O_CREAT)
        try:
            locked = try_lock(fd)
        except BaseException:
            os.close(fd)
            raise
        if not locked:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise OwnerAlreadyServing(
                f"{path} is served by a live process (pid {holder}, holding {lock_path}); "
                "stop it first or give this frontend another id"
            )
        with contextlib.suppress(FileNotFoundError):
            if os.lstat(lock_path).st_ino == os.fstat(fd).st_ino:
                break
        # The previous holder removed the file between our open and our lock.
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd

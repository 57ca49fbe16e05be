"""The peer's side: call an owner's ``encode`` through an authenticated proxy.

``EncodeProxy`` replaces ``BaseProxy``, which makes three handshakes per
proxy (create, incref, decref), has finalizers that hang against a stopped
owner, and shares one connection per thread among every proxy: here each
thread keeps one persistent connection per owner, nothing is reference
counted, every step is bounded by the call's deadline, and a connection
that timed out is dropped.
"""

from __future__ import annotations

import pickle
import socket
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from multiprocessing import AuthenticationError
from typing import Any

from mptok.core.ids import INT32
from mptok.core.protocol import PeerReply
from mptok.transport.mp_private import ACCEPT_CONNECTION, authenticate_to_owner
from mptok.transport.wire import (
    CLOSE_TIMEOUT_S,
    ENCODE_TYPEID,
    MAX_MESSAGE_BYTES,
    MessageTooLarge,
    OwnerError,
    OwnerTimeout,
    OwnerUnreachable,
    TimedConnection,
    TransportError,
    left_or_zero,
    time_left,
)

# How long a call to an owner may take, unless its caller says otherwise: the
# default of mptok serve's --route-timeout.
CALL_TIMEOUT_S = 5.0


class _StaleConnection(OwnerUnreachable):
    """A reused connection turned out dead: the owner restarted or closed it idle."""


class _Once:
    """Runs ``fn`` the first time it is called, and never again (None: never)."""

    def __init__(self, fn: Callable[[], None] | None):
        self._fn = fn

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()


class _Link:
    """One thread's authenticated connection to one owner.

    ``in_use`` is held by the owning thread for the length of a call, and by
    ``EncodeProxy.close()`` to close the connection; ``abort()`` only wakes a
    call, so it needs no more than the short ``_guard``, which also keeps it
    from shutting down a descriptor that ``close()`` has released.
    """

    def __init__(self, conn: TimedConnection, incarnation: Hashable):
        self.conn: TimedConnection | None = conn
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

    ``encode_since`` raises ``OwnerTimeout``, ``OwnerUnreachable`` or
    ``OwnerError`` (or what its ``while_waiting`` raised) and nothing else,
    whatever the owner does. The ids of its reply are an int32
    ``memoryview`` of the bytes received (``np.asarray`` reads it without a copy).
    """

    def __init__(
        self, address: str, authkey: bytes, timeout_s: float = CALL_TIMEOUT_S, *, max_reply_bytes: int = MAX_MESSAGE_BYTES
    ):
        if not isinstance(authkey, bytes) or not authkey:
            raise ValueError("authkey must be non-empty bytes")
        if not timeout_s > 0:
            raise ValueError("timeout_s must be > 0")
        self.address = address
        self._key = authkey
        self._timeout_s = timeout_s
        self._max_reply_bytes = max_reply_bytes
        self._local = threading.local()
        self._links_lock = threading.Lock()
        # Weak: a thread's link goes (and its socket closes) with the thread.
        self._links: weakref.WeakSet[_Link] = weakref.WeakSet()
        self._closed = False

    def encode_since(
        self,
        text: str,
        key: str | None = None,
        *,
        since: int | None = None,
        shared_chars: int = 0,
        incarnation: Hashable = None,
        deadline: float | None = None,
        while_waiting: Callable[[], None] | None = None,
    ) -> PeerReply | None:
        """The owner's reply for a prompt of conversation ``key``.

        Without ``since``, ``text`` is the whole prompt. With it, the caller
        holds the ids of the conversation's version ``since`` and ``text``
        is the prompt after its first ``shared_chars`` characters, which it
        shares with that version (see ``mptok.routing.answer.answer_peer``);
        None means the owner cannot rebuild the prompt from that version.

        The call ends by ``deadline`` (a ``time.monotonic()`` instant) if
        given, else ``timeout_s`` from now: calls made for one prompt share
        one deadline.

        ``while_waiting`` runs once per call (it must not block): after the
        request is sent, while the owner works, or before connecting when
        the call needs a new connection (a handshake waits on the owner
        too). What it raises ends the call, drops its connection and reaches
        the caller as it is.
        """
        if deadline is None:
            deadline = time.monotonic() + self._timeout_s
        args = (text, key, since, shared_chars)
        pending = _Once(while_waiting)
        link = self._reusable_link(incarnation)
        if link is not None:
            try:
                return self._call(link, args, deadline, pending)
            except _StaleConnection:
                pass
        pending()  # a new connection's handshake waits on the owner too: before it
        return self._call(self._open(incarnation, deadline), args, deadline, pending)

    def abort(self) -> list[_Link]:
        """Fail calls in flight and later calls at once, without waiting; ``close()`` then frees the connections.

        Returns the connections to free (for ``close()``).
        """
        with self._links_lock:
            self._closed = True
            links = list(self._links)
        for link in links:
            link.abort()
        return links

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Close every thread's connection; calls in flight and later calls fail at once.

        Waits at most ``timeout_s`` in all for the calls in flight to let go
        of their connections.
        """
        links = self.abort()
        deadline = time.monotonic() + timeout_s
        for link in links:
            if link.in_use.acquire(timeout=left_or_zero(deadline)):
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

    def _call(self, link: _Link, args: tuple, deadline: float, while_waiting: _Once) -> PeerReply | None:
        with link.in_use:
            conn = link.conn
            if conn is None:
                raise _StaleConnection(f"connection to {self.address} was closed")
            conn.deadline = deadline
            self._step(link, conn.send, (ENCODE_TYPEID, "encode", args, {}))
            try:
                while_waiting()
            except BaseException:
                link.close()  # the reply, if it comes, is never read
                raise
            reply = self._step(link, conn.recv)
        return _reply_from(self.address, reply)

    def _step(self, link: _Link, step: Callable[..., Any], *args: Any) -> Any:
        """``step(*args)`` on ``link``'s connection; a failure drops the connection unless the stream is intact."""
        try:
            return step(*args)
        except (pickle.UnpicklingError, ValueError, TypeError) as e:
            # A whole message that is not a reply: the stream is intact.
            raise OwnerError(f"{self.address} sent no reply: {e!r}") from e
        except Exception as e:
            link.close()
            raise self._failure(e, "call", stale=_StaleConnection) from e

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

    def _connect(self, deadline: float) -> TimedConnection:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(time_left(deadline))
            sock.connect(self.address)
            conn = TimedConnection(sock, self._max_reply_bytes)
            conn.deadline = deadline
            authenticate_to_owner(conn, self._key)
            conn.send((None, ACCEPT_CONNECTION, ("mptok-peer",), {}))
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
            return OwnerTimeout(f"{step} with {self.address}: no answer by the deadline")
        if isinstance(e, MessageTooLarge):
            return OwnerError(f"{self.address}: {e}")
        if isinstance(e, AuthenticationError):
            return OwnerUnreachable(
                f"{step} with {self.address} failed: the authkey was refused, or it is not an owner ({e})"
            )
        if isinstance(e, (EOFError, OSError)):
            return stale(f"{step} with {self.address} failed: {e!r}")
        return OwnerUnreachable(f"{step} with {self.address} failed: {e!r}")


def _reply_from(address: str, reply: object) -> PeerReply | None:
    """The ``PeerReply`` an owner's ``('#RETURN', (version, reused, int32 bytes))`` carries, its ids
    an int32 ``memoryview`` of those bytes; None for ``('#RETURN', None)``; else ``OwnerError``."""
    kind, result = reply if isinstance(reply, tuple) and len(reply) == 2 else (None, reply)
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
        try:
            ids = memoryview(result[2]).cast(INT32)  # the received bytes themselves, no copy
        except TypeError as e:
            raise OwnerError(f"{address} sent {len(result[2])} bytes, not int32 ids") from e
        return PeerReply(result[0], result[1], ids)
    if kind == "#RETURN" and isinstance(result, str):
        raise OwnerError(f"{address} could not tokenize the prompt: {result}")
    raise OwnerError(f"{address} answered {kind!r}: {str(result)[:200]}")

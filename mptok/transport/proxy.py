"""The peer's side: call an owner's ``encode`` through an authenticated proxy.

``EncodeProxy`` replaces ``BaseProxy`` (docs/ROUTING.md, "The manager"):
one persistent connection per thread per owner, nothing reference counted,
every step bounded by the call's ``Deadline``. A call is two steps the
caller drives, ``send`` and then ``SentRequest.reply``; between them the
caller may do its own work while the owner does its own (routing checks
the owner's liveness there); nothing here calls back up.
"""

from __future__ import annotations

import contextlib
import pickle
import socket
import threading
import weakref
from collections.abc import Hashable
from multiprocessing import AuthenticationError
from types import TracebackType
from typing import Any

from mptok.core.deadline import Deadline
from mptok.core.protocol import PeerReply, PeerRequest
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
)

# How long a call to an owner may take, unless its caller says otherwise: the
# default of mptok serve's --route-timeout.
CALL_TIMEOUT_S = 5.0


class _StaleConnection(OwnerUnreachable):
    """A reused connection turned out dead: the owner restarted or closed it idle."""


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

    Each thread keeps one authenticated connection to the owner. Every step
    ends by the call's deadline; a call that times out drops its connection,
    so a late reply is never read as the answer to a later call. A reused
    connection that turns out dead (the owner restarted, or closed it idle) is
    replaced once, by the same deadline; ``incarnation`` (any hashable naming
    the owner process the caller expects) drops connections made to an owner
    since replaced. ``send``, ``SentRequest.reply`` and ``ask`` raise
    ``OwnerTimeout``, ``OwnerUnreachable`` or ``OwnerError`` and nothing else.
    """

    def __init__(self, address: str, authkey: bytes, timeout_s: float = CALL_TIMEOUT_S):
        if not isinstance(authkey, bytes) or not authkey:
            raise ValueError("authkey must be non-empty bytes")
        if not timeout_s > 0:
            raise ValueError("timeout_s must be > 0")
        self.address = address
        self._key = authkey
        self._timeout_s = timeout_s
        self._local = threading.local()
        self._links_lock = threading.Lock()
        # Weak: a thread's link goes (and its socket closes) with the thread.
        self._links: weakref.WeakSet[_Link] = weakref.WeakSet()
        self._closed = False

    def ask(self, request: PeerRequest, deadline: Deadline | None = None, incarnation: Hashable = None) -> PeerReply | None:
        """``send`` and read the reply at once: the owner's ``PeerReply``, or
        None when ``request`` is a delta whose fingerprint matches nothing it keeps."""
        with self.send(request, deadline, incarnation) as sent:
            return sent.reply()

    def send(self, request: PeerRequest, deadline: Deadline | None = None, incarnation: Hashable = None) -> SentRequest:
        """Send ``request`` on this thread's connection (made first, by
        ``deadline``, if there is none), and return the call, whose reply is
        read by the same ``deadline`` (default: ``timeout_s`` from now). Use
        the result in a ``with`` block: leaving it unread drops the
        connection (the owner's late reply is never read)."""
        if deadline is None:
            deadline = Deadline.after(self._timeout_s)
        link = self._reusable_link(incarnation)
        if link is not None:
            with contextlib.suppress(_StaleConnection):
                return SentRequest(self, self._send_on(link, request, deadline), request, deadline, incarnation, reused=True)
        return SentRequest(self, self._send_fresh(request, deadline, incarnation), request, deadline, incarnation, reused=False)

    def connected(self, incarnation: Hashable = None) -> bool:
        """Whether this thread holds a connection to the owner ``incarnation``
        names (a ``send`` then makes no handshake, which waits on the owner too)."""
        link: _Link | None = getattr(self._local, "link", None)
        return link is not None and link.conn is not None and link.incarnation == incarnation

    def abort(self) -> list[_Link]:
        """Fail calls in flight and later calls at once, without waiting; returns
        the connections for ``close()`` to free."""
        with self._links_lock:
            self._closed = True
            links = list(self._links)
        for link in links:
            link.abort()
        return links

    def close(self, deadline: Deadline | None = None) -> None:
        """Close every thread's connection; calls in flight and later calls fail at
        once. Waits until ``deadline`` (default: ``CLOSE_TIMEOUT_S`` from now) at
        most, in all, for the calls in flight to let go of their connections."""
        links = self.abort()
        if deadline is None:
            deadline = Deadline.after(CLOSE_TIMEOUT_S)
        for link in links:
            if link.in_use.acquire(timeout=deadline.left()):
                try:
                    link.close()
                finally:
                    link.in_use.release()

    def _send_fresh(self, request: PeerRequest, deadline: Deadline, incarnation: Hashable) -> _Link:
        """Send on a new connection; returns it with its ``in_use`` held."""
        return self._send_on(self._open(incarnation, deadline), request, deadline)

    def _send_on(self, link: _Link, request: PeerRequest, deadline: Deadline) -> _Link:
        """Send on ``link`` (its reply is read by ``deadline`` too); returns it with its ``in_use``
        held, or raises with it released."""
        link.in_use.acquire()
        try:
            self._step(link, "send", (ENCODE_TYPEID, "encode", request.to_wire(), {}), deadline=deadline)
        except BaseException:
            link.in_use.release()
            raise
        return link

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

    def _step(self, link: _Link, step: str, *args: Any, deadline: Deadline | None = None) -> Any:
        """Method ``step`` (``send`` or ``recv``) of ``link``'s connection, whose ``in_use`` the caller
        holds, called with ``args`` (by ``deadline``, if given; else by the one it has); a failure drops
        the connection unless the stream is intact."""
        conn = link.conn
        if conn is None:
            raise _StaleConnection(f"connection to {self.address} was closed")
        if deadline is not None:
            conn.deadline = deadline
        try:
            return getattr(conn, step)(*args)
        except (pickle.UnpicklingError, ValueError, TypeError) as e:
            # A whole message that is not a reply: the stream is intact.
            raise OwnerError(f"{self.address} sent no reply: {e!r}") from e
        except Exception as e:
            link.close()
            raise self._failure(e, "call", conn.deadline, stale=_StaleConnection) from e

    def _open(self, incarnation: Hashable, deadline: Deadline) -> _Link:
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

    def _connect(self, deadline: Deadline) -> TimedConnection:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(deadline.left_or_raise())
            sock.connect(self.address)
            conn = TimedConnection(sock, MAX_MESSAGE_BYTES)
            conn.deadline = deadline
            authenticate_to_owner(conn, self._key)
            conn.send((None, ACCEPT_CONNECTION, ("mptok-peer",), {}))
            kind, result = conn.recv()
            if kind != "#RETURN":
                raise OwnerUnreachable(f"{self.address} refused the connection: {result!r:.200}")
        except Exception as e:
            sock.close()
            raise self._failure(e, "connection", deadline, stale=OwnerUnreachable) from e
        return conn

    def _failure(self, e: Exception, step: str, deadline: Deadline, *, stale: type[OwnerUnreachable]) -> TransportError:
        """What a failed ``step`` means to the caller; ``stale`` is for a lost connection."""
        if isinstance(e, TransportError):
            return e
        # Past the deadline, whatever broke the step is the deadline's doing:
        # a thread that waited for the GIL after its last check of the time
        # writes to an owner that has since ended the handshake by its own
        # clock (a broken pipe), and that is this call's timeout.
        if isinstance(e, TimeoutError) or deadline.passed:
            return OwnerTimeout(f"{step} with {self.address}: no answer by the deadline")
        if isinstance(e, MessageTooLarge):
            return OwnerError(f"{self.address}: {e}")
        if isinstance(e, AuthenticationError):
            return OwnerUnreachable(f"{step} with {self.address} failed: the authkey was refused, or it is not an owner ({e})")
        if isinstance(e, (EOFError, OSError)):
            return stale(f"{step} with {self.address} failed: {e!r}")
        return OwnerUnreachable(f"{step} with {self.address} failed: {e!r}")


class SentRequest:
    """A request on its way to an owner; ``reply()`` reads the answer. Leaving
    the ``with`` block without it (the caller gave up) drops the connection,
    so the late reply is never read."""

    def __init__(
        self, proxy: EncodeProxy, link: _Link, request: PeerRequest, deadline: Deadline, incarnation: Hashable, *, reused: bool
    ):
        self._proxy, self._request = proxy, request
        self._link: _Link | None = link
        self._deadline, self._incarnation, self._reused = deadline, incarnation, reused
        self._answered = False

    def reply(self) -> PeerReply | None:
        """The owner's reply, or None for a delta whose fingerprint matches nothing it keeps."""
        assert self._link is not None, "a reply is read once, inside the with block"
        try:
            message = self._proxy._step(self._link, "recv")
        except _StaleConnection:
            if not self._reused:
                raise
            # The owner closed a reused connection (it restarted, or it was
            # idle): once more on a new one, by the same deadline.
            self._release()
            self._reused = False
            self._link = self._proxy._send_fresh(self._request, self._deadline, self._incarnation)
            message = self._proxy._step(self._link, "recv")
        self._answered = True  # whatever it says, the stream is intact
        return _reply_from(self._proxy.address, message)

    def __enter__(self) -> SentRequest:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._link is not None and not self._answered:
            self._link.close()  # the reply, if it comes, is never read
        self._release()

    def _release(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            link.in_use.release()


def _reply_from(address: str, reply: object) -> PeerReply | None:
    """The ``PeerReply`` an owner's ``('#RETURN', reply)`` carries; None for
    ``('#RETURN', None)``; else ``OwnerError``."""
    kind, result = reply if isinstance(reply, tuple) and len(reply) == 2 else (None, reply)
    if kind == "#RETURN" and result is None:
        return None
    if kind == "#RETURN" and isinstance(result, str):
        raise OwnerError(f"{address} could not tokenize the prompt: {result}")
    if kind != "#RETURN":
        raise OwnerError(f"{address} answered {kind!r}: {str(result)[:200]}")
    try:
        return PeerReply.from_wire(result)
    except ValueError as e:
        raise OwnerError(f"{address} answered: {e}") from e

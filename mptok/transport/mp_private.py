"""The one place that touches ``multiprocessing``'s private surface.

mptok keeps the manager protocol, its authkey handshake, its registry and
its per-request dispatch (``Server.serve_client``), and replaces the parts
that cannot run inside a serving frontend (see docs/ROUTING.md). Doing so
means overriding and calling names CPython does not document and may change
in any release. They are all here, behind names of mptok's own, so that the
other transport modules use none of them, and
``tests/test_transport.py::test_the_private_surface_mp_private_relies_on_is_unchanged``
(run on 3.11, 3.12 and 3.13 by ``make test-versions``) fails in one place
when a CPython upgrade moves one. ``PRIVATE_SURFACE`` is the same list in a
form that test checks.

``multiprocessing.connection``:

* ``deliver_challenge(connection, authkey)`` and
  ``answer_challenge(connection, authkey)``: the mutual HMAC handshake
  (3.11's format, and 3.12+'s ``{sha256}`` negotiation), undocumented and
  outside ``__all__``: ``authenticate_client``/``authenticate_to_owner``.
  They call only ``send_bytes`` and ``recv_bytes(maxlength)`` on the
  connection, which ``mptok.transport.wire.TimedConnection`` provides.

``multiprocessing.process``:

* ``AuthenticationString``: the type ``Server.authkey`` has (it refuses to
  be pickled).

``multiprocessing.managers``:

* ``Server``, an undocumented class, subclassed as ``OwnerServer``.
  ``Server.__init__`` is not called (it binds a ``Listener`` with a backlog
  of 16 or 128); the fields it sets are set by hand instead: ``registry``,
  ``address``, ``authkey``, ``id_to_obj``, ``id_to_refcount``,
  ``id_to_local_proxy_obj``, ``mutex``; and ``stop_event``, which
  ``Server.serve_forever`` sets and ``serve_client`` reads.
* ``Server.serve_client(conn)``: the per-request dispatch, with its check
  of exposed methods, reused as it is; it ends its thread with
  ``sys.exit()`` on EOF.
* ``Server.handle_request(conn)`` and ``Server.accept_connection(c, name)``:
  overridden (``serve_peer``: a handshake bounded by the connection's
  deadline, then only ``accept_connection``; the thread is not renamed
  after what the peer sent).
* ``Server.public`` and ``Server.fallback_mapping``: overridden to expose
  only ``accept_connection`` and no ``#GETVALUE``/``__str__``/``__repr__``
  fallbacks.
* ``BaseManager._registry``: the class's registry, written by
  ``register()``; ``InProcessManager.for_owner()`` gives each owner a class
  with its own.
* ``BaseManager._address``, ``_authkey``, ``_state`` and ``State``
  (``INITIAL``, ``STARTED``, ``SHUTDOWN``): what ``BaseManager.__init__``
  sets, read to build the server and kept current so that ``with manager:``
  and ``BaseManager``'s own checks see the right state.
* ``BaseManager.get_server()``: overridden, since the stock one builds a
  ``Server`` whatever ``_Server`` says.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import connection, process
from multiprocessing.managers import BaseManager, Server, State
from typing import Any, Self

from mptok.core.counting import Counters
from mptok.transport.wire import PeerConnection, TimedConnection

logger = logging.getLogger(__name__)

ACCEPT_CONNECTION = "accept_connection"


@dataclass(frozen=True)
class PrivateName:
    """One private name this module relies on, as ``PRIVATE_SURFACE`` lists it.

    kind: "override" (a method overridden here, whose parameters must stay
    exactly ``parameters``), "call" (called here: its first parameters must
    be ``parameters``, any others optional), "attribute" (a class attribute
    read or overridden), "field" (an instance field the class's
    ``__init__`` sets) or "read by serve_client" (a field
    ``Server.serve_client`` reads that ``OwnerServer`` sets by hand).
    """

    owner: Any
    name: str
    kind: str
    parameters: tuple[str, ...] = ()


PRIVATE_SURFACE: tuple[PrivateName, ...] = (
    PrivateName(connection, "deliver_challenge", "call", ("connection", "authkey")),
    PrivateName(connection, "answer_challenge", "call", ("connection", "authkey")),
    PrivateName(process, "AuthenticationString", "attribute"),
    PrivateName(Server, "serve_client", "call", ("self", "conn")),
    PrivateName(Server, "handle_request", "override", ("self", "conn")),
    PrivateName(Server, "accept_connection", "override", ("self", "c", "name")),
    PrivateName(Server, "public", "attribute"),
    PrivateName(Server, "fallback_mapping", "attribute"),
    *(
        PrivateName(Server, field, "field")
        for field in ("registry", "address", "authkey", "id_to_obj", "id_to_refcount", "id_to_local_proxy_obj", "mutex")
    ),
    PrivateName(Server, "stop_event", "read by serve_client"),
    PrivateName(BaseManager, "_registry", "attribute"),
    *(PrivateName(BaseManager, field, "field") for field in ("_address", "_authkey", "_state")),
    *(PrivateName(State, name, "attribute") for name in ("INITIAL", "STARTED", "SHUTDOWN")),
    PrivateName(BaseManager, "get_server", "override", ("self",)),
)


def authenticate_client(conn: TimedConnection, authkey: bytes) -> None:
    """The owner's half of the mutual authkey handshake; raises ``AuthenticationError`` on a wrong key."""
    connection.deliver_challenge(conn, authkey)
    connection.answer_challenge(conn, authkey)


def authenticate_to_owner(conn: TimedConnection, authkey: bytes) -> None:
    """The peer's half of the mutual authkey handshake; raises ``AuthenticationError`` on a wrong key."""
    connection.answer_challenge(conn, authkey)
    connection.deliver_challenge(conn, authkey)


class OwnerServer(Server):
    """The manager ``Server`` of one owner: authenticates peers, dispatches their
    calls (``serve_client``) to objects built once, when the server is, and
    published under their typeid as ident: peers need no ``create`` and hold
    no references."""

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

    def served_objects(self) -> list[object]:
        """The objects served, one per registered typeid."""
        return [entry[0] for ident, entry in self.id_to_obj.items() if ident != "0"]

    def handle_request(self, conn: PeerConnection) -> None:
        self.serve_peer(conn)

    def serve_peer(self, conn: PeerConnection) -> None:
        """Authenticate ``conn`` (within whatever bound it has), then serve it until it ends."""
        try:
            authenticate_client(conn, self.authkey)
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

    def accept_connection(self, c: PeerConnection, name: str | None = None) -> None:
        """Serve ``c``'s calls until EOF, an I/O timeout or ``stop()``, without
        renaming the thread after the name the peer sent."""
        c.start_serving()
        c.send(("#RETURN", None))
        # serve_client ends its thread with sys.exit() on EOF or a failed send.
        with contextlib.suppress(SystemExit):
            self.serve_client(c)


class InProcessManager(BaseManager):
    """A ``BaseManager`` whose ``OwnerServer`` serves from this process.

    ``start()`` builds the server and hands it to ``_start_listening``;
    ``shutdown()`` stops it and calls ``_stop_listening``: a subclass
    provides both. Neither spawns nor connects to a process.
    """

    def __init__(self, address: str, authkey: bytes):
        if not isinstance(authkey, bytes) or not authkey:
            raise ValueError("authkey must be non-empty bytes")
        super().__init__(address=address, authkey=authkey)
        self._lifecycle = threading.Lock()
        self._owner_server: OwnerServer | None = None

    @classmethod
    def for_owner(cls) -> type[Self]:
        """A new subclass with an empty registry of its own."""
        return type(cls.__name__, (cls,), {"_registry": {}, "__module__": cls.__module__})

    def get_server(self) -> OwnerServer:
        return OwnerServer(self._registry, self._address, bytes(self._authkey))

    def start(self) -> None:  # type: ignore[override]
        """Start serving from this process; returns once ``_start_listening`` has."""
        with self._lifecycle:
            if self._state.value != State.INITIAL:
                raise RuntimeError(f"a {type(self).__name__} starts once")
            server = self.get_server()
            self._start_listening(server)
            self._owner_server = server
            self._state.value = State.STARTED

    def shutdown(self, timeout_s: float | None = None) -> bool:  # type: ignore[override]
        """Stop serving (idempotent); returns what ``_stop_listening(timeout_s)`` does."""
        with self._lifecycle:
            if self._state.value != State.STARTED:
                self._state.value = State.SHUTDOWN
                return True
            self._state.value = State.SHUTDOWN
            assert self._owner_server is not None
            self._owner_server.stop_event.set()  # connections end after the request they are serving
            return self._stop_listening(timeout_s)

    def _start_listening(self, server: OwnerServer) -> None:
        raise NotImplementedError

    def _stop_listening(self, timeout_s: float | None) -> bool:
        raise NotImplementedError

    def server(self) -> OwnerServer | None:
        """The server, once started."""
        return self._owner_server

    def connect(self) -> None:
        raise NotImplementedError("peers call an owner through EncodeProxy")

"""The owner's side: serve this frontend's cache to its peers from this process's threads.

``serve_encode`` starts a ``TokenizeManager``, which joins the manager of
``mptok.transport.mp_private`` (a registry per owner, and a server that
authenticates a peer within a bound, then dispatches only ``encode``) to the
``Listener`` of ``mptok.transport.listener`` (the socket file, the accept
loop, the connection cap and the time limits). The object served is
``_EncodeService``: ``encode`` and nothing else.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from mptok.core.counting import Counters, Histogram
from mptok.core.protocol import PeerReply, PeerRequest
from mptok.transport.listener import Listener
from mptok.transport.mp_private import InProcessManager, OwnerServer
from mptok.transport.wire import ENCODE_TYPEID, ServerLimits

logger = logging.getLogger(__name__)


# What an owner runs for a peer's request (``mptok.routing.owners.PeerService.answer``):
# the reply, or None when a delta's fingerprint matches no prompt kept here.
PeerAnswer = Callable[[PeerRequest], PeerReply | None]


class _EncodeService:
    """The object an owner serves: ``encode`` and nothing else.

    ``encode(*PeerRequest.to_wire())`` returns ``PeerReply.to_wire()``; None
    when the request's fingerprint matches no prompt the owner keeps; or a str
    saying why the owner could not tokenize the text (the peer then tokenizes
    it itself). It never raises: the peer would refuse to unpickle an exception.
    """

    def __init__(self, answer: PeerAnswer):
        self._answer = answer
        self.counters = Counters(("served", "served_since", "serve_errors"))
        # The owner's own work per answered call, without the transport:
        # beside the peers' mptok_route_seconds, what a crossing costs.
        self.serve_seconds = Histogram()

    def encode(self, *args: object) -> tuple | str | None:
        started = time.perf_counter()
        try:
            request = PeerRequest.from_wire(args)
            reply = self._answer(request)
            packed = None if reply is None else reply.to_wire()
        except Exception as e:
            self.counters.add("serve_errors")
            logger.debug("could not tokenize a prompt for a peer: %r", e)
            return f"{type(e).__name__}: {e}"
        self.serve_seconds.observe(time.perf_counter() - started)
        self.counters.add_each("served", *(("served_since",) if request.delta and packed is not None else ()))
        return packed


class TokenizeManager(InProcessManager):
    """A ``BaseManager`` that serves its registered objects from this process's threads.

    ``start()`` binds the Unix socket at ``address`` (0600; raises
    ``OwnerAlreadyServing`` if a live process serves it) and returns once it
    listens, spawning no process; ``shutdown()`` stops accepting, ends every
    connection, joins every thread within ``limits.close_timeout_s`` and
    removes the socket file. Register on a class from ``for_owner()``, one per
    owner (the registry is the class's). Peers call with ``EncodeProxy``.
    """

    def __init__(self, address: str, authkey: bytes, limits: ServerLimits | None = None, *, name: str = "mptok-owner"):
        super().__init__(address, authkey)
        self._limits = limits if limits is not None else ServerLimits()
        self._name = name
        self._listener: Listener | None = None

    def _start_listening(self, server: OwnerServer) -> None:
        self._listener = Listener(self.address, server.serve_peer, self._limits, self._name)

    def _stop_listening(self, timeout_s: float | None) -> bool:
        """Returns whether every thread ended in time (default budget: ``limits.close_timeout_s``)."""
        assert self._listener is not None
        return self._listener.close(self._limits.close_timeout_s if timeout_s is None else timeout_s)

    def stats(self) -> dict[str, int]:
        """Counters of the server, its listener and the ``encode`` service."""
        server = self.server()
        if server is None or self._listener is None:
            return {}
        return {**server.counters.snapshot(), **self._listener.stats(), **self._service(server).counters.snapshot()}

    def timings(self) -> dict[str, dict[str, Any]]:
        """``serve_seconds``: the ``Histogram.snapshot()`` of the owner's own work per answered call."""
        server = self.server()
        return {} if server is None else {"serve_seconds": self._service(server).serve_seconds.snapshot()}

    @staticmethod
    def _service(server: OwnerServer) -> _EncodeService:
        (service,) = server.served_objects()
        assert isinstance(service, _EncodeService)
        return service


def serve_encode(
    address: str, answer: PeerAnswer, authkey: bytes, limits: ServerLimits | None = None, *, name: str = "mptok-owner",
) -> TokenizeManager:
    """Serve ``answer`` as ``encode`` at ``address`` to peers that know
    ``authkey``, on the manager's threads, concurrently; returns the started
    manager (``shutdown()`` it when done)."""
    manager_class = TokenizeManager.for_owner()
    service = _EncodeService(answer)
    manager_class.register(ENCODE_TYPEID, callable=lambda: service, exposed=("encode",), create_method=False)
    manager = manager_class(address, authkey, limits, name=name)
    manager.start()
    return manager

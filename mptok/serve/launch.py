"""What the supervisor needs to start a tokenizing frontend, without loading one.

The supervisor only checks the port and spawns frontends. Importing
``mptok.serve.frontend`` there would load the HTTP stack, numpy, the cache,
the transport and ``tokenizers`` into a process that uses none of them, and
pickling the spawn target or its settings by reference would import it.
So the target, the settings it crosses the spawn pipe with and the port's
socket live here, and the frontend module is imported in the child only.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from mptok.serve.options import ServeOptions


@dataclass(frozen=True)
class FrontendSettings:
    """What one frontend process needs to start; picklable (it crosses the spawn pipe).

    ``options`` are the command line's (``mptok.serve.options``), with the
    port the supervisor bound (never 0). The authkey is not in here: it
    travels as its own Process argument and is never logged.
    """

    frontend_id: int
    ipc_dir: str
    chat_template: str | None  # the template's source, read by the supervisor
    options: ServeOptions


def run_frontend(settings: FrontendSettings, authkey: bytes, ready: Any, listener: socket.socket) -> None:
    """The supervisor's spawn target: ``mptok.serve.frontend.frontend_main``, imported in the child."""
    from mptok.serve.frontend import frontend_main

    frontend_main(settings, authkey, ready, listener)


def tcp_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not listening yet), SO_REUSEADDR set.

    No SO_REUSEPORT: the bind fails while anyone listens on the port (an
    SO_REUSEPORT bind would quietly share a port another server of this
    user holds).
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def listening_socket(host: str, port: int) -> socket.socket:
    """The one socket every frontend accepts from: ``tcp_socket``, listening.

    The supervisor makes it and each frontend gets a duplicate of it (a
    spawn argument). Frontends that share one listening socket take
    connections as they are free to: a frontend waiting on its event loop
    accepts the next connection while a busy one is still in a request.
    Sockets of their own in one SO_REUSEPORT group would each be handed
    connections by a hash of the client's address, busy or not, so one
    frontend could have a queue while another has nothing to do.
    """
    sock = tcp_socket(host, port)
    try:
        # SOMAXCONN: the kernel's cap; each frontend's server asks for its
        # own backlog again when it starts accepting.
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock

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


def run_frontend(settings: FrontendSettings, authkey: bytes, ready: Any) -> None:
    """The supervisor's spawn target: ``mptok.serve.frontend.frontend_main``, imported in the child."""
    from mptok.serve.frontend import frontend_main

    frontend_main(settings, authkey, ready)


def tcp_socket(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not listening yet), SO_REUSEADDR set.

    With ``reuse_port`` it joins the port's SO_REUSEPORT group, as every
    frontend does; without, the bind fails while anyone listens on the port,
    which is how the supervisor checks that the port is free.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock

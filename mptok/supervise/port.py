"""The port's one listening socket, which every process of a server accepts from.

The supervisor binds and listens before it starts anything, and hands each
process a duplicate of this socket (a spawn argument). Processes that share
one listening socket take connections as they are free to: one waiting on
its event loop accepts the next connection while a busy one is still in a
request. Sockets of their own in one SO_REUSEPORT group would each be
handed connections by a hash of the client's address, busy or not, so one
process could have a queue while another has nothing to do.
"""

from __future__ import annotations

import socket


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``, SO_REUSEADDR set, listening.

    No SO_REUSEPORT: the bind fails while anyone listens on the port (an
    SO_REUSEPORT bind would quietly share a port another server of this
    user holds). The backlog is the kernel's cap (SOMAXCONN); each
    frontend's server asks for its own again when it starts accepting.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock

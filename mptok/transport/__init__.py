"""Serve one frontend's prefix-token cache to the other frontends of a server.

The shape of ``multiprocessing.managers`` over a Unix socket, with the
parts that cannot run inside a serving frontend replaced (docs/ROUTING.md,
"The manager"): the owner's end (``owner``, on ``listener``), the peer's
(``proxy``), what both share (``wire``), and ``mp_private``, the only module
that touches ``multiprocessing``'s private surface.
"""

from mptok.transport.listener import OwnerAlreadyServing, is_served
from mptok.transport.owner import TokenizeManager, serve_encode
from mptok.transport.proxy import EncodeProxy
from mptok.transport.wire import (
    ENCODE_TYPEID,
    MessageTooLarge,
    OwnerError,
    OwnerTimeout,
    OwnerUnreachable,
    ServerLimits,
    socket_path,
)

__all__ = [
    "ENCODE_TYPEID",
    "EncodeProxy",
    "MessageTooLarge",
    "OwnerAlreadyServing",
    "OwnerError",
    "OwnerTimeout",
    "OwnerUnreachable",
    "ServerLimits",
    "TokenizeManager",
    "is_served",
    "serve_encode",
    "socket_path",
]

"""Serve one frontend's prefix-token cache to the other frontends of a server.

With several frontend processes behind one port, the kernel hands the turns
of a conversation to different processes, each with its own
``PrefixTokenCache``. The frontend that owns a conversation
(``mptok.routing``) therefore serves its cache to its peers, and a peer asks
the owner to tokenize that conversation's prompts rather than tokenizing a
200k-token history from scratch.

The shape is ``multiprocessing.managers``: a ``BaseManager`` subclass serves
``encode`` on a Unix socket, and peers call it through authenticated proxies
speaking the manager wire protocol (the mutual HMAC authkey handshake,
pickled ``(ident, method, args, kwds)`` requests, ``('#RETURN', result)``
replies). The stock machinery cannot run inside a serving frontend as it
is, so mptok keeps the protocol, the registry and the per-request dispatch
and replaces the rest: the owner's end (``owner``, on the socket and accept
loop of ``listener``), the peer's (``proxy``), what both share (``wire``),
and ``mp_private``, the only module that touches ``multiprocessing``'s
private surface. What crosses is ``mptok.core.protocol``'s ``PeerRequest``
and ``PeerReply``, each decoded once, on arrival.
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

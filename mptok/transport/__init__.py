"""Serve one frontend's prefix-token cache to the other frontends of a server.

With several frontend processes behind one port, the kernel hands the turns
of a conversation to different processes, each with its own
``PrefixTokenCache``. The frontend that owns a conversation
(``mptok.routing``) therefore serves its cache to its peers, and a peer asks
the owner to tokenize that conversation's prompts rather than tokenizing a
200k-token history from scratch.

The shape is ``multiprocessing.managers``: a ``BaseManager`` subclass serves
the cache's ``encode`` on a Unix socket, and peers call it through
authenticated proxies speaking the manager wire protocol (the mutual HMAC
authkey handshake, pickled ``(ident, method, args, kwds)`` requests,
``('#RETURN', result)`` replies). The stock machinery cannot run inside a
serving frontend as it is, so mptok keeps the protocol, the registry and the
per-request dispatch (``Server.serve_client``) and replaces the rest, each
end in its own module:

* ``mptok.transport.mp_private``: the only module that touches
  ``multiprocessing``'s private surface (the ``Server`` subclass, the
  registry, the handshake); its docstring lists
  every private name it relies on and why, and a test checks them on each
  Python version.
* ``mptok.transport.wire``: what both ends share. ``TimedConnection``
  speaks ``Connection``'s framing, which reads and writes with no
  timeout, with a deadline per message and a cap on its size.
* ``mptok.transport.listener``: the owner's socket file, accept loop,
  connection cap and time limits (``Listener``, ``ServerLimits``).
* ``mptok.transport.owner``: ``TokenizeManager`` and ``serve_encode``, the
  manager served from threads of the frontend itself on that listener.
* ``mptok.transport.proxy``: ``EncodeProxy``, which replaces ``BaseProxy``:
  one persistent connection per thread per owner, every step bounded by
  the call's ``Deadline``; a call is a ``send`` and a ``reply``, which the
  caller drives.

What crosses is ``mptok.core.protocol``'s ``PeerRequest`` and
``PeerReply``, each decoded once, on arrival.

Everything a caller needs is importable from ``mptok.transport``.
"""

from mptok.transport.listener import OwnerAlreadyServing, ServerLimits, is_served
from mptok.transport.owner import PeerAnswer, TokenizeManager, serve_encode
from mptok.transport.proxy import CALL_TIMEOUT_S, EncodeProxy, SentRequest
from mptok.transport.wire import (
    CLOSE_TIMEOUT_S,
    ENCODE_TYPEID,
    SOCKET_NAME,
    MessageTooLarge,
    OwnerError,
    OwnerTimeout,
    OwnerUnreachable,
    TransportError,
    socket_path,
)

__all__ = [
    "CALL_TIMEOUT_S",
    "CLOSE_TIMEOUT_S",
    "ENCODE_TYPEID",
    "SOCKET_NAME",
    "EncodeProxy",
    "MessageTooLarge",
    "OwnerAlreadyServing",
    "is_served",
    "OwnerError",
    "OwnerTimeout",
    "OwnerUnreachable",
    "PeerAnswer",
    "SentRequest",
    "ServerLimits",
    "TokenizeManager",
    "TransportError",
    "serve_encode",
    "socket_path",
]

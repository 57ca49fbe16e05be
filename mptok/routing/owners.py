"""Tokenize each conversation in the frontend process whose cache holds it.

With several frontends behind one port, the kernel hands each connection to
any of them, so consecutive turns of a conversation land in different
processes, each with its own ``PrefixTokenCache``, and a turn finds its
conversation cached only one time in F. Every frontend therefore serves its
cache to the others (``mptok.transport``) and sends each keyed prompt whose
conversation it keeps no copy of to the conversation's owner: the first
live frontend in the conversation's rendezvous order, which every process
computes alike. The owner's answer is kept here where there is room, so
the conversation's next turn to land here is extended here. While an owner is
down, every process sends its conversations to the same next frontend in
their order, whose cache then holds them; when the owner is back, they go
back to it. A prompt that no owner tokenizes in time is tokenized where it
arrived: routing changes where the work is done, never the ids.

Routing is a layer above the cache. ``TokenizationOwners`` holds the two
sides and their lifecycle: the asker's ``Router`` (``mptok.routing.router``),
which gives the ids or None ("tokenize it here"), and the owner's
``PeerService`` (``mptok.routing.answer``), which the transport serves to
the peers; its ``encode`` asks the router, then the local cache when the
router gave no ids. Nothing below calls back up.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

import numpy as np

from mptok.cache.protocols import TokenCache
from mptok.core.deadline import Deadline
from mptok.core.private_files import secure_ipc_dir
from mptok.routing.answer import PeerService, PeerWorkers
from mptok.routing.calibration import build_backend, seconds_per_char, typical_text
from mptok.routing.deadline import PATIENCE_FACTOR, RouteLimits
from mptok.routing.liveness import OwnerRecord, publish, unpublish
from mptok.routing.policy import KEPT, NEVER, POLICIES, routing_policy
from mptok.routing.router import Router
from mptok.routing.switch_interval import lower_switch_interval
from mptok.transport import OwnerAlreadyServing, ServerLimits, is_served, serve_encode, socket_path

__all__ = [
    "OwnerAlreadyServing",
    "ServerLimits",
    "TokenizationOwners",
    "lower_switch_interval",
    "seat_taken",
]


def seat_taken(ipc_dir: str, frontend_id: int) -> bool:
    """Whether a live process serves frontend id ``frontend_id`` in ``ipc_dir`` now."""
    return is_served(socket_path(ipc_dir, frontend_id))


class TokenizationOwners:
    """Serve this frontend's cache to its peers and route keyed prompts to their owners.

    ``encode(tokenizer, text, key)`` is the routed ``cache.encode`` (and
    ``encode_array`` the routed ``cache.encode_array``): the same ids,
    tokenized here when this frontend keeps the conversation (or owns
    it), else by the conversation's owner, another live frontend, whose
    answer this frontend keeps where there is room. It never fails
    because an owner did: a call that fails or runs past its deadline
    (``timeout_s``, and for a delta call this frontend's patience,
    ``mptok.routing.deadline``) is given up and the prompt tokenized here;
    an owner that timed out is skipped for ``backoff_s``. docs/ROUTING.md
    has the whole protocol: liveness checks, deadlines, the GIL, close.

    Starting builds the tokenizer's backend (1.5 s to 3 s for a large
    vocabulary) and, with peers to ask, learns what a character costs here
    at worst, for its patience (``mptok.routing.calibration``), then binds
    ``<ipc_dir>/tokenize-<frontend_id>.sock`` (raises
    ``OwnerAlreadyServing`` while a live process serves this frontend id,
    ``PermissionError`` for an ipc dir other users can enter) and publishes
    this process as the owner. ``close()`` (or leaving the ``with`` block)
    undoes it all within one time budget; it is idempotent. A process that
    serves peers should call ``lower_switch_interval()`` once at start.
    ``routing`` is the policy (``mptok.routing.policy``): "kept" (the
    default, or ``MPTOK_ROUTING``) extends here what this frontend keeps and
    routes the rest, "always" routes every prompt another frontend owns,
    "never" none. ``warm_thread`` (None for a
    tokenizer the cache does not serve) runs the cache's fast engines once
    on real text on the calling thread (``Engines.warm_this_thread``):
    what a pool of the frontend's own threads can run on each before it
    serves (``mptok.core.warm_threads``).
    """

    def __init__(
        self,
        ipc_dir: str,
        frontend_id: int,
        num_frontends: int,
        cache: TokenCache,
        tokenizer: Any,
        *,
        authkey: bytes,
        timeout_s: float = 5.0,
        backoff_s: float = 10.0,
        limits: ServerLimits | None = None,
        patience_factor: float = PATIENCE_FACTOR,
        routing: str | None = None,
    ):
        if not 0 <= frontend_id < num_frontends:
            raise ValueError(f"frontend_id {frontend_id} is not in range({num_frontends})")
        if not patience_factor >= 0:
            raise ValueError(f"patience_factor must be >= 0, got {patience_factor}")
        self._frontend_id = frontend_id
        self._ipc_dir = secure_ipc_dir(ipc_dir)
        self._cache = cache
        self.policy = routing_policy(routing)
        self._close_timeout_s = (limits if limits is not None else ServerLimits()).close_timeout_s
        self._close_lock = threading.Lock()
        self._closed = False
        # Peers may call as soon as the socket listens; an owner whose
        # tokenizer backend is still to be built (1.5 s to 3 s) would time
        # them out and be backed off from. So it is built first.
        backend = build_backend(tokenizer, cache.config.tokenizer_backend)
        # Patience is for asking peers: a lone frontend never does.
        worst_s_per_char = seconds_per_char(backend) if num_frontends > 1 and backend is not None else None
        route_limits = RouteLimits(
            timeout_s,
            backoff_s,
            patience_factor * worst_s_per_char if worst_s_per_char is not None and patience_factor > 0 else None,
        )
        self._router = Router(
            cache, tokenizer, frontend_id, num_frontends, self._ipc_dir, authkey, route_limits,
            routing=self.policy != NEVER, keep_copies=self.policy == KEPT,
        )
        # A fast engine builds per-thread state on a thread's first calls.
        self.warm_thread: Callable[[], object] | None = (
            functools.partial(backend.engines.warm_this_thread, typical_text()) if backend is not None else None
        )
        # Peers are answered on threads warmed here, before they can call.
        self._workers = PeerWorkers(
            PeerService(cache, tokenizer).answer, self.warm_thread, wait_s=timeout_s, name=f"mptok-peer-{frontend_id}"
        )
        address = socket_path(self._ipc_dir, frontend_id)
        try:
            self._manager = serve_encode(address, self._workers.answer, authkey, limits, name=f"mptok-owner-{frontend_id}")
        except BaseException:
            self._workers.close(Deadline.after(self._close_timeout_s))
            raise
        try:
            self._record: OwnerRecord = publish(self._ipc_dir, frontend_id, address)
        except BaseException:
            self._manager.shutdown()
            self._workers.close(Deadline.after(self._close_timeout_s))
            raise

    @property
    def frontend_id(self) -> int:
        return self._frontend_id

    def encode(self, tokenizer: Any, text: str, key: str | None = None) -> list[int]:
        """Exactly ``cache.encode(tokenizer, text, key)``'s ids, from the
        conversation's owner or from ``cache``: never fails because an owner
        did (see the class). Raises what ``cache.encode`` raises for bad input."""
        return self.encode_array(tokenizer, text, key).tolist()

    def encode_array(self, tokenizer: Any, text: str, key: str | None = None) -> np.ndarray:
        """``encode``'s ids as a 1-D int32 numpy array (``cache.encode_array``),
        for a caller that writes JSON or sends them on: no list is made."""
        ids = self._router.decide(tokenizer, text, key)
        return ids if ids is not None else self._cache.encode_array(tokenizer, text, key)

    def stats(self) -> dict[str, int]:
        """Counters since start, for /metrics.

        routed: prompts a peer tokenized. copies_kept: routed prompts whose
        ids this frontend also kept as its own copy (the kept policy, where
        that evicted nothing). kept_here: prompts another frontend owns,
        extended here because this frontend keeps a copy of their
        conversation (the kept policy). owned_here: prompts whose owner is
        this frontend. taken_over_here: prompts tokenized here because every
        frontend before this one in their order was skipped.
        route_failures: calls that failed (each also counts as
        fallback_timeout, fallback_patience or fallback_error; a call that
        failed to reach an owner the check then found gone counts as that
        skip instead). fallback_<reason>: owners skipped or failed, by reason.
        served, serve_errors,
        active_connections, accepted, refused, handshake_failures,
        refused_requests: this frontend as an owner. held_entries,
        held_bytes, held_max_bytes: the fingerprints of routed prompts held here.
        policy_<name>: 1 for the routing policy in force (``self.policy``), else 0.
        """
        policy = {f"policy_{name}": int(name == self.policy) for name in POLICIES}
        return {**self._router.stats(), **self._manager.stats(), **policy}

    def timings(self) -> dict[str, dict[str, Any]]:
        """Histogram snapshots since start, for /metrics.

        route_seconds: for each prompt a peer tokenized, from choosing its
        owner to holding its ids here (liveness check, transport, the
        owner's work); failed calls are not counted. serve_seconds: the
        owner's own work (its waits for a peer worker and for its GIL
        included, the transport not)
        for each call this frontend answered with ids or with None.
        """
        return {"route_seconds": self._router.route_seconds(), **self._manager.timings()}

    def close(self, timeout_s: float | None = None) -> None:
        """Stop routing and serving within ``timeout_s`` in all (default:
        ``limits.close_timeout_s``). There is no finalizer: call it (or use ``with``)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        deadline = Deadline.after(self._close_timeout_s if timeout_s is None else timeout_s)
        # Run last to first, each even if an earlier one raised: new prompts
        # stay here, peers stop choosing this owner, calls to peers fail
        # fast, then serving stops, then its workers. One deadline for all of it.
        with contextlib.ExitStack() as steps:
            steps.callback(self._workers.close, deadline)
            steps.callback(lambda: self._manager.shutdown(deadline.left()))
            steps.callback(self._router.close, deadline)
            steps.callback(unpublish, self._ipc_dir, self._frontend_id, self._record)
            self._router.stop()

    def __enter__(self) -> TokenizationOwners:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

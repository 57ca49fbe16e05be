"""Tokenize each conversation in the frontend process whose cache holds it.

With several frontends behind one port, the kernel hands each connection to
any of them, so consecutive turns of a conversation land in different
processes, each with its own ``PrefixTokenCache``, and a turn finds its
conversation cached only one time in F. Every frontend therefore serves its
cache to the others (``mptok.transport``) and sends each keyed prompt to the
conversation's owner: the first live frontend in the conversation's
rendezvous order, which every process computes alike. While an owner is
down, every process sends its conversations to the same next frontend in
their order, whose cache then holds them; when the owner is back, they go
back to it. A prompt that no owner tokenizes in time is tokenized where it
arrived: routing changes where the work is done, never the ids.

Routing is a layer above the cache. ``TokenizationOwners`` holds the two
sides and their lifecycle: the asker's ``Router`` (``mptok.routing.router``),
whose plain ``Decision`` is the owner's ids or "tokenize it here", and the
owner's ``PeerService`` (``mptok.routing.answer``), which the transport
serves to the peers; its ``encode`` asks the router, then the local cache
when the decision says so. Nothing below calls back up.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

import numpy as np

from mptok.core.deadline import Deadline
from mptok.core.private_files import secure_ipc_dir
from mptok.routing.answer import PeerService, PeerWorkers
from mptok.routing.calibration import build_backend, seconds_per_char, typical_text
from mptok.routing.crossing import CrossingCosts
from mptok.routing.deadline import PATIENCE_FACTOR, RouteLimits
from mptok.routing.liveness import OwnerRecord, publish, unpublish
from mptok.routing.policy import ALWAYS, CHEAPER, NEVER, POLICIES, routing_policy
from mptok.routing.router import RoutableCache, Router
from mptok.routing.switch_interval import lower_switch_interval
from mptok.transport import OwnerAlreadyServing, ServerLimits, is_served, serve_encode, socket_path

__all__ = [
    "OwnerAlreadyServing",
    "RoutableCache",
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
    tokenized by the conversation's owner when that is another live
    frontend and a call to it is expected to cost less than tokenizing the
    prompt here (``mptok.routing.crossing``), else here. It never fails
    because an owner did: a call that fails or runs past its deadline
    (``timeout_s``, and for a delta call this frontend's patience,
    ``mptok.routing.deadline``) is given up and the prompt tokenized here;
    an owner that timed out is skipped for ``backoff_s``. docs/ROUTING.md
    has the whole protocol: liveness checks, deadlines, the GIL, close.

    Starting builds the tokenizer's backend (1.5 s to 3 s for a large
    vocabulary) and, with peers to ask, learns what a character costs here
    (``mptok.routing.calibration``), then binds
    ``<ipc_dir>/tokenize-<frontend_id>.sock`` (raises
    ``OwnerAlreadyServing`` while a live process serves this frontend id,
    ``PermissionError`` for an ipc dir other users can enter) and publishes
    this process as the owner. ``close()`` (or leaving the ``with`` block)
    undoes it all within one time budget; it is idempotent. A process that
    serves peers should call ``lower_switch_interval()`` once at start.
    ``routing`` is the policy (``mptok.routing.policy``): "cheaper" (the
    default, or ``MPTOK_ROUTING``) weighs each crossing, "always" routes every
    prompt an owner can answer, "never" none; ``weigh_crossing=False`` is
    "always", as before there was a policy. ``warm_thread`` (None for a
    tokenizer the cache does not serve) runs the cache's fast engines once
    on real text on the calling thread (``TokenizerBackend.warm_this_thread``):
    what a pool of the frontend's own threads can run on each before it
    serves (``mptok.core.warm_threads``).
    """

    def __init__(
        self,
        ipc_dir: str,
        frontend_id: int,
        num_frontends: int,
        cache: RoutableCache,
        tokenizer: Any,
        *,
        authkey: bytes,
        timeout_s: float = 5.0,
        backoff_s: float = 10.0,
        limits: ServerLimits | None = None,
        patience_factor: float = PATIENCE_FACTOR,
        weigh_crossing: bool = True,
        routing: str | None = None,
    ):
        if not 0 <= frontend_id < num_frontends:
            raise ValueError(f"frontend_id {frontend_id} is not in range({num_frontends})")
        if not patience_factor >= 0:
            raise ValueError(f"patience_factor must be >= 0, got {patience_factor}")
        self._frontend_id = frontend_id
        self._ipc_dir = secure_ipc_dir(ipc_dir)
        self._cache = cache
        self.policy = routing_policy(routing if routing is not None or weigh_crossing else ALWAYS)
        self._close_timeout_s = (limits if limits is not None else ServerLimits()).close_timeout_s
        self._close_lock = threading.Lock()
        self._closed = False
        # Peers may call as soon as the socket listens; an owner whose
        # tokenizer backend is still to be built (1.5 s to 3 s) would time
        # them out and be backed off from. So it is built first.
        backend = build_backend(tokenizer, cache.config.tokenizer_backend)
        # Calibration is for asking peers: a lone frontend never does.
        calibrated = num_frontends > 1 and backend is not None
        worst_s_per_char = seconds_per_char(backend) if calibrated else None
        # Without weighing, every prompt an owner can answer is routed.
        weighing = calibrated and self.policy == CHEAPER
        route_limits = RouteLimits(
            timeout_s,
            backoff_s,
            patience_factor * worst_s_per_char if worst_s_per_char is not None and patience_factor > 0 else None,
        )
        sample = typical_text() if backend is not None else ""
        crossing = CrossingCosts(seconds_per_char(backend, sample) if weighing else None)
        self._router = Router(
            cache, tokenizer, frontend_id, num_frontends, self._ipc_dir, authkey, route_limits, crossing, routing=self.policy != NEVER
        )
        # A fast engine builds per-thread state on a thread's first calls.
        self.warm_thread: Callable[[], object] | None = (
            functools.partial(backend.warm_this_thread, sample) if backend is not None else None
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
        decision = self._router.decide(tokenizer, text, key)
        if decision.ids is not None:
            return decision.ids
        started = time.perf_counter()
        ids = self._cache.encode_array(tokenizer, text, key, room_only=decision.room_only)
        if decision.timed:
            self._router.tokenized_here(len(text), time.perf_counter() - started)
        return ids

    def stats(self) -> dict[str, int]:
        """Counters since start, for /metrics.

        routed: prompts a peer tokenized. copies_kept: routed prompts whose
        ids this frontend also kept as its own copy (the cheaper policy, where
        that evicted nothing). owned_here: prompts whose owner is
        this frontend. taken_over_here: prompts tokenized here because every
        frontend before this one in their order was skipped.
        route_failures: calls that failed (each also counts as
        fallback_timeout, fallback_patience or fallback_error; a call that
        failed to reach an owner the check then found gone counts as that
        skip instead). fallback_<reason>: owners skipped or failed, by reason.
        crossing_<choice>: for prompts this frontend could send its owner as
        a delta, whether it did because that was cheaper (route_cheaper), not
        yet known (route_unknown) or to refresh the estimate (route_probe), or
        tokenized it here because that was cheaper (local_cheaper) or because
        this frontend keeps a version of it (local_kept). served, serve_errors,
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

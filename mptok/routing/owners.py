"""Tokenize each conversation in the frontend process whose cache holds it.

With several frontends behind one port, consecutive turns of a
conversation land in different processes, each with its own
``PrefixTokenCache``. Every frontend therefore serves its cache to the
others (``mptok.transport``) and sends each keyed prompt whose conversation
it keeps no copy of to the conversation's owner, the first live frontend in
the conversation's rendezvous order (``mptok.routing.router``); a prompt
that no owner tokenizes in time is tokenized where it arrived: routing
changes where the work is done, never the ids. ``TokenizationOwners`` holds
both sides for one frontend and their lifecycle. The owner's side is here:
``PeerService`` answers a peer's ``PeerRequest`` in one cache call
(``extend_after``), on ``PeerWorkers``, a few threads warmed before peers
can call. The transport decodes the request and encodes the reply;
nothing below calls back up.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from types import TracebackType
from typing import Any

import numpy as np

from mptok.cache.protocols import TokenCache
from mptok.core.deadline import Deadline
from mptok.core.private_files import secure_ipc_dir
from mptok.core.protocol import Fingerprint, PeerReply, PeerRequest
from mptok.routing.calibration import build_backend, seconds_per_char, typical_text
from mptok.routing.liveness import OwnerRecord, publish, unpublish
from mptok.routing.policy import KEPT, NEVER, PATIENCE_FACTOR, POLICIES, ROUTE_TIMEOUT_S, routing_policy
from mptok.routing.router import RouteLimits, Router
from mptok.transport import OwnerAlreadyServing, ServerLimits, is_served, serve_encode, socket_path

__all__ = ["OwnerAlreadyServing", "ServerLimits", "TokenizationOwners", "lower_switch_interval", "seat_taken"]

logger = logging.getLogger(__name__)

# An owner's serving threads share its frontend's GIL: a peer's call waits
# about one switch interval for it while the main thread runs Python.
PEER_SWITCH_INTERVAL_S = 0.001


def lower_switch_interval(seconds: float = PEER_SWITCH_INTERVAL_S) -> None:
    """Lower this process's ``sys.setswitchinterval`` to ``seconds`` (never raise it), so
    that a peer's call waits about 1 ms instead of 5 ms for the GIL while the main
    thread runs Python. Process-wide: call it from the process's entry point
    (``mptok serve``'s frontends do; docs/ROUTING.md, "The GIL")."""
    if sys.getswitchinterval() > seconds:
        sys.setswitchinterval(seconds)


def seat_taken(ipc_dir: str, frontend_id: int) -> bool:
    """Whether a live process serves frontend id ``frontend_id`` in ``ipc_dir`` now."""
    return is_served(socket_path(ipc_dir, frontend_id))


# Threads answering peers: more than the cores cannot tokenize more at once
# (the engines release the GIL), and each one warms caches of its own.
PEER_WORKERS = max(1, min(4, os.cpu_count() or 1))
# Requests a connection's thread hands to the workers before it warms itself
# and answers its connection's later requests on its own.
HANDED_OVER_FIRST = 8


class PeerService:
    """This frontend's answers to its peers: ``cache`` tokenizing with ``tokenizer``."""

    def __init__(self, cache: TokenCache, tokenizer: Any):
        self._cache = cache
        self._tokenizer = tokenizer

    def answer(self, request: PeerRequest) -> PeerReply | None:
        """The reply to ``request``: all the prompt's ids, and whether it is kept
        here. None when a delta's fingerprint matches no prompt kept here; a
        prompt without a key has no fingerprint and is answered whole, not
        kept. Raises what ``cache.encode`` raises for bad input. Called on
        the transport's threads, concurrently."""
        if request.key is None:
            return None if request.delta else PeerReply(False, self._cache.encode_array(self._tokenizer, request.text))
        after = None
        if request.since is not None:
            after = Fingerprint.from_wire(request.since, request.shared_chars)
            if after is None:
                return None
        kept = self._cache.extend_after(self._tokenizer, request.text, request.key, after)
        return None if kept is None else PeerReply(kept.kept, kept.ids)


class PeerWorkers:
    """The threads that answer peers: a fixed few, each warmed once before peers can call.

    A fast engine builds per-thread state on a thread's first tokenizations,
    so a connection's thread hands its first requests to these and waits for
    each reply, until it has handed over ``HANDED_OVER_FIRST`` and warms itself
    (docs/ROUTING.md, "Peers are answered on a few warm threads"). An answer
    never routes, so owners waiting on each other's workers can never wait in
    a cycle. ``answer`` waits ``wait_s`` at most for a worker (past it, the peer
    has given up too), then raises ``TimeoutError``: the peer tokenizes itself.
    """

    def __init__(
        self, answer: Callable[[PeerRequest], PeerReply | None], warm: Callable[[], object] | None, *, wait_s: float, name: str
    ):
        if not wait_s > 0:
            raise ValueError("PeerWorkers needs wait_s > 0")
        self._answer = answer
        self._warm = warm
        self._wait_s = wait_s
        self._requests: queue.SimpleQueue[tuple[Future[PeerReply | None], PeerRequest] | None] = queue.SimpleQueue()
        self._warmed = threading.Semaphore(0)
        # Per connection thread: requests handed over, and whether it is warm.
        self._here = threading.local()
        # Daemons: a worker still in a tokenization when close() gives up
        # on it finishes it, touching nothing, and never holds up the exit.
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(PEER_WORKERS)]
        for thread in self._threads:
            thread.start()
        deadline = Deadline.after(wait_s)
        for _ in self._threads:
            if not self._warmed.acquire(timeout=deadline.left()):
                # Only the first calls pay for it later: peers are still answered.
                logger.warning("peer workers still warming after %g s; serving peers anyway", wait_s)
                break

    def answer(self, request: PeerRequest) -> PeerReply | None:
        """``answer(request)`` on a worker, or on the calling thread once it is
        warm; raises what it raises, or ``TimeoutError`` after ``wait_s`` without a worker's reply."""
        here = self._here
        if self._warm is None or getattr(here, "warm", False):
            return self._answer(request)
        future: Future[PeerReply | None] = Future()
        self._requests.put((future, request))
        here.handed = getattr(here, "handed", 0) + 1
        if here.handed >= HANDED_OVER_FIRST:
            self._warm_quietly()
            here.warm = True
        try:
            return future.result(timeout=self._wait_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no peer worker answered within {self._wait_s:g} s") from None

    def close(self, deadline: Deadline) -> None:
        """Fail the requests not yet started and stop the workers, waiting
        until ``deadline`` at most for one still in an answer."""
        while True:
            try:
                item = self._requests.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in self._threads:
            self._requests.put(None)
        for thread in self._threads:
            thread.join(deadline.left())

    def _warm_quietly(self) -> None:
        # A warm-up that fails costs only the first call's speed.
        try:
            if self._warm is not None:
                self._warm()
        except Exception:
            logger.warning("warming a thread that answers peers failed", exc_info=True)

    def _work(self) -> None:
        try:
            self._warm_quietly()
        finally:
            self._warmed.release()
        while (item := self._requests.get()) is not None:
            future, request = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._answer(request))
            except BaseException as e:  # the waiting connection thread raises it
                future.set_exception(e)


class TokenizationOwners:
    """Serve this frontend's cache to its peers and route keyed prompts to their owners.

    ``encode`` and ``encode_array`` are the routed ``cache.encode`` and
    ``cache.encode_array``: the same ids, tokenized here when this frontend
    keeps the conversation (or owns it), else by its owner, whose answer this
    frontend keeps where there is room. They never fail because an owner did:
    a call that fails or runs past its deadline (``timeout_s``, and for a delta
    call this frontend's patience) is given up and the prompt tokenized here;
    an owner that timed out is skipped for ``backoff_s`` (docs/ROUTING.md).

    Starting builds the tokenizer's backend, learns what a character costs
    here at worst (``mptok.routing.calibration``), binds
    ``<ipc_dir>/tokenize-<frontend_id>.sock`` (raises ``OwnerAlreadyServing``
    while a live process serves this id, ``PermissionError`` for an ipc dir
    other users can enter) and publishes this process as the owner; ``close()``
    (or leaving the ``with`` block) undoes it all within one time budget,
    idempotent. A process that serves peers should call
    ``lower_switch_interval()`` once. ``routing`` is the policy
    (``mptok.routing.policy``). ``warm_thread`` (None for a tokenizer the cache
    does not serve) runs the cache's fast engines once on real text on the
    calling thread, for a pool of the frontend's own threads before it serves.
    """

    def __init__(
        self, ipc_dir: str, frontend_id: int, num_frontends: int, cache: TokenCache, tokenizer: Any, *, authkey: bytes,
        timeout_s: float = ROUTE_TIMEOUT_S, backoff_s: float = 10.0, limits: ServerLimits | None = None,
        patience_factor: float = PATIENCE_FACTOR, routing: str | None = None,
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
            timeout_s, backoff_s,
            patience_factor * worst_s_per_char if worst_s_per_char is not None and patience_factor > 0 else None,
        )
        self._router = Router(
            cache, tokenizer, frontend_id, num_frontends, self._ipc_dir, authkey, route_limits,
            routing=self.policy != NEVER, keep_copies=self.policy == KEPT,
        )
        self.warm_thread: Callable[[], object] | None = (
            functools.partial(backend.engines.warm_this_thread, typical_text()) if backend is not None else None
        )
        self._workers = PeerWorkers(
            PeerService(cache, tokenizer).answer, self.warm_thread, wait_s=timeout_s, name=f"mptok-peer-{frontend_id}"
        )
        address = socket_path(self._ipc_dir, frontend_id)
        with contextlib.ExitStack() as undo:  # what has started stops if a later step raises
            undo.callback(lambda: self._workers.close(Deadline.after(self._close_timeout_s)))
            self._manager = serve_encode(address, self._workers.answer, authkey, limits, name=f"mptok-owner-{frontend_id}")
            undo.callback(self._manager.shutdown)
            self._record: OwnerRecord = publish(self._ipc_dir, frontend_id, address)
            undo.pop_all()

    @property
    def frontend_id(self) -> int:
        return self._frontend_id

    def encode(self, tokenizer: Any, text: str, key: str | None = None, deadline: Deadline | None = None) -> list[int]:
        """Exactly ``cache.encode(tokenizer, text, key)``'s ids, from the
        conversation's owner or from ``cache``: never fails because an owner
        did (see the class). No owner is waited on past ``deadline`` (the
        caller's, e.g. from the request's arrival) nor past the route's own
        limits; the prompt is then tokenized here. Raises what
        ``cache.encode`` raises for bad input."""
        return self.encode_array(tokenizer, text, key, deadline).tolist()

    def encode_array(self, tokenizer: Any, text: str, key: str | None = None, deadline: Deadline | None = None) -> np.ndarray:
        """``encode``'s ids as a 1-D int32 numpy array (``cache.encode_array``),
        for a caller that writes JSON or sends them on: no list is made."""
        ids = self._router.decide(tokenizer, text, key, deadline)
        return ids if ids is not None else self._cache.encode_array(tokenizer, text, key)

    def stats(self) -> dict[str, int]:
        """Counters since start, for /metrics (``mptok.front.catalogue`` says what
        each means): the router's, the owner's (``served``, ``serve_errors``, the
        connections) and ``policy_<name>``, 1 for the policy in force."""
        policy = {f"policy_{name}": int(name == self.policy) for name in POLICIES}
        return {**self._router.stats(), **self._manager.stats(), **policy}

    def timings(self) -> dict[str, dict[str, Any]]:
        """Histogram snapshots since start, for /metrics (``mptok.front.catalogue``):
        ``route_seconds``, the routed prompts' (failed calls not counted), and
        ``serve_seconds``, the owner's own work per call it answered."""
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

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

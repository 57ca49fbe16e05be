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

Routing is a layer above the cache: ``TokenizationOwners.encode`` either
asks the owner (through the peer delta protocol, ``mptok.routing.held``) or calls
the local cache's ``encode``; the cache never calls back up. The owner side
of the transport answers peers with ``mptok.routing.answer.answer_peer`` directly.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

import numpy as np

from mptok.cache.prefix_cache import TokenCache
from mptok.core.counting import Counters, Histogram
from mptok.core.private_files import secure_ipc_dir
from mptok.core.protocol import PeerReply
from mptok.routing.answer import PeerCache, answer_peer
from mptok.routing.calibration import build_backend, seconds_per_char, typical_text
from mptok.routing.crossing import CHOICES, LOCAL_CHEAPER, LOCAL_KEPT, CrossingCosts
from mptok.routing.policy import ALWAYS, CHEAPER, NEVER, POLICIES, routing_policy
from mptok.routing.deadline import PATIENCE_FACTOR, RouteDeadline
from mptok.routing.held import BadReply, HeldReplies
from mptok.routing.liveness import (
    ERROR,
    FALLBACK_REASONS,
    PATIENCE,
    TIMEOUT,
    OwnerLiveness,
    OwnerRecord,
    publish,
    unpublish,
)
from mptok.routing.order import owner_order
from mptok.routing.switch_interval import lower_switch_interval
from mptok.transport import (
    EncodeProxy,
    OwnerAlreadyServing,
    OwnerError,
    OwnerTimeout,
    OwnerUnreachable,
    ServerLimits,
    TransportError,
    left_or_zero,
    serve_encode,
    socket_path,
)

__all__ = [
    "OwnerAlreadyServing",
    "RoutableCache",
    "ServerLimits",
    "TokenizationOwners",
    "lower_switch_interval",
]

logger = logging.getLogger(__name__)

_ROUTE_COUNTERS = (
    ("routed", "routed_since", "owned_here", "taken_over_here", "route_failures")
    + tuple(f"fallback_{reason}" for reason in FALLBACK_REASONS)
    + tuple(f"crossing_{choice}" for choice in CHOICES)
)


class _RouteFailed(Exception):
    """A call to a conversation's owner failed; the prompt is then tokenized
    by the next frontend in its order, or here. Never reaches a caller."""


class _OwnerSkipped(Exception):
    """The check run during a call found the owner not worth waiting for."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class _Here:
    """What ``_route`` says when no owner tokenized a prompt: tokenize it
    here and keep it (this frontend is its first live owner, or the route
    failed), or keep it only where that evicts nothing (``room_only``:
    tokenizing here was cheaper and its owner keeps the conversation)."""

    room_only: bool


_KEEP_HERE = _Here(room_only=False)
_KEEP_IF_ROOM = _Here(room_only=True)


class RoutableCache(TokenCache, PeerCache, Protocol):
    """What routing needs from this frontend's cache: encode here, and
    answer its peers (``PrefixTokenCache``)."""

    def encode_array(
        self, tokenizer: Any, text: str, key: str | None = None, *, room_only: bool = False
    ) -> np.ndarray:
        """``encode``'s ids as an int32 array; with ``room_only`` the prompt
        is kept only if that evicts no other."""
        ...

    def holds(self, tokenizer: Any, key: str) -> bool:
        """Whether a prompt of conversation ``key`` is kept here."""
        ...


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
    "always", as before there was a policy.
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
        self._num_frontends = num_frontends
        self._ipc_dir = secure_ipc_dir(ipc_dir)
        self._cache = cache
        self._tokenizer = tokenizer
        self.policy = routing_policy(routing if routing is not None or weigh_crossing else ALWAYS)
        self._routing = self.policy != NEVER
        self._timeout_s = timeout_s
        self._close_timeout_s = (limits if limits is not None else ServerLimits()).close_timeout_s
        self._counters = Counters(_ROUTE_COUNTERS)
        self._route_seconds = Histogram()
        self._close_lock = threading.Lock()
        self._closed = False
        # Everything that validates arguments comes before serving starts.
        self._liveness = OwnerLiveness(self._ipc_dir, backoff_s=backoff_s)
        self._proxies = {
            peer: EncodeProxy(socket_path(self._ipc_dir, peer), authkey, timeout_s)
            for peer in range(num_frontends)
            if peer != frontend_id
        }
        self._held = HeldReplies(max_bytes=cache.config.max_held_bytes)
        # Peers may call as soon as the socket listens; an owner whose
        # tokenizer backend is still to be built (1.5 s to 3 s) would time
        # them out and be backed off from. So it is built first.
        backend = build_backend(tokenizer, cache.config.tokenizer_backend)
        # Calibration is for asking peers: a lone frontend never does.
        calibrated = num_frontends > 1 and backend is not None
        worst_s_per_char = seconds_per_char(backend) if calibrated else None
        self._patience_per_char_s = (
            patience_factor * worst_s_per_char if worst_s_per_char is not None and patience_factor > 0 else None
        )
        # Without weighing, every prompt an owner can answer is routed.
        weighing = calibrated and self.policy == CHEAPER
        typical_s_per_char = seconds_per_char(backend, typical_text()) if weighing else None
        self._crossing = CrossingCosts(typical_s_per_char)
        address = socket_path(self._ipc_dir, frontend_id)
        self._manager = serve_encode(
            address,
            functools.partial(answer_peer, cache, tokenizer),
            authkey,
            limits,
            name=f"mptok-owner-{frontend_id}",
        )
        try:
            self._record: OwnerRecord = publish(self._ipc_dir, frontend_id, address)
        except BaseException:
            self._manager.shutdown()
            raise

    @property
    def frontend_id(self) -> int:
        return self._frontend_id

    def encode(self, tokenizer: Any, text: str, key: str | None = None) -> list[int]:
        """Exactly ``cache.encode(tokenizer, text, key)``'s ids, from the
        conversation's owner or from ``cache``: never fails because an owner
        did (see the class). Raises what ``cache.encode`` raises for bad input."""
        routed = self._routed(tokenizer, text, key)
        if isinstance(routed, np.ndarray):
            return routed.tolist()
        if not routed.room_only:
            return self._cache.encode(tokenizer, text, key)
        return self._cache.encode_array(tokenizer, text, key, room_only=True).tolist()

    def encode_array(self, tokenizer: Any, text: str, key: str | None = None) -> np.ndarray:
        """``encode``'s ids as a 1-D int32 numpy array (``cache.encode_array``),
        for a caller that writes JSON or sends them on: no list is made."""
        routed = self._routed(tokenizer, text, key)
        if isinstance(routed, np.ndarray):
            return routed
        return self._cache.encode_array(tokenizer, text, key, room_only=routed.room_only)

    def _routed(self, tokenizer: Any, text: str, key: str | None) -> np.ndarray | _Here:
        if (
            self._routing
            and key is not None
            and tokenizer is self._tokenizer
            and self._cache.would_keep(text, key)
        ):
            return self._route(key, text)
        return _KEEP_HERE

    def stats(self) -> dict[str, int]:
        """Counters since start, for /metrics.

        routed: prompts a peer tokenized. owned_here: prompts whose owner is
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
        return {**self._counters.snapshot(), **self._manager.stats(), **self._held.stats(), **policy}

    def timings(self) -> dict[str, dict[str, Any]]:
        """Histogram snapshots since start, for /metrics.

        route_seconds: for each prompt a peer tokenized, from choosing its
        owner to holding its ids here (liveness check, transport, the
        owner's work); failed calls are not counted. serve_seconds: the
        owner's own work (its waits for its GIL included, the transport not)
        for each call this frontend answered with ids or with None.
        """
        return {"route_seconds": self._route_seconds.snapshot(), **self._manager.timings()}

    def close(self, timeout_s: float | None = None) -> None:
        """Stop routing and serving within ``timeout_s`` in all (default:
        ``limits.close_timeout_s``). There is no finalizer: call it (or use ``with``)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + (self._close_timeout_s if timeout_s is None else timeout_s)
        # Run last to first, each even if an earlier one raised: new prompts
        # stay here, peers stop choosing this owner, calls to peers fail
        # fast, then serving stops. One deadline for all of it.
        with contextlib.ExitStack() as steps:
            steps.callback(lambda: self._manager.shutdown(left_or_zero(deadline)))
            steps.callback(self._close_proxies, deadline)
            steps.callback(unpublish, self._ipc_dir, self._frontend_id, self._record)
            self._routing = False

    def _close_proxies(self, deadline: float) -> None:
        # Every call in flight is woken first, so that they all unwind
        # together rather than one proxy after another.
        for proxy in self._proxies.values():
            proxy.abort()
        for proxy in self._proxies.values():
            proxy.close(left_or_zero(deadline))

    def __enter__(self) -> TokenizationOwners:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _route(self, key: str, text: str) -> np.ndarray | _Here:
        """The ids from the conversation's owner, or where to tokenize here
        (this frontend is the first live one in the order, or the call
        failed: kept; this frontend keeps a version of it, or a call to the
        owner would cost more: kept where there is room)."""
        started = time.perf_counter()
        deadline = RouteDeadline.starting_now(self._timeout_s, self._patience_per_char_s, len(text))
        order = owner_order(key, self._num_frontends)
        for frontend in order:
            if frontend == self._frontend_id:
                self._counters.add("owned_here" if frontend == order[0] else "taken_over_here")
                return _KEEP_HERE
            # An owner found live (or that answered) within revalidate_s is
            # called at once and checked while it works (``_ask``).
            try:
                record, reason, checked = self._liveness.recently_live(frontend), None, False
                if record is None:
                    record, reason = self._liveness.check(frontend)
                    checked = True
                if reason is not None:
                    raise _OwnerSkipped(reason)
                assert record is not None
                owner = (frontend, record.incarnation)
                delta = self._held.get(owner, key) is not None
                if delta and self._crossing.weighing and self._cache.holds(self._tokenizer, key):
                    # Extending the version kept here costs less than the
                    # owner extending its own, plus the crossing.
                    self._counters.add(f"crossing_{LOCAL_KEPT}")
                    return _KEEP_IF_ROOM
                if delta:
                    choice = self._crossing.choose(owner, len(text))
                    self._counters.add(f"crossing_{choice}")
                    if choice == LOCAL_CHEAPER:
                        return _KEEP_IF_ROOM
                ids, answered_since = self._ask(frontend, record, key, text, deadline, checked)
            except _OwnerSkipped as e:
                self._counters.add(f"fallback_{e.reason}")
                continue
            except _RouteFailed as e:
                logger.debug("route for %r failed: %s", key, e)
                return _KEEP_HERE
            except Exception:
                logger.warning("routing to frontend %d raised; tokenizing locally", frontend, exc_info=True)
                self._count_failure(ERROR)
                return _KEEP_HERE
            took_s = time.perf_counter() - started
            self._route_seconds.observe(took_s)
            if answered_since:
                self._crossing.observe(owner, took_s)
            return ids
        raise AssertionError("this frontend is in every order")

    def _confirm_live(self, frontend: int) -> None:
        """``_OwnerSkipped`` if the liveness check says to skip ``frontend``."""
        _, reason = self._liveness.check(frontend)
        if reason is not None:
            raise _OwnerSkipped(reason)

    def _ask(
        self, frontend: int, record: OwnerRecord, key: str, text: str, deadline: RouteDeadline, checked: bool
    ) -> tuple[np.ndarray, bool]:
        """Ask ``frontend`` through the delta protocol, by the route's one
        ``deadline``. Unless ``checked``, the liveness check runs once:
        while the owner works on a delta call, before a whole-text call (a
        stopped owner never reads a send larger than the socket's buffer)."""
        proxy = self._proxies[frontend]
        to_check: Callable[[], None] | None = None if checked else functools.partial(self._confirm_live, frontend)
        patience_ran_out = False

        def call(sent: str, since: int | None, shared_chars: int) -> PeerReply | None:
            nonlocal to_check, patience_ran_out
            check, to_check = to_check, None
            if since is None and check is not None:
                check()
                check = None
            ends_at, patience_ran_out = deadline.for_call(delta=since is not None)
            return proxy.encode_since(
                sent,
                key,
                since=since,
                shared_chars=shared_chars,
                incarnation=record.incarnation,
                deadline=ends_at,
                while_waiting=check,
            )

        try:
            ids, answered_since = self._held.ask((frontend, record.incarnation), key, text, call)
        except OwnerTimeout as e:
            self._liveness.timed_out(frontend, record)
            raise self._failed(PATIENCE if patience_ran_out else TIMEOUT, frontend, e) from e
        except OwnerUnreachable as e:
            # An owner that died (or went) since its last check is skipped,
            # as that check would have; any other failure is one.
            self._liveness.failed(frontend)
            self._confirm_live(frontend)
            raise self._failed(ERROR, frontend, e) from e
        except (OwnerError, BadReply) as e:
            raise self._failed(ERROR, frontend, e) from e
        self._liveness.answered(frontend, record)
        if answered_since:
            self._counters.add("routed_since")
        self._counters.add("routed")
        return ids, answered_since

    def _failed(self, reason: str, frontend: int, error: TransportError | BadReply) -> _RouteFailed:
        self._count_failure(reason)
        return _RouteFailed(f"frontend {frontend} did not tokenize the prompt: {error}")

    def _count_failure(self, reason: str) -> None:
        self._counters.add(f"fallback_{reason}")
        self._counters.add("route_failures")

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
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from mptok.backend import SlowTokenizerError, backend_for
from mptok.counting import Counters, Histogram
from mptok.errors import RouteFailed
from mptok.peer import PeerReply
from mptok.config import CacheConfig
from mptok.ids import NO_IDS, IdPieces, common_prefix_length, held_bytes
from mptok.liveness import OwnerLiveness, OwnerRecord, publish, unpublish
from mptok.transport import (
    EncodeProxy,
    OwnerAlreadyServing,
    OwnerError,
    OwnerTimeout,
    OwnerUnreachable,
    ServerLimits,
    TransportError,
    secure_ipc_dir,
    serve_encode,
    socket_path,
)
from mptok.transport.wire import left_or_zero

__all__ = [
    "FALLBACK_REASONS",
    "OwnerAlreadyServing",
    "ServerLimits",
    "TokenizationOwners",
    "lower_switch_interval",
    "owner_of",
    "owner_order",
]

# Why a prompt was not tokenized by its conversation's owner: the owner was
# skipped without a call (the first six), or the call failed.
FALLBACK_REASONS = ("not_published", "dead", "zombie", "stopped", "pid_reused", "backoff", "timeout", "error")

_ROUTE_COUNTERS = ("routed", "routed_since", "owned_here", "taken_over_here", "route_failures") + tuple(
    f"fallback_{reason}" for reason in FALLBACK_REASONS
)
_HASH_PERSON = b"mptok-route-v1"


def _answer_peer(
    cache: Any, tokenizer: Any, text: str, key: str | None, since: int | None, shared_chars: int
) -> PeerReply | None:
    """What this frontend's cache answers a peer (``mptok.transport.PeerAnswer``)."""
    return cache.encode_for_peer(tokenizer, key, text, since=since, shared_chars=shared_chars)


def _build_backend(tokenizer: Any) -> None:
    """Build (and run once) the tokenizer backend an owner answers its peers with."""
    with contextlib.suppress(SlowTokenizerError):
        backend_for(tokenizer).encode("warm up")


def owner_order(key: str, num_frontends: int) -> list[int]:
    """Frontend ids in the order they serve conversation ``key``; the first is its owner.

    Rendezvous (highest random weight) hashing over blake2b: the same in
    every process and every run, whatever PYTHONHASHSEED is. While a
    frontend is down, each of its conversations moves to the next frontend in
    that conversation's own order, so the load of a dead frontend spreads
    over the others and nothing else moves.
    """
    if num_frontends < 1:
        raise ValueError(f"num_frontends must be >= 1, got {num_frontends}")
    base = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8, person=_HASH_PERSON)
    scored = []
    for frontend in range(num_frontends):
        h = base.copy()
        h.update(frontend.to_bytes(4, "big"))
        scored.append((h.digest(), frontend))
    scored.sort(reverse=True)
    return [frontend for _, frontend in scored]


def owner_of(key: str, num_frontends: int) -> int:
    """The frontend that tokenizes conversation ``key`` while it is up."""
    return owner_order(key, num_frontends)[0]


@dataclass(frozen=True)
class _Held:
    """The last reply an owner sent this frontend for one conversation."""

    version: int
    text: str
    ids: IdPieces


# What a held reply costs beyond its key, text and id lists: the _Held and
# IdPieces objects, piece tuples, the LRU dict's slot (scripts/bench_memory.py).
HELD_OVERHEAD_BYTES = 512


class HeldReplies:
    """What this frontend holds of each conversation it routed: the owner's
    last reply, with its version, text and ids.

    The next turn of that conversation then sends the owner only the
    characters after those it shares with the held text and gets back only
    the ids that changed (``PrefixTokenCache.encode_for_peer``). LRU, bounded
    by entries and by bytes, counted as the cache counts its own
    (``CacheConfig.max_held_bytes``): key, text, id lists, bookkeeping. A
    reply over the budget by itself is not held. Thread-safe.
    """

    def __init__(self, max_entries: int = 1024, max_bytes: int = CacheConfig.max_held_bytes):
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._held: OrderedDict[Hashable, tuple[_Held, int]] = OrderedDict()
        self._bytes = 0

    def get(self, owner: Hashable, key: str) -> _Held | None:
        with self._lock:
            held = self._held.get((owner, key))
            if held is None:
                return None
            self._held.move_to_end((owner, key))
            return held[0]

    def put(self, owner: Hashable, key: str, held: _Held | None) -> None:
        """Hold ``held`` (None: forget) for ``key``'s conversation at ``owner``."""
        nbytes = 0 if held is None else held_bytes((owner, key), held.text, held.ids) + HELD_OVERHEAD_BYTES
        with self._lock:
            old = self._held.pop((owner, key), None)
            if old is not None:
                self._bytes -= old[1]
            if held is None or nbytes > self._max_bytes:
                return
            self._held[(owner, key)] = (held, nbytes)
            self._bytes += nbytes
            while len(self._held) > self._max_entries or self._bytes > self._max_bytes:
                _, (_, evicted_bytes) = self._held.popitem(last=False)
                self._bytes -= evicted_bytes

    def stats(self) -> dict[str, int]:
        """``held_entries`` and ``held_bytes`` (never more than ``held_max_bytes``)."""
        with self._lock:
            return {"held_entries": len(self._held), "held_bytes": self._bytes, "held_max_bytes": self._max_bytes}


PEER_SWITCH_INTERVAL_S = 0.001


def lower_switch_interval(seconds: float = PEER_SWITCH_INTERVAL_S) -> None:
    """Lower this process's ``sys.setswitchinterval`` to ``seconds`` (never raise it), so
    that a peer's call waits about 1 ms instead of 5 ms for the GIL while the main
    thread runs Python (see ``TokenizationOwners``). Process-wide: call it from the
    process's entry point."""
    if sys.getswitchinterval() > seconds:
        sys.setswitchinterval(seconds)


class TokenizationOwners:
    """Serve this frontend's cache to its peers and route keyed prompts to their owners.

    Starting builds the tokenizer's backend first (what the cache answers
    peers with: 1.5 s to 3 s for a large vocabulary), so that an owner is
    ready when peers can see it and no peer's first call waits on it,
    whatever its ``timeout_s``. It then binds
    ``<ipc_dir>/tokenize-<frontend_id>.sock`` (raises
    ``OwnerAlreadyServing`` while a live process serves this frontend id, and
    ``PermissionError`` for an ipc dir that other users can enter), publishes
    this process as the owner, and installs ``cache.route``. From then on
    ``cache.encode(tokenizer, text, key)`` may be answered by another
    frontend, with the same ids. A prompt that an owner has not answered
    within ``timeout_s`` (one deadline for the whole route, when the owner
    needs a second call for the whole text) or whose call failed is
    tokenized locally; an owner that timed out is skipped for ``backoff_s``.

    ``close()`` (or leaving the ``with`` block) uninstalls the route,
    unpublishes this owner, closes the connections to peers and stops
    serving, all within one time budget; no socket file, lock file or
    thread remains (a thread still tokenizing when the budget runs out ends
    when its tokenization does). It is idempotent.

    The serving threads share this process's GIL: while the frontend runs
    Python code, a peer's call waits for the GIL each time its serving
    thread gets it back (after the request arrives, and whenever the main
    thread takes it away mid-call), so the transport reads a request in one
    call and writes a reply in one. If the main thread runs Python without
    releasing the GIL, each wait ends within the switch interval (a tiny
    call took 16 ms at the default 5 ms, about 1 ms at 1 ms). If it also
    releases and retakes the GIL often, as an event loop does in every
    ``select`` and a busy loop in every ``poll()``, each release resets the
    waiting thread's timer, and a serving thread on another, idle CPU loses
    nearly every race for it: a routed 38k-token hit then took from 4 ms to
    seconds (8000 futile wake-ups per call), whatever the switch interval
    (5 ms down to 0.02 ms), and about 4 ms with both threads on one CPU.
    The switch interval is process-wide, so this class leaves it alone: a
    process that serves peers should call ``lower_switch_interval()`` once
    at start (``mptok serve``'s frontends do).
    """

    def __init__(
        self,
        ipc_dir: str,
        frontend_id: int,
        num_frontends: int,
        cache: Any,
        tokenizer: Any,
        *,
        authkey: bytes,
        timeout_s: float = 5.0,
        backoff_s: float = 10.0,
        limits: ServerLimits | None = None,
    ):
        if not 0 <= frontend_id < num_frontends:
            raise ValueError(f"frontend_id {frontend_id} is not in range({num_frontends})")
        self._frontend_id = frontend_id
        self._num_frontends = num_frontends
        self._ipc_dir = secure_ipc_dir(ipc_dir)
        self._cache = cache
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
        config = getattr(cache, "config", None)
        held_budget = config.max_held_bytes if isinstance(config, CacheConfig) else CacheConfig.max_held_bytes
        self._held = HeldReplies(max_bytes=held_budget)
        # Peers may call as soon as the socket listens; an owner whose
        # tokenizer backend is still to be built (1.5 s to 3 s) would time
        # them out and be backed off from. So it is built first.
        _build_backend(tokenizer)
        address = socket_path(self._ipc_dir, frontend_id)
        self._manager = serve_encode(
            address,
            functools.partial(_answer_peer, cache, tokenizer),
            authkey,
            limits,
            name=f"mptok-owner-{frontend_id}",
        )
        try:
            self._record: OwnerRecord = publish(self._ipc_dir, frontend_id, address)
        except BaseException:
            self._manager.shutdown()
            raise
        cache.route = self._route

    @property
    def frontend_id(self) -> int:
        return self._frontend_id

    def stats(self) -> dict[str, int]:
        """Counters since start, for /metrics.

        routed: prompts a peer tokenized. owned_here: prompts whose owner is
        this frontend. taken_over_here: prompts tokenized here because every
        frontend before this one in their order was skipped.
        route_failures: calls that failed (each also counts as
        fallback_timeout or fallback_error). fallback_<reason>: owners
        skipped or failed, by reason. served, serve_errors,
        active_connections, accepted, refused, handshake_failures,
        refused_requests: this frontend as an owner. held_entries,
        held_bytes, held_max_bytes: the owners' replies held here.
        """
        return {**self._counters.snapshot(), **self._manager.stats(), **self._held.stats()}

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
            if getattr(self._cache, "route", None) == self._route:
                self._cache.route = None

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

    def _route(self, key: str, text: str) -> list[int] | None:
        started = time.perf_counter()
        order = owner_order(key, self._num_frontends)
        for frontend in order:
            if frontend == self._frontend_id:
                self._counters.add("owned_here" if frontend == order[0] else "taken_over_here")
                return None
            record, reason = self._liveness.check(frontend)
            if reason is None:
                assert record is not None
                ids = self._ask(frontend, record, key, text)
                self._route_seconds.observe(time.perf_counter() - started)
                return ids
            self._counters.add(f"fallback_{reason}")
        raise AssertionError("this frontend is in every order")

    def _ask(self, frontend: int, record: OwnerRecord, key: str, text: str) -> list[int]:
        owner = (frontend, record.incarnation)
        held = self._held.get(owner, key)
        try:
            ids = self._ask_since(frontend, owner, record, key, text, held)
        except OwnerTimeout as e:
            self._liveness.timed_out(frontend, record)
            raise self._failed("timeout", frontend, e) from e
        except OwnerUnreachable as e:
            self._liveness.failed(frontend)
            raise self._failed("error", frontend, e) from e
        except OwnerError as e:
            raise self._failed("error", frontend, e) from e
        self._counters.add("routed")
        return ids

    def _ask_since(
        self,
        frontend: int,
        owner: Hashable,
        record: OwnerRecord,
        key: str,
        text: str,
        held: _Held | None,
    ) -> list[int]:
        """Ask with what this frontend holds of the conversation at ``owner``,
        if anything; hold what the owner answers. Both calls, when the owner
        needs the whole text after all, end by one deadline."""
        proxy = self._proxies[frontend]
        deadline = time.monotonic() + self._timeout_s
        reply = None
        if held is not None:
            shared = common_prefix_length(held.text, text)
            reply = proxy.encode_since(
                text[shared:], key, since=held.version, shared_chars=shared,
                incarnation=record.incarnation, deadline=deadline,
            )
            if reply is not None:
                self._counters.add("routed_since")
        if reply is None:
            held = None
            reply = proxy.encode_since(text, key, incarnation=record.incarnation, deadline=deadline)
            if reply is None:
                raise OwnerError(f"frontend {frontend} asked for a version it was not given")
        if reply.reused > (held.ids.length if held is not None else 0):
            self._held.put(owner, key, None)
            raise OwnerError(f"frontend {frontend} reused more ids than this frontend holds")
        ids = (held.ids if held is not None else NO_IDS).spliced(reply.reused, reply.ids).bounded()
        self._held.put(owner, key, _Held(reply.version, text, ids) if reply.version else None)
        return ids.to_list()

    def _failed(self, reason: str, frontend: int, error: TransportError) -> RouteFailed:
        self._counters.add(f"fallback_{reason}")
        self._counters.add("route_failures")
        return RouteFailed(f"frontend {frontend} did not tokenize the prompt: {error}")

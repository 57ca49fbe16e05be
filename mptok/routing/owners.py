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
import math
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

from mptok.cache.backend import SlowTokenizerError, TokenizerBackend, backend_for
from mptok.cache.prefix_cache import TokenCache
from mptok.core.counting import Counters, Histogram
from mptok.core.private_files import secure_ipc_dir
from mptok.core.protocol import PeerReply
from mptok.routing.answer import PeerCache, answer_peer
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

_ROUTE_COUNTERS = ("routed", "routed_since", "owned_here", "taken_over_here", "route_failures") + tuple(
    f"fallback_{reason}" for reason in FALLBACK_REASONS
)


# How long an asker waits for an owner that holds the conversation: at most
# PATIENCE_FLOOR_S plus PATIENCE_FACTOR times what tokenizing the whole
# prompt here would take (see ``TokenizationOwners``). A stall guard, not a
# latency target: a burst of 64 concurrent prompts per frontend, 4
# frontends on 2 cores, took calls past 0.1 s (tests/test_routing.py), and
# giving up then only moves the same work onto the same saturated CPUs.
PATIENCE_FACTOR = 2.0
PATIENCE_FLOOR_S = 1.0
# Characters of made-up words that the backend tokenizes at start, to learn
# what a character costs here; new random words, because BPE caches the
# words it has seen and a sample seen before would look cheaper than a prompt.
_CALIBRATION_CHARS = 20_000
_LETTERS = "etaoinshrdlucmfwypvbgkjqxz"


def _build_backend(tokenizer: Any, choice: str) -> TokenizerBackend | None:
    """Build (and run once) the tokenizer backend an owner answers its peers
    with (the cache's ``choice`` of engine); None for a slow tokenizer, which
    the cache does not serve."""
    try:
        backend = backend_for(tokenizer, choice)
    except SlowTokenizerError:
        return None
    backend.encode("warm up")
    return backend


def _seconds_per_char(backend: TokenizerBackend) -> float:
    """What tokenizing one character of made-up words costs ``backend`` here."""
    rng = random.Random(os.urandom(8))  # words the backend has not cached yet
    words, chars = [], 0
    while chars < _CALIBRATION_CHARS:
        word = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(1, 9)))
        words.append(word)
        chars += len(word) + 1
    sample = " ".join(words)
    started = time.perf_counter()
    backend.encode(sample)
    return (time.perf_counter() - started) / len(sample)


class _RouteFailed(Exception):
    """A call to a conversation's owner failed; the prompt is then tokenized
    by the next frontend in its order, or here. Never reaches a caller."""


class _OwnerSkipped(Exception):
    """The check run during a call found the owner not worth waiting for."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class _RouteDeadline:
    """When the route of one prompt must end: ``timeout_at`` for every call,
    and ``patience_at`` (if earlier) for a delta call (see ``TokenizationOwners``)."""

    timeout_at: float
    patience_at: float

    @classmethod
    def starting_now(cls, timeout_s: float, patience_per_char_s: float | None, prompt_chars: int) -> _RouteDeadline:
        now = time.monotonic()
        patience_s = math.inf if patience_per_char_s is None else PATIENCE_FLOOR_S + patience_per_char_s * prompt_chars
        return cls(now + timeout_s, now + patience_s)

    def for_call(self, *, delta: bool) -> tuple[float, bool]:
        """The call's deadline, and whether it is the patience's."""
        if delta and self.patience_at < self.timeout_at:
            return self.patience_at, True
        return self.timeout_at, False


class RoutableCache(TokenCache, PeerCache, Protocol):
    """What routing needs from this frontend's cache: encode here, and keep
    the versions an owner answers its peers from (``PrefixTokenCache``)."""


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

    ``encode(tokenizer, text, key)`` is the routed ``cache.encode``: the same
    ids, tokenized by the conversation's owner when that is another live
    frontend, else by ``cache`` here.

    Starting builds the tokenizer's backend first (what the cache answers
    peers with: 1.5 s to 3 s for a large vocabulary), so that an owner is
    ready when peers can see it and no peer's first call waits on it,
    whatever its ``timeout_s``, and, when it has peers to ask, learns what
    tokenizing a character costs here (20k characters, a few ms). It then binds
    ``<ipc_dir>/tokenize-<frontend_id>.sock`` (raises
    ``OwnerAlreadyServing`` while a live process serves this frontend id, and
    ``PermissionError`` for an ipc dir that other users can enter), publishes
    this process as the owner. Only keyed prompts that the cache would keep,
    for the ``tokenizer`` given here, are routed. A prompt that an owner has
    not answered in time (one deadline for the whole route, when the owner
    needs a second call for the whole text) or whose call failed is
    tokenized locally; an owner that timed out is skipped for ``backoff_s``.
    In time means within ``timeout_s`` of the prompt's first call; and when
    this frontend holds the owner's last reply for the conversation, so that
    the owner is asked only for what changed, within this frontend's
    patience too: ``PATIENCE_FLOOR_S`` plus ``patience_factor`` times what
    tokenizing the whole prompt here would take. Past that, waiting costs
    more than doing all the work here (an owner whose serving threads starve
    for its GIL can take 100 times longer than its work), so the owner is
    treated as timed out (counted as ``fallback_patience``). A call that
    sends the whole text (first contact, or an owner that lost the version)
    waits for ``timeout_s``: the owner's own work is then a full
    tokenization, and several at once queue behind each other.
    ``patience_factor=0`` always waits for ``timeout_s``.

    The liveness check of an owner (a ``stat`` and a ``/proc`` read) runs
    before the call when neither a check nor an answer showed the owner
    live within the last ``revalidate_s`` (1 s), and before a whole-text
    call; otherwise it runs
    while the owner works on the delta call. An owner it then finds dead or
    stopped, or that a call fails to reach and the check finds gone, is
    skipped as if it had been checked first: the call is given up (its
    connection dropped, so a late reply is never read) and the prompt goes
    to the next frontend in its order, within the same deadline.

    ``close()`` (or leaving the ``with`` block) makes ``encode`` tokenize
    everything here, unpublishes this owner, closes the connections to peers and stops
    serving, all within one time budget; no socket file, lock file or
    thread remains (a thread still tokenizing when the budget runs out ends
    when its tokenization does). It is idempotent.

    The serving threads share this process's GIL, so a peer's call waits
    for it while the frontend runs Python: about one switch interval when
    the main thread holds it, and much longer when the main thread releases
    and retakes it very often (an event loop polling). The call's deadline
    bounds that wait. The measurements are in docs/ROUTING.md, "The GIL".
    The switch interval is process-wide, so this class leaves it alone: a
    process that serves peers should call ``lower_switch_interval()`` once
    at start (``mptok serve``'s frontends do).
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
        self._routing = True
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
        backend = _build_backend(tokenizer, cache.config.tokenizer_backend)
        # Patience is for asking peers: a lone frontend never does.
        asks_peers = num_frontends > 1 and patience_factor > 0 and backend is not None
        self._patience_per_char_s = patience_factor * _seconds_per_char(backend) if asks_peers else None
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
        if (
            self._routing
            and key is not None
            and tokenizer is self._tokenizer
            and self._cache.would_keep(text, key)
        ):
            ids = self._route(key, text)
            if ids is not None:
                return ids
        return self._cache.encode(tokenizer, text, key)

    def stats(self) -> dict[str, int]:
        """Counters since start, for /metrics.

        routed: prompts a peer tokenized. owned_here: prompts whose owner is
        this frontend. taken_over_here: prompts tokenized here because every
        frontend before this one in their order was skipped.
        route_failures: calls that failed (each also counts as
        fallback_timeout, fallback_patience or fallback_error; a call that
        failed to reach an owner the check then found gone counts as that
        skip instead). fallback_<reason>: owners skipped or failed, by reason. served, serve_errors,
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

    def _route(self, key: str, text: str) -> list[int] | None:
        """The ids from the conversation's owner; None to tokenize here (this
        frontend is the first live one in the order, or the call failed)."""
        started = time.perf_counter()
        deadline = _RouteDeadline.starting_now(self._timeout_s, self._patience_per_char_s, len(text))
        order = owner_order(key, self._num_frontends)
        for frontend in order:
            if frontend == self._frontend_id:
                self._counters.add("owned_here" if frontend == order[0] else "taken_over_here")
                return None
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
                ids = self._ask(frontend, record, key, text, deadline, checked)
            except _OwnerSkipped as e:
                self._counters.add(f"fallback_{e.reason}")
                continue
            except _RouteFailed as e:
                logger.debug("route for %r failed: %s", key, e)
                return None
            except Exception:
                logger.warning("routing to frontend %d raised; tokenizing locally", frontend, exc_info=True)
                self._count_failure(ERROR)
                return None
            self._route_seconds.observe(time.perf_counter() - started)
            return ids
        raise AssertionError("this frontend is in every order")

    def _confirm_live(self, frontend: int) -> None:
        """``_OwnerSkipped`` if the liveness check says to skip ``frontend``."""
        _, reason = self._liveness.check(frontend)
        if reason is not None:
            raise _OwnerSkipped(reason)

    def _ask(
        self, frontend: int, record: OwnerRecord, key: str, text: str, deadline: _RouteDeadline, checked: bool
    ) -> list[int]:
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
        return ids

    def _failed(self, reason: str, frontend: int, error: TransportError | BadReply) -> _RouteFailed:
        self._count_failure(reason)
        return _RouteFailed(f"frontend {frontend} did not tokenize the prompt: {error}")

    def _count_failure(self, reason: str) -> None:
        self._counters.add(f"fallback_{reason}")
        self._counters.add("route_failures")

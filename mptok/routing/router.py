"""The asker's side of routing: for one prompt, its ids from where they are kept, or a plain "tokenize it here".

``Router.decide`` is this frontend's whole part of a routed prompt
(docs/ROUTING.md, "Request path"). The layers below it are called, never
calling back: the liveness check that runs while the owner works runs
here, between sending the request and reading the reply.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mptok.cache.config import DEFAULT_MAX_HELD_BYTES
from mptok.cache.protocols import TokenCache
from mptok.core.counting import Counters, Histogram
from mptok.core.deadline import Deadline
from mptok.core.ids import key_bytes
from mptok.core.protocol import Fingerprint, PeerRequest, checkpoint_blocks, extend_chain
from mptok.routing.liveness import ERROR, FALLBACK_REASONS, PATIENCE, TIMEOUT, OwnerWatch
from mptok.routing.policy import PATIENCE_FLOOR_S
from mptok.transport import EncodeProxy, OwnerError, OwnerTimeout, OwnerUnreachable, socket_path

logger = logging.getLogger(__name__)

ROUTE_COUNTERS = (
    "routed", "routed_since", "copies_kept", "kept_here", "owned_here", "taken_over_here", "route_failures",
    *(f"fallback_{reason}" for reason in FALLBACK_REASONS),
)  # fmt: skip


_HASH_PERSON = b"mptok-route-v1"


def owner_order(key: str, num_frontends: int) -> list[int]:
    """Frontend ids in the order they serve conversation ``key``; the first is its owner.

    Rendezvous hashing over blake2b: the same in every process and run,
    whatever PYTHONHASHSEED is. While a frontend is down, each of its
    conversations moves to the next frontend in its own order, so the load
    spreads over the others and nothing else moves.
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
class RouteDeadline:
    """``timeout`` for every call of a route, and ``patience`` (if earlier) for a
    delta call: every blocking step obeys one of them, so a slow step never
    leaves the next its whole timeout again. Past the patience, waiting for an
    owner asked only for what changed costs more than tokenizing the whole prompt here."""

    timeout: Deadline
    patience: Deadline
    given: Deadline | None = None  # the caller's, already in both

    @property
    def callers_passed(self) -> bool:
        """Whether the caller's deadline has passed: then a call that ran
        out of time says nothing about the owner's speed."""
        return self.given is not None and self.given.passed

    def for_call(self, *, delta: bool) -> tuple[Deadline, bool]:
        """The call's deadline, and whether it is the patience's."""
        if delta and self.patience.at < self.timeout.at:
            return self.patience, True
        return self.timeout, False


@dataclass(frozen=True)
class RouteLimits:
    """How long this frontend waits for owners: ``timeout_s`` for a route,
    ``patience_per_char_s`` per character of the prompt (plus the floor)
    for a delta call (None: no patience), and ``backoff_s`` for which an
    owner that timed out is skipped."""

    timeout_s: float
    backoff_s: float
    patience_per_char_s: float | None

    def deadline(self, prompt_chars: int, given: Deadline | None = None) -> RouteDeadline:
        """The deadlines of a route starting now for a prompt of
        ``prompt_chars`` characters: each the earlier of this frontend's
        limit and ``given`` (the caller's, None: no limit of its own)."""
        per_char = self.patience_per_char_s
        patience_s = None if per_char is None else PATIENCE_FLOOR_S + per_char * prompt_chars
        return RouteDeadline(
            Deadline.after(self.timeout_s).earlier(given), Deadline.after(patience_s).earlier(given), given
        )


# What a held fingerprint costs beyond its key, its (owner, key) tuple and its
# digest: the Fingerprint object, the LRU dict's slot, the pair in it and the
# byte count (tests/test_memory.py holds the total to what tracemalloc sees).
HELD_OVERHEAD_BYTES = 256


class HeldFingerprints:
    """A fingerprint of the last prompt this frontend routed per (owner,
    conversation): about 440 bytes with a 36-character key, whatever the
    conversation's length. LRU, bounded by entries and by bytes
    (``CacheConfig.max_held_bytes``). Thread-safe."""

    def __init__(self, max_entries: int = 16384, max_bytes: int = DEFAULT_MAX_HELD_BYTES):
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._held: OrderedDict[Hashable, tuple[Fingerprint, int]] = OrderedDict()
        self._bytes = 0

    def request(self, owner: Hashable, key: str, text: str) -> tuple[PeerRequest, bytes]:
        """What to send ``owner`` for ``text``: a delta when a fingerprint is
        held and ``text`` starts with the characters it covers, else the whole
        text; and the digest chain of ``text`` computed for it (``remember``
        goes on from there)."""
        held = self.get(owner, key)
        if held is None or len(text) < held.chars:
            return PeerRequest(text, key), b""
        chain = extend_chain(text, upto_blocks=held.blocks)
        if not held.matches(chain):
            return PeerRequest(text, key), chain
        return PeerRequest(text[held.chars :], key, held.since, held.chars), chain

    def remember(self, owner: Hashable, key: str, text: str, chain: bytes, kept: bool) -> bytes:
        """``owner`` answered for ``text`` (``chain`` as ``request`` gave it):
        hold its fingerprint if the owner ``kept`` the prompt, else forget.
        Returns the digests of ``text`` computed so far (a prefix of its chain)."""
        if not kept:
            self.put(owner, key, None)
            return chain
        chain = extend_chain(text, chain, upto_blocks=checkpoint_blocks(len(text)))
        self.put(owner, key, Fingerprint.of(text, chain))
        return chain

    def get(self, owner: Hashable, key: str) -> Fingerprint | None:
        with self._lock:
            held = self._held.get((owner, key))
            if held is None:
                return None
            self._held.move_to_end((owner, key))
            return held[0]

    def put(self, owner: Hashable, key: str, held: Fingerprint | None) -> None:
        """Hold ``held`` (None: forget) for ``key``'s conversation at ``owner``."""
        # The owner's identity is one object that all its entries share: each counts only its own tuple and key.
        nbytes = 0 if held is None else sys.getsizeof((owner, key)) + key_bytes(key) + sys.getsizeof(held.digest) + HELD_OVERHEAD_BYTES
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


@dataclass(frozen=True)
class _Fallback:
    """Why an owner gave no ids (one of ``FALLBACK_REASONS``), and whether
    the prompt goes to the next frontend in its order (``skip``) or is
    tokenized here."""

    reason: str
    skip: bool


@dataclass(frozen=True)
class _Answered:
    """The owner's ids, the digests of the prompt's text computed on the
    way (``HeldFingerprints``), and whether a delta request got them."""

    ids: np.ndarray
    chain: bytes
    delta: bool


class Router:
    """Decides, for each keyed prompt, where it is tokenized: here, or by its owner, which it asks.

    ``routing`` False decides "here" for every prompt (the ``never`` policy);
    ``keep_copies`` is the ``kept`` policy (``mptok.routing.policy``).
    ``decide`` never raises because an owner failed (a call that fails or runs past its
    deadline decides "here", see ``TokenizationOwners``), only what the cache raises for bad input.
    """

    def __init__(
        self, cache: TokenCache, tokenizer: Any, frontend_id: int, num_frontends: int, ipc_dir: str, authkey: bytes,
        limits: RouteLimits, *, routing: bool, keep_copies: bool,
    ):
        self._frontend_id = frontend_id
        self._num_frontends = num_frontends
        self._cache = cache
        self._tokenizer = tokenizer
        self._limits = limits
        self._routing = routing
        self._keep_copies = keep_copies
        peers = [peer for peer in range(num_frontends) if peer != frontend_id]
        self._watches = {peer: OwnerWatch(ipc_dir, peer, backoff_s=limits.backoff_s) for peer in peers}
        self._proxies = {peer: EncodeProxy(socket_path(ipc_dir, peer), authkey, limits.timeout_s) for peer in peers}
        self._held = HeldFingerprints(max_bytes=cache.config.max_held_bytes)
        self._counters = Counters(ROUTE_COUNTERS)
        self._route_seconds = Histogram()

    def decide(self, tokenizer: Any, text: str, key: str | None, deadline: Deadline | None = None) -> np.ndarray | None:
        """The ids of ``text`` from where its conversation is kept, or None:
        tokenize it here. No owner is waited on past ``deadline`` (the
        caller's, if any) nor past this frontend's own limits; once it has
        passed, none is asked."""
        if not self._routing or key is None or tokenizer is not self._tokenizer:
            return None
        if deadline is not None and deadline.passed:
            self._counters.add("fallback_" + TIMEOUT)
            return None
        if len(text) < self._cache.config.min_chars:
            return None  # no cache keeps it: a crossing would buy nothing
        order = owner_order(key, self._num_frontends)
        if order[0] == self._frontend_id:
            self._counters.add("owned_here")
            return None
        if self._keep_copies:
            # Kept here: extended here, before any look at its owner (a
            # lookup, no tokenizing or lock, where nothing of it is kept).
            here = self._cache.extend_if_kept(tokenizer, text, key)
            if here is not None:
                self._counters.add("kept_here")
                return here
        started = time.perf_counter()
        route_deadline = self._limits.deadline(len(text), deadline)
        for frontend in order:
            if frontend == self._frontend_id:
                self._counters.add("taken_over_here")
                return None
            try:
                outcome = self._ask(frontend, key, text, route_deadline)
            except Exception:
                logger.warning("routing to frontend %d raised; tokenizing locally", frontend, exc_info=True)
                outcome = _Fallback(ERROR, skip=False)
            if isinstance(outcome, _Answered):
                self._route_seconds.observe(time.perf_counter() - started)
                # Where there is room, the conversation's next prompt to land here is extended here.
                copied = self._keep_copies and self._cache.adopt(tokenizer, text, key, outcome.ids, outcome.chain)
                self._counters.add_each(
                    "routed", *(("routed_since",) if outcome.delta else ()), *(("copies_kept",) if copied else ())
                )
                return outcome.ids
            self._counters.add(f"fallback_{outcome.reason}")
            if not outcome.skip:
                self._counters.add("route_failures")
                logger.debug("frontend %d did not tokenize a prompt of %r: %s", frontend, key, outcome.reason)
                return None
        raise AssertionError("this frontend is in every order")

    def stats(self) -> dict[str, int]:
        """The route counters (see ``TokenizationOwners.stats``) and the held fingerprints'."""
        return {**self._counters.snapshot(), **self._held.stats()}

    def route_seconds(self) -> dict[str, Any]:
        return self._route_seconds.snapshot()

    def stop(self) -> None:
        """Decide "tokenize here" for every prompt from now on."""
        self._routing = False

    def close(self, deadline: Deadline) -> None:
        """Stop routing; wake every call in flight at once, then close every connection by ``deadline``."""
        self.stop()
        for proxy in self._proxies.values():
            proxy.abort()
        for proxy in self._proxies.values():
            proxy.close(deadline)

    def _ask(self, frontend: int, key: str, text: str, deadline: RouteDeadline) -> _Answered | _Fallback:
        """Ask ``frontend`` for ``text``'s ids: a delta when a fingerprint
        matches, then the whole text if the owner matched nothing. The
        liveness check runs once: before anything unless the owner was found
        live (or answered) within ``revalidate_s``; then while the owner works
        on a delta on a connection this thread holds, else before sending (a
        handshake waits on the owner too, and a stopped owner never reads a
        whole text larger than the socket's buffer)."""
        watch = self._watches[frontend]
        record, checked = watch.recently_live(), False
        if record is None:
            record, reason = watch.check()
            if reason is not None:
                return _Fallback(reason, skip=True)
            checked = True
        proxy = self._proxies[frontend]
        owner = (frontend, record.incarnation)
        request, chain = self._held.request(owner, key, text)
        call_deadline, patience_ended = deadline.for_call(delta=request.delta)
        check_while_waiting = not checked and request.delta and proxy.connected(record.incarnation)
        try:
            if not checked and not check_while_waiting and (reason := watch.check()[1]):
                return _Fallback(reason, skip=True)
            with proxy.send(request, call_deadline, record.incarnation) as sent:
                if check_while_waiting and (reason := watch.check()[1]):
                    return _Fallback(reason, skip=True)
                reply = sent.reply()
            answered_delta = reply is not None and request.delta
            if reply is None and request.delta:
                # No prompt the owner keeps has the fingerprint: the whole text.
                patience_ended = False
                reply = proxy.ask(PeerRequest(text, key), deadline.timeout, record.incarnation)
        except OwnerTimeout:
            if not deadline.callers_passed:
                watch.timed_out(record)
            return _Fallback(PATIENCE if patience_ended else TIMEOUT, skip=False)
        except OwnerUnreachable:
            # An owner that died (or went) since its last check is skipped,
            # as that check would have; any other failure is one.
            watch.forget()
            reason = watch.check()[1]
            return _Fallback(reason, skip=True) if reason else _Fallback(ERROR, skip=False)
        except OwnerError:
            return _Fallback(ERROR, skip=False)
        if reply is None:  # the owner asked for a fingerprint it was not given
            self._held.remember(owner, key, text, chain, kept=False)
            return _Fallback(ERROR, skip=False)
        chain = self._held.remember(owner, key, text, chain, reply.kept)
        watch.answered(record)
        return _Answered(reply.ids, chain, answered_delta)

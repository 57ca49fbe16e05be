"""The asker's side of routing: for one prompt, its owner's ids or a plain "tokenize it here".

``Router.decide`` is this frontend's whole part of a routed prompt, in
order: one question to the cache (would it keep the prompt, does it hold
the conversation), the conversation's order of frontends (``order``), the
first one worth calling (``liveness``), whether a crossing pays
(``crossing``), the request (``held``: a delta when a fingerprint is held),
one call through the transport within the route's deadline (``deadline``),
and the fingerprint of what the owner kept. It returns a ``Decision``: the
ids, or tokenize here and how to keep the prompt. The layers below it are
called, never calling back: the liveness check that runs while the owner
works runs here, between sending the request and reading the reply.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from mptok.cache.prefix_cache import Holding, TokenCache
from mptok.core.counting import Counters, Histogram
from mptok.core.deadline import Deadline
from mptok.core.protocol import PeerRequest
from mptok.routing.answer import PeerCache
from mptok.routing.crossing import CHOICES, LOCAL_CHEAPER, LOCAL_KEPT, CrossingCosts
from mptok.routing.deadline import RouteDeadline, RouteLimits
from mptok.routing.held import HeldFingerprints
from mptok.routing.liveness import ERROR, FALLBACK_REASONS, PATIENCE, TIMEOUT, OwnerLiveness, OwnerRecord
from mptok.routing.order import owner_order
from mptok.transport import EncodeProxy, OwnerError, OwnerTimeout, OwnerUnreachable, socket_path

logger = logging.getLogger(__name__)

ROUTE_COUNTERS = (
    ("routed", "routed_since", "copies_kept", "owned_here", "taken_over_here", "route_failures")
    + tuple(f"fallback_{reason}" for reason in FALLBACK_REASONS)
    + tuple(f"crossing_{choice}" for choice in CHOICES)
)


class RoutableCache(TokenCache, PeerCache, Protocol):
    """What routing needs from this frontend's cache: encode here, and
    answer its peers (``PrefixTokenCache``)."""

    def encode_array(
        self, tokenizer: Any, text: str, key: str | None = None, *, room_only: bool = False
    ) -> np.ndarray:
        """``encode``'s ids as an int32 array; with ``room_only`` the prompt
        is kept only if that evicts no other."""
        ...

    def keep_copy(self, tokenizer: Any, text: str, key: str, ids: np.ndarray, chain: bytes = b"") -> bool:
        """Keep the owner's ``ids`` of ``text`` as this frontend's copy, only
        where that evicts nothing (``chain``: digests of ``text`` computed
        already); whether it was kept."""
        ...


@dataclass(frozen=True)
class Decision:
    """What becomes of one prompt: ``ids`` (int32) from its owner, or, when
    None, tokenize it here and keep it (``room_only``: only where that
    evicts nothing, because its owner keeps the conversation). ``timed``:
    tokenized here because that was judged cheaper than its owner; what it
    takes goes to ``Router.tokenized_here``."""

    ids: np.ndarray | None = None
    room_only: bool = False
    timed: bool = False


TOKENIZE_HERE = Decision()
TOKENIZE_HERE_IF_ROOM = Decision(room_only=True)
TOKENIZE_HERE_TIMED = Decision(room_only=True, timed=True)


@dataclass(frozen=True)
class _Fallback:
    """Why an owner gave no ids (one of ``FALLBACK_REASONS``), and whether
    the prompt goes to the next frontend in its order (``skip``) or is
    tokenized here."""

    reason: str
    skip: bool


@dataclass(frozen=True)
class _Answered:
    """The owner's ids, which owner (frontend, incarnation) gave them,
    whether a delta request got them, and the digests of the prompt's text
    computed on the way (``HeldFingerprints``)."""

    ids: np.ndarray
    owner: tuple
    delta: bool
    chain: bytes


class Router:
    """Decides, for each keyed prompt, whether its owner tokenizes it, and asks it.

    ``decide`` never raises because an owner failed: a call that fails or
    runs past its deadline (``limits``: the timeout, and for a delta call
    the patience) is given up and the decision is to tokenize here; an
    owner that timed out is skipped for ``limits.backoff_s``. It raises what the cache raises for bad input.
    ``close(deadline)`` stops routing and closes every connection.
    """

    def __init__(
        self, cache: RoutableCache, tokenizer: Any, frontend_id: int, num_frontends: int, ipc_dir: str, authkey: bytes,
        limits: RouteLimits, crossing: CrossingCosts, *, routing: bool,
    ):
        self._frontend_id = frontend_id
        self._num_frontends = num_frontends
        self._cache = cache
        self._tokenizer = tokenizer
        self._limits = limits
        self._crossing = crossing
        self._routing = routing
        self._liveness = OwnerLiveness(ipc_dir, backoff_s=limits.backoff_s)
        self._proxies = {
            peer: EncodeProxy(socket_path(ipc_dir, peer), authkey, limits.timeout_s)
            for peer in range(num_frontends)
            if peer != frontend_id
        }
        self._held = HeldFingerprints(max_bytes=cache.config.max_held_bytes)
        self._counters = Counters(ROUTE_COUNTERS)
        self._route_seconds = Histogram()

    def decide(self, tokenizer: Any, text: str, key: str | None) -> Decision:
        """The ids of ``text`` from its conversation's owner, or where to tokenize it here."""
        if not self._routing or key is None or tokenizer is not self._tokenizer:
            return TOKENIZE_HERE
        holding = self._cache.holding(tokenizer, text, key)
        if holding is Holding.NOT_KEPT:
            return TOKENIZE_HERE
        started = time.perf_counter()
        deadline = self._limits.deadline(len(text))
        order = owner_order(key, self._num_frontends)
        for frontend in order:
            if frontend == self._frontend_id:
                self._counters.add("owned_here" if frontend == order[0] else "taken_over_here")
                return TOKENIZE_HERE
            try:
                outcome = self._try_owner(frontend, key, text, holding, deadline)
            except Exception:
                logger.warning("routing to frontend %d raised; tokenizing locally", frontend, exc_info=True)
                outcome = _Fallback(ERROR, skip=False)
            if isinstance(outcome, Decision):
                return outcome
            if isinstance(outcome, _Answered):
                took_s = time.perf_counter() - started
                self._route_seconds.observe(took_s)
                if outcome.delta:
                    self._crossing.observe(outcome.owner, took_s)
                if self._crossing.weighing and self._cache.keep_copy(tokenizer, text, key, outcome.ids, outcome.chain):
                    # Where there is room, the owner's answer is also this
                    # frontend's copy: the conversation's next prompt to land
                    # here is extended here, with no crossing and no miss.
                    self._counters.add("copies_kept")
                return Decision(outcome.ids)
            self._counters.add(f"fallback_{outcome.reason}")
            if not outcome.skip:
                self._counters.add("route_failures")
                logger.debug("frontend %d did not tokenize a prompt of %r: %s", frontend, key, outcome.reason)
                return TOKENIZE_HERE
        raise AssertionError("this frontend is in every order")

    def tokenized_here(self, prompt_chars: int, seconds: float) -> None:
        """A prompt ``decide`` timed took ``seconds`` to tokenize here: the
        crossing's estimate of what a character costs here follows it."""
        self._crossing.observe_here(prompt_chars, seconds)

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

    def _try_owner(
        self, frontend: int, key: str, text: str, holding: Holding, deadline: RouteDeadline
    ) -> _Answered | Decision | _Fallback:
        # An owner found live (or that answered) within revalidate_s is
        # called at once and checked while it works.
        record, checked = self._liveness.recently_live(frontend), False
        if record is None:
            record, reason = self._liveness.check(frontend)
            if reason is not None:
                return _Fallback(reason, skip=True)
            assert record is not None
            checked = True
        owner = (frontend, record.incarnation)
        if self._held.get(owner, key) is not None:
            # A delta call: weigh it against tokenizing here. Extending the
            # version kept here costs less than the owner extending its own,
            # plus the crossing.
            weighing_kept = self._crossing.weighing and holding is Holding.KEPT_HERE
            choice = LOCAL_KEPT if weighing_kept else self._crossing.choose(owner, len(text))
            self._counters.add(f"crossing_{choice}")
            if choice == LOCAL_KEPT:
                return TOKENIZE_HERE_IF_ROOM
            if choice == LOCAL_CHEAPER:
                return TOKENIZE_HERE_TIMED
        return self._ask(frontend, record, key, text, deadline, checked)

    def _ask(
        self, frontend: int, record: OwnerRecord, key: str, text: str, deadline: RouteDeadline, checked: bool
    ) -> _Answered | _Fallback:
        """Ask ``frontend`` for ``text``'s ids: a delta when a fingerprint
        matches, then the whole text if the owner matched nothing. Unless
        ``checked``, the liveness check runs once: while the owner works on
        a delta on a connection it holds; else before sending (a handshake
        waits on the owner too, and a stopped owner never reads a whole
        text larger than the socket's buffer)."""
        proxy = self._proxies[frontend]
        owner = (frontend, record.incarnation)
        request, chain = self._held.request(owner, key, text)
        call_deadline, patience_ended = deadline.for_call(delta=request.delta)
        check_while_waiting = not checked and request.delta and proxy.connected(record.incarnation)
        try:
            if not checked and not check_while_waiting and (reason := self._skip_reason(frontend)):
                return _Fallback(reason, skip=True)
            with proxy.send(request, call_deadline, record.incarnation) as sent:
                if check_while_waiting and (reason := self._skip_reason(frontend)):
                    return _Fallback(reason, skip=True)
                reply = sent.reply()
            answered_delta = reply is not None and request.delta
            if reply is None and request.delta:
                # No prompt the owner keeps has the fingerprint: the whole text.
                patience_ended = False
                reply = proxy.ask(PeerRequest(text, key), deadline.timeout, record.incarnation)
        except OwnerTimeout:
            self._liveness.timed_out(frontend, record)
            return _Fallback(PATIENCE if patience_ended else TIMEOUT, skip=False)
        except OwnerUnreachable:
            # An owner that died (or went) since its last check is skipped,
            # as that check would have; any other failure is one.
            self._liveness.failed(frontend)
            reason = self._skip_reason(frontend)
            return _Fallback(reason, skip=True) if reason else _Fallback(ERROR, skip=False)
        except OwnerError:
            return _Fallback(ERROR, skip=False)
        if reply is None:  # the owner asked for a fingerprint it was not given
            self._held.remember(owner, key, text, chain, kept=False)
            return _Fallback(ERROR, skip=False)
        chain = self._held.remember(owner, key, text, chain, reply.kept)
        self._liveness.answered(frontend, record)
        if answered_delta:
            self._counters.add("routed_since")
        self._counters.add("routed")
        return _Answered(reply.ids, owner, answered_delta, chain)

    def _skip_reason(self, frontend: int) -> str | None:
        """Why the liveness check says to skip ``frontend`` now; None: call it."""
        return self._liveness.check(frontend)[1]

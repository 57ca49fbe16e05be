"""Whether sending a prompt to its owner pays, against tokenizing it here.

A delta call to an owner costs a round trip (the transport, the owner's
wait for its GIL, its work on the new characters, this side's fingerprint
of the prompt); tokenizing the whole prompt here costs its characters times
what a character costs this frontend's backend: learned at start
(``mptok.routing.calibration``), then from the prompts it tokenized here
because that was cheaper. With a fast backend a short prompt is cheaper
here; with ``tokenizers`` a long one is cheaper at its owner.
``CrossingCosts`` learns each owner's round trip from recent delta calls
and a character's cost here from recent local choices (EWMAs, both in
wall time: under load both wait for the same CPUs) and chooses the cheaper.

A prompt tokenized here because that was cheaper is kept here only where
the cache has room for it without evicting anything, and a conversation
kept here is extended here (``LOCAL_KEPT``: cheaper than the owner
extending its own copy and the crossing on top). With room to spare a
frontend so keeps what lands on it, as a cache per frontend would; under
memory pressure nothing is evicted for such a copy, so each conversation
is still kept once, by its owner.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

# Weight of the newest observation in the moving averages.
EWMA_WEIGHT = 0.2
# One prompt in this many that would go local for an owner is routed
# anyway, so that an estimate made under load does not keep routing off
# after the load is gone.
PROBE_EVERY = 32

# Why a prompt went where it went (counted as ``crossing_<reason>``).
ROUTE_CHEAPER = "route_cheaper"
ROUTE_UNKNOWN = "route_unknown"
ROUTE_PROBE = "route_probe"
LOCAL_CHEAPER = "local_cheaper"
LOCAL_KEPT = "local_kept"
CHOICES = (ROUTE_CHEAPER, ROUTE_UNKNOWN, ROUTE_PROBE, LOCAL_CHEAPER, LOCAL_KEPT)


class CrossingCosts:
    """Per owner, the moving average of a delta route's seconds; the moving
    average of what a character costs here; and the choice they imply for a
    prompt. Thread-safe."""

    def __init__(self, seconds_per_char: float | None):
        self._seconds_per_char = seconds_per_char
        self._lock = threading.Lock()
        self._route_s: dict[Hashable, float] = {}
        self._local_since_probe: dict[Hashable, int] = {}

    @property
    def weighing(self) -> bool:
        """Whether choices are weighed at all (a lone frontend, or one told
        not to weigh, routes every prompt an owner can answer)."""
        return self._seconds_per_char is not None

    def choose(self, owner: Hashable, prompt_chars: int) -> str:
        """One of ``CHOICES`` but ``LOCAL_KEPT``: route unless tokenizing ``prompt_chars``
        characters here is expected to cost less than a delta call to ``owner``."""
        if self._seconds_per_char is None:
            return ROUTE_UNKNOWN
        with self._lock:
            here_s = self._seconds_per_char * prompt_chars
            route_s = self._route_s.get(owner)
            if route_s is None:
                return ROUTE_UNKNOWN
            if route_s <= here_s:
                return ROUTE_CHEAPER
            local = self._local_since_probe.get(owner, 0) + 1
            if local >= PROBE_EVERY:
                self._local_since_probe[owner] = 0
                return ROUTE_PROBE
            self._local_since_probe[owner] = local
            return LOCAL_CHEAPER

    def observe(self, owner: Hashable, seconds: float) -> None:
        """A delta route to ``owner`` took ``seconds``, from choosing it to holding the ids."""
        with self._lock:
            previous = self._route_s.get(owner)
            self._route_s[owner] = seconds if previous is None else previous + EWMA_WEIGHT * (seconds - previous)

    def observe_here(self, prompt_chars: int, seconds: float) -> None:
        """A prompt of ``prompt_chars`` characters, chosen ``LOCAL_CHEAPER``,
        took ``seconds`` to tokenize here (nothing if choices are not weighed)."""
        if prompt_chars <= 0:
            return
        with self._lock:
            previous = self._seconds_per_char
            if previous is not None:
                self._seconds_per_char = previous + EWMA_WEIGHT * (seconds / prompt_chars - previous)

    def estimate(self, owner: Hashable) -> float | None:
        with self._lock:
            return self._route_s.get(owner)

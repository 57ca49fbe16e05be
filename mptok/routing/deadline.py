"""When the route of one prompt must end.

Every call of a route shares one deadline (``timeout_s`` from when the
route began), a ``mptok.core.deadline.Deadline`` that every blocking step
of the call obeys. A delta call ends sooner, at the asker's patience: past
the time tokenizing the whole prompt here would take (times a factor, plus
a floor), waiting for an owner costs more than doing the work here.
"""

from __future__ import annotations

from dataclasses import dataclass

from mptok.core.deadline import Deadline

# How long an asker waits for an owner that holds the conversation: at most
# PATIENCE_FLOOR_S plus PATIENCE_FACTOR times what tokenizing the whole
# prompt here would take. A stall guard, not a latency target: a burst of 64
# concurrent prompts per frontend, 4 frontends on 2 cores, took calls past
# 0.1 s (tests/test_routing.py), and giving up then only moves the same work
# onto the same saturated CPUs.
PATIENCE_FACTOR = 2.0
PATIENCE_FLOOR_S = 1.0

# How long a route waits for an owner by default (``mptok serve
# --route-timeout``): the transport's own default call timeout
# (``mptok.transport.proxy.CALL_TIMEOUT_S``), declared here too so that
# reading the options loads no transport.
ROUTE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class RouteDeadline:
    """``timeout`` for every call of a route, and ``patience`` (if earlier) for a delta call."""

    timeout: Deadline
    patience: Deadline

    @classmethod
    def starting_now(cls, timeout_s: float, patience_per_char_s: float | None, prompt_chars: int) -> RouteDeadline:
        patience_s = None if patience_per_char_s is None else PATIENCE_FLOOR_S + patience_per_char_s * prompt_chars
        return cls(Deadline.after(timeout_s), Deadline.after(patience_s))

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

    def deadline(self, prompt_chars: int) -> RouteDeadline:
        """The deadlines of a route starting now for a prompt of ``prompt_chars`` characters."""
        return RouteDeadline.starting_now(self.timeout_s, self.patience_per_char_s, prompt_chars)

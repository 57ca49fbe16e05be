"""When the route of one prompt must end.

Every call of a route shares one deadline (``timeout_s`` from the first
call). A delta call ends sooner, at the asker's patience: past the time
tokenizing the whole prompt here would take (times a factor, plus a floor),
waiting for an owner costs more than doing the work here.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

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
    """``timeout_at`` for every call of a route, and ``patience_at`` (if
    earlier) for a delta call; ``time.monotonic()`` instants."""

    timeout_at: float
    patience_at: float

    @classmethod
    def starting_now(cls, timeout_s: float, patience_per_char_s: float | None, prompt_chars: int) -> RouteDeadline:
        now = time.monotonic()
        patience_s = math.inf if patience_per_char_s is None else PATIENCE_FLOOR_S + patience_per_char_s * prompt_chars
        return cls(now + timeout_s, now + patience_s)

    def for_call(self, *, delta: bool) -> tuple[float, bool]:
        """The call's deadline, and whether it is the patience's."""
        if delta and self.patience_at < self.timeout_at:
            return self.patience_at, True
        return self.timeout_at, False

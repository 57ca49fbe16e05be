"""One way to say "by when": every blocking call on the routed path ends by a ``Deadline``.

A route takes one ``Deadline`` when it starts and hands it down through its
blocking steps (connect, handshake, send, receive, waits for a lock or a
thread): a timeout per step would give the next step its whole timeout again.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Deadline:
    """A ``time.monotonic()`` instant (``at``; ``math.inf``: no limit)."""

    at: float

    @classmethod
    def after(cls, seconds: float | None) -> Deadline:
        """``seconds`` from now; None: never."""
        return cls(math.inf if seconds is None else time.monotonic() + seconds)

    @classmethod
    def never(cls) -> Deadline:
        return cls(math.inf)

    def earlier(self, other: Deadline | None) -> Deadline:
        """This deadline or ``other``, whichever ends first (None: this one)."""
        return self if other is None or self.at <= other.at else other

    @property
    def bounded(self) -> bool:
        """Whether it ends at all."""
        return not math.isinf(self.at)

    @property
    def passed(self) -> bool:
        return time.monotonic() >= self.at

    def left(self) -> float:
        """Seconds left, 0.0 once it has passed (``math.inf`` for no limit)."""
        return max(0.0, self.at - time.monotonic())

    def left_or_raise(self) -> float:
        """Seconds left, ``math.inf`` for no limit; ``TimeoutError`` once it has passed."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        return left

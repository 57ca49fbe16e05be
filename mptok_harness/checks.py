"""What every test and script checks against: the tokenizer's own ids, a bound on every wait, one warm-up.

``expected_ids`` is the one definition of a right answer (mptok's contract:
the same ids as full tokenization by the same tokenizer). ``HANG_GUARD_S``
bounds every wait on a child process, a server or a socket, so that a broken
test fails instead of hanging; it is a guard, never a timed assertion.
``warm_up`` is the one way a test or script readies a cache's tokenizer on
its thread before it measures or injects faults.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

HANG_GUARD_S = 120.0


def expected_ids(tokenizer: Any, text: str, add_special_tokens: bool = False) -> list[int]:
    """What every path must return: the tokenizer's own ids for ``text``."""
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = HANG_GUARD_S) -> None:
    """Poll ``predicate`` until it holds; fail (never hang) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.005)


def warm_up(cache: Any, tokenizer: Any) -> None:
    """Build ``tokenizer``'s backend in ``cache`` and run it once on this thread,
    as a frontend's start does, so that no first call of what follows pays for it."""
    cache.encode(tokenizer, "warm up")

"""What the operator chooses about routing: which prompts cross, and how long an asker waits.

``kept`` (the default) decides by what is kept: a conversation this
frontend keeps is extended here, any other goes to its owner and the
owner's answer is kept here where that evicts nothing. ``always`` sends
every prompt another frontend owns; ``never`` none (it still answers peers).
Set by ``MPTOK_ROUTING``, overridden by ``mptok serve --routing`` and by
``TokenizationOwners(routing=...)``. Standard library only: the supervisor
reads these defaults for its options without loading routing.
"""

from __future__ import annotations

import os

ALWAYS = "always"
KEPT = "kept"
NEVER = "never"
POLICIES = (ALWAYS, KEPT, NEVER)
ENV_VAR = "MPTOK_ROUTING"

# How long a route waits for an owner by default (``mptok serve --route-timeout``).
ROUTE_TIMEOUT_S = 5.0
# How long an asker waits for an owner that holds the conversation: at most
# PATIENCE_FLOOR_S plus PATIENCE_FACTOR times what tokenizing the whole
# prompt here would take. A stall guard, not a latency target: a burst of 64
# concurrent prompts per frontend, 4 frontends on 2 cores, took calls past
# 0.1 s (tests/test_routing.py), and giving up then only moves the same work
# onto the same saturated CPUs.
PATIENCE_FACTOR = 2.0
PATIENCE_FLOOR_S = 1.0


def routing_policy(explicit: str | None = None) -> str:
    """``explicit`` if given, else ``MPTOK_ROUTING``, else ``kept``;
    ``ValueError`` naming the source and the value for anything not in ``POLICIES``."""
    if explicit is not None:
        value, named = explicit, f"routing={explicit!r}"
    else:
        raw = os.environ.get(ENV_VAR, "")
        value, named = raw.strip() or KEPT, f"{ENV_VAR}={raw!r}"
    if value not in POLICIES:
        raise ValueError(f"{named} must be one of {', '.join(POLICIES)}")
    return value

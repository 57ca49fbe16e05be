"""Which prompts a frontend sends to their conversation's owner: the operator's choice.

``kept`` (the default) decides by what is kept: a conversation this
frontend keeps is extended here; any other goes to its owner, and the
owner's answer is kept here where that evicts nothing, so its next turn
to land here is extended here. ``always`` sends every prompt another
frontend owns (one copy of each conversation, at its owner). ``never``
sends none: each frontend is a cache of its own, as caches per instance
are; it still answers peers that ask. Set by ``MPTOK_ROUTING``, by
``mptok serve --routing`` and by ``TokenizationOwners(routing=...)``, in
that order of precedence from last to first.
"""

from __future__ import annotations

import os

ALWAYS = "always"
KEPT = "kept"
NEVER = "never"
POLICIES = (ALWAYS, KEPT, NEVER)
ENV_VAR = "MPTOK_ROUTING"


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

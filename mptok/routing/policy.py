"""Which prompts a frontend sends to their conversation's owner: the operator's choice.

``cheaper`` (the default) weighs each crossing (``mptok.routing.crossing``):
a prompt goes to its owner when that is expected to cost less than
tokenizing it here, and a conversation this frontend keeps a version of is
extended here. ``always`` sends every prompt an owner can answer (one copy
of each conversation, at its owner, whatever a crossing costs). ``never``
sends none: each frontend is a cache of its own, as caches per instance
are; it still answers peers that ask. Set by ``MPTOK_ROUTING``, by
``mptok serve --routing`` and by ``TokenizationOwners(routing=...)``, in
that order of precedence from last to first.
"""

from __future__ import annotations

import os

ALWAYS = "always"
CHEAPER = "cheaper"
NEVER = "never"
POLICIES = (ALWAYS, CHEAPER, NEVER)
ENV_VAR = "MPTOK_ROUTING"


def routing_policy(explicit: str | None = None) -> str:
    """``explicit`` if given, else ``MPTOK_ROUTING``, else ``cheaper``;
    ``ValueError`` naming the source and the value for anything not in ``POLICIES``."""
    if explicit is not None:
        value, named = explicit, f"routing={explicit!r}"
    else:
        raw = os.environ.get(ENV_VAR, "")
        value, named = raw.strip() or CHEAPER, f"{ENV_VAR}={raw!r}"
    if value not in POLICIES:
        raise ValueError(f"{named} must be one of {', '.join(POLICIES)}")
    return value

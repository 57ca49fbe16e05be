"""The GIL switch interval of a process that serves peers.

An owner's serving threads share its frontend's GIL: a peer's call waits
about one switch interval for it while the main thread runs Python (5 ms by
default). The interval is process-wide, so only a process's entry point
lowers it (``mptok serve``'s frontends do); see docs/ROUTING.md, "The GIL".
"""

from __future__ import annotations

import sys

PEER_SWITCH_INTERVAL_S = 0.001


def lower_switch_interval(seconds: float = PEER_SWITCH_INTERVAL_S) -> None:
    """Lower this process's ``sys.setswitchinterval`` to ``seconds`` (never raise it), so
    that a peer's call waits about 1 ms instead of 5 ms for the GIL while the main
    thread runs Python. Process-wide: call it from the process's entry point."""
    if sys.getswitchinterval() > seconds:
        sys.setswitchinterval(seconds)

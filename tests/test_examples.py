"""The README's runnable examples run as written, in real processes."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import mptok

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_owners_example_routes_every_turn_to_the_owner():
    """examples/owners.py: two frontend processes, six turns of one
    conversation alternating between them; the owner tokenizes them all."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "owners.py"), "--frontends", "2", "--turns", "6"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr
    owner = mptok.owner_of("conversation-1", 2)
    lines = done.stdout.splitlines()
    assert lines[0] == f"conversation-1 is owned by frontend {owner}"
    assert f"frontend {owner}: routed 0, owned here 3, cache hits 5, misses 1" in lines
    assert f"frontend {1 - owner}: routed 3, owned here 0, cache hits 0, misses 0" in lines

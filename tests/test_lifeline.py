"""A child that outlives its parent is told so: at once if the parent was already gone.

The parent's death itself (SIGKILL of a real supervisor) is in
tests/test_serve.py; here, the race every parent-death watch has: the
parent died before the watch was set up.
"""

from __future__ import annotations

import os
import subprocess
import sys

CHILD = """
import os, signal, sys
from mptok.supervise.lifeline import stop_with_parent
got = []
signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
how = stop_with_parent(int(sys.argv[1]))
print(how, got == [signal.SIGTERM])
"""


def run_child(parent_pid: int) -> str:
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(parent_pid)], capture_output=True, text=True, timeout=60, check=True
    ).stdout.strip()


def test_a_parent_already_gone_is_noticed_at_once():
    # The child's real parent is this process: naming another pid is what
    # the child sees when the parent died before it asked (it was re-parented).
    how, signalled = run_child(999_999_999).split()
    assert signalled == "True"
    if sys.platform.startswith("linux"):
        assert how == "pdeathsig"


def test_a_live_parent_is_not_signalled():
    how, signalled = run_child(os.getpid()).split()
    assert signalled == "False"

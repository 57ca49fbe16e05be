"""What ``mptok serve`` loads before it starts a frontend.

The supervisor only spawns and watches processes, so importing it loads
none of the tokenizer stack.
"""

from __future__ import annotations

import ast
import subprocess
import sys

from mptok_harness.checks import HANG_GUARD_S
from mptok_harness.serve import REPO

# What a process that tokenizes loads and the supervisor must not.
_STACK = ("tokenizers", "numpy", "mptok.cache", "mptok.transport")


def _loaded_after(code: str) -> list[str]:
    probe = f"{code}; import sys; print(sorted(m for m in sys.modules if m.startswith({_STACK!r})))"
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S, check=True
    )
    return ast.literal_eval(result.stdout)


def test_importing_the_supervisor_loads_no_tokenizer_stack():
    assert _loaded_after("import mptok.serve.supervisor") == []

"""``mptok sglang ARGS``: SGLang's own server, ``python -m sglang.launch_server ARGS``, with mptok on.

It takes exactly SGLang's arguments and replaces this process with
SGLang's launcher, after setting two variables that every process SGLang
starts inherits: ``MPTOK_SGLANG=1`` (the plugin's switch) and, unless the
user set it, ``SGLANG_HTTP_SERVER_APP_PATH`` to ``mptok.sglang.app:app``
(so that the uvicorn workers of ``--tokenizer-worker-num`` > 1 load it).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from mptok.sglang import SWITCH

APP_PATH_VARIABLE = "SGLANG_HTTP_SERVER_APP_PATH"
APP_PATH = "mptok.sglang.app:app"


def launch_sglang(args: Sequence[str]) -> int:
    """Exec SGLang's launcher with ``args`` and mptok on; returns only if SGLang cannot be run."""
    try:
        import sglang  # noqa: F401
    except ImportError as e:
        print(f"mptok sglang: SGLang is not importable here ({e}); pip install sglang", file=sys.stderr)
        return 2
    os.environ[SWITCH] = "1"
    os.environ.setdefault(APP_PATH_VARIABLE, APP_PATH)
    os.execv(sys.executable, [sys.executable, "-m", "sglang.launch_server", *args])

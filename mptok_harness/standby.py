"""A kind of process that stands by, for the supervisor's spares without vLLM: ``python -m mptok_harness.standby``.

``StandbyKind`` is a ``FrontendKind`` with ``standby`` set: each process
reports ``("standby", pid)`` at once, waits for its ``("serve", id)``,
reports ready and then sleeps until SIGTERM (``--standby-after S``: it
stands by S seconds after it starts, as a real kind builds first). It serves nothing: what it
exercises is the supervisor (``mptok render``'s spares, their take-over and
their stop), started as a command with ``mptok serve``'s supervisor options
(``--spares K`` added), so that ``mptok_harness.serve.Server`` can run it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

from mptok.supervise.lifeline import stop_with_parent
from mptok.supervise.options import ServeOptions, add_arguments
from mptok.supervise.run import run_supervisor

SUPERVISOR_FIELDS = ("frontends", "port", "startup_timeout_s", "max_restarts", "restart_window_s", "given_up_retry_s")


class StandbyKind:
    standby = True
    hang_timeout_s = None

    def __init__(self, spares: int, standby_after_s: float = 0.0) -> None:
        self.spares = spares
        self._standby_after_s = standby_after_s

    def check(self, options: ServeOptions) -> None:
        pass

    def target(self, frontend_id: int | None, ipc_dir: str, options: ServeOptions) -> tuple[str, Any]:
        assert frontend_id is None, frontend_id  # a standby kind's processes start without an id
        return "mptok_harness.standby:standby_main", self._standby_after_s

    def exited(self, pid: int, ipc_dir: str) -> None:
        pass


def standby_main(standby_after_s: float, authkey: bytes, conn: Any, listener: Any) -> None:
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    stop_with_parent(os.getppid())
    time.sleep(standby_after_s)  # what a real kind spends building
    conn.send(("standby", os.getpid()))
    message = conn.recv()
    assert message[0] == "serve", message
    conn.send(("ready", os.getpid()))
    while True:
        time.sleep(1)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="standby")
    add_arguments(parser, only=SUPERVISOR_FIELDS)
    parser.add_argument("--spares", type=int, default=1)
    parser.add_argument("--standby-after", type=float, default=0.0)
    parsed = parser.parse_args(argv)
    options = ServeOptions(**{name: getattr(parsed, name) for name in SUPERVISOR_FIELDS})
    return run_supervisor(options, StandbyKind(parsed.spares, parsed.standby_after), "standby")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

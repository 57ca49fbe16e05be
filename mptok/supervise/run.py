"""What a command that runs the supervisor sets for its whole process, then the supervisor's run.

``mptok serve`` and ``mptok render`` both run ``Supervisor`` in the
command's own process. What is process-wide is set here, not in the
supervisor: logging, the environment the frontends inherit, and the
SIGTERM/SIGINT handlers (restored on return).
"""

from __future__ import annotations

import logging
import os
import sys

from mptok.supervise.logfmt import configure_logging, log_event
from mptok.supervise.options import ServeOptions
from mptok.supervise.supervisor import EXIT_CANNOT_START, FrontendKind, StartupError, StopSignals, Supervisor

logger = logging.getLogger("mptok.cli")


def run_supervisor(options: ServeOptions, kind: FrontendKind, command: str) -> int:
    """Run the supervisor of ``mptok <command>`` in this process until SIGTERM/SIGINT; 2 with a
    one-line message if it cannot start. ``kind`` is what runs in each slot."""
    try:
        configure_logging("supervisor")
    except ValueError as e:  # MPTOK_LOG_LEVEL: there is no log to write it to
        print(f"mptok {command}: cannot start: {e}", file=sys.stderr)
        return EXIT_CANNOT_START
    # Inherited by the frontends: no advisory warnings from transformers
    # (no PyTorch, sequence longer than the model's) in the operator's log.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        with StopSignals() as signals:
            return Supervisor(options, signals, kind).run()
    except StartupError as e:
        log_event(logger, logging.CRITICAL, "cannot_start", error=str(e))
        print(f"mptok {command}: cannot start: {e}", file=sys.stderr)
        return EXIT_CANNOT_START

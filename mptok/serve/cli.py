"""The ``mptok`` command: ``mptok serve`` runs the tokenization server.

Only argument parsing and process-level set-up live here (logging, the
environment the frontends inherit, signal handlers); the options themselves
are declared in ``mptok.serve.options``, and what serving means is in
``mptok.serve.supervisor`` and ``mptok.serve.frontend``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from mptok.cache.config import ENV_PREFIX, CacheConfig
from mptok.serve.logfmt import configure_logging, log_event
from mptok.serve.options import ServeOptions, add_arguments

if TYPE_CHECKING:
    from mptok.serve.supervisor import FrontendKind

logger = logging.getLogger("mptok.cli")

# Adds one more command to the ``mptok`` parser's subcommands (``mptok render``).
AddCommand = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


def _version() -> str:
    try:
        return importlib.metadata.version("mptok")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "(version unknown: not installed)"


def build_parser(*more_commands: AddCommand) -> argparse.ArgumentParser:
    """The ``mptok`` argument parser: ``serve``, and the commands ``more_commands`` add."""
    parser = argparse.ArgumentParser(prog="mptok", description="Exact prefix-cached tokenization for LLM frontends.")
    parser.add_argument("--version", action="version", version=f"mptok {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="run N tokenization frontends on one port",
        description=(
            "Run N HTTP tokenization frontends (POST /tokenize and /detokenize as in vLLM, "
            "GET /health, GET /metrics) on one port, "
            "accepting from one listening socket; each conversation is tokenized by the frontend whose prefix cache holds it. "
            "Restarts frontends that die; SIGTERM or SIGINT stops everything gracefully. "
            "Exit status: 0 after a signal, 2 if it cannot start, 3 if every frontend crash-looped."
        ),
        epilog=_environment_help(),
    )
    add_arguments(serve)
    for add in more_commands:
        add(commands)
    return parser


def _default_help(field: dataclasses.Field) -> str:
    return "" if field.default is None else f" (default {field.default})"


def _environment_help() -> str:
    cache = ", ".join(
        ENV_PREFIX + f.name.upper() + _default_help(f) for f in dataclasses.fields(CacheConfig)
    )
    return (
        f"Environment: the cache's limits, read by every frontend at start (docs/CACHE.md): {cache}; "
        "prompts shorter than MIN_CHARS characters are not cached. "
        "MPTOK_LOG_LEVEL: DEBUG, INFO (default), WARNING, ERROR or CRITICAL."
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mptok`` (and ``scripts/supervise.py``); returns the exit status."""
    return serve(parse_serve_options(argv))


def parse_serve_options(argv: Sequence[str] | None = None) -> ServeOptions:
    """The options of an ``mptok serve ...`` command line (``argv`` without the program name);
    exits with status 2 and argparse's message for a bad one, as ``--help`` does with 0."""
    args = build_parser().parse_args(argv)
    return ServeOptions(**{k: v for k, v in vars(args).items() if k != "command"})


def serve(options: ServeOptions, kind: FrontendKind | None = None, command: str = "serve") -> int:
    """Run ``mptok serve`` in this process until SIGTERM/SIGINT; 2 with a one-line message if it cannot start.

    ``kind`` and ``command``: another server on the same supervisor (``mptok render``).

    Sets what is process-wide here, not in the supervisor: logging, the
    environment the frontends inherit, and the SIGTERM/SIGINT handlers
    (restored on return).
    """
    from mptok.serve.supervisor import EXIT_CANNOT_START, StartupError, StopSignals, Supervisor

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


if __name__ == "__main__":
    sys.exit(main())

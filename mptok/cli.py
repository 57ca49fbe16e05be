"""The ``mptok`` command: ``mptok serve`` runs the tokenization server.

Only argument parsing and process-level set-up live here (logging, the
environment the frontends inherit); what serving means is in
``mptok.supervisor`` and ``mptok.frontend``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import math
import os
import sys
from collections.abc import Sequence

from mptok.logfmt import configure_logging, log_event

logger = logging.getLogger("mptok.cli")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0 to 65535, got {value}")
    return value


def _bytes(text: str) -> int:
    from mptok.config import parse_bytes

    try:
        value = parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


# Longer waits are surely a typo, and infinite ones overflow the timers they reach.
_MAX_SECONDS = 86_400.0


def _seconds(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and 0 < value <= _MAX_SECONDS):
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most {_MAX_SECONDS:,.0f} seconds, got {text}")
    return value


# (flag, ServeOptions field, type, metavar, help); the default comes from ServeOptions.
_SERVE_OPTIONS = (
    ("--frontends", "frontends", _positive_int, "N", "frontend processes (default: the number of CPUs, here %(default)s)"),
    ("--host", "host", str, "HOST", "address to listen on (default: %(default)s)"),
    ("--port", "port", _port, "PORT", "TCP port; 0 picks a free one, named in the ready line (default: %(default)s)"),
    ("--tokenizer", "tokenizer", str, "PATH",
     "a tokenizer.json file or a directory holding one (and tokenizer_config.json); "
     "default: the embedded DeepSeek V3-family tokenizer"),
    ("--chat-template", "chat_template_file", str, "FILE",
     'Jinja chat template for {"messages": ...} requests; default: the tokenizer\'s own, '
     "else the built-in DeepSeek V3 template when the tokenizer has its special tokens"),
    ("--max-prompt-chars", "max_prompt_chars", _positive_int, "N",
     "longest prompt (after the chat template) in characters; longer ones get 413 (default: %(default)s)"),
    ("--cache-bytes", "cache_bytes", _bytes, "SIZE",
     "memory each frontend's prefix cache may hold for its conversations (text, ids, offsets, "
     "versions, keys), e.g. 512M or 2G; default: MPTOK_CACHE_MAX_BYTES, else 512MiB"),
    ("--threads", "threads", _positive_int, "N", "tokenizing threads per frontend (default: %(default)s)"),
    ("--affinity-chars", "affinity_chars", _non_negative_int, "N",
     "route a raw prompt that carries no conversation id by a hash of its first N characters "
     "(0: such prompts are not routed); right only when those characters differ between "
     "conversations: prompts sharing a longer prefix all go to one frontend. Chats without an id "
     "are always routed by their first messages (default: %(default)s)"),
    ("--route-timeout", "route_timeout_s", _seconds, "S",
     "seconds a frontend waits for the conversation's owner before tokenizing the prompt itself "
     "(default: %(default)s)"),
    ("--route-backoff", "route_backoff_s", _seconds, "S",
     "seconds an owner that timed out is then skipped (default: %(default)s)"),
    ("--graceful-timeout", "graceful_timeout_s", _seconds, "S",
     "on SIGTERM/SIGINT, seconds in-flight requests get to finish; "
     "frontends still running 5 s later are killed (default: %(default)s)"),
    ("--startup-timeout", "startup_timeout_s", _seconds, "S",
     "seconds every frontend gets to become ready at start-up (default: %(default)s)"),
    ("--max-restarts", "max_restarts", _non_negative_int, "N",
     "a frontend that exits more than N times within --restart-window is given up: a crash loop "
     "(default: %(default)s)"),
    ("--restart-window", "restart_window_s", _seconds, "S",
     "seconds over which --max-restarts counts exits (default: %(default)s)"),
    ("--max-in-flight", "max_in_flight", _positive_int, "N",
     "/tokenize requests one frontend holds at once (reading, queued, tokenizing); "
     "more get 503 with Retry-After at once (default: %(default)s)"),
    ("--queue-timeout", "queue_timeout_s", _seconds, "S",
     "seconds a request may wait for a tokenizing thread; then 503 with Retry-After (default: %(default)s)"),
    ("--read-timeout", "read_timeout_s", _seconds, "S",
     "seconds a client gets to send a whole request, headers and body, from its first byte; "
     "then 408 and the connection is closed (default: %(default)s)"),
    ("--max-connections", "max_connections", _positive_int, "N",
     "open connections per frontend; beyond, 503 at once (default: %(default)s)"),
    ("--max-messages", "max_messages", _positive_int, "N",
     'most "messages" in one request; more get 413 (default: %(default)s)'),
    ("--given-up-retry", "given_up_retry_s", _seconds, "S",
     "seconds after which a frontend given up for crash-looping is tried again (default: %(default)s)"),
)  # fmt: skip


def _version() -> str:
    try:
        return importlib.metadata.version("mptok")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "(version unknown: not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The ``mptok`` argument parser (``serve`` is its only command)."""
    from mptok.supervisor import ServeOptions

    defaults = ServeOptions(frontends=os.cpu_count() or 1)
    parser = argparse.ArgumentParser(prog="mptok", description="Exact prefix-cached tokenization for LLM frontends.")
    parser.add_argument("--version", action="version", version=f"mptok {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="run N tokenization frontends on one port",
        description=(
            "Run N HTTP tokenization frontends (POST /tokenize and /detokenize as in vLLM, "
            "GET /health, GET /metrics) on one port "
            "with SO_REUSEPORT; each conversation is tokenized by the frontend whose prefix cache holds it. "
            "Restarts frontends that die; SIGTERM or SIGINT stops everything gracefully. "
            "Exit status: 0 after a signal, 2 if it cannot start, 3 if every frontend crash-looped."
        ),
    )
    for flag, dest, kind, metavar, help_text in _SERVE_OPTIONS:
        serve.add_argument(flag, dest=dest, type=kind, metavar=metavar, default=getattr(defaults, dest), help=help_text)
    _add_vllm_options(serve)
    return parser


def _add_vllm_options(serve: argparse.ArgumentParser) -> None:
    """The options ``vllm serve`` has for its tokenizer endpoints, spelled as vLLM spells them."""
    serve.add_argument(
        "--max-model-len", dest="max_model_len", type=_positive_int, metavar="N", default=None,
        help="the context length /tokenize reports as max_model_len; longer prompts get 400 as in vLLM "
        "(default: the tokenizer's model_max_length when it is a real limit, else none)",
    )
    serve.add_argument(
        "--served-model-name", dest="served_model_names", nargs="+", metavar="NAME", default=(),
        help='model names requests may give in "model"; any other gets vLLM\'s 404 (default: any name is accepted)',
    )
    serve.add_argument(
        "--enable-tokenizer-info-endpoint", dest="enable_tokenizer_info_endpoint", action="store_true",
        help="serve GET /tokenizer_info (the tokenizer's configuration and chat template), as vLLM's option does",
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mptok`` (and ``scripts/supervise.py``); returns the exit status."""
    args = build_parser().parse_args(argv)
    options = {k: v for k, v in vars(args).items() if k != "command"}
    return serve(**options)


def serve(**options: object) -> int:
    """Run ``mptok serve`` with ``ServeOptions(**options)``; 2 with a one-line message if it cannot start."""
    from mptok.supervisor import EXIT_CANNOT_START, ServeOptions, StartupError, Supervisor

    configure_logging("supervisor")
    # Inherited by the frontends: no advisory warnings from transformers
    # (no PyTorch, sequence longer than the model's) in the operator's log.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return Supervisor(ServeOptions(**options)).run()
    except StartupError as e:
        log_event(logger, logging.CRITICAL, "cannot_start", error=str(e))
        print(f"mptok serve: cannot start: {e}", file=sys.stderr)
        return EXIT_CANNOT_START


if __name__ == "__main__":
    sys.exit(main())

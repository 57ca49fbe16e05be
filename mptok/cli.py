"""The ``mptok`` command: ``mptok serve`` and ``mptok render``, two servers on one supervisor, and ``mptok sglang``.

Only argument parsing lives here: the options are declared in
``mptok.supervise.options`` and ``mptok.render.options``, and ``mptok
sglang``'s arguments are all SGLang's (``mptok.sglang.launch``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import sys
from collections.abc import Sequence

from mptok.cache.config import ENV_PREFIX, CacheConfig
from mptok.render.options import RenderArgumentError, add_render_arguments, render_options
from mptok.supervise.options import ServeOptions, add_arguments


def _version() -> str:
    try:
        return importlib.metadata.version("mptok")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "(version unknown: not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The ``mptok`` argument parser: ``serve`` and ``render``."""
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
    render = commands.add_parser(
        "render",
        help="run vLLM's render server in N processes on one port",
        usage="mptok render MODEL [options] [vLLM's render arguments]",
        description=(
            "Run N processes of vLLM's own render server (vllm launch render: every endpoint, vLLM's answers "
            "and errors) on one port, accepting from one listening socket, with --tokenizer-mode mptok "
            "routing each conversation to the process whose prefix cache holds it. Restarts processes that "
            "die or hang; answers 503 with Retry-After when a process holds --max-in-flight requests; one /metrics for all of them. "
            "Any argument not listed here is vLLM's and is passed to vllm launch render. "
            "Exit status: 0 after a signal, 2 if it cannot start, 3 if every process crash-looped."
        ),
    )
    add_render_arguments(render)
    commands.add_parser(
        "sglang",
        add_help=False,
        help="run SGLang's server (python -m sglang.launch_server ARGS) with mptok on",
        usage="mptok sglang [SGLang's launch_server arguments]",
    )
    return parser


def _environment_help() -> str:
    cache = ", ".join(
        ENV_PREFIX + f.name.upper() + ("" if f.default in (None, dataclasses.MISSING) else f" (default {f.default})")
        for f in dataclasses.fields(CacheConfig)
    )
    return (
        f"Environment: the cache's limits, read by every frontend at start (docs/CACHE.md): {cache}; "
        "prompts shorter than MIN_CHARS characters are not cached. "
        "MPTOK_LOG_LEVEL: DEBUG, INFO (default), WARNING, ERROR or CRITICAL."
    )


def parse_serve_options(argv: Sequence[str] | None = None) -> ServeOptions:
    """The options of an ``mptok serve ...`` command line (``argv`` without the program name);
    exits with status 2 and argparse's message for a bad one, as ``--help`` does with 0."""
    args = build_parser().parse_args(argv)
    return ServeOptions(**{k: v for k, v in vars(args).items() if k != "command"})


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mptok`` (and ``scripts/supervise.py``); returns the exit status."""
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["sglang"]:
        # Every argument after it is SGLang's: never parsed here.
        from mptok.sglang.launch import launch_sglang

        return launch_sglang(words[1:])
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    # Imported here: parsing loads neither the supervisor nor what runs in its slots.
    from mptok.supervise.run import run_supervisor

    if args.command != "render":
        from mptok.serve.launch import TokenizeFrontends

        return run_supervisor(parse_serve_options(argv), TokenizeFrontends(), command="serve")
    try:
        options = render_options(args, unknown)
    except RenderArgumentError as e:
        parser.exit(2, f"mptok render: {e}\n")
    from mptok.render.frontends import RenderFrontends

    return run_supervisor(options.serve, RenderFrontends(options), command="render")


if __name__ == "__main__":
    sys.exit(main())

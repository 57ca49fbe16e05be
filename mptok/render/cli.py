"""The ``mptok`` command: ``mptok serve``, ``mptok render`` and ``mptok sglang``.

``mptok serve``'s parser and process set-up are ``mptok.serve.cli``'s; this
adds the ``render`` command (``mptok.render.options``) and runs it on the
same supervisor with the render processes as its ``FrontendKind``. The
arguments ``mptok render`` does not know are vLLM's, passed on. ``mptok
sglang``'s arguments are all SGLang's (``mptok.sglang.launch``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mptok.render.options import RenderArgumentError, add_render_arguments, render_options
from mptok.serve.cli import build_parser, parse_serve_options, serve


def add_render_command(commands: argparse._SubParsersAction) -> None:
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


def add_sglang_command(commands: argparse._SubParsersAction) -> None:
    """``mptok sglang`` in ``mptok --help``; its arguments are SGLang's, never parsed here (``run_sglang_command``)."""
    commands.add_parser(
        "sglang",
        add_help=False,
        help="run SGLang's server (python -m sglang.launch_server ARGS) with mptok on",
        usage="mptok sglang [SGLang's launch_server arguments]",
    )


def run_sglang_command(argv: Sequence[str]) -> int | None:
    """``mptok sglang ARGS`` (SGLang's launch_server arguments, all of them SGLang's); None for another command."""
    if list(argv[:1]) != ["sglang"]:
        return None
    from mptok.sglang.launch import launch_sglang

    return launch_sglang(argv[1:])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mptok``; returns the exit status."""
    sglang_status = run_sglang_command(sys.argv[1:] if argv is None else argv)
    if sglang_status is not None:
        return sglang_status
    parser = build_parser(add_render_command, add_sglang_command)
    args, unknown = parser.parse_known_args(argv)
    if args.command != "render":
        return serve(parse_serve_options(argv))
    try:
        options = render_options(args, unknown)
    except RenderArgumentError as e:
        parser.exit(2, f"mptok render: {e}\n")
    from mptok.render.frontends import RenderFrontends

    return serve(options.serve, RenderFrontends(options), command="render")


if __name__ == "__main__":
    sys.exit(main())

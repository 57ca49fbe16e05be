"""The command line of ``mptok render``: the supervisor's options, and vLLM's render arguments passed through.

``mptok render MODEL [mptok's options] [vLLM's arguments]``. mptok's
options are the ones ``mptok serve`` declares for its supervisor, its
admission and its routing (``mptok.supervise.options``, the same flags, help
and checks), plus ``--hang-timeout`` and ``--spares``; every other argument is vLLM's and
reaches each render process's ``vllm launch render`` as given. Arguments
that cannot mean the same thing for N processes on one port are refused
here, before anything starts.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from mptok.supervise.options import ServeOptions, add_arguments, bounded, parse_seconds

# ServeOptions fields that mean the same for render processes as for mptok serve's frontends.
SHARED_FIELDS = (
    "frontends", "host", "port", "route_timeout_s", "route_backoff_s", "route_patience", "graceful_timeout_s",
    "startup_timeout_s", "max_restarts", "restart_window_s", "max_in_flight", "given_up_retry_s",
)  # fmt: skip
# vLLM loads its stack in each process: slower to start than mptok serve's frontends.
STARTUP_TIMEOUT_S = 300.0
HANG_TIMEOUT_S = 30.0
# One warm process takes the place of whichever process exits first: a restart in seconds for one process's memory; a second exit
# within the minute a new spare takes to build restarts cold.
SPARES = 1
MODE = "mptok"
# vLLM arguments mptok sets itself, or that N processes on one port cannot honour.
_REFUSED = {
    "--uds": "the render processes share a TCP port (--host, --port)",
    "--api-server-count": "use --frontends (vllm launch render runs one process)",
    "--headless": "a render server serves HTTP",
}


class RenderArgumentError(ValueError):
    """A vLLM argument ``mptok render`` cannot pass on; the message says why."""


@dataclass(frozen=True)
class RenderOptions:
    """Everything ``mptok render`` is told; picklable (each render process gets it). ``serve``: the supervisor's
    options (the others at their defaults); ``vllm_args``: vLLM's, after ``model``, as given."""

    serve: ServeOptions
    model: str
    vllm_args: tuple[str, ...] = ()
    hang_timeout_s: float = HANG_TIMEOUT_S
    spares: int = SPARES


def add_render_arguments(parser: argparse.ArgumentParser) -> None:
    """``MODEL``, the shared options of ``mptok serve``, ``--hang-timeout`` and ``--spares``; the rest is vLLM's."""
    parser.add_argument("model", metavar="MODEL", help="the model directory or name, as vllm launch render takes it")
    add_arguments(parser, only=SHARED_FIELDS)
    parser.set_defaults(startup_timeout_s=STARTUP_TIMEOUT_S)
    parser.add_argument(
        "--hang-timeout", dest="hang_timeout_s", type=parse_seconds, metavar="S", default=HANG_TIMEOUT_S,
        help="a ready render process whose event loop has not run for S seconds (stopped, stuck) is killed "
        "and restarted (default: %(default)s)",
    )
    parser.add_argument(
        "--spares", type=bounded(int, lambda v: 0 <= v <= 64, "0 to 64"), metavar="K", default=SPARES,
        help="render processes kept built and waiting (not listening) beside the N, each costing one render "
        "process's memory; a process that exits or hangs is replaced by one within seconds, where a new "
        "process takes as long as a start; 0 restarts cold (default: %(default)s)",
    )


def render_options(parsed: argparse.Namespace, vllm_args: Sequence[str]) -> RenderOptions:
    """The options of a parsed ``mptok render`` command line and the arguments it did not know (vLLM's)."""
    fields = {name: getattr(parsed, name) for name in SHARED_FIELDS}
    return RenderOptions(ServeOptions(**fields), parsed.model, checked_vllm_args(vllm_args), parsed.hang_timeout_s, parsed.spares)


def checked_vllm_args(args: Sequence[str]) -> tuple[str, ...]:
    """``args`` unless one is refused (``RenderArgumentError``); ``--tokenizer-mode`` may only say mptok."""
    for i, arg in enumerate(args):
        flag, _, value = arg.partition("=")
        if flag in _REFUSED:
            raise RenderArgumentError(f"{flag}: {_REFUSED[flag]}")
        if flag == "--tokenizer-mode":
            mode = value or (args[i + 1] if i + 1 < len(args) else "")
            if mode != MODE:
                raise RenderArgumentError(f"--tokenizer-mode {mode}: mptok render always renders with --tokenizer-mode {MODE}")
    return tuple(args)

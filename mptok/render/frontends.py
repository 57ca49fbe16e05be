"""The supervisor's ``FrontendKind`` for ``mptok render``'s vLLM render processes, and its clean-up after one.

Each process gets the ipc directory, with prometheus_client's multiprocess
directory in it, so that one ``/metrics`` shows every process. When a
process has exited, its live gauges are removed from that directory; its
counters stay, so totals never go down. The supervisor never imports vLLM.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass

from mptok.render.options import RenderOptions
from mptok.supervise.options import ServeOptions
from mptok.supervise.supervisor import StartupError


@dataclass(frozen=True)
class RenderSettings:
    """What one render process needs to start; picklable (it crosses the spawn pipe). The authkey is not in here."""

    ipc_dir: str
    options: RenderOptions


def prometheus_dir(ipc_dir: str) -> str:
    return os.path.join(ipc_dir, "prometheus")


class RenderFrontends:
    """``FrontendKind`` of ``mptok render``: vLLM render processes that beat (``--hang-timeout``),
    start without an id, and are kept warm as ``--spares``."""

    standby = True

    def __init__(self, options: RenderOptions) -> None:
        self._options = options
        self.hang_timeout_s: float | None = options.hang_timeout_s
        self.spares = options.spares

    def check(self, options: ServeOptions) -> None:
        if importlib.util.find_spec("vllm") is None:
            raise StartupError("mptok render runs vLLM's render server, and vLLM is not installed: pip install 'mptok[vllm]'")

    def target(self, frontend_id: int | None, ipc_dir: str, options: ServeOptions) -> tuple[str, RenderSettings]:
        os.makedirs(prometheus_dir(ipc_dir), mode=0o700, exist_ok=True)
        # Imported in the child only: naming the worker's function would import vLLM here. ``options``: this
        # command's supervisor options, with the port bound.
        return "mptok.render.worker:render_main", RenderSettings(ipc_dir, dataclasses.replace(self._options, serve=options))

    def exited(self, pid: int, ipc_dir: str) -> None:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, prometheus_dir(ipc_dir))

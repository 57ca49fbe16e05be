"""What the supervisor needs to start a tokenizing frontend, without loading one.

Importing ``mptok.serve.frontend`` would load the HTTP stack, numpy, the
cache and ``tokenizers`` into a supervisor that uses none of them, so the
frontend is named by its entry point, imported in the child only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from mptok.api.chat_template import ChatTemplateError, check_template_source
from mptok.supervise.options import ServeOptions
from mptok.supervise.supervisor import StartupError


@dataclass(frozen=True)
class FrontendSettings:
    """What one frontend process needs to start; picklable (it crosses the spawn pipe).

    ``options`` carry the port the supervisor bound (never 0). The authkey is
    not in here: it travels as its own Process argument and is never logged.
    """

    frontend_id: int
    ipc_dir: str
    chat_template: str | None  # the template's source, read by the supervisor
    options: ServeOptions


class TokenizeFrontends:
    """``mptok serve``'s frontends (``mptok.serve.frontend``): a tokenizer path that exists, a template that parses."""

    hang_timeout_s: float | None = None
    standby = False
    spares = 0
    _template_source: str | None = None  # set by check(), read by target()

    def check(self, options: ServeOptions) -> None:
        if options.tokenizer is not None and not os.path.exists(options.tokenizer):
            raise StartupError(f"--tokenizer {options.tokenizer}: no such file or directory")
        if options.chat_template_file is not None:
            try:
                with open(options.chat_template_file, encoding="utf-8") as f:
                    self._template_source = f.read()
                check_template_source(self._template_source)
            except (OSError, UnicodeDecodeError, ChatTemplateError) as e:
                raise StartupError(f"--chat-template {options.chat_template_file}: {e}") from None

    def target(self, frontend_id: int, ipc_dir: str, options: ServeOptions) -> tuple[str, FrontendSettings]:
        return "mptok.serve.frontend:frontend_main", FrontendSettings(frontend_id, ipc_dir, self._template_source, options)

    def exited(self, pid: int, ipc_dir: str) -> None:
        pass

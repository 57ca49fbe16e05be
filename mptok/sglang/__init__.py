"""mptok inside SGLang: ``mptok sglang [SGLang's launch_server arguments]``.

SGLang runs ``--tokenizer-worker-num N`` uvicorn worker processes on one
port, each with its own ``TokenizerManager`` and tokenizer and no memory of
the prompts it tokenized: every turn of a conversation is tokenized in
full, on whichever worker the kernel gave the connection to. SGLang has no
tokenizer registry; it has plugins (the ``sglang.srt.plugins`` entry point,
run by ``load_plugins()``) that put hooks on its functions
(``HookRegistry``). This package is such a plugin, off unless
``MPTOK_SGLANG=1`` (what ``mptok sglang`` sets): installed but off, it
registers nothing and SGLang is untouched. On:

- ``hooks.py``: after ``TokenizerManager.init_tokenizer_and_processor``
  (run in exactly the processes that tokenize), the tokenizer's ``encode``
  of one text goes through mptok's cache, and so does ``/generate``'s text
  (``TokenizerManager._tokenize_texts``); a chat names its conversation by
  its first messages (``mptok.api.affinity``);
- ``mptok.front.engine_tokens``: one per worker: the cache, and with N > 1
  the routing of each conversation to the worker that holds it; workers
  have no rank, so each claims the first seat no live worker serves;
- ``app.py``: uvicorn's workers do not load plugins; SGLang serves the app
  named by ``SGLANG_HTTP_SERVER_APP_PATH``, which ``mptok sglang`` points at
  this module that loads them and re-exports SGLang's app;
- ``launch.py``: ``mptok sglang`` itself.
"""

from __future__ import annotations

import os

# The switch: the plugin does anything only in a process that has it.
SWITCH = "MPTOK_SGLANG"


def enabled() -> bool:
    return os.environ.get(SWITCH) == "1"


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: with the switch on, put mptok's hooks on SGLang."""
    if not enabled():
        return
    from mptok.sglang.hooks import register_hooks

    register_hooks()

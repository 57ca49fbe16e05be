"""SGLang's HTTP app, in a uvicorn worker that has loaded SGLang's plugins.

With ``--tokenizer-worker-num`` > 1, SGLang's server runs
``uvicorn.run(SGLANG_HTTP_SERVER_APP_PATH, workers=N)``: each worker is a
fresh interpreter that imports the app by that path and never calls
``load_plugins()``, so a plugin's hooks would be missing exactly where
prompts are tokenized. ``mptok sglang`` points the path here: importing
this module loads the plugins (mptok's among them), then hands uvicorn
SGLang's own app object.
"""

from __future__ import annotations

from sglang.srt.plugins import load_plugins

load_plugins()

from sglang.srt.entrypoints.http_server import app  # noqa: E402  (after the hooks are on)

__all__ = ["app"]

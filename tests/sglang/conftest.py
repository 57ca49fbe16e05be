"""Real SGLang for the plugin's tests: they run in ``make test-sglang``'s environment and are not collected elsewhere.

The model directory is written once per session; each server is started by
the fixture that needs it and stopped at its end, so no two SGLang servers
run at once on a small machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

try:
    import sglang.srt.plugins  # noqa: F401
except ImportError:  # not make test-sglang's environment
    collect_ignore = ["test_plugin.py"]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mptok_harness.sglang import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("sglang-model"))

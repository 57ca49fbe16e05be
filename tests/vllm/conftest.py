"""Real vLLM for the plugin's tests: they run in ``make test-vllm``'s environment and are not collected elsewhere.

The model directory is written once per session; each server is started by
the test module that needs it and stopped at its end (module fixtures), so
no two ``vllm serve`` run at once on a small machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mptok_harness.vllm import write_model_dir

try:
    import vllm.renderers.hf  # noqa: F401
except ImportError:  # not make test-vllm's environment: nothing here to run
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("vllm-model"))


@pytest.fixture(scope="session")
def logs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")

"""Real vLLM for the plugin's tests: they run in ``make test-vllm``'s environment and are not collected elsewhere
(but ``test_compat.py``, which checks the error a missing vLLM gives).

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
except ImportError:  # not make test-vllm's environment: only what needs no vLLM runs
    collect_ignore = ["test_plugin.py", "test_teardown.py", "test_render_server.py", "test_render_tier.py"]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("vllm-model"))


@pytest.fixture(scope="session")
def render_plain(model_dir: Path, logs_dir: Path):
    """Every render case's ids and answer from ``vllm launch render`` without the switch (``render_cases.py``)."""
    from render_cases import plain_render

    return plain_render(model_dir, logs_dir)


@pytest.fixture(scope="session")
def render_plain_ids(render_plain) -> dict[str, list[int]]:
    return render_plain.ids

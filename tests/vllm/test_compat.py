"""The plugin refuses a vLLM it was not tested with, or none, with an error that says what to do; its extra installs only what it accepts."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re

import pytest

from mptok.vllm.compat import UnsupportedVllm, check_vllm, supported_range


def _vllm_installed() -> bool:
    try:
        return importlib.util.find_spec("vllm.version") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(_vllm_installed(), reason="vLLM is installed here")
def test_without_vllm_the_error_says_what_to_install():
    with pytest.raises(UnsupportedVllm, match=r"pip install 'mptok\[vllm\]'"):
        check_vllm()


@pytest.mark.skipif(not _vllm_installed(), reason="needs vLLM: make test-vllm")
@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0", "nightly"])
def test_a_vllm_outside_the_tested_range_is_refused(monkeypatch, version):
    from vllm import version as vllm_version

    monkeypatch.setattr(vllm_version, "__version__", version)
    with pytest.raises(UnsupportedVllm, match=rf"supports vLLM {supported_range()}, not {version}"):
        check_vllm()


@pytest.mark.skipif(not _vllm_installed(), reason="needs vLLM: make test-vllm")
def test_the_installed_vllm_is_in_the_tested_range():
    assert check_vllm().startswith(("0.32", "0.33"))


def test_the_general_plugin_entry_point_is_declared():
    plugins = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert plugins.get("mptok") == "mptok.vllm:register"


def test_the_vllm_extra_installs_the_range_the_plugin_accepts():
    """``pip install 'mptok[vllm]'`` must not install a vLLM the plugin then refuses, nor leave out a tested one."""
    (requirement,) = [
        r for r in importlib.metadata.requires("mptok") or [] if re.match(r"vllm\b", r) and 'extra == "vllm"' in r
    ]
    specifiers = requirement.split(";")[0].removeprefix("vllm").strip()
    assert set(specifiers.split(",")) == set(supported_range().split(","))

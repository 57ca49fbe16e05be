"""The plugin runs on a vLLM that has every hook it uses (with a warning on a release it was not tested with),
refuses one that lacks a hook, naming it, and says what to install without vLLM; its extra installs the tested releases.

The hooks are taken out of the installed vLLM itself, in this process
(monkeypatch undoes each): deleted, re-signed, or no longer called.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import re
import types

import pytest

from mptok.vllm import compat
from mptok.vllm.compat import HOOKS, RENDER_HOOKS, UnsupportedVllm, check_vllm, problems, EXTRA_RANGE, TESTED_RELEASES


def _vllm_installed() -> bool:
    try:
        return importlib.util.find_spec("vllm.version") is not None
    except ModuleNotFoundError:
        return False


needs_vllm = pytest.mark.skipif(not _vllm_installed(), reason="needs vLLM: make test-vllm")


@pytest.mark.skipif(_vllm_installed(), reason="vLLM is installed here")
def test_without_vllm_the_error_says_what_to_install():
    with pytest.raises(UnsupportedVllm, match=r"pip install 'mptok\[vllm\]'"):
        check_vllm()


@needs_vllm
def test_the_installed_vllm_is_a_tested_release_with_every_hook():
    assert problems(HOOKS + RENDER_HOOKS) == []
    assert check_vllm().startswith(tuple(f"{major}.{minor}." for major, minor in compat.TESTED_VLLM))


@needs_vllm
@pytest.mark.parametrize("version", ["0.35.0", "1.0.0", "nightly"])
def test_an_untested_release_with_every_hook_runs_with_one_warning(monkeypatch, caplog, version):
    from vllm import version as vllm_version

    monkeypatch.setattr(vllm_version, "__version__", version)
    monkeypatch.setattr(compat, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="vllm.mptok"):
        assert check_vllm() == version
        assert check_vllm() == version
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert f"tested with vLLM {TESTED_RELEASES}, not {version}" in warnings[0]


@needs_vllm
def test_a_tested_release_runs_without_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(compat, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="vllm.mptok"):
        check_vllm()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def _defining(container: object, name: str) -> list[object]:
    """The classes of ``container``'s MRO (or the module ``container``) whose namespace holds ``name``."""
    if isinstance(container, types.ModuleType):
        return [container]
    cls = container if isinstance(container, type) else type(container)
    return [klass for klass in cls.__mro__ if name in vars(klass) and klass.__module__ != "builtins"]


def _remove(monkeypatch: pytest.MonkeyPatch, hook: compat.Hook) -> None:
    container: object = importlib.import_module(hook.module)
    *path, last = hook.attribute.split(".")
    for part in path:
        container = getattr(container, part)
    fields = getattr(container, "__dataclass_fields__", None)
    if isinstance(fields, dict) and last in fields:
        monkeypatch.delitem(fields, last)
    for owner in _defining(container, last):
        if last in vars(owner):
            monkeypatch.delattr(owner, last)


@needs_vllm
@pytest.mark.parametrize("hook", HOOKS + RENDER_HOOKS, ids=lambda hook: hook.attribute)
def test_a_vllm_without_a_hook_is_refused_naming_it(monkeypatch, hook):
    _remove(monkeypatch, hook)
    hooks = HOOKS + RENDER_HOOKS
    with pytest.raises(UnsupportedVllm, match=re.escape(f"{hook.name}: ")) as refused:
        check_vllm(hooks)
    assert f"tested: {TESTED_RELEASES}" in str(refused.value)
    (problem,) = problems(hooks)
    assert problem.startswith(f"{hook.name}: "), problem


@needs_vllm
def test_a_vllm_that_calls_the_overridden_method_with_other_parameters_is_refused(monkeypatch):
    from vllm.renderers.hf import HfRenderer

    (owner,) = _defining(HfRenderer, "_tokenize_prompt")

    def _tokenize_prompt(self, prompt, params, lora_request):  # as if vLLM had added a parameter
        raise AssertionError("not called")

    monkeypatch.setattr(owner, "_tokenize_prompt", _tokenize_prompt)
    with pytest.raises(UnsupportedVllm, match=r"HfRenderer\._tokenize_prompt\(prompt, params\): takes \(prompt, params, lora_request\)"):
        check_vllm()


@needs_vllm
def test_a_vllm_whose_renderer_no_longer_calls_the_overridden_method_is_refused(monkeypatch):
    """The plugin would be bypassed without a word: vLLM tokenizing by another path."""
    from vllm.renderers.hf import HfRenderer

    for klass in HfRenderer.__mro__:
        for name, value in list(vars(klass).items()):
            function = getattr(value, "__func__", value)
            if name != "_tokenize_prompt" and isinstance(function, types.FunctionType) and compat._names_in(function.__code__, "_tokenize_prompt"):
                monkeypatch.setattr(klass, name, lambda self, *args, **kwargs: None)
    assert problems() == ["vllm.renderers.hf.HfRenderer._tokenize_prompt(prompt, params): no method of HfRenderer calls it"]


def test_the_general_plugin_entry_point_is_declared():
    plugins = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert plugins.get("mptok") == "mptok.vllm:register"


def test_the_vllm_extra_installs_the_tested_releases():
    """``pip install 'mptok[vllm]'`` installs a vLLM the plugin was tested with, and leaves none of them out."""
    (requirement,) = [
        r for r in importlib.metadata.requires("mptok") or [] if re.match(r"vllm\b", r) and 'extra == "vllm"' in r
    ]
    specifiers = requirement.split(";")[0].removeprefix("vllm").strip()
    assert set(specifiers.split(",")) == set(EXTRA_RANGE.split(","))

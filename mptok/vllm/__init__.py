"""mptok inside vLLM: ``vllm serve MODEL --tokenizer-mode mptok``.

vLLM runs ``--api-server-count N`` API server processes on one port, each
with its own tokenizer and no memory of the prompts it tokenized: every turn
of a conversation is tokenized in full, on whichever API server the kernel
gave the connection to. This package is a vLLM general plugin (the
``vllm.general_plugins`` entry point, run in every vLLM process) that adds
one tokenizer mode, ``mptok``. Without it, vLLM is untouched. With it:

- ``tokenizer.py``: the mode's tokenizer is vLLM's own HF tokenizer;
- ``renderer.py``: the mode's renderer is vLLM's HF renderer, whose prompt
  tokenization goes through ``mptok.front.engine_tokens``: the cache, and
  with several API servers the routing of each conversation to the API
  server that holds it.

``register()`` only records the two names in vLLM's registries: nothing of
mptok is imported or started until a process builds a renderer of mode mptok.
"""

from __future__ import annotations

MODE = "mptok"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register tokenizer and renderer mode ``mptok``."""
    from vllm.renderers.registry import RENDERER_REGISTRY
    from vllm.tokenizers.registry import TokenizerRegistry

    TokenizerRegistry.register(MODE, "mptok.vllm.tokenizer", "MptokTokenizer")
    RENDERER_REGISTRY.register(MODE, "mptok.vllm.renderer", "MptokRenderer")

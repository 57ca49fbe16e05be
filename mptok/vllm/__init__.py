"""mptok inside vLLM: ``vllm serve MODEL --tokenizer-mode mptok``.

vLLM's ``--api-server-count N`` API servers each tokenize every turn of a
conversation in full. This vLLM general plugin (the ``vllm.general_plugins``
entry point, run in every vLLM process) adds one tokenizer mode, ``mptok``:
its tokenizer is vLLM's own HF tokenizer (``tokenizer.py``), its renderer
vLLM's HF renderer tokenizing through ``mptok.front.engine_tokens``
(``renderer.py``): the cache, and with several API servers, routing.
``register()`` only records the two names: nothing of mptok is imported or
started until a process builds a renderer of mode mptok.
"""

from __future__ import annotations

MODE = "mptok"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register tokenizer and renderer mode ``mptok``."""
    from vllm.renderers.registry import RENDERER_REGISTRY
    from vllm.tokenizers.registry import TokenizerRegistry

    TokenizerRegistry.register(MODE, "mptok.vllm.tokenizer", "MptokTokenizer")
    RENDERER_REGISTRY.register(MODE, "mptok.vllm.renderer", "MptokRenderer")

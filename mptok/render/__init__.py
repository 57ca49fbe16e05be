"""``mptok render``: vLLM's own render server on every core, its conversations routed between them.

``mptok render MODEL --frontends N [vLLM's arguments]`` runs N ``vllm launch
render`` processes on one port under ``mptok serve``'s supervisor, each with
the plugin's renderer routing every conversation to the process whose cache
holds it (docs/VLLM.md). Nothing here imports vLLM but ``worker.py`` and
``hits.py``, in the render processes.
"""

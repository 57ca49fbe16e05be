"""``mptok render``: vLLM's own render server on every core, its conversations routed between them.

vLLM's GPU-less render server (``vllm launch render``: chat template,
tokenization, what a prefix-aware router calls before it picks a model
server) is one process, bound without SO_REUSEPORT, near one core. ``mptok
render MODEL --frontends N [vLLM's arguments]`` runs N of them on one port
under ``mptok serve``'s supervisor, each with the plugin's renderer routing
every conversation to the process whose cache holds it:

- ``options.py``: the command line (``mptok.cli`` parses it): the supervisor's options, vLLM's passed through;
- ``frontends.py``: what the supervisor runs in each slot, and what it cleans up after one;
- ``worker.py``: one process: vLLM's own render server, on the shared port;
- ``hits.py``: the chat and completion render endpoints answered with vLLM's prompt and answer bytes, without
  vLLM's per-request objects, where a request is plain enough; vLLM's app answers the rest;
- ``gate.py``: what ``mptok serve`` adds around each request: admission, the supervisor's series on ``/metrics``.

Nothing here imports vLLM but ``worker.py`` and ``hits.py``, in the render processes.
"""

"""What mptok's tests and its scripts/ both need: the right answer and a bound
on every wait (``checks``), a real ``mptok serve`` subprocess and plain HTTP to
it (``serve``), HTTP written by hand for malformed requests (``raw_http``),
real frontend processes driving ``TokenizationOwners`` directly
(``frontends``), a real nginx in front (``nginx``), real vLLM and the model
it serves (``vllm``) and the requests sent to it (``vllm_requests``), the tokenizer families
built offline (``families``, ``chat_tokenizers``), the conversations they
tokenize (``conversations``, ``prompts``, ``growing_chats``) and fixed source
texts (``texts``).

Why a package of its own: tests and benchmarks must measure the same thing
with the same helpers. It lives in the checkout beside ``mptok`` and is not
installed with it (``pyproject.toml`` packages ``mptok`` only): it needs the
checkout (``scripts/supervise.py``, ``deploy/``'s templates, the test extras
for some families) and is no part of mptok's API. Tests import it through
pytest's ``pythonpath = ["."]``; scripts run from the repository's root as
modules (``python -m scripts.replay_bench``), which puts the root on the path.
"""

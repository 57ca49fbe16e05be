"""What mptok's tests and its scripts/ both need: a real ``mptok serve`` subprocess
and plain HTTP to it (``serve``), a real nginx in front of it (``nginx``), the
tokenizer families built offline (``families``, ``chat_tokenizers``) and the
conversations they tokenize (``conversations``, ``prompts``).

Why a package of its own: tests and benchmarks must measure the same thing
with the same helpers, and each side importing the other's files (through
``sys.path`` edits) tied the two directories together. It sits at the top of
the repository, beside ``mptok``, rather than inside it as ``mptok.testing``:
the server never imports it, it needs the checkout (``scripts/supervise.py``,
``deploy/``'s templates, the test extras for some families), and it is no
part of mptok's library API, which may not change by accident; an editable
install (``make``'s ``.venv``) makes it importable from tests and scripts
alike, without path hacks.
"""

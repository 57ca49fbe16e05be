import os

import pytest

# The tests compare against full tokenization in the same process; the Rust
# tokenizer's own thread pool would only compete with the servers under test.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The cache's mechanism tests count hits on plain text, which only the
# `tokenizers` backend splices (a fast engine splices at added tokens alone:
# docs/CACHE.md, "Fast engines"), so they run on the reference backend;
# test_backends.py and test_exactness.py choose their backends themselves.
# `MPTOK_CACHE_TOKENIZER_BACKEND=auto` runs everything on the automatic choice.
os.environ.setdefault("MPTOK_CACHE_TOKENIZER_BACKEND", "tokenizers")


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded default tokenizer, loaded once for every test that names it."""
    import mptok

    return mptok.load_tokenizer()

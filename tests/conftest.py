import os

import pytest

# The tests compare against full tokenization in the same process; the Rust
# tokenizer's own thread pool would only compete with the servers under test.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite runs what users run: the default backend choice ("auto", the
# fastest engine that passes its start-up check). A test about the
# `tokenizers` path names that backend itself and says why.


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded default tokenizer, loaded once for every test that names it."""
    import mptok

    return mptok.load_tokenizer()

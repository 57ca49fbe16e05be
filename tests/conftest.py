import os

import pytest

# The tests compare against full tokenization in the same process; the Rust
# tokenizer's own thread pool would only compete with the servers under test.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded default tokenizer, loaded once for every test that names it."""
    import mptok

    return mptok.load_tokenizer()

import os
import sys

import pytest

# Test helpers (families, conversations) import as top-level modules.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded default tokenizer, loaded once for every test that names it."""
    import mptok

    return mptok.load_tokenizer()

"""The README's commands run as a new user runs them.

tests/conftest.py pins the tests' own tokenizer backend in the environment,
and every process started here would inherit it; a new user's server, scripts
and example run on the default (``auto``), so the pin is lifted for these.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="session")
def default_backend() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("MPTOK_CACHE_TOKENIZER_BACKEND", raising=False)
        yield

import os
import shutil
import tempfile
from pathlib import Path

import pytest

# The tests compare against full tokenization in the same process; the Rust
# tokenizer's own thread pool would only compete with the servers under test.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite runs what users run: the default backend choice ("auto", the
# fastest engine that passes its start-up check). A test about the
# `tokenizers` path names that backend itself and says why.


@pytest.fixture(scope="session", autouse=True)
def engine_memo_of_the_session(tmp_path_factory):
    """The engine memo in a directory of this session's, not the user's cache.

    Not another setting: the memo is on, as it is by default, so the first
    start of the session decides and every later process (the servers and
    frontends the tests start inherit the variable) reads its verdict, as
    on a user's machine. What the suite must not do is write into the home
    directory of whoever runs it, or depend on what an earlier run left
    there: each session decides once, then reads what it decided.
    """
    previous = os.environ.get("MPTOK_ENGINE_MEMO")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # One memo for the run's workers (each a session of its own), in the directory they share.
        shared = tmp_path_factory.getbasetemp().parent / "engine-memo"
        shared.mkdir(exist_ok=True)
        os.environ["MPTOK_ENGINE_MEMO"] = str(shared)
    else:
        os.environ["MPTOK_ENGINE_MEMO"] = str(tmp_path_factory.mktemp("engine-memo"))
    yield
    if previous is None:
        os.environ.pop("MPTOK_ENGINE_MEMO", None)
    else:
        os.environ["MPTOK_ENGINE_MEMO"] = previous


@pytest.fixture(scope="session")
def logs_dir(tmp_path_factory):
    """Where the engine suites' servers write their logs."""
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded default tokenizer, loaded once for every test that names it."""
    import mptok

    return mptok.load_tokenizer()


@pytest.fixture
def trust_restored():
    """Tests that make an engine or a tokenizer's seam rules give wrong ids
    leave the process distrusting them for good; the tests after them must
    find them trusted."""
    from mptok.cache import backend
    from mptok.engines import choice

    kept = [(found, set(found)) for found in (choice._distrusted, backend._rules_distrusted)]
    yield
    for found, before in kept:
        found.clear()
        found.update(before)


@pytest.fixture
def short_tmp_dir():
    """A directory of its own right under the system's temporary one, removed
    after: ``tmp_path`` lies deeper (more so under xdist), and a Unix socket
    path in a directory made inside it can outgrow the 107-byte limit."""
    path = tempfile.mkdtemp(prefix="mptok-test-")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)

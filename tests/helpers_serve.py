"""The tests' name for ``mptok_harness.serve`` (a real ``mptok serve`` and plain HTTP to it)."""

from mptok_harness.serve import (  # noqa: F401
    HANG_GUARD_S,
    REPO,
    SUPERVISE,
    Server,
    free_port,
    request,
    scrape,
    tokenize,
    total,
    wait_for_snapshots,
)

"""Whether a peer is worth asking, read from real processes: ``mptok.routing.liveness``.

Each owner here is a real child process that published its own record
(``publish``), then was stopped, killed, reaped or impersonated; the test
reads what ``OwnerWatch.check`` concludes, as a routing frontend would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from mptok.core.private_files import secure_ipc_dir
from mptok.routing.liveness import (
    BACKOFF,
    DEAD,
    NOT_PUBLISHED,
    PID_REUSED,
    STOPPED,
    ZOMBIE,
    OwnerWatch,
    publish,
    read_record,
    record_path,
    start_ticks,
)
from mptok_harness.checks import HANG_GUARD_S, wait_until

# Publishes itself as the owner of frontend id argv[2], then waits for its stdin to close.
OWNER = (
    "import sys\n"
    "from mptok.routing.liveness import publish\n"
    "publish(sys.argv[1], int(sys.argv[2]), 'unused.sock')\n"
    "print('published', flush=True)\n"
    "sys.stdin.read()\n"
)


@pytest.fixture
def ipc_dir(tmp_path):
    return secure_ipc_dir(str(tmp_path / "ipc"))


@pytest.fixture
def owner(ipc_dir):
    """owner(frontend_id=0) -> a child process that has published its record; all ended after the test."""
    started: list[subprocess.Popen] = []

    def start(frontend_id: int = 0) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", OWNER, ipc_dir, str(frontend_id)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        started.append(proc)
        assert proc.stdout.readline() == b"published\n"
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait(HANG_GUARD_S)
        proc.stdin.close()
        proc.stdout.close()


def reason(watch: OwnerWatch) -> str | None:
    return watch.check()[1]


def test_a_live_owner_is_worth_asking_and_its_record_names_it(ipc_dir, owner):
    proc = owner()
    record, why = OwnerWatch(ipc_dir, 0).check()
    assert why is None
    assert record.pid == proc.pid and record.address == "unused.sock"
    assert record.start_ticks == start_ticks(proc.pid)


def test_an_unpublished_owner_is_not_published(ipc_dir):
    assert OwnerWatch(ipc_dir, 3).check() == (None, NOT_PUBLISHED)


def test_a_stopped_owner_reads_stopped_and_live_again_once_continued(ipc_dir, owner):
    proc = owner()
    liveness = OwnerWatch(ipc_dir, 0)
    assert reason(liveness) is None
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: reason(liveness) == STOPPED, "the owner to read stopped")
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    wait_until(lambda: reason(liveness) is None, "the continued owner to read live")


def test_a_killed_owner_reads_zombie_until_reaped_then_dead(ipc_dir, owner):
    proc = owner()
    liveness = OwnerWatch(ipc_dir, 0)
    assert reason(liveness) is None
    proc.kill()
    wait_until(lambda: reason(liveness) == ZOMBIE, "the unreaped owner to read zombie")
    proc.wait(HANG_GUARD_S)
    assert reason(liveness) == DEAD
    # A reader that never saw it alive concludes the same from the record.
    assert reason(OwnerWatch(ipc_dir, 0)) == DEAD


def test_a_record_whose_pid_now_names_another_process_reads_pid_reused(ipc_dir, owner):
    proc = owner()
    path = record_path(ipc_dir, 0)
    with open(path) as f:
        fields = json.load(f)
    # The pid is alive, but it started at another time than the owner that
    # published: what a reused pid looks like.
    fields["start_ticks"] += 1
    fields["create_time"] -= 100
    os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(fields, f)
    record, why = OwnerWatch(ipc_dir, 0).check()
    assert record.pid == proc.pid and why == PID_REUSED


def test_an_owner_that_timed_out_is_backed_off_until_it_is_replaced(ipc_dir, owner):
    owner()
    liveness = OwnerWatch(ipc_dir, 0, backoff_s=HANG_GUARD_S)
    record, why = liveness.check()
    assert why is None
    liveness.timed_out(record)
    assert reason(liveness) == BACKOFF
    assert reason(liveness) == BACKOFF  # not a one-off: for backoff_s
    assert reason(OwnerWatch(ipc_dir, 0)) is None  # another process's view has no back-off
    # A new owner of the same frontend id is a different incarnation: asked at once.
    successor = owner(0)
    wait_until(lambda: reason(liveness) is None, "the successor to be worth asking")
    assert liveness.check()[0].pid == successor.pid
    with pytest.raises(ValueError):
        OwnerWatch(ipc_dir, 0, backoff_s=-1)


def test_a_record_others_may_write_or_reached_through_a_link_is_refused(ipc_dir, owner, tmp_path):
    owner()
    path = record_path(ipc_dir, 0)
    assert read_record(path) is not None
    os.chmod(path, 0o644)  # readable by others (in a 0700 dir) is harmless
    assert read_record(path) is not None
    os.chmod(path, 0o664)
    assert read_record(path) is None
    assert OwnerWatch(ipc_dir, 0, revalidate_s=0).check() == (None, NOT_PUBLISHED)
    os.chmod(path, 0o600)
    assert reason(OwnerWatch(ipc_dir, 0)) is None
    # The same record, reached through a symbolic link, is refused too.
    elsewhere = tmp_path / "elsewhere.json"
    os.rename(path, elsewhere)
    os.symlink(elsewhere, path)
    assert read_record(str(elsewhere)) is not None
    assert OwnerWatch(ipc_dir, 0).check() == (None, NOT_PUBLISHED)


def test_publish_replaces_the_record_atomically_and_leaves_no_temporary_file(ipc_dir):
    first = publish(ipc_dir, 5, "first.sock")
    second = publish(ipc_dir, 5, "second.sock")
    assert first.incarnation != second.incarnation
    assert read_record(record_path(ipc_dir, 5)) == second
    assert os.listdir(ipc_dir) == [os.path.basename(record_path(ipc_dir, 5))]

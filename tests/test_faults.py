"""Owners that die, stop, hang, restart, close, or meet hostile clients; and liveness.

Every test runs real frontend processes (see mptok_harness.frontends) with the real
cache and tokenizer and checks exact ids. What a fault cost is asserted
through the fallback counters, never through wall-clock time.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator

import psutil
import pytest

from mptok.routing.liveness import OwnerWatch, publish, read_record, record_path, start_ticks, unpublish
from mptok.transport import socket_path
from mptok_harness.checks import HANG_GUARD_S, wait_until
from mptok_harness.checks import expected_ids as expected
from mptok_harness.frontends import Frontend, FrontendPool, key_owned_by
from mptok_harness.prompts import conversation


@pytest.fixture
def pool(tmp_path):
    frontends = FrontendPool(str(tmp_path / "ipc"))
    try:
        yield frontends
    finally:
        frontends.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Owner 0 and asker 1, shared by the tests that leave both running. The
    asker sends every prompt to the owner (``routing="always"``): under the
    default policy it keeps the owner's answer as its own copy and extends
    the next turn itself, and these tests are about the calls to the owner."""
    frontends = FrontendPool(str(tmp_path_factory.mktemp("pair") / "ipc"))
    try:
        owner, asker = frontends.start(
            [0, 1], 2, timeout_s=0.5, backoff_s=1.0, limits={"handshake_timeout_s": 0.5}, routing="always"
        )
        yield frontends, owner, asker
    finally:
        frontends.close()


def changes(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before[name] for name in after if after[name] != before[name]}


def routing(frontend) -> dict[str, int]:
    return frontend.stats()["routing"]


def status_of(pid: int) -> str:
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "gone"


@contextlib.contextmanager
def stopped(frontend: Frontend) -> Iterator[None]:
    """``frontend`` SIGSTOPped for the ``with`` block, then SIGCONTinued."""
    frontend.signal(signal.SIGSTOP)
    try:
        wait_until(lambda: status_of(frontend.pid) == "stopped", "the frontend to stop")
        yield
    finally:
        frontend.signal(signal.SIGCONT)


def owned_prompts(owner: int, n: int, count: int, prefix: str, **sizes) -> list[tuple[str, str]]:
    """First prompts of ``count`` conversations that ``owner`` owns."""
    return [
        (key_owned_by(owner, n, f"{prefix}-{i}"), conversation(zlib.crc32(f"{prefix}-{i}".encode()), 1, **sizes)[0])
        for i in range(count)
    ]


def assert_exact(tokenizer, items, results) -> None:
    for (key, text), result in zip(items, results, strict=True):
        assert result == ("ok", expected(tokenizer, text)), (key, result[:2])


def connections_to(address: str) -> int:
    """Connections to the Unix socket at ``address``, accepted or waiting in
    its backlog, as the kernel lists them."""
    with open("/proc/net/unix") as f:
        rows = [line.split() for line in f]
    return sum(1 for row in rows if len(row) == 8 and row[7] == address and row[5] != "01")  # 01: listening


def test_owner_sigkilled_in_the_middle_of_calls(pool, tokenizer):
    owner, asker = pool.start([0, 1], 2)
    items = owned_prompts(0, 2, 32, "killed", first_chars=60_000)
    answered, in_flight = items[:2], items[2:]
    assert_exact(tokenizer, answered, asker.call("encode_many", answered, 2))
    # The owner freezes, as in a native call that never releases the GIL;
    # calls reach it and wait; it dies under them.
    owner.hold_gil(int(HANG_GUARD_S))
    address = socket_path(pool.ipc_dir, 0)
    connected = connections_to(address)
    asker.send("encode_async", in_flight)
    wait_until(lambda: connections_to(address) > connected, "a call to reach the frozen owner")
    owner.signal(signal.SIGKILL)
    owner.process.join(HANG_GUARD_S)
    kind, results = asker.recv()
    assert kind == "done"
    assert_exact(tokenizer, in_flight, results)
    stats = routing(asker)
    assert stats["routed"] == len(answered)
    # Seen failing (an error), or found dead: a zombie until its parent reaps it.
    assert stats["fallback_error"] + stats["fallback_dead"] + stats["fallback_zombie"] >= 1
    assert stats["fallback_timeout"] == 0
    # From now on the dead owner is skipped without a call.
    key, text = owned_prompts(0, 2, 1, "after-kill")[0]
    assert asker.encode(key, text) == expected(tokenizer, text)
    after = routing(asker)
    assert after["fallback_dead"] == stats["fallback_dead"] + 1
    assert after["fallback_error"] == stats["fallback_error"]


def test_a_dead_owners_kept_conversations_are_served_here_without_a_liveness_check(pool, tokenizer):
    """What is kept is looked at before the owner's liveness: once its owner
    is SIGKILLed, a conversation this frontend keeps a copy of is extended
    here with no check (no fallback counted) and no call; one it keeps
    nothing of is checked, found dead and taken over here."""
    owner, asker = pool.start([0, 1], 2)  # the default policy
    key, other = key_owned_by(0, 2, "kept-dead"), key_owned_by(0, 2, "unkept-dead")
    turns = conversation(22, 3, first_chars=6000)
    assert asker.encode(key, turns[0]) == expected(tokenizer, turns[0])
    assert routing(asker)["copies_kept"] == 1
    owner.signal(signal.SIGKILL)
    owner.process.join(HANG_GUARD_S)
    before = routing(asker)
    for turn in turns[1:]:
        assert asker.encode(key, turn) == expected(tokenizer, turn)
    assert changes(before, routing(asker)) == {"kept_here": 2}
    unkept = conversation(23, 1, first_chars=6000)[0]
    assert asker.encode(other, unkept) == expected(tokenizer, unkept)
    assert changes(before, routing(asker)) == {"kept_here": 2, "fallback_dead": 1, "taken_over_here": 1}


def test_sigstopped_owner_is_skipped_at_once(pair, tokenizer):
    _, owner, asker = pair
    key, text = owned_prompts(0, 2, 1, "warm")[0]
    assert asker.encode(key, text) == expected(tokenizer, text)
    before = routing(asker)
    with stopped(owner):
        items = owned_prompts(0, 2, 5, "stopped")
        assert_exact(tokenizer, items, asker.call("encode_many", items, 5))
    # Skipped without a call: no timeout, no error.
    assert changes(before, routing(asker)) == {"fallback_stopped": 5, "taken_over_here": 5}
    wait_until(lambda: status_of(owner.pid) != "stopped", "the owner to resume")
    assert_exact(tokenizer, items[:1], asker.call("encode_many", items[:1], 1))
    assert routing(asker)["routed"] == before["routed"] + 1


def test_an_owner_stopped_since_its_last_check_is_given_up_mid_call(pair, tokenizer):
    # An owner found live (or that answered) less than a second ago is asked
    # for the next turn's delta at once; the check then runs while the call
    # is in flight.
    _, owner, asker = pair
    key = key_owned_by(0, 2, "stopped-mid-call")
    turns = conversation(12, 2, first_chars=6000)  # long enough for a fingerprint: the next turn is a delta
    assert asker.encode(key, turns[0]) == expected(tokenizer, turns[0])
    before, served = routing(asker), routing(owner)["served"]
    with stopped(owner):
        assert asker.encode(key, turns[1]) == expected(tokenizer, turns[1])
    # Given up on the check, not after the 0.5 s timeout...
    assert changes(before, routing(asker)) == {"fallback_stopped": 1, "taken_over_here": 1}
    # ...made after the request was sent: the owner, resumed, answers it (to
    # a connection the asker has dropped).
    wait_until(lambda: routing(owner)["served"] == served + 1, "the resumed owner to answer the abandoned call")


def test_an_owner_slower_than_local_work_is_given_up_before_the_timeout(pool, tokenizer):
    # Every prompt to the owner, as in `pair`.
    timeout_s = 60
    owner, asker = pool.start([0, 1], 2, timeout_s=timeout_s, backoff_s=1.0, routing="always")
    key = key_owned_by(0, 2, "patience")
    turns = conversation(11, 2, first_chars=6000)  # long enough for a fingerprint: the next turn is a delta
    assert asker.encode(key, turns[0]) == expected(tokenizer, turns[0])
    before = routing(asker)
    # The owner holds the conversation but answers nothing for as long as
    # the route timeout; the asker's patience (1 s plus twice what the
    # prompt costs here) runs out first.
    owner.hold_gil(timeout_s)
    assert asker.encode(key, turns[1]) == expected(tokenizer, turns[1])
    assert changes(before, routing(asker)) == {"fallback_patience": 1, "route_failures": 1}


def test_owner_holding_the_gil_costs_one_timeout_then_backs_off(pair, tokenizer):
    _, owner, asker = pair
    key, text = owned_prompts(0, 2, 1, "warm")[0]
    assert asker.encode(key, text) == expected(tokenizer, text)
    before = routing(asker)
    # Longer than the timeout (0.5 s) plus the back-off (1 s).
    owner.hold_gil(2)
    items = owned_prompts(0, 2, 4, "gil")
    # One after another: the first call times out, the rest skip the owner.
    assert_exact(tokenizer, items, asker.call("encode_many", items, 1))
    assert changes(before, routing(asker)) == {
        "fallback_timeout": 1,
        "route_failures": 1,
        "fallback_backoff": 3,
        "taken_over_here": 3,
    }
    # Once the owner runs again (it answers) and the back-off is over, it is
    # asked again, on a new connection.
    owner.stats()
    assert_exact(tokenizer, items[:1], asker.call("encode_many", items[:1], 1))
    assert routing(asker)["routed"] == before["routed"] + 1


def test_garbage_and_silent_clients_do_not_disturb_service(pair, tokenizer):
    pool, owner, asker = pair
    address = socket_path(pool.ipc_dir, 0)
    key, text = owned_prompts(0, 2, 1, "meanwhile")[0]
    assert asker.encode(key, text) == expected(tokenizer, text)
    before = routing(owner)

    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(HANG_GUARD_S)
        s.connect(address)
        return s

    silent = connect()
    garbage = connect()
    garbage.sendall(random.Random(1).randbytes(4096))
    huge = connect()
    huge.sendall((2**31 - 1).to_bytes(4, "big") + b"x" * 100)
    for s in (garbage, huge):
        with contextlib.suppress(ConnectionResetError):
            while s.recv(65536):
                pass  # the server's challenge, then EOF
    assert asker.encode(key, text + " more") == expected(tokenizer, text + " more")
    # The silent client's handshake times out (0.5 s): its thread is freed
    # while the client still holds its socket open.
    wait_until(
        lambda: routing(owner)["handshake_failures"] == before["handshake_failures"] + 3,
        "the silent client to be dropped",
    )
    assert routing(owner)["active_connections"] == before["active_connections"]
    assert silent.recv(4096)  # the challenge it never answered...
    assert silent.recv(4096) == b""  # ...then EOF
    for s in (silent, garbage, huge):
        s.close()
    assert routing(owner)["served"] == before["served"] + 1


def test_restarted_owner_takes_its_conversations_back(pool, tokenizer):
    # Every turn to its owner ("always"): no copy kept where a turn lands
    # answers it first, so each turn shows which frontend owns the conversation.
    f0, f1, f2 = pool.start([0, 1, 2], 3, routing="always")
    key = key_owned_by(0, 3, "comeback", then=1)
    turns = conversation(5, 5)

    assert f2.encode(key, turns[0]) == expected(tokenizer, turns[0])
    assert routing(f2)["routed"] == 1
    # A second owner for id 0 is refused while the first lives...
    failure = pool.start_failing(0, 3)
    assert failure[:2] == ("failed", "OwnerAlreadyServing") and f"pid {f0.pid}" in failure[2]
    assert f2.encode(key, turns[0]) == expected(tokenizer, turns[0])
    assert routing(f0)["served"] == 2
    # ...and SIGKILL leaves the socket file behind, for the next owner to replace.
    f0.signal(signal.SIGKILL)
    f0.process.join(HANG_GUARD_S)
    assert os.path.exists(socket_path(pool.ipc_dir, 0))

    # While 0 is down, every frontend sends the conversation to 1, whose
    # cache then holds it: the second turn arriving there is a hit.
    hits_before = f1.stats()["cache"]["hits"]
    assert f2.encode(key, turns[1]) == expected(tokenizer, turns[1])
    assert f1.encode(key, turns[2]) == expected(tokenizer, turns[2])
    assert f1.stats()["cache"]["hits"] == hits_before + 1
    assert routing(f2)["fallback_dead"] == 1 and routing(f1)["taken_over_here"] == 1

    (g0,) = pool.start([0], 3)
    assert f2.encode(key, turns[3]) == expected(tokenizer, turns[3])
    assert f1.encode(key, turns[4]) == expected(tokenizer, turns[4])
    assert routing(g0)["served"] == 2
    assert g0.stats()["cache"]["hits"] == 1
    assert routing(f2)["routed"] == 4 and routing(f1)["routed"] == 1


def test_close_with_peers_blocked_on_the_owner(pool, tokenizer):
    owner, asker = pool.start([0, 1], 2, timeout_s=60.0)
    items = owned_prompts(0, 2, 8, "closing", first_chars=150_000)
    asker.send("encode_async", items)
    wait_until(lambda: routing(owner)["served"] >= 1, "the owner to serve a call")
    closed = owner.call("close")
    assert closed == {"threads": [], "socket_exists": False}
    kind, results = asker.recv()
    assert kind == "done"
    assert_exact(tokenizer, items, results)
    stats = routing(asker)
    assert stats["fallback_timeout"] == 0
    assert stats["routed"] + stats["fallback_error"] + stats["fallback_not_published"] == 8
    assert not os.path.exists(socket_path(pool.ipc_dir, 0))


# -- liveness, against real processes ----------------------------------------


@pytest.fixture
def child():
    procs = []

    def start() -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        for signum in (signal.SIGCONT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signum)
        proc.wait(10)


def write_record(ipc_dir: str, frontend_id: int, pid: int, create_time: float, **fields) -> None:
    path = record_path(ipc_dir, frontend_id)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"pid": pid, "create_time": create_time, "address": "x", "nonce": str(time.time_ns()), **fields}, f)
    os.replace(tmp, path)


def test_liveness_names_each_reason_to_skip(tmp_path, child):
    ipc_dir = str(tmp_path)
    live = {i: OwnerWatch(ipc_dir, i, backoff_s=60.0) for i in range(4)}
    assert live[0].check() == (None, "not_published")

    record = publish(ipc_dir, 0, "/some/address")
    assert read_record(record_path(ipc_dir, 0)) == record
    assert live[0].check() == (record, None)

    stopped = child()
    write_record(ipc_dir, 1, stopped.pid, psutil.Process(stopped.pid).create_time())
    assert live[1].check()[1] is None
    os.kill(stopped.pid, signal.SIGSTOP)
    wait_until(lambda: status_of(stopped.pid) == "stopped", "the child to stop")
    assert live[1].check()[1] == "stopped"

    zombie = child()
    write_record(ipc_dir, 2, zombie.pid, psutil.Process(zombie.pid).create_time())
    os.kill(zombie.pid, signal.SIGKILL)  # not reaped: a zombie
    wait_until(lambda: status_of(zombie.pid) == "zombie", "the child to die")
    assert live[2].check()[1] == "zombie"
    zombie.wait()
    assert live[2].check()[1] == "dead"

    reused = child()
    write_record(ipc_dir, 3, reused.pid, psutil.Process(reused.pid).create_time() - 100)
    assert live[3].check()[1] == "pid_reused"

    # A timed-out owner is skipped until it is replaced by a new one.
    live[0].timed_out(record)
    assert live[0].check()[1] == "backoff"
    unpublish(ipc_dir, 0, record)
    assert live[0].check()[1] == "not_published"
    replacement = publish(ipc_dir, 0, "/some/address")
    assert live[0].check() == (replacement, None)
    # unpublish leaves a successor's record alone.
    unpublish(ipc_dir, 0, record)
    assert read_record(record_path(ipc_dir, 0)) == replacement
    assert sorted(os.listdir(ipc_dir)) == [f"owner-{i}.json" for i in range(4)]


def soak(pool, tokenizer, rounds: int, seed: int) -> list[str]:
    """``rounds`` rounds of three frontends serving twelve conversations, one
    turn a round, while one frontend, picked at random, is SIGKILLed (and
    restarted after the round), SIGSTOPped (and continued), or left alone;
    every id is exact. Every round runs (each wait is bounded, none by a
    clock that could end the soak early); returns each round's action."""
    n = 3
    frontends = dict(enumerate(pool.start(list(range(n)), n, timeout_s=1.0, backoff_s=0.5)))
    rng = random.Random(seed)
    convs = {f"soak-{i}": conversation(300 + i, rounds, first_chars=4000) for i in range(12)}
    actions = []
    for turn in range(rounds):
        victim = rng.randrange(n)
        action = rng.choice(("kill", "stop", "none"))
        if action == "kill":
            frontends[victim].signal(signal.SIGKILL)
            frontends[victim].process.join(HANG_GUARD_S)
            assert frontends[victim].process.exitcode == -signal.SIGKILL
        elif action == "stop":
            frontends[victim].signal(signal.SIGSTOP)
            wait_until(lambda: status_of(frontends[victim].pid) == "stopped", "the frontend to stop")
        askers = [f for i, f in frontends.items() if not (i == victim and action != "none")]
        items = [(key, c[turn]) for key, c in convs.items()]
        for f in askers:
            f.send("encode_many", items, 12)
        for f in askers:
            assert_exact(tokenizer, items, f.recv())
        if action == "kill":
            (frontends[victim],) = pool.start([victim], n, timeout_s=1.0, backoff_s=0.5)
        elif action == "stop":
            frontends[victim].signal(signal.SIGCONT)
        actions.append(action)
    return actions


def test_frontends_killed_and_stopped_while_serving(pool, tokenizer):
    """The soak's bounded form, run by ``make test``: one frontend killed, one
    stopped, one round left alone (seed 8's three rounds)."""
    assert soak(pool, tokenizer, rounds=3, seed=8) == ["stop", "kill", "none"]


@pytest.mark.slow
def test_soak_frontends_killed_stopped_and_restarted_while_serving(pool, tokenizer):
    """Eight rounds of random kills and stops under load (``make soak``)."""
    actions = soak(pool, tokenizer, rounds=8, seed=7)
    assert {"kill", "stop"} <= set(actions)


# -- owners that are ready when published; one deadline per prompt -----------


def test_a_cold_owner_is_ready_when_peers_can_see_it(pool, tokenizer):
    # Peers give an owner 1 s, less than building a tokenizer backend takes.
    # Owners start as a library user starts them (no warm-up of their own),
    # and are asked the moment their record appears: at start, after a
    # restart, and as the next owner of a killed one's conversation.
    # Every turn to its owner ("always"): a copy kept by the asker would
    # answer the later turns without asking the restarted owners.
    options = dict(timeout_s=1.0, backoff_s=60.0, warm_up=False, routing="always")
    (asker,) = pool.start([2], 3, **options)
    key = key_owned_by(0, 3, "cold", then=1)
    turns = conversation(11, 3)

    def published(frontend) -> None:
        path = record_path(pool.ipc_dir, frontend.frontend_id)

        def by_it() -> bool:
            record = read_record(path)
            return record is not None and record.pid == frontend.process.pid

        wait_until(by_it, f"frontend {frontend.frontend_id} to publish")

    (first,) = pool.launch([0], 3, **options)
    published(first)
    assert asker.encode(key, turns[0]) == expected(tokenizer, turns[0])
    first.kill()
    (restarted,) = pool.launch([0], 3, **options)
    published(restarted)
    assert asker.encode(key, turns[1]) == expected(tokenizer, turns[1])
    (next_owner,) = pool.launch([1], 3, **options)
    published(next_owner)
    restarted.kill()
    assert asker.encode(key, turns[2]) == expected(tokenizer, turns[2])
    stats = routing(asker)
    assert (stats["routed"], stats["fallback_timeout"], stats["fallback_dead"]) == (3, 0, 1)


def test_both_calls_of_a_routed_prompt_share_one_deadline(pool, tokenizer):
    # The owner matches no fingerprint the asker holds, so the prompt takes
    # two calls, each 0.7 s: each within the asker's 1 s, together not.
    from mptok_harness.frontends import SLOW_MARKER

    pool.start_scripted_owner(0, delay_s=0.7)
    (asker,) = pool.start([1], 2, timeout_s=1.0, routing="always")  # every prompt to the owner, as in `pair`
    key = key_owned_by(0, 2, "deadline")
    first, second = conversation(12, 2, first_chars=6000)  # long enough for a fingerprint
    second += SLOW_MARKER
    assert asker.encode(key, first) == expected(tokenizer, first)
    assert routing(asker)["routed"] == 1
    assert asker.encode(key, second) == expected(tokenizer, second)
    stats = routing(asker)
    assert (stats["routed"], stats["routed_since"], stats["fallback_timeout"]) == (1, 0, 1)


# -- liveness and the wall clock ----------------------------------------------

linux_proc = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="start ticks are read from /proc")


@linux_proc
def test_a_clock_step_does_not_make_live_owners_look_like_reused_pids(pool, tokenizer):
    # psutil's create_time() moves with the wall clock: after a step of 1 s,
    # psutil reports every process 1 s off from what its owner published.
    # Shifting the published value is the same thing, seen from the asker.
    owner, asker = pool.start([0, 1], 2)
    path = record_path(pool.ipc_dir, 0)
    with open(path) as f:
        fields = json.load(f)
    fields["create_time"] += 1.0
    write_record(pool.ipc_dir, 0, **fields)
    key, text = owned_prompts(0, 2, 1, "clock-step")[0]
    assert asker.encode(key, text) == expected(tokenizer, text)
    stats = routing(asker)
    assert (stats["routed"], stats["fallback_pid_reused"]) == (1, 0)


@linux_proc
def test_a_skip_verdict_is_checked_again_though_the_record_did_not_change(tmp_path, child):
    # A verdict reached on a wrong reading must not stop routing to a live
    # owner for good. The wrong reading: a record rewritten in place with
    # the same size and mtime, wrong at first, so that it looks unchanged.
    ipc_dir = str(tmp_path)
    live = OwnerWatch(ipc_dir, 0, backoff_s=60.0, revalidate_s=0.05)
    proc = child()
    ticks, create_time = start_ticks(proc.pid), psutil.Process(proc.pid).create_time()
    path = record_path(ipc_dir, 0)

    def rewrite(ticks: int, create_time: float) -> None:
        with open(path, "r+" if os.path.exists(path) else "w") as f:
            f.write(f'{{"pid": {proc.pid}, "create_time": {create_time:.6f}, "start_ticks": {ticks}, '
                    f'"address": "x", "nonce": "n"}}')

    rewrite(ticks ^ 1, create_time + 100)
    assert live.check()[1] == "pid_reused"
    before = os.stat(path)
    rewrite(ticks, create_time)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    wait_until(lambda: live.check()[1] is None, "the owner to be found live again", timeout_s=10)

"""Pure logic the rest of the suite reaches only through real processes, tested on its own.

The supervisor's restart policy, the cache's content index, a route's
deadline, sizes and the engine memo's directory as an operator writes
them, warming a pool's threads, and what crosses the wire
between frontends: framing, the owner's reply record and the fingerprint.
Real objects throughout (a real socket pair for the wire); the whole file
runs in about a second.
"""

from __future__ import annotations

import math
import os
import pickle
import concurrent.futures
import socket
import struct
import threading
import time
from array import array
from collections import OrderedDict

import numpy as np
import pytest

from mptok.cache.prefix_cache import INDEX_BLOCK_CHARS, PrefixIndex
from mptok.cache.prefix_cache import INDEX_SAMPLE_CHARS as SAMPLE_CHARS
from mptok.core.deadline import Deadline
from mptok.core.file_locks import lock_by, try_lock
from mptok.core.protocol import BLOCK_CHARS, DIGEST_BYTES, SLACK_CHARS, Fingerprint, PeerReply, PeerRequest, extend_chain
from mptok.core.settings import engine_memo_dir, parse_bytes
from mptok.core.warm_threads import warm_every_thread
from mptok.routing.policy import PATIENCE_FLOOR_S
from mptok.routing.router import RouteLimits
from mptok.supervise.supervisor import RestartPolicy
from mptok.transport import ENCODE_TYPEID, MessageTooLarge, OwnerError
from mptok.transport.proxy import _reply_from
from mptok.transport.wire import MAX_MESSAGE_BYTES, TimedConnection

# -- RestartPolicy -----------------------------------------------------------------


def test_restart_delay_doubles_with_each_exit_up_to_its_cap():
    policy = RestartPolicy(max_restarts=10, window_s=60.0, first_delay_s=0.25)
    delays = [policy.delay_after_exit(float(t)) for t in range(8)]
    assert delays == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert policy.recent_exits == 8


def test_more_exits_than_allowed_within_the_window_is_a_crash_loop():
    policy = RestartPolicy(max_restarts=3, window_s=60.0, first_delay_s=0.25)
    assert [policy.delay_after_exit(t) for t in (0.0, 1.0, 2.0)] == [0.25, 0.5, 1.0]
    assert policy.delay_after_exit(3.0) is None
    assert policy.delay_after_exit(4.0) is None  # still looping: 5 exits within the window


def test_exits_older_than_the_window_are_forgotten():
    policy = RestartPolicy(max_restarts=2, window_s=10.0, first_delay_s=1.0)
    assert policy.delay_after_exit(0.0) == 1.0
    assert policy.delay_after_exit(10.0) == 2.0  # exactly the window apart: both count
    assert policy.delay_after_exit(15.0) == 2.0  # the exit at 0 has left the window
    assert policy.delay_after_exit(16.0) is None  # 10, 15 and 16: three within 10 s
    assert policy.delay_after_exit(100.0) == 1.0
    assert policy.recent_exits == 1


def test_a_given_up_frontend_tried_again_starts_a_fresh_count():
    policy = RestartPolicy(max_restarts=1, window_s=60.0, first_delay_s=0.5)
    assert policy.delay_after_exit(0.0) == 0.5
    assert policy.delay_after_exit(1.0) is None
    policy.forget_exits()
    assert policy.recent_exits == 0
    assert policy.delay_after_exit(2.0) == 0.5


# -- PrefixIndex -------------------------------------------------------------------


def _text(seed: int, chars: int) -> str:
    words = [f"w{seed}-{i} " for i in range(chars // 4 + 1)]
    return "".join(words)[:chars]


def test_index_finds_the_longest_filed_prompt_the_text_starts_with():
    index = PrefixIndex()
    long = _text(1, 3 * INDEX_BLOCK_CHARS + 100)
    index.add("short", long[:500])
    index.add("middle", long[: INDEX_BLOCK_CHARS + 7])
    index.add("long", long)
    assert len(index) == 3
    assert index.longest_prefix_of(long + " and more") == "long"
    assert index.longest_prefix_of(long) == "long"  # a prompt starts with itself
    assert index.longest_prefix_of(long[: 2 * INDEX_BLOCK_CHARS]) == "middle"
    assert index.longest_prefix_of(long[:600]) == "short"
    assert index.longest_prefix_of(long[:499]) is None  # shorter than anything filed
    assert index.longest_prefix_of(_text(2, 5000)) is None


def test_index_picks_the_longest_match_within_one_bucket():
    index = PrefixIndex()
    base = _text(3, 3000)  # both under one block: the same bucket
    index.add("a", base[:1000])
    index.add("b", base[:2000])
    index.add("other", _text(4, 2500))
    assert index.longest_prefix_of(base) == "b"
    assert index.longest_prefix_of(base[:1500]) == "a"


def test_adding_again_replaces_a_holders_prompt_and_discard_forgets_it():
    index = PrefixIndex()
    first, second = _text(5, 6000), _text(6, 6000)
    index.add("h", first)
    index.add("h", second)
    assert len(index) == 1
    assert index.longest_prefix_of(first) is None
    assert index.longest_prefix_of(second + "x") == "h"
    index.discard("h")
    index.discard("h")  # twice, or never filed: nothing happens
    index.discard("never")
    assert len(index) == 0 and index.longest_prefix_of(second) is None


def test_a_fingerprint_collision_costs_a_compare_never_a_wrong_holder():
    # The index samples the end of each block: two prompts that differ only
    # elsewhere share every fingerprint, and the compare tells them apart.
    filed = _text(7, 2 * INDEX_BLOCK_CHARS)
    other = filed[:100] + ("X" if filed[100] != "X" else "Y") + filed[101:]
    assert other[INDEX_BLOCK_CHARS - SAMPLE_CHARS : INDEX_BLOCK_CHARS] == filed[INDEX_BLOCK_CHARS - SAMPLE_CHARS : INDEX_BLOCK_CHARS]
    index = PrefixIndex()
    index.add("filed", filed)
    assert index.longest_prefix_of(other + " more") is None
    assert index.longest_prefix_of(filed + " more") == "filed"


# -- a route's deadline ------------------------------------------------------------


def test_a_route_without_patience_ends_at_its_timeout_for_every_call():
    before = time.monotonic()
    deadline = RouteLimits(5.0, 10.0, None).deadline(100_000)
    after = time.monotonic()
    assert before + 5.0 <= deadline.timeout.at <= after + 5.0
    assert math.isinf(deadline.patience.at)
    assert deadline.for_call(delta=True) == (deadline.timeout, False)
    assert deadline.for_call(delta=False) == (deadline.timeout, False)


def test_a_delta_call_ends_at_the_askers_patience_when_that_comes_first():
    before = time.monotonic()
    deadline = RouteLimits(30.0, 10.0, 1e-6).deadline(1_000_000)  # patience: 1 s floor + 1 s
    after = time.monotonic()
    assert before + PATIENCE_FLOOR_S + 1.0 <= deadline.patience.at <= after + PATIENCE_FLOOR_S + 1.0
    assert deadline.for_call(delta=True) == (deadline.patience, True)
    assert deadline.for_call(delta=False) == (deadline.timeout, False)  # a whole prompt waits the timeout


def test_patience_longer_than_the_timeout_leaves_the_timeout():
    deadline = RouteLimits(0.5, 10.0, 1e-3).deadline(10_000)  # patience 11 s
    assert deadline.for_call(delta=True) == (deadline.timeout, False)


def test_a_deadline_counts_down_and_then_raises():
    never = Deadline.after(None)
    assert not never.bounded and math.isinf(never.left()) and math.isinf(never.left_or_raise())
    left = Deadline.after(10.0).left_or_raise()
    assert 9.0 < left <= 10.0
    with pytest.raises(TimeoutError):
        Deadline(time.monotonic() - 0.001).left_or_raise()
    assert Deadline(time.monotonic() - 5.0).left() == 0.0 and Deadline(time.monotonic() - 5.0).passed
    assert 0.0 < Deadline.after(1.0).left() <= 1.0


# -- file locks --------------------------------------------------------------------


def test_a_held_lock_is_refused_at_once_or_by_the_deadline_and_taken_once_free(tmp_path):
    # flock locks belong to an open file: two opens are two holders, as two processes would be.
    path = tmp_path / "x.lock"
    path.write_text("")
    second = os.open(path, os.O_RDONLY)
    try:
        first = os.open(path, os.O_RDONLY)
        try:
            assert try_lock(first)
            assert not try_lock(second) and not try_lock(second, shared=True)
            assert not lock_by(second, Deadline.after(0.05))
        finally:
            os.close(first)  # the holder ends, and its lock with it
        assert lock_by(second, Deadline.after(10.0))
        third = os.open(path, os.O_RDONLY)
        try:
            assert not try_lock(third, shared=True)
        finally:
            os.close(third)
    finally:
        os.close(second)


def test_shared_locks_are_held_together_and_keep_an_exclusive_one_out(tmp_path):
    path = tmp_path / "x.lock"
    path.write_text("")
    fds = [os.open(path, os.O_RDONLY) for _ in range(3)]
    try:
        assert try_lock(fds[0], shared=True) and lock_by(fds[1], Deadline.after(1.0), shared=True)
        assert not try_lock(fds[2])
    finally:
        for fd in fds:
            os.close(fd)


# -- sizes -------------------------------------------------------------------------


# -- warming a pool's threads --------------------------------------------------


def test_every_thread_of_a_pool_is_warmed_once_and_then_serves():
    warmed: list[int] = []
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert warm_every_thread(pool, 4, lambda: warmed.append(threading.get_ident()), Deadline.after(10))
        assert len(warmed) == 4 and len(set(warmed)) == 4
        # Later work runs on those threads: none is started cold.
        served = {pool.submit(threading.get_ident).result() for _ in range(40)}
    assert served <= set(warmed)


def test_a_warm_up_that_fails_or_hangs_is_logged_and_the_pool_still_serves(caplog):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert not warm_every_thread(pool, 2, lambda: 1 / 0, Deadline.after(10))
        assert pool.submit(lambda: 7).result(timeout=10) == 7
    gate = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        started = time.monotonic()
        assert not warm_every_thread(pool, 2, gate.wait, Deadline.after(0.3))
        assert time.monotonic() - started < 5
        gate.set()
        assert pool.submit(lambda: 7).result(timeout=10) == 7
    assert "could not all be warmed" in caplog.text


@pytest.mark.parametrize(
    "text, size",
    [
        ("536870912", 536870912),
        ("512M", 512 << 20),
        ("512MiB", 512 << 20),
        ("512mb", 512 << 20),
        ("1G", 1 << 30),
        ("1GiB", 1 << 30),
        ("2k", 2048),
        ("4T", 4 << 40),
        ("100B", 100),
        (" 64M ", 64 << 20),
        ("1_024", 1024),
        ("0", 0),
    ],
)
def test_parse_bytes_reads_sizes_in_units_of_1024(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["", "lots", "1.5G", "-1", "12X", "M", "1 G", "1GG", "0x10", "1e9"])
def test_parse_bytes_refuses_anything_else(text):
    with pytest.raises(ValueError, match="is not a size in bytes"):
        parse_bytes(text)


@pytest.mark.parametrize(
    "environ, directory",
    [
        ({"HOME": "/home/u"}, "/home/u/.cache/mptok"),
        ({"HOME": "/home/u", "XDG_CACHE_HOME": "/var/cache/u"}, "/var/cache/u/mptok"),
        # XDG: a relative XDG_CACHE_HOME is ignored.
        ({"HOME": "/home/u", "XDG_CACHE_HOME": "cache"}, "/home/u/.cache/mptok"),
        ({"HOME": "/home/u", "MPTOK_ENGINE_MEMO": "/srv/memo/"}, "/srv/memo"),
        ({"HOME": "/home/u", "MPTOK_ENGINE_MEMO": " "}, "/home/u/.cache/mptok"),
        ({"HOME": "/home/u", "MPTOK_ENGINE_MEMO": "off"}, None),
        ({"HOME": "/home/u", "MPTOK_ENGINE_MEMO": "Off"}, None),
    ],
)
def test_the_engine_memo_is_in_the_users_cache_unless_the_variable_says_where_or_off(environ, directory):
    assert engine_memo_dir(environ) == directory


@pytest.mark.parametrize("value", ["memo", "./memo", "~/memo", "of"])
def test_the_engine_memo_variable_refuses_a_relative_path_in_one_line(value):
    with pytest.raises(ValueError, match=r"^MPTOK_ENGINE_MEMO=.* must be an absolute directory path, or 'off'$"):
        engine_memo_dir({"HOME": "/home/u", "MPTOK_ENGINE_MEMO": value})


# -- the wire: framing ---------------------------------------------------------------


def pair_of(cap: int) -> tuple[TimedConnection, TimedConnection]:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return TimedConnection(left, cap), TimedConnection(right, cap)


@pytest.fixture
def pair():
    ends = pair_of(MAX_MESSAGE_BYTES)
    yield ends
    for end in ends:
        end.close()


def test_messages_cross_whole_and_in_order_whatever_their_size(pair):
    sender, receiver = pair
    sizes = [0, 1, 65_000, 65_536, 300_000, 5 << 20]  # empty, the inbox's size, past it, past the first read
    messages = [bytes([i + 1]) * size for i, size in enumerate(sizes)]
    writer = threading.Thread(target=lambda: [sender.send_bytes(m) for m in messages])
    writer.start()
    received = [bytes(receiver.recv_bytes()) for _ in messages]
    writer.join()
    assert [len(m) for m in received] == sizes and received == messages


def test_the_managers_request_and_reply_round_trip(pair):
    asker, owner = pair
    sent = PeerRequest("tail text", "conversation-1", 12345678901234567890, 8192)
    request = (ENCODE_TYPEID, "encode", sent.to_wire(), {})
    asker.send(request)
    assert owner.recv() == request
    assert PeerRequest.from_wire(request[2]) == sent
    ids = np.array([0, 5, 2**31 - 1, 70000], dtype=np.int32)
    owner.send(("#RETURN", PeerReply(True, ids).to_wire()))
    reply = _reply_from("owner-0", asker.recv())
    assert reply.kept is True
    assert reply.ids.dtype == np.int32 and reply.ids.tolist() == ids.tolist()
    owner.send(("#RETURN", None))  # no kept prompt has the fingerprint
    assert _reply_from("owner-0", asker.recv()) is None


@pytest.mark.parametrize(
    "args",
    [
        ("text", None, None),  # a field missing
        (b"text", None, None, 0),  # text that is no str
        ("text", 5, None, 0),  # a key that is no str
        ("text", "k", "12", 0),  # a fingerprint that is no int
        ("text", "k", True, 0),  # nor a bool
        ("text", "k", None, 0.5),  # a count that is no int
    ],
)
def test_a_malformed_request_is_refused(args):
    with pytest.raises(ValueError):
        PeerRequest.from_wire(args)


def test_the_long_header_form_is_read(pair):
    sender, receiver = pair
    sender._sock.sendall(struct.pack("!iQ", -1, 5) + b"hello")
    assert receiver.recv_bytes() == b"hello"


def test_a_negative_length_ends_the_connection(pair):
    sender, receiver = pair
    sender._sock.sendall(struct.pack("!i", -2) + b"rest")
    with pytest.raises(OSError, match="length header -2"):
        receiver.recv_bytes()
    with pytest.raises(EOFError):  # shut down: the stream is useless after a refused frame
        sender.recv_bytes()


def test_a_message_over_the_cap_is_refused_unread():
    sender, receiver = pair_of(100)
    try:
        sender.send_bytes(b"x" * 100)
        assert len(receiver.recv_bytes()) == 100
        sender.send_bytes(b"x" * 101)
        with pytest.raises(MessageTooLarge):
            receiver.recv_bytes()
    finally:
        sender.close()
        receiver.close()


def test_a_message_over_the_readers_own_limit_is_refused(pair):
    sender, receiver = pair
    sender.send_bytes(b"y" * 11)
    with pytest.raises(MessageTooLarge):
        receiver.recv_bytes(maxlength=10)


@pytest.mark.parametrize(
    "frame",
    [
        struct.pack("!i", 100) + b"only ten b",  # a body cut short
        struct.pack("!i", 100)[:2],  # a header cut short
        struct.pack("!i", -1) + struct.pack("!Q", 5)[:3],  # a long header cut short
    ],
    ids=["body", "header", "long header"],
)
def test_a_truncated_frame_is_an_error_not_a_message(pair, frame):
    sender, receiver = pair
    sender._sock.sendall(frame)
    sender._sock.shutdown(socket.SHUT_WR)
    with pytest.raises(OSError, match="end of file during message"):
        receiver.recv_bytes()


def test_a_closed_connection_between_messages_is_end_of_file(pair):
    sender, receiver = pair
    sender.send_bytes(b"last")
    sender._sock.shutdown(socket.SHUT_WR)
    assert receiver.recv_bytes() == b"last"
    with pytest.raises(EOFError):
        receiver.recv_bytes()


@pytest.mark.parametrize("payload", [OrderedDict(a=1), array("i", [1, 2]), time.monotonic], ids=["class", "array", "function"])
def test_a_pickle_that_names_any_global_is_refused(pair, payload):
    sender, receiver = pair
    sender.send_bytes(pickle.dumps(payload, pickle.HIGHEST_PROTOCOL))
    with pytest.raises(pickle.UnpicklingError, match="refused to load global"):
        receiver.recv()


def test_a_message_not_there_by_the_deadline_times_out(pair):
    sender, receiver = pair
    receiver.deadline = Deadline.after(0.05)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        receiver.recv_bytes()
    assert time.monotonic() - started < 2.0
    receiver.deadline = Deadline(time.monotonic() - 1.0)  # already past: not even one read
    sender.send_bytes(b"too late")
    with pytest.raises(TimeoutError):
        receiver.recv_bytes()


# -- the wire: what an owner answers ---------------------------------------------------


def _wire_bytes(ids) -> bytes:
    """The ids' bytes as a reply carries them, pickled and read back."""
    _, payload = pickle.loads(pickle.dumps(PeerReply(True, ids).to_wire(), pickle.HIGHEST_PROTOCOL))
    return bytes(payload)


def test_ids_cross_as_native_int32_from_a_list_or_an_int32_buffer():
    ids = [0, 1, 128000, 2**31 - 1]
    expected = np.array(ids, dtype=np.int32).tobytes()
    assert _wire_bytes(ids) == expected
    assert _wire_bytes(np.array(ids, dtype=np.int32)) == expected
    assert _wire_bytes(array("i", ids)) == expected
    assert _wire_bytes(np.repeat(np.array(ids, dtype=np.int32), 2)[::2]) == expected  # strided
    assert _wire_bytes([]) == b""
    with pytest.raises(TypeError, match="int32"):
        PeerReply(True, np.array(ids, dtype=np.int64))
    with pytest.raises(ValueError, match="one-dimensional"):
        PeerReply(True, np.zeros((2, 2), dtype=np.int32))
    with pytest.raises(OverflowError):
        PeerReply(True, [1 << 40])


@pytest.mark.parametrize(
    "reply, error",
    [
        (("#RETURN", (True, b"\x01\x02\x03")), "not int32 ids"),  # truncated ids
        (("#RETURN", (True,)), "answered"),  # a field missing
        (("#RETURN", (True, b"", 0)), "answered"),  # one too many
        (("#RETURN", (1, b"")), "answered"),  # kept that is no bool
        (("#RETURN", ("yes", b"")), "answered"),  # nor a str
        (("#RETURN", (True, [1, 2])), "answered"),  # ids not as bytes
        (("#RETURN", "tokenizer exploded"), "could not tokenize the prompt: tokenizer exploded"),
        (("#ERROR", "boom"), "answered '#ERROR'"),
        ("not a tuple", "answered None"),
    ],
)
def test_a_malformed_reply_is_an_owner_error_never_ids(reply, error):
    with pytest.raises(OwnerError, match=error):
        _reply_from("owner-0", reply)


def test_a_fingerprint_crosses_as_two_ints_and_back():
    text = _text(8, 3 * BLOCK_CHARS + SLACK_CHARS + 10)
    held = Fingerprint.of(text, extend_chain(text))
    assert held is not None and held.blocks == 3 and held.chars == 3 * BLOCK_CHARS
    assert Fingerprint.from_wire(held.since, held.chars) == held
    assert held.matches(extend_chain(text + " next turn"))
    assert not held.matches(extend_chain("x" + text[1:]))
    assert Fingerprint.of(text[: BLOCK_CHARS + SLACK_CHARS - 1], extend_chain(text)) is None  # too short for one


@pytest.mark.parametrize(
    "since, shared_chars",
    [(0, BLOCK_CHARS), (-5, BLOCK_CHARS), (1 << (8 * DIGEST_BYTES), BLOCK_CHARS), (12345, 0), (12345, -BLOCK_CHARS), (12345, BLOCK_CHARS + 1)],
)
def test_values_no_fingerprint_has_are_refused_from_the_wire(since, shared_chars):
    assert Fingerprint.from_wire(since, shared_chars) is None


def test_ids_json_reuses_a_conversations_last_answer_and_writes_what_orjson_writes():
    import orjson

    from mptok.core.ids import IdPieces
    from mptok.serve.ids_json import CHUNK_IDS, IdsJson

    rng = np.random.default_rng(3)
    ids = rng.integers(0, 128_000, 6 * CHUNK_IDS).astype(np.int32)
    written = IdsJson(max_bytes=1 << 30)

    def check(array: np.ndarray, key: str | None = "chat") -> None:
        assert b"".join(written.parts(array, key)) == orjson.dumps(array, option=orjson.OPT_SERIALIZE_NUMPY)

    pieces = IdPieces.of(ids[: 2 * CHUNK_IDS + 5])
    check(pieces.array())
    pieces = pieces.spliced(pieces.length, ids[2 * CHUNK_IDS + 5 : 3 * CHUNK_IDS])  # an append: the same buffer
    check(pieces.array())
    rewritten = ids[: 3 * CHUNK_IDS].copy()
    rewritten[CHUNK_IDS + 7] += 1  # a changed id in a chunk the last answer wrote
    check(rewritten)
    check(ids[: CHUNK_IDS + 3])  # shorter than the last
    check(ids[1:])  # shifted: nothing shared
    check(ids, None)  # no conversation: nothing kept
    check(ids[:10])
    assert written.stats()["answers_kept"] == 1
    small = IdsJson(max_bytes=CHUNK_IDS)  # a bound below one answer: nothing kept, still right
    assert b"".join(small.parts(ids, "chat")) == orjson.dumps(ids, option=orjson.OPT_SERIALIZE_NUMPY)
    assert small.stats() == {"answers_kept": 0, "answer_bytes": 0}

"""The owner's manager server and the peers' proxy, on real Unix sockets.

These tests run both ends in one process (the server's threads and the
proxy's threads); the frontends-in-processes tests are in test_routing and
test_faults. Where the thing under test is the transport itself, the served
``encode`` is a small function whose answer shows what reached the owner.
"""

from __future__ import annotations

import ast
import contextlib
import dis
import functools
import inspect
import os
import socket
import stat
import struct
import sys
import threading
import time
from array import array
from multiprocessing import connection, managers

import pytest

import mptok
from mptok.core.deadline import Deadline
from mptok.core.private_files import secure_ipc_dir
from mptok.core.protocol import PeerReply, PeerRequest
from mptok.transport import (
    ENCODE_TYPEID,
    EncodeProxy,
    OwnerAlreadyServing,
    OwnerError,
    OwnerTimeout,
    OwnerUnreachable,
    ServerLimits,
    TokenizeManager,
    mp_private,
    serve_encode,
    socket_path,
)
from mptok_harness.checks import HANG_GUARD_S, wait_until

KEY = b"transport-test-key"


def echo(text: str, key: str | None) -> list[int]:
    return [ord(c) for c in text] + ([] if key is None else [-1] + [ord(c) for c in key])


def answer_in_full(encode):
    """The owner's answer for an ``encode(text, key) -> ids`` that keeps no prompt (no delta matches)."""

    def answer(request: PeerRequest) -> PeerReply | None:
        return None if request.delta else PeerReply(False, encode(request.text, request.key))

    return answer


def ids_from(proxy: EncodeProxy, text: str, key: str | None = None) -> list[int]:
    """The owner's ids for the whole ``text``, as a list."""
    reply = proxy.ask(PeerRequest(text, key))
    assert reply is not None
    return reply.ids.tolist()


@pytest.fixture
def ipc_dir(tmp_path):
    return secure_ipc_dir(str(tmp_path / "ipc"))


@pytest.fixture
def serve(ipc_dir):
    """serve(encode, frontend_id=0, **limits) -> (manager, address); all shut down after the test."""
    started = []

    def start(encode, frontend_id: int = 0, **limits) -> tuple[TokenizeManager, str]:
        address = socket_path(ipc_dir, frontend_id)
        manager = serve_encode(address, answer_in_full(encode), KEY, ServerLimits(**limits), name=f"mptok-test-{frontend_id}")
        started.append(manager)
        return manager, address

    yield start
    for manager in started:
        assert manager.shutdown()


def mptok_threads() -> list[str]:
    """The owner's threads (its accept loop and one per peer), by the default
    name ``serve_encode`` gives them; process-wide daemons of other layers
    (the fast backends' verifier) are not the transport's to join."""
    return [t.name for t in threading.enumerate() if t.name.startswith("mptok-owner")]


def test_text_and_key_with_lone_surrogates_cross_intact(serve):
    _, address = serve(echo)
    proxy = EncodeProxy(address, KEY)
    text = "a\ud800b\udfff 🙂 \x00 é\r\n" * 5000
    assert ids_from(proxy, text, "k\udc80") == echo(text, "k\udc80")
    assert ids_from(proxy, "", None) == []


def test_ids_cross_as_int32_from_a_list_or_any_int32_buffer_and_arrive_as_int32(serve):
    numpy = pytest.importorskip("numpy")
    want = [0, 1, -1, 2**31 - 1, -(2**31), 128_000] * 1000
    forms = {
        "list": list,
        "array": lambda ids: array("i", ids),
        "numpy": lambda ids: numpy.array(ids, dtype=numpy.int32),
        "numpy view": lambda ids: numpy.repeat(numpy.array(ids, dtype=numpy.int32), 2)[::2],  # strided
        "int64": lambda ids: numpy.array(ids, dtype=numpy.int64),
    }
    _, address = serve(lambda text, key: forms[text](want))
    proxy = EncodeProxy(address, KEY)
    for form in ("list", "array", "numpy", "numpy view"):
        reply = proxy.ask(PeerRequest(form, None))
        # The received bytes themselves, read as int32 (no copy on arrival).
        assert isinstance(reply.ids, numpy.ndarray) and reply.ids.dtype == numpy.int32, form
        assert isinstance(reply.ids.base, (bytes, bytearray)), form
        assert reply.ids.tolist() == want, form
    with pytest.raises(OwnerError, match="int32"):
        proxy.ask(PeerRequest("int64", None))


def test_the_handshake_is_this_pythons_own(serve, monkeypatch):
    # 3.12 added digest negotiation ("{sha256}" challenges); 3.11 sends a
    # bare HMAC-MD5 challenge. Both ends run the stdlib's handshake over the
    # deadline-bounded connection, so both versions work.
    challenges: list[bytes] = []
    deliver = connection.deliver_challenge

    def spy(conn, authkey, *args, **kwargs):
        send_bytes = conn.send_bytes
        conn.send_bytes = lambda buf: (challenges.append(bytes(buf)), send_bytes(buf))[1]
        try:
            return deliver(conn, authkey, *args, **kwargs)
        finally:
            del conn.send_bytes

    monkeypatch.setattr(connection, "deliver_challenge", spy)
    _, address = serve(echo)
    assert ids_from(EncodeProxy(address, KEY), "hi") == echo("hi", None)
    sent = [c for c in challenges if c.startswith(b"#CHALLENGE#")]
    assert len(sent) == 2  # the owner's, and the peer's to the owner
    assert all(c.startswith(b"#CHALLENGE#{sha256}") == (sys.version_info >= (3, 12)) for c in sent)


def test_a_real_cache_answers_exactly_and_reports_what_it_cannot_tokenize(serve):
    tokenizer = mptok.load_tokenizer()
    cache = mptok.PrefixTokenCache()
    manager, address = serve(functools.partial(cache.encode, tokenizer))
    proxy = EncodeProxy(address, KEY, timeout_s=30)
    text = "Routed prompts come back exact, emoji 🙂 and all. " * 1000
    assert ids_from(proxy, text, "conversation") == tokenizer(text, add_special_tokens=False)["input_ids"]
    with pytest.raises(OwnerError, match="could not tokenize"):
        ids_from(proxy, "lone \ud800 surrogate " * 20, "other")
    # The failure was the tokenizer's, on a healthy connection.
    assert ids_from(proxy, text + " more", "conversation")[-1] == tokenizer(" more")["input_ids"][-1]
    stats = manager.stats()
    assert (stats["served"], stats["serve_errors"], stats["accepted"]) == (2, 1, 1)
    assert cache.stats()["hits"] == 1


def test_a_timed_out_call_drops_its_connection_so_its_late_reply_is_never_read(serve):
    release = threading.Event()

    def slow_echo(text, key):
        if text == "slow":
            release.wait(HANG_GUARD_S)
        return echo(text, key)

    manager, address = serve(slow_echo)
    proxy = EncodeProxy(address, KEY, timeout_s=0.3)
    with pytest.raises(OwnerTimeout):
        ids_from(proxy, "slow")
    release.set()
    assert ids_from(proxy, "fast") == echo("fast", None)
    assert manager.stats()["accepted"] == 2


def test_reconnects_transparently_after_the_owner_restarts_on_the_same_path(serve):
    first, address = serve(echo)
    proxy = EncodeProxy(address, KEY)
    assert ids_from(proxy, "before") == echo("before", None)
    assert first.shutdown()
    second, _ = serve(lambda text, key: [42])
    # The thread's connection to the first owner is dead; the call replaces it.
    assert ids_from(proxy, "after") == [42]
    assert second.stats()["accepted"] == 1


def test_idle_connections_are_closed_and_peers_reconnect(serve):
    manager, address = serve(echo, idle_timeout_s=0.2)
    proxy = EncodeProxy(address, KEY)
    assert ids_from(proxy, "one") == echo("one", None)
    wait_until(lambda: manager.stats()["active_connections"] == 0, "the idle connection to close")
    assert ids_from(proxy, "two") == echo("two", None)
    assert manager.stats()["accepted"] == 2


def test_connections_beyond_the_cap_are_refused_at_once(serve):
    manager, address = serve(echo, max_connections=2)
    proxies = [EncodeProxy(address, KEY, timeout_s=HANG_GUARD_S) for _ in range(3)]
    assert ids_from(proxies[0], "a") == echo("a", None)
    assert ids_from(proxies[1], "b") == echo("b", None)
    with pytest.raises(OwnerUnreachable):
        ids_from(proxies[2], "c")
    assert manager.stats()["refused"] == 1
    proxies[0].close()
    wait_until(lambda: manager.stats()["active_connections"] == 1, "a slot to free")
    assert ids_from(proxies[2], "c") == echo("c", None)


def test_64_threads_connecting_at_once_all_get_through(serve):
    manager, address = serve(echo)
    proxy = EncodeProxy(address, KEY, timeout_s=HANG_GUARD_S)
    barrier = threading.Barrier(64)
    results: dict[int, object] = {}

    def call(i: int) -> None:
        barrier.wait(HANG_GUARD_S)
        try:
            results[i] = ids_from(proxy, f"thread {i}")
        except Exception as e:
            results[i] = e

    threads = [threading.Thread(target=call, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_GUARD_S)
    assert results == {i: echo(f"thread {i}", None) for i in range(64)}
    assert (manager.stats()["accepted"], manager.stats()["refused"]) == (64, 0)


def test_shutdown_wakes_idle_and_busy_peers_joins_every_thread_and_removes_the_socket(serve):
    entered = threading.Event()

    def busy_echo(text, key):
        if text == "busy":
            entered.set()
            time.sleep(0.3)
        return echo(text, key)

    manager, address = serve(busy_echo)
    idle = EncodeProxy(address, KEY, timeout_s=HANG_GUARD_S)
    assert ids_from(idle, "idle") == echo("idle", None)
    busy = EncodeProxy(address, KEY, timeout_s=HANG_GUARD_S)
    outcome: list[BaseException] = []

    def call_busy() -> None:
        try:
            ids_from(busy, "busy")
        except BaseException as e:
            outcome.append(e)

    caller = threading.Thread(target=call_busy)
    caller.start()
    assert entered.wait(HANG_GUARD_S)
    assert manager.shutdown() is True
    caller.join(HANG_GUARD_S)
    # The peer blocked on the owner was woken by the shutdown (EOF).
    assert len(outcome) == 1 and isinstance(outcome[0], OwnerUnreachable)
    assert mptok_threads() == []
    assert not os.path.exists(address)
    with pytest.raises(OwnerUnreachable):
        ids_from(idle, "after")
    assert manager.shutdown() is True  # idempotent


def test_proxy_close_fails_later_calls_at_once_and_frees_the_owners_threads(serve):
    manager, address = serve(echo)
    proxy = EncodeProxy(address, KEY)
    assert ids_from(proxy, "x") == echo("x", None)
    proxy.close()
    with pytest.raises(OwnerUnreachable, match="closed"):
        ids_from(proxy, "y")
    wait_until(lambda: manager.stats()["active_connections"] == 0, "the owner to see the close")


def listening(address: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(8)
    return listener


def test_every_step_of_a_call_is_bounded_against_a_server_that_never_answers(ipc_dir):
    # Never accepts: the connect succeeds, the handshake never comes.
    with listening(socket_path(ipc_dir, 7)) as mute, pytest.raises(OwnerTimeout):
        ids_from(EncodeProxy(mute.getsockname(), KEY, timeout_s=0.2), "anyone there?")


def test_a_reply_trickled_a_byte_at_a_time_cannot_hold_a_call_past_its_deadline(ipc_dir):
    # An owner that authenticates, then sends its reply one byte at a time:
    # every read gets something, yet the call ends at its deadline.
    with listening(socket_path(ipc_dir, 9)) as slow:
        stop = threading.Event()

        def trickle_the_reply() -> None:
            sock, _ = slow.accept()
            with sock, connection.Connection(os.dup(sock.fileno())) as conn:
                connection.deliver_challenge(conn, KEY)
                connection.answer_challenge(conn, KEY)
                conn.recv()
                conn.send(("#RETURN", None))
                conn.recv()
                reply = frame(("#RETURN", (0, 0, bytes(4000))))
                for i in range(len(reply)):
                    if stop.wait(0.02):
                        return
                    with contextlib.suppress(OSError):
                        sock.sendall(reply[i : i + 1])

        owner = threading.Thread(target=trickle_the_reply)
        owner.start()
        try:
            with pytest.raises(OwnerTimeout):
                EncodeProxy(slow.getsockname(), KEY, timeout_s=0.5).ask(PeerRequest("hello?", None))
        finally:
            stop.set()
            owner.join(HANG_GUARD_S)


def test_a_server_that_is_not_an_owner_fails_the_handshake(ipc_dir):
    with listening(socket_path(ipc_dir, 8)) as bogus:

        def answer_with_nonsense() -> None:
            conn, _ = bogus.accept()
            with conn:
                conn.sendall(b"\x00\x00\x00\x05hello")

        server = threading.Thread(target=answer_with_nonsense)
        server.start()
        with pytest.raises(OwnerUnreachable, match="connection with"):
            ids_from(EncodeProxy(bogus.getsockname(), KEY, timeout_s=HANG_GUARD_S), "hello?")
        server.join(HANG_GUARD_S)


def test_a_live_path_is_refused_and_a_stale_socket_file_is_replaced(serve, ipc_dir):
    _, address = serve(echo)
    with pytest.raises(OwnerAlreadyServing, match=f"pid {os.getpid()}"):
        serve_encode(address, answer_in_full(echo), KEY)
    assert ids_from(EncodeProxy(address, KEY), "still here") == echo("still here", None)
    # A socket file whose owner went away without removing it.
    stale = socket_path(ipc_dir, 3)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(stale)
    dead.close()
    _, address3 = serve(echo, frontend_id=3)
    assert address3 == stale
    assert ids_from(EncodeProxy(stale, KEY), "new") == echo("new", None)
    assert stat.S_IMODE(os.stat(stale).st_mode) == 0o600


def test_each_owner_in_a_process_has_its_own_registry_and_answers_for_itself(serve):
    first, a = serve(echo, frontend_id=0)
    second, b = serve(lambda text, key: [len(text)], frontend_id=1)
    assert ids_from(EncodeProxy(a, KEY), "abc") == echo("abc", None)
    assert ids_from(EncodeProxy(b, KEY), "abc") == [3]
    assert type(first) is not type(second)
    assert type(first)._registry is not type(second)._registry
    assert TokenizeManager._registry == {}


def test_the_ipc_dir_must_belong_to_this_user_and_be_closed_to_others(tmp_path):
    created = secure_ipc_dir(str(tmp_path / "new" / "ipc"))
    assert stat.S_IMODE(os.stat(created).st_mode) == 0o700
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o711)
    with pytest.raises(PermissionError, match="chmod 700"):
        secure_ipc_dir(str(open_dir))
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(NotADirectoryError):
        secure_ipc_dir(str(not_a_dir))
    if os.geteuid() == 0:
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 65534, 65534)
        with pytest.raises(PermissionError, match="belongs to uid 65534"):
            secure_ipc_dir(str(foreign))


def test_limits_and_keys_are_validated():
    with pytest.raises(ValueError):
        ServerLimits(max_connections=0)
    with pytest.raises(ValueError):
        ServerLimits(handshake_timeout_s=0)
    with pytest.raises(ValueError):
        EncodeProxy("/nowhere", b"")
    with pytest.raises(ValueError):
        TokenizeManager.for_owner()("/nowhere", "not bytes")  # type: ignore[arg-type]


def test_messages_cross_intact_however_they_are_split_and_however_many_are_queued():
    from mptok.transport.wire import TimedConnection

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender, receiver = TimedConnection(a, 1 << 24), TimedConnection(b, 1 << 24)
    try:
        receiver.deadline = sender.deadline = Deadline.after(HANG_GUARD_S)
        big = "x" * (3 << 20)  # larger than the inbox can ever grow
        messages = ["small", "y" * 100_000, big, "after the big one", "z" * 200_000, "last"]
        for message in messages:  # queued back to back: reads take several at once
            sender.send(message)
        assert [receiver.recv() for _ in messages] == messages
        # Trickled a few bytes at a time, the length header split in two.
        raw = connection.reduction.ForkingPickler.dumps(("trickled", "w" * 70_000))
        framed = len(raw).to_bytes(4, "big") + bytes(raw)

        def trickle() -> None:
            for i in [0, *range(2, len(framed), 3001)]:
                a.sendall(framed[i : 2 if i == 0 else i + 3001])
                time.sleep(0.0005)

        writer = threading.Thread(target=trickle)
        writer.start()
        assert receiver.recv() == ("trickled", "w" * 70_000)
        writer.join()
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(EOFError):
            receiver.recv()
    finally:
        sender.close()
        receiver.close()


# -- framing from an authenticated but hostile peer --------------------------


def authenticated_socket(address: str) -> socket.socket:
    """A connection that passed the handshake, to write raw frames on."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    conn = connection.Connection(os.dup(sock.fileno()))
    try:
        assert conn.poll(HANG_GUARD_S)
        connection.answer_challenge(conn, KEY)
        connection.deliver_challenge(conn, KEY)
        conn.send((None, "accept_connection", ("raw",), {}))
        assert conn.poll(HANG_GUARD_S)
        assert conn.recv() == ("#RETURN", None)
    finally:
        conn.close()
    sock.settimeout(HANG_GUARD_S)
    return sock


def frame(message: object) -> bytes:
    raw = bytes(connection.reduction.ForkingPickler.dumps(message))
    return struct.pack("!i", len(raw)) + raw


def read_until_eof(sock: socket.socket) -> bytes:
    """Everything the owner sends before it closes the connection (a hang fails the test)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def test_a_negative_frame_length_ends_the_connection_and_runs_nothing(serve):
    manager, address = serve(echo)
    request = (ENCODE_TYPEID, "encode", ("once", None, None, 0), {})
    # -1000 reaches back before the start of the inbox: the stream was read
    # from bytes already consumed, and a request ran again.
    for length in (-2, -1000, -(1 << 31)):
        with authenticated_socket(address) as sock:
            sock.sendall(struct.pack("!i", length) + frame(request) + frame(request))
            assert read_until_eof(sock) == b""
    assert manager.stats()["served"] == 0
    assert ids_from(EncodeProxy(address, KEY), "still serving") == echo("still serving", None)


def test_a_header_that_never_ends_times_out_with_the_message_timeout(serve):
    manager, address = serve(echo, message_timeout_s=0.3, idle_timeout_s=600)
    with authenticated_socket(address) as sock:
        sock.sendall(b"\x00\x00")  # half a length header, then silence
        assert read_until_eof(sock) == b""
    assert manager.stats()["served"] == 0


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak RSS is read from /proc")
def test_a_length_header_alone_allocates_no_large_buffer(serve):
    # 200 MiB announced (under the 256 MiB cap), then a few bytes and silence:
    # the owner gives up after the message timeout, having allocated little.
    manager, address = serve(echo, message_timeout_s=0.3)

    def peak_rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak becomes the current RSS
    before = peak_rss()
    with authenticated_socket(address) as sock:
        sock.sendall(struct.pack("!i", 200 << 20) + b"\x80\x04")
        assert read_until_eof(sock) == b""
    assert peak_rss() - before < 64 << 20
    assert manager.stats()["served"] == 0


def test_a_message_longer_than_a_first_read_arrives_whole(serve):
    from mptok.transport.wire import _FIRST_READ_BYTES

    _, address = serve(lambda text, key: [len(text)])
    text = "w" * (3 * _FIRST_READ_BYTES)
    assert ids_from(EncodeProxy(address, KEY, timeout_s=HANG_GUARD_S), text) == [len(text)]


# -- the ipc dir: no symbolic links, nothing left behind ----------------------


def test_a_planted_symlink_is_refused_and_its_target_left_untouched(ipc_dir, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    address = socket_path(ipc_dir, 0)
    os.symlink(victim, address + ".lock")
    with pytest.raises(PermissionError, match="symbolic link"):
        serve_encode(address, answer_in_full(echo), KEY)
    assert victim.read_text() == "precious"
    assert not os.path.exists(address)
    # The ipc dir itself may not be a link either, even to a good directory.
    linked = tmp_path / "linked-ipc"
    linked.symlink_to(ipc_dir)
    with pytest.raises(PermissionError, match="symbolic link"):
        secure_ipc_dir(str(linked))


def test_shutdown_leaves_neither_socket_nor_lock_file(serve, ipc_dir):
    manager, address = serve(echo)
    assert os.path.exists(address + ".lock")
    assert manager.shutdown()
    assert os.listdir(ipc_dir) == []
    # and the path can be served again at once
    again, _ = serve(echo)
    assert ids_from(EncodeProxy(address, KEY), "again") == echo("again", None)


def test_owners_racing_for_one_path_never_serve_it_at_once(ipc_dir):
    # close() removes the lock file while holding it; a contender that
    # opened the old file must not end up holding it beside the next owner.
    address = socket_path(ipc_dir, 0)
    holders: list[int] = []
    overlaps: list[list[int]] = []
    guard = threading.Lock()

    def contend(me: int) -> None:
        served = 0
        for _ in range(20_000):
            if served == 40:
                return
            try:
                manager = serve_encode(address, answer_in_full(echo), KEY, name=f"mptok-race-{me}")
            except OwnerAlreadyServing:
                continue
            with guard:
                holders.append(me)
                if len(holders) > 1:
                    overlaps.append(list(holders))
            time.sleep(0.0005)
            with guard:
                holders.remove(me)
            manager.shutdown()
            served += 1

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_GUARD_S)
    assert overlaps == []
    assert os.listdir(ipc_dir) == []


# -- the private surface of multiprocessing, fenced in mp_private -------------


def attributes_read_from_self(function) -> set[str]:
    """The attribute names ``function`` reads as ``self.name``, from its bytecode."""
    instructions = list(dis.get_instructions(function))
    return {
        after.argval
        for before, after in zip(instructions, instructions[1:])
        if before.opname == "LOAD_FAST" and before.argval == "self" and after.opname in ("LOAD_ATTR", "LOAD_METHOD")
    }


def test_the_private_surface_mp_private_relies_on_is_unchanged():
    """Fails on a CPython that moved any private name mp_private relies on (make test-versions: 3.12, 3.13)."""
    stock_server = managers.Server({}, None, KEY, "pickle")  # binds an arbitrary Unix address
    try:
        stock_fields = {managers.Server: set(vars(stock_server)), managers.BaseManager: set(vars(managers.BaseManager(authkey=KEY)))}
    finally:
        stock_server.listener.close()
    for private in mp_private.PRIVATE_SURFACE:
        where = f"{getattr(private.owner, '__name__', private.owner)}.{private.name} ({private.kind})"
        assert private.name in mp_private.__doc__, f"{where} is not in mp_private's docstring"
        if private.kind == "field":
            assert private.name in stock_fields[private.owner], f"{where}: no longer set by __init__"
            continue
        if private.kind == "read by serve_client":
            assert private.name in attributes_read_from_self(managers.Server.serve_client), where
            continue
        assert hasattr(private.owner, private.name), f"{where}: gone"
        if private.kind in ("override", "call"):
            parameters = inspect.signature(getattr(private.owner, private.name)).parameters
            names = tuple(parameters)
            if private.kind == "override":
                assert names == private.parameters, f"{where}: now {names}"
            else:
                assert names[: len(private.parameters)] == private.parameters, f"{where}: now {names}"
                extra = list(parameters.values())[len(private.parameters) :]
                assert all(p.default is not p.empty for p in extra), f"{where}: now {names}"

    # OwnerServer sets by hand what Server.__init__ sets (bar the Listener it
    # replaces) and what serve_client reads; nothing stock code reads is missing.
    hand_set = set(vars(mp_private.OwnerServer({}, "/nowhere", KEY))) - {"counters"}
    assert stock_fields[managers.Server] - {"listener"} | {"stop_event"} == hand_set
    assert attributes_read_from_self(managers.Server.serve_client) <= hand_set | {"fallback_mapping", "create"}


def test_no_other_transport_module_touches_the_private_surface():
    private_names = {p.name for p in mp_private.PRIVATE_SURFACE if p.name.startswith("_") or p.kind != "field"}
    private_names -= {"public", "INITIAL", "STARTED", "SHUTDOWN"}  # words too common to tell apart
    package = os.path.dirname(mp_private.__file__)
    for module in sorted(os.listdir(package)):
        if not module.endswith(".py") or module == "mp_private.py":
            continue
        with open(os.path.join(package, module)) as f:
            tree = ast.parse(f.read())
        # Names the code uses (attributes, names, definitions, imports), not its prose.
        used = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, ast.Name):
                used.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                used.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                used.update(alias.name for alias in node.names)
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("multiprocessing"):
                    assert [alias.name for alias in node.names] == ["AuthenticationError"], module
        assert used & private_names == set(), f"{module} uses names only mp_private may use"

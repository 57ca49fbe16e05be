"""Routing across real frontend processes: owners, exact ids, concurrency, refusals."""

from __future__ import annotations

import contextlib
import inspect
import os
import pickle
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from multiprocessing import connection, managers

import pytest

import mptok
from mptok.core.protocol import PeerReply, PeerRequest
from mptok.routing.owners import HANDED_OVER_FIRST, PEER_WORKERS
from mptok.routing.liveness import BACKOFF, FALLBACK_REASONS, PATIENCE, TIMEOUT
from mptok.core.deadline import Deadline
from mptok.routing.router import RouteLimits, owner_of, owner_order
from mptok.routing.owners import TokenizationOwners
from mptok.transport import ENCODE_TYPEID, EncodeProxy, OwnerUnreachable, socket_path
from mptok_harness.checks import expected_ids as expected
from mptok_harness.frontends import AUTHKEY, FrontendPool, key_owned_by
from mptok_harness.prompts import conversation

N = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    pool = FrontendPool(str(tmp_path_factory.mktemp("cluster") / "ipc"))
    try:
        yield pool, pool.start(list(range(N)), N)
    finally:
        pool.close()


def fallbacks(stats: dict) -> dict[str, int]:
    return {reason: stats["routing"][f"fallback_{reason}"] for reason in FALLBACK_REASONS}


NO_FALLBACKS = dict.fromkeys(FALLBACK_REASONS, 0)
# The harness's frontends keep TokenizationOwners' default back-off.
OWNER_BACKOFF_S = inspect.signature(TokenizationOwners).parameters["backoff_s"].default


# -- owner_order -------------------------------------------------------------


def test_owner_order_is_pinned_across_runs():
    # Pinned values: a change here would move every conversation of a
    # running fleet during a rolling upgrade.
    assert owner_order("conversation-1", 8) == [7, 1, 5, 6, 4, 0, 2, 3]
    assert owner_order("conv-🙂", 3) == [2, 1, 0]
    assert owner_order("x\ud800y", 8) == [6, 5, 4, 2, 1, 0, 3, 7]
    assert owner_of("conversation-1", 8) == 7
    assert mptok.owner_of("conversation-1", 8) == 7  # the public name
    assert owner_order("anything", 1) == [0]
    with pytest.raises(ValueError):
        owner_order("k", 0)


def test_owner_order_is_the_same_in_another_process_with_another_hash_seed():
    keys = [f"key-{i}" for i in range(50)]
    code = "import sys; from mptok.routing.router import owner_order; print([owner_order(k, 5) for k in sys.argv[1:]])"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code, *keys], env=env, capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.strip() == str([owner_order(k, 5) for k in keys])


def test_a_down_frontend_moves_only_its_own_conversations_and_spreads_them():
    keys = [f"conversation-{i}" for i in range(3000)]
    orders = {k: owner_order(k, 5) for k in keys}
    assert all(sorted(order) == list(range(5)) for order in orders.values())
    owners = Counter(order[0] for order in orders.values())
    assert all(450 <= n <= 750 for n in owners.values()), owners
    down = 2
    moved = Counter()
    for order in orders.values():
        live = [f for f in order if f != down]
        if order[0] != down:
            assert live[0] == order[0]
        else:
            moved[live[0]] += 1
    # The dead frontend's conversations spread over all the others.
    assert sorted(moved) == [0, 1, 3, 4] and min(moved.values()) > 60, moved


# -- the owner's threads -----------------------------------------------------


class _CacheNamingItsThreads(mptok.PrefixTokenCache):
    """A real cache that notes which threads answered peers."""

    def __init__(self):
        super().__init__()
        self.peer_threads: set[tuple[str, int]] = set()

    def extend_after(self, *args, **kwargs):
        self.peer_threads.add((threading.current_thread().name, threading.get_ident()))
        return super().extend_after(*args, **kwargs)


def test_an_owner_answers_every_connection_on_its_few_warm_workers(tmp_path, tokenizer):
    # A fast engine's first tokenization on a new thread costs tens of ms of
    # CPU; an owner answering on each connection's own thread paid that per
    # connection. Here 8 asking threads open 8 connections to one owner.
    ipc = str(tmp_path / "ipc")
    owner_cache = _CacheNamingItsThreads()
    convs = [conversation(4000 + i, 3, first_chars=2000) for i in range(8)]
    keys = [key_owned_by(0, 2, f"workers-{i}") for i in range(8)]
    # routing="always": every turn crosses to the owner, whose answering threads are what is tested.
    with (
        TokenizationOwners(ipc, 0, 2, owner_cache, tokenizer, authkey=AUTHKEY, routing="always") as owner,
        TokenizationOwners(ipc, 1, 2, mptok.PrefixTokenCache(), tokenizer, authkey=AUTHKEY, routing="always") as asker,
    ):
        answers: dict[int, list[list[int]]] = {}

        def ask(i: int) -> None:
            answers[i] = [asker.encode(tokenizer, text, keys[i]) for text in convs[i]]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        for i, conv in enumerate(convs):
            assert answers[i] == [expected(tokenizer, text) for text in conv]
        assert asker.stats()["routed"] == 24
        assert owner.stats()["accepted"] >= 8
    assert owner_cache.peer_threads, "no peer was answered"
    assert len(owner_cache.peer_threads) <= PEER_WORKERS, owner_cache.peer_threads
    assert all(name.startswith("mptok-peer-0") for name, _ in owner_cache.peer_threads), owner_cache.peer_threads


def test_a_busy_connections_thread_warms_itself_and_answers_on_its_own(tmp_path, tokenizer):
    # The hand-over costs two more wake-ups and GIL waits per call: a
    # connection past its first few requests is answered on its own thread.
    ipc = str(tmp_path / "ipc")
    owner_cache = _CacheNamingItsThreads()
    turns = HANDED_OVER_FIRST + 4
    conv = conversation(4100, turns, first_chars=2000)
    key = key_owned_by(0, 2, "busy")
    # routing="always": every turn crosses to the owner, whose answering threads are what is tested.
    with (
        TokenizationOwners(ipc, 0, 2, owner_cache, tokenizer, authkey=AUTHKEY, routing="always") as owner,
        TokenizationOwners(ipc, 1, 2, mptok.PrefixTokenCache(), tokenizer, authkey=AUTHKEY, routing="always") as asker,
    ):
        assert [asker.encode(tokenizer, text, key) for text in conv] == [expected(tokenizer, text) for text in conv]
        assert asker.stats()["routed"] == turns
        assert owner.stats()["accepted"] == 1
    names = {name for name, _ in owner_cache.peer_threads}
    workers = {name for name in names if name.startswith("mptok-peer-0")}
    assert workers and names - workers, names  # the first turns on a worker, the last on the connection's thread


# -- a running cluster -------------------------------------------------------


def test_prompts_sent_to_any_frontend_get_exact_ids_from_their_owner(cluster, tokenizer):
    _, frontends = cluster
    before = [f.stats() for f in frontends]
    keys = [f"exact-{i}" for i in range(6)]
    convs = {key: conversation(seed, 5) for seed, key in enumerate(keys)}
    for turn in range(5):
        for i, key in enumerate(keys):
            frontend = frontends[(turn + i) % N]
            text = convs[key][turn]
            assert frontend.encode(key, text) == expected(tokenizer, text)
    after = [f.stats() for f in frontends]
    routed = sum(a["routing"]["routed"] - b["routing"]["routed"] for a, b in zip(after, before, strict=True))
    owned = sum(a["routing"]["owned_here"] - b["routing"]["owned_here"] for a, b in zip(after, before, strict=True))
    kept = sum(a["routing"]["kept_here"] - b["routing"]["kept_here"] for a, b in zip(after, before, strict=True))
    # Each conversation's first turn on each of the two frontends that do
    # not own it goes to its owner; its later turns there extend the copy
    # kept from the owner's answer (the default policy).
    assert routed == 6 * 2 and routed + owned + kept == 30
    # Every turn after the first reached a cache that kept its conversation.
    hits = sum(a["cache"]["hits"] - b["cache"]["hits"] for a, b in zip(after, before, strict=True))
    assert hits == 6 * 4
    assert all(fallbacks(s) == NO_FALLBACKS for s in after)


def test_64_threads_in_each_frontend_at_once(cluster, tokenizer):
    _, frontends = cluster
    work = {}
    for f in frontends:
        convs = [conversation(1000 + 100 * f.frontend_id + i, 2, first_chars=600) for i in range(32)]
        # Two turns of 32 conversations: first turns and cache hits at once.
        work[f.frontend_id] = [(f"many-{f.frontend_id}-{i}", c[t]) for i, c in enumerate(convs) for t in (0, 1)]
    for f in frontends:
        f.send("encode_many", work[f.frontend_id], 64)
    for f in frontends:
        results = f.recv()
        for (key, text), result in zip(work[f.frontend_id], results, strict=True):
            assert result == ("ok", expected(tokenizer, text)), (key, result[:2])
    all_stats = [f.stats() for f in frontends]
    given_up = 0
    for stats in all_stats:
        # No call failed, no owner was skipped as gone. A call that ran past
        # the asker's patience or timeout is allowed: 4 x 64 threads on a
        # small machine under other load can starve an owner, and giving up
        # on it (then tokenizing here, exactly) is what routing is for; so
        # is skipping that owner for the back-off that follows, and only then.
        slow = {reason: 0 for reason in (PATIENCE, TIMEOUT, BACKOFF)}
        assert {**fallbacks(stats), **slow} == NO_FALLBACKS
        assert stats["routing"]["refused"] == 0
        gave_up_here = stats["routing"][f"fallback_{PATIENCE}"] + stats["routing"][f"fallback_{TIMEOUT}"]
        assert gave_up_here or not stats["routing"][f"fallback_{BACKOFF}"], stats["routing"]
        given_up += gave_up_here
    # An asker that gives up while its handshake is under way leaves the
    # owner a handshake that failed; no handshake fails otherwise.
    handshake_failures = sum(stats["routing"]["handshake_failures"] for stats in all_stats)
    assert handshake_failures <= given_up, (handshake_failures, given_up)
    if given_up:
        # An owner that timed out is skipped for the back-off; the tests
        # after this one, on the same cluster, expect every owner called.
        time.sleep(OWNER_BACKOFF_S)


def test_text_the_owner_cannot_tokenize_fails_with_the_askers_own_error(cluster, tokenizer):
    _, frontends = cluster
    asker = frontends[0]
    key = key_owned_by(1, N, "surrogate")
    text = "a lone surrogate \ud800 in a long prompt " * 20
    with pytest.raises(Exception) as local:
        tokenizer(text, add_special_tokens=False)
    owner_before, asker_before = frontends[1].stats(), asker.stats()
    reply = asker.call("encode", key, text)
    assert reply[:2] == ("raised", type(local.value).__name__)
    # The text reached the owner intact and failed there; the asker counted it.
    assert frontends[1].stats()["routing"]["serve_errors"] == owner_before["routing"]["serve_errors"] + 1
    assert asker.stats()["routing"]["fallback_error"] == asker_before["routing"]["fallback_error"] + 1


def test_wrong_authkey_is_refused_without_disturbing_service(cluster, tokenizer):
    pool, frontends = cluster
    address = socket_path(pool.ipc_dir, 2)
    before = frontends[2].stats()["routing"]
    intruder = EncodeProxy(address, b"not-the-key", timeout_s=5)
    with pytest.raises(OwnerUnreachable, match="authkey"):
        intruder.ask(PeerRequest("x" * 300, None))
    key = key_owned_by(2, N, "after-intruder")
    text = conversation(77, 1)[0]
    assert frontends[0].encode(key, text) == expected(tokenizer, text)
    after = frontends[2].stats()["routing"]
    assert after["handshake_failures"] == before["handshake_failures"] + 1
    assert after["served"] == before["served"] + 1


def test_peers_can_call_encode_and_nothing_else(cluster, tmp_path):
    pool, frontends = cluster
    address = socket_path(pool.ipc_dir, 1)
    before = frontends[1].stats()["routing"]

    # The stock client's connect() asks for 'dummy'; create, shutdown and
    # debug_info would create objects, stop the server or read its state.
    with pytest.raises(managers.RemoteError, match="refused"):
        managers.BaseManager(address=address, authkey=AUTHKEY).connect()
    for name, args in [("create", (ENCODE_TYPEID,)), ("shutdown", ()), ("debug_info", ()), ("serve_client", ())]:
        conn = connection.Client(address, authkey=AUTHKEY)
        with pytest.raises(managers.RemoteError, match="refused"):
            managers.dispatch(conn, None, name, args)
        conn.close()

    # On an accepted connection, only the exposed 'encode' of the service.
    conn = connection.Client(address, authkey=AUTHKEY)
    managers.dispatch(conn, None, "accept_connection", ("peer",))
    refused = [(ENCODE_TYPEID, "#GETVALUE"), (ENCODE_TYPEID, "__reduce__"), (ENCODE_TYPEID, "_encode"), ("0", "encode")]
    for ident, method in refused:
        conn.send((ident, method, (), {}))
        kind, _ = conn.recv()
        assert kind == "#TRACEBACK", (ident, method)

    # A request whose unpickling would call a function is refused unread.
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    conn.send_bytes(pickle.dumps((ENCODE_TYPEID, "encode", (Payload(),), {})))
    kind, message = conn.recv()
    assert kind == "#TRACEBACK" and "refused to load global" in message
    assert not marker.exists()
    conn.send((ENCODE_TYPEID, "encode", PeerRequest("still serving " * 30, None).to_wire(), {}))
    kind, reply = conn.recv()
    assert kind == "#RETURN" and PeerReply.from_wire(reply).ids.size > 0
    conn.close()

    after = frontends[1].stats()["routing"]
    assert after["refused_requests"] == before["refused_requests"] + 5


@contextlib.contextmanager
def in_process_owners(ipc_dir: str, tokenizer, count: int):
    """``count`` frontends' caches and owners in this process; closed after."""
    caches = [mptok.PrefixTokenCache() for _ in range(count)]
    owners = []
    try:
        for i in range(count):
            # Every prompt routed ("always"), so that what crosses is known in advance.
            owners.append(TokenizationOwners(ipc_dir, i, count, caches[i], tokenizer, authkey=AUTHKEY, routing="always"))
        yield caches, owners
    finally:
        for owner in owners:
            owner.close()


def test_two_owners_in_one_process_each_answer_for_themselves(tmp_path, tokenizer):
    ipc_dir = str(tmp_path / "ipc")
    with in_process_owners(ipc_dir, tokenizer, 3) as (caches, owners):
        managers_ = [o._manager for o in owners]
        registries = {id(type(m)._registry) for m in managers_}
        assert len(registries) == 3
        for owner in (0, 1):
            for text in conversation(owner, 3, first_chars=6000):
                key = key_owned_by(owner, 3, f"in-process-{owner}")
                assert owners[2].encode(tokenizer, text, key=key) == expected(tokenizer, text)
        served = [o.stats()["served"] for o in owners]
        assert served == [3, 3, 0]
        # After the first turn, frontend 2 holds each conversation's
        # fingerprint and sends only the new characters.
        assert [o.stats()["served_since"] for o in owners] == [2, 2, 0]
        assert owners[2].stats()["routed_since"] == 4
        # Each owner's cache holds only its own conversation.
        assert [c.stats()["entries"] for c in caches] == [1, 1, 0]
        assert owners[2].stats()["routed"] == 6
    assert not [p for p in os.listdir(ipc_dir) if p.endswith((".sock", ".json"))]


def test_only_keyed_prompts_the_cache_would_keep_are_routed(tmp_path, tokenizer):
    """The routed encoder asks an owner only for keyed prompts that the cache
    would keep, with the tokenizer it serves; anything else, and everything
    once it is closed, is tokenized by the local cache, with no call."""
    with in_process_owners(str(tmp_path / "ipc"), tokenizer, 2) as (caches, owners):
        key = key_owned_by(0, 2, "offered")
        rng = random.Random(6)
        long_text = conversation(6, 1)[0]
        assert len(long_text) >= caches[1].config.min_chars
        short = "short prompt"
        assert owners[1].encode(tokenizer, long_text + " keyless") == expected(tokenizer, long_text + " keyless")
        assert owners[1].encode(tokenizer, short, key=key) == expected(tokenizer, short)
        assert owners[0].stats()["served"] == 0 and owners[1].stats()["routed"] == 0
        assert caches[1].stats()["uncached"] == 1 and caches[1].stats()["misses"] == 1
        assert owners[1].encode(tokenizer, long_text, key=key) == expected(tokenizer, long_text)
        assert (owners[0].stats()["served"], owners[1].stats()["routed"]) == (1, 1)
        assert caches[0].stats()["entries"] == 1 and caches[1].stats()["entries"] == 1
        with pytest.raises(TypeError):
            owners[1].encode(tokenizer, b"bytes", key=key)
        with pytest.raises(ValueError):
            owners[1].encode(tokenizer, long_text, key="k" * 1000)
        owners[1].close()
        later = long_text + plain_words(rng)
        assert owners[1].encode(tokenizer, later, key=key) == expected(tokenizer, later)
        assert owners[0].stats()["served"] == 1 and owners[1].stats()["routed"] == 1
        assert caches[1].stats()["entries"] == 2


def test_an_owner_that_answers_a_whole_text_with_none_is_a_failed_call(tmp_path, tokenizer):
    """An owner that contradicts the protocol (None, "no such fingerprint",
    for a whole text that carried none) gives no ids: the prompt is
    tokenized here, counted as an error, and nothing is held for it."""
    from mptok.core.private_files import secure_ipc_dir
    from mptok.routing.liveness import publish, unpublish
    from mptok.transport import serve_encode, socket_path

    ipc_dir = secure_ipc_dir(str(tmp_path / "ipc"))
    address = socket_path(ipc_dir, 0)
    liar = serve_encode(address, lambda request: None, AUTHKEY, name="mptok-test-liar")
    record = publish(ipc_dir, 0, address)
    cache = mptok.PrefixTokenCache()
    try:
        # Every prompt routed ("always"): no copy of the first turn to extend here.
        with TokenizationOwners(ipc_dir, 1, 2, cache, tokenizer, authkey=AUTHKEY, routing="always") as asker:
            key = key_owned_by(0, 2, "liar")
            for text in conversation(3, 2, first_chars=9000):
                assert asker.encode(tokenizer, text, key=key) == expected(tokenizer, text)
            stats = asker.stats()
            assert (stats["routed"], stats["fallback_error"], stats["route_failures"]) == (0, 2, 2)
            assert stats["held_entries"] == 0 and cache.stats()["entries"] == 1
    finally:
        unpublish(ipc_dir, 0, record)
        liar.shutdown()


def plain_words(rng: random.Random) -> str:
    return " " + " ".join(rng.choice(("alpha", "beta", "gamma", "delta")) for _ in range(20))


def test_turns_asked_from_alternating_frontends_send_only_what_changed(tmp_path, tokenizer):
    """Turns of one conversation land on different frontends, as a port's
    processes take its connections: each asker sends only the characters after what its
    fingerprint covers, however many turns the owner kept since, and every
    id list is exact. A conversation the owner has forgotten costs one
    whole-text retry."""
    from mptok_harness.conversations import chat_turns

    with in_process_owners(str(tmp_path / "ipc"), tokenizer, 4) as (caches, owners):
        key = key_owned_by(0, 4, "alternating")
        # Frontend 3 asks again only after 20 turns went through others.
        askers = [1, 2, 3, 1, 1, 2] * 2 + [3] * 2 + [2] * 18 + [3]
        prompts = chat_turns(
            random.Random(5), "<｜User｜>", "<｜end▁of▁sentence｜>", turns=len(askers) + 1, words_per_message=800
        )
        assert len(prompts[0]) > 4096 + 256  # every prompt gets a fingerprint
        for asker, prompt in zip(askers, prompts):
            assert owners[asker].encode(tokenizer, prompt, key=key) == expected(tokenizer, prompt)
        caches[0].clear()
        assert owners[3].encode(tokenizer, prompts[-1], key=key) == expected(tokenizer, prompts[-1])
        served, since = owners[0].stats()["served"], owners[0].stats()["served_since"]
        asked = len(askers) + 1
        # Three first requests and one forgotten conversation go whole (the
        # forgotten one twice); every other turn is answered from a fingerprint.
        assert served == asked + 1 and since == asked - 4
        # The first turn and the one after the owner forgot are misses.
        assert caches[0].stats()["hits"] == asked - 2


@contextlib.contextmanager
def owner_and_asker(ipc_dir: str, tokenizer, asker_config: mptok.CacheConfig):
    """Frontends 0 and 1 in this process under the default policy, 1's
    cache under ``asker_config`` and holding a keyless prompt first, which
    is yielded with the caches and owners; closed after."""
    caches = [mptok.PrefixTokenCache(), mptok.PrefixTokenCache(asker_config)]
    owners = []
    try:
        owners = [TokenizationOwners(ipc_dir, i, 2, caches[i], tokenizer, authkey=AUTHKEY) for i in range(2)]
        unrelated = conversation(9, 1)[0]
        assert owners[1].encode(tokenizer, unrelated) == expected(tokenizer, unrelated)
        yield caches, owners, unrelated
    finally:
        for owner in owners:
            owner.close()


def assert_kept_what_it_had(cache, tokenizer, key: str, unrelated: str) -> None:
    """A cache with room for one entry kept its keyless prompt, not ``key``'s conversation."""
    assert cache.stats()["entries"] == 1
    assert cache.extend_if_kept(tokenizer, unrelated, key) is None
    assert cache.encode(tokenizer, unrelated) == expected(tokenizer, unrelated)
    assert cache.stats()["hits"] == 1


def test_an_owners_answer_is_kept_as_the_askers_copy_where_there_is_room(tmp_path, tokenizer):
    """Under the default policy a frontend that routed a prompt keeps the
    owner's ids as its own copy where that evicts nothing (nothing is
    tokenized for it), so the conversation's next turn to land there is
    extended there: a hit, with no crossing and no miss. A cache with no
    room keeps what it had. Every id list is exact."""
    from mptok_harness.conversations import chat_turns

    for max_entries in (None, 1):
        config = mptok.CacheConfig() if max_entries is None else mptok.CacheConfig(max_entries=max_entries)
        with owner_and_asker(str(tmp_path / "ipc"), tokenizer, config) as (caches, owners, unrelated):
            key = key_owned_by(0, 2, f"copy-{max_entries}")
            first, second = chat_turns(random.Random(3), "<｜User｜>", "<｜end▁of▁sentence｜>", turns=2, words_per_message=900)
            assert owners[1].encode(tokenizer, first, key=key) == expected(tokenizer, first)
            stats = owners[1].stats()
            assert stats["routed"] == 1 and caches[0].stats()["misses"] == 1  # the owner tokenized it
            assert owners[1].encode(tokenizer, second, key=key) == expected(tokenizer, second)
            after = owners[1].stats()
            if max_entries == 1:
                assert stats["copies_kept"] == 0
                assert_kept_what_it_had(caches[1], tokenizer, key, unrelated)
            else:
                assert stats["copies_kept"] == 1 and caches[1].stats()["misses"] == 1  # the keyless prompt only
                assert after["routed"] == 1 and after["kept_here"] == 1
                assert caches[1].stats()["hits"] == 1  # the second turn extended the copy


def test_a_frontend_that_keeps_a_conversation_extends_it_without_asking_its_owner(tmp_path, tokenizer):
    """Under the default policy what is kept decides: a conversation this
    frontend's cache keeps (here, one it tokenized itself before it had
    peers) is extended here, and its owner is never called, at any length
    (the later turns are long enough for a fingerprint). Every id list is exact."""
    from mptok_harness.conversations import chat_turns

    with owner_and_asker(str(tmp_path / "ipc"), tokenizer, mptok.CacheConfig()) as (caches, owners, _):
        key = key_owned_by(0, 2, "kept-here")
        prompts = chat_turns(random.Random(4), "<｜User｜>", "<｜end▁of▁sentence｜>", turns=4, words_per_message=900)
        assert len(prompts[1]) > 4096 + 256
        assert caches[1].encode(tokenizer, prompts[0], key=key) == expected(tokenizer, prompts[0])
        for prompt in prompts[1:]:
            assert owners[1].encode(tokenizer, prompt, key=key) == expected(tokenizer, prompt)
        stats = owners[1].stats()
        assert (stats["kept_here"], stats["routed"], owners[0].stats()["served"]) == (3, 0, 0)
        assert caches[1].stats()["hits"] == 3 and caches[0].stats()["entries"] == 0


def test_a_short_prompt_with_a_copy_kept_here_does_not_cross(tmp_path, tokenizer):
    """A prompt of 256 to 4,351 characters is cached but too short for a
    fingerprint: its first turn to land here goes to its owner, whose answer
    is kept as this frontend's copy, and its later turns extend that copy
    here instead of crossing again. Every id list is exact."""
    with owner_and_asker(str(tmp_path / "ipc"), tokenizer, mptok.CacheConfig()) as (caches, owners, _):
        key = key_owned_by(0, 2, "short")
        prompts = conversation(21, 4, first_chars=300, turn_chars=400)
        assert caches[1].config.min_chars <= len(prompts[0]) and len(prompts[-1]) < 4096 + 256
        for prompt in prompts:
            assert owners[1].encode(tokenizer, prompt, key=key) == expected(tokenizer, prompt)
        stats = owners[1].stats()
        assert (stats["routed"], stats["copies_kept"], stats["kept_here"]) == (1, 1, 3), stats
        assert owners[0].stats()["served"] == 1 and stats["held_entries"] == 0  # no fingerprint
        assert caches[1].stats()["hits"] == 3


def test_a_callers_deadline_that_has_passed_asks_no_owner_and_blames_none(tmp_path, tokenizer):
    """A route obeys its caller's deadline: once it has passed, the prompt is
    tokenized here (exact ids) without a call, and the owner is not backed
    off for it: the next prompt without a deadline is routed."""
    ipc_dir = str(tmp_path / "ipc")
    with in_process_owners(ipc_dir, tokenizer, 2) as (caches, owners):
        key = key_owned_by(0, 2, "deadline")
        first, second = conversation(0, 2, first_chars=6000)
        assert owners[1].encode(tokenizer, first, key=key, deadline=Deadline(0.0)) == expected(tokenizer, first)
        stats = owners[1].stats()
        assert (stats["routed"], stats[f"fallback_{TIMEOUT}"], owners[0].stats()["served"]) == (0, 1, 0)
        assert caches[1].stats()["entries"] == 1  # tokenized and kept here
        later = Deadline.after(600.0)
        assert owners[1].encode_array(tokenizer, second, key=key, deadline=later).tolist() == expected(tokenizer, second)
        assert (owners[1].stats()["routed"], owners[0].stats()["served"]) == (1, 1)


def test_a_routes_deadlines_are_the_earlier_of_its_limits_and_the_callers():
    limits = RouteLimits(timeout_s=5.0, backoff_s=1.0, patience_per_char_s=None)
    sooner, later = Deadline.after(1.0), Deadline.after(60.0)
    route = limits.deadline(1000, sooner)
    assert route.timeout == sooner and route.patience == sooner and not route.callers_passed
    route = limits.deadline(1000, later)
    assert route.timeout.at < later.at and route.patience == later
    route = limits.deadline(1000)
    assert route.given is None and not route.patience.bounded
    assert limits.deadline(1000, Deadline(0.0)).callers_passed

"""The cache's memory budget: everything it holds counted in bytes, evicted
by bytes, conversation ids bounded, and exact ids whatever was evicted or
failed to allocate."""

from __future__ import annotations

import gc
import os
import random
import secrets
import tracemalloc
import uuid
import warnings

import pytest

import mptok
import mptok.cache.prefix_cache
from mptok import CacheConfig, PrefixTokenCache
from mptok.api.tokenize_request import RequestError, parse_tokenize_request
from mptok.cache.config import DEFAULT_MAX_HELD_BYTES, MAX_KEY_BYTES
from mptok.core.protocol import Fingerprint, PeerRequest, extend_chain
from mptok.engines import choice
from mptok.routing.owners import PeerService
from mptok.routing.router import HeldFingerprints
from mptok_harness.checks import expected_ids as full_ids
from mptok_harness.conversations import plain_delta
from mptok_harness.prompts import conversation
from mptok_harness.serve import Server, scrape, tokenize, total, wait_for_snapshots

MiB = 1024 * 1024


def test_eviction_keeps_the_bytes_within_the_budget_and_ids_exact(tokenizer):
    budget = 1 * MiB
    cache = PrefixTokenCache(CacheConfig(max_bytes=budget, min_chars=0))
    rng = random.Random(1)
    texts = {f"conversation-{i}": plain_delta(rng, 4000) for i in range(24)}
    for key, text in texts.items():
        assert cache.encode(tokenizer, text, key=key) == full_ids(tokenizer, text)
        assert 0 < cache.stats()["cached_bytes"] <= budget
    stats = cache.stats()
    assert stats["entries"] < len(texts), "a 1 MiB budget cannot hold 24 prompts of ~20k characters and their ids"
    # The oldest was evicted: its next turn is tokenized in full, exactly.
    first = "conversation-0"
    longer = texts[first] + plain_delta(rng, 50)
    assert cache.encode(tokenizer, longer, key=first) == full_ids(tokenizer, longer)
    assert cache.stats()["misses"] == stats["misses"] + 1
    # The newest is kept: its next turn hits.
    last = f"conversation-{len(texts) - 1}"
    longer = texts[last] + plain_delta(rng, 50)
    before = cache.stats()["hits"]
    assert cache.encode(tokenizer, longer, key=last) == full_ids(tokenizer, longer)
    assert cache.stats()["hits"] == before + 1


def test_a_prompt_over_the_byte_budget_is_tokenized_not_kept(tokenizer):
    cache = PrefixTokenCache(CacheConfig(max_bytes=64 * 1024, min_chars=0))
    text = plain_delta(random.Random(2), 6000)  # ~30k characters: text + ids exceed 64 KiB
    assert cache.encode(tokenizer, text, key="big") == full_ids(tokenizer, text)
    assert cache.stats()["entries"] == 0 and cache.stats()["cached_bytes"] == 0


def test_keys_count_in_the_bytes(tokenizer):
    text = plain_delta(random.Random(3), 200)
    sizes = []
    for key in ("k", "k" * MAX_KEY_BYTES):
        cache = PrefixTokenCache(CacheConfig(min_chars=0))
        cache.encode(tokenizer, text, key=key)
        sizes.append(cache.stats()["cached_bytes"])
    assert sizes[1] - sizes[0] >= MAX_KEY_BYTES - 1


def test_a_new_prompt_replaces_its_predecessor_and_counts_only_the_buffer_it_pins(tokenizer):
    rng = random.Random(4)
    cache = PrefixTokenCache(CacheConfig(min_chars=0))
    base = plain_delta(rng, 12_000)
    cache.encode(tokenizer, base, key="c")
    alone = cache.stats()["cached_bytes"]
    ids_bytes = _entry(cache, "c").prompt.ids.nbytes
    assert 4 * len(full_ids(tokenizer, base)) <= ids_bytes <= 4.3 * len(full_ids(tokenizer, base)) + 2048
    # A prompt that shares nothing with it replaces it: nothing of the old
    # one stays beside it (peers name text by fingerprint, not by earlier
    # versions' ids).
    rewritten = "Z" + plain_delta(rng, 9_000)
    cache.encode(tokenizer, rewritten, key="c")
    assert cache.stats()["misses"] == 2 and cache.stats()["entries"] == 1
    assert cache.stats()["cached_bytes"] < alone
    # An extension shares its predecessor's buffer, counted once.
    longer = rewritten + plain_delta(rng, 30)
    before = _entry(cache, "c").prompt.ids
    cache.encode(tokenizer, longer, key="c")
    assert cache.stats()["hits"] == 1
    after = _entry(cache, "c").prompt.ids
    assert after.buffer is before.buffer or after.nbytes <= 4.3 * after.length + 2048


def _entry(cache: PrefixTokenCache, key: str):
    return next(entry for holder, entry in cache._kept._entries.items() if holder[1] == key)


def test_conversation_ids_longer_than_the_limit_are_refused(tokenizer):
    cache = PrefixTokenCache(CacheConfig(min_chars=0))
    text = "Hello there, a prompt."
    assert cache.encode(tokenizer, text, key="a" * MAX_KEY_BYTES) == full_ids(tokenizer, text)
    assert cache.encode(tokenizer, text, key="\u00e9" * (MAX_KEY_BYTES // 2)) == full_ids(tokenizer, text)
    for key in ("a" * (MAX_KEY_BYTES + 1), "\u00e9" * (MAX_KEY_BYTES // 2 + 1), "x" * 100_000):
        with pytest.raises(ValueError, match=f"at most {MAX_KEY_BYTES} bytes"):
            cache.encode(tokenizer, text, key=key)
        with pytest.raises(ValueError):
            PeerService(cache, tokenizer).answer(PeerRequest(text, key))
    assert cache.stats()["entries"] == 2
    # Over HTTP the same limit is a 400, from the body or from the header.
    with pytest.raises(RequestError) as refused:
        parse_tokenize_request(b'{"prompt": "hi", "conversation_id": "%s"}' % (b"a" * 257), None)
    assert refused.value.status == 400
    with pytest.raises(RequestError) as refused:
        parse_tokenize_request(b'{"prompt": "hi"}', "h" * 257)
    assert refused.value.status == 400
    assert parse_tokenize_request(b'{"prompt": "hi"}', "h" * 256).conversation_id == "h" * 256


def test_an_allocation_failure_empties_the_cache_and_the_ids_stay_exact(tokenizer, monkeypatch):
    rng = random.Random(5)
    cache = PrefixTokenCache(CacheConfig(min_chars=0))
    text = plain_delta(rng, 800)
    cache.encode(tokenizer, "another conversation " * 20, key="other")
    cache.encode(tokenizer, text, key="c")
    real_extend = mptok.cache.prefix_cache.extend_prompt
    failures = []

    def extend_out_of_memory(*args, **kwargs):
        if not failures:
            failures.append(1)
            raise MemoryError
        return real_extend(*args, **kwargs)

    monkeypatch.setattr(mptok.cache.prefix_cache, "extend_prompt", extend_out_of_memory)
    text += plain_delta(rng, 40)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "cache disabled" warning either
        assert cache.encode(tokenizer, text, key="c") == full_ids(tokenizer, text)
    stats = cache.stats()
    assert failures == [1]
    assert (stats["allocation_failures"], stats["disabled"], stats["entries"], stats["cached_bytes"]) == (1, 0, 0, 0)
    # The cache works again from the next prompt on.
    for _ in range(3):
        text += plain_delta(rng, 40)
        assert cache.encode(tokenizer, text, key="c") == full_ids(tokenizer, text)
    assert cache.stats()["hits"] == 2 and cache.stats()["entries"] == 1


def test_byte_budgets_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("MPTOK_CACHE_MAX_BYTES", "64M")
    assert CacheConfig.from_env().max_bytes == 64 * MiB
    assert CacheConfig.from_env().max_held_bytes == DEFAULT_MAX_HELD_BYTES  # fingerprints, whatever the cache's budget
    monkeypatch.setenv("MPTOK_CACHE_MAX_HELD_BYTES", "1M")
    assert CacheConfig.from_env().max_held_bytes == MiB
    monkeypatch.setenv("MPTOK_CACHE_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match="MPTOK_CACHE_MAX_BYTES"):
        CacheConfig.from_env()


def test_held_fingerprints_are_bounded_by_bytes_whatever_the_conversation_length():
    budget = 16 * 1024
    held = HeldFingerprints(max_bytes=budget)
    for i in range(200):
        text = f"conversation {i} " * (1000 + 5000 * (i % 3))
        held.put((1, 7), f"conversation-{i}", Fingerprint.of(text, extend_chain(text)))
        assert held.stats()["held_bytes"] <= budget
    stats = held.stats()
    assert 16 < stats["held_entries"] < 200  # under 1 KiB each, whatever the text's length
    assert held.get((1, 7), "conversation-199") is not None
    assert held.get((1, 7), "conversation-0") is None


def test_held_fingerprints_count_what_python_allocates_for_them():
    # As a frontend holds them: one owner identity (frontend id, pid, start
    # time, nonce) shared by many conversations, 36-character keys.
    owner = (1, (os.getpid(), 1764640000.25, secrets.token_hex(8)))
    count = 5000
    held = HeldFingerprints(max_entries=count, max_bytes=1 << 30)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(count):
            held.put(owner, str(uuid.uuid4()), Fingerprint(10, secrets.token_bytes(16)))
        traced = (tracemalloc.get_traced_memory()[0] - before) / count
    finally:
        tracemalloc.stop()
    counted = held.stats()["held_bytes"] / count
    assert 350 < traced < 550, traced  # about 440: docs/CACHE.md's figure
    assert abs(counted - traced) / traced < 0.15, (counted, traced)


def test_counted_bytes_match_what_python_allocates(tokenizer):
    """The budget is honest: the cache's own count is within 25% of what
    tracemalloc sees it hold, over long conversations whose id buffers
    grow by appends and are copied when they fill or a turn rewrites."""
    rng = random.Random(7)
    texts = {f"c{i}": [plain_delta(rng, 25_000)] for i in range(3)}
    for turns in texts.values():
        for _ in range(40):
            turns.append(turns[-1] + plain_delta(rng, 60))
    cache = PrefixTokenCache(CacheConfig(min_chars=0))
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for key, turns in texts.items():
            for text in turns:
                cache.encode(tokenizer, text, key=key)
        # A background check holds the prompt it works on until it is done.
        assert choice.VERIFIER.drain(timeout=120)
        gc.collect()
        traced = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # The texts were allocated before tracing began; the cache's count includes them.
    counted = cache.stats()["cached_bytes"] - sum(len(turns[-1]) + 49 for turns in texts.values())
    assert cache.stats()["hits"] >= 110
    assert abs(counted - traced) <= 0.25 * traced, (counted, traced)
    tokens = sum(len(full_ids(tokenizer, turns[-1])) for turns in texts.values())
    # 4-byte ids, their buffers' spare room (at most an eighth) and the
    # fingerprint chain: no offsets are kept (scripts/bench_memory.py).
    assert traced / tokens < 6


def test_cache_bytes_reaches_every_frontend_and_bounds_what_each_holds(tmp_path, tokenizer):
    """`mptok serve --cache-bytes` is each frontend's cache budget, the held
    fingerprints have their own (``DEFAULT_MAX_HELD_BYTES``): read back from
    /metrics after more routed conversations than the frontends can keep."""
    budget, conversations, turns = 256 * 1024, 16, 4
    with Server(tmp_path / "serve.log", "--frontends", "2", "--cache-bytes", str(budget)) as server:
        chats = [conversation(seed, turns, first_chars=4000) for seed in range(conversations)]
        for turn in range(turns):
            for seed, prompts in enumerate(chats):
                body = {"prompt": prompts[turn], "conversation_id": f"budget-{seed}", "add_special_tokens": False}
                assert tokenize(server.port, body)["tokens"] == full_ids(tokenizer, prompts[turn])
        wait_for_snapshots()
        samples = scrape(server.port)
    frontends = {labels["frontend"] for name, labels, _ in samples if name == "mptok_cache_bytes"}
    assert len(frontends) == 2
    for frontend in frontends:
        def value(name: str) -> float:
            return total(samples, name, frontend=frontend)

        assert value("mptok_cache_max_bytes") == budget
        assert value("mptok_held_fingerprint_max_bytes") == DEFAULT_MAX_HELD_BYTES
        assert 0 < value("mptok_cache_bytes") <= budget
        assert value("mptok_held_fingerprint_bytes") <= DEFAULT_MAX_HELD_BYTES
    assert total(samples, "mptok_cache_entries") < conversations, "the budget should have evicted conversations"
    assert total(samples, "mptok_routed_total") > 0

"""Conversations without a session id find their owner from their own content.

The identity rules are checked directly; then a fleet of keyless chats that
share one long system prompt is replayed against a real ``mptok serve`` of
four frontends, a new connection per turn, every answer compared with full
tokenization of the rendered chat.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

import mptok
from mptok.api.affinity import ChatNames, IdentityKind, chat_identity, identify, prompt_identity
from mptok.api.chat_template import DEEPSEEK_V3_TEMPLATE
from mptok.core.protocol import PeerRequest
from mptok.routing.owners import PeerService
from mptok.routing.router import owner_order
from mptok_harness.conversations import plain_delta
from mptok_harness.serve import scrape, serving, tokenize, total, wait_for_snapshots

FRONTENDS = 4
FLEET = 16
TURNS = 6


def test_an_explicit_id_wins():
    messages = [{"role": "user", "content": "hi"}]
    assert identify("session-7", messages, None) == mptok.api.affinity.ConversationIdentity("session-7", IdentityKind.KEYED)


def test_a_chat_keeps_its_identity_from_turn_to_turn():
    rng = random.Random(1)
    system = {"role": "system", "content": plain_delta(rng, 50)}
    first = {"role": "user", "content": "Task: summarise the build log."}
    identities = set()
    messages = [system, first]
    for _ in range(5):
        identities.add(chat_identity(messages))
        messages = [*messages, {"role": "assistant", "content": plain_delta(rng, 10)}, {"role": "user", "content": "next"}]
    assert len(identities) == 1
    # The order a client writes a message's fields in does not matter.
    assert chat_identity([system, {"content": first["content"], "role": "user"}]) in identities


def test_a_chats_name_is_decided_once_and_then_looked_up_as_chat_identity_decides_it():
    rng = random.Random(2)
    names = ChatNames()
    system = {"role": "system", "content": plain_delta(rng, 50)}
    chats = [[system, {"role": "user", "content": f"Task {i}"}] for i in range(3)]
    for _ in range(3):
        for messages in chats:
            copy = [dict(m) for m in messages]  # a new request's own objects
            assert names.of(copy) == chat_identity(messages) is not None
            messages += [{"role": "assistant", "content": plain_delta(rng, 5)}, {"role": "user", "content": "next"}]
    assert names._names.stats()[0] == 3  # one entry per conversation
    # Another field order, values JSON tells apart and Python does not, and odd input: as chat_identity says.
    reordered = [system, {"content": "Task 0", "role": "user"}]
    assert names.of(reordered) == chat_identity(reordered) == chat_identity(chats[0])
    for messages in (
        [{"role": "user", "content": "x", "n": 1}],
        [{"role": "user", "content": "x", "n": True}],
        [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
        [{"role": "system", "content": "no user"}],
        ["not a message"],
    ):
        assert names.of(messages) == chat_identity(messages)
    assert ChatNames(max_bytes=10).of(chats[1]) == chat_identity(chats[1])  # too big to keep, still named


def test_chats_sharing_a_system_prompt_get_different_identities():
    system = {"role": "system", "content": "You are one of many agents. " * 100}
    tasks = [f"Task {i}: fix warning number {i}." for i in range(FLEET)]
    assert len({chat_identity([system, {"role": "user", "content": t}]) for t in tasks}) == FLEET


def test_what_has_no_stable_part_is_keyless():
    assert identify(None, [{"role": "system", "content": "only a system prompt"}], None).kind is IdentityKind.KEYLESS
    assert identify(None, None, "a raw prompt").kind is IdentityKind.KEYLESS  # affinity_chars off
    assert identify(None, None, "short", affinity_chars=10).kind is IdentityKind.KEYLESS
    derived = identify(None, None, "a raw prompt that is long enough", affinity_chars=10)
    assert derived.kind is IdentityKind.DERIVED
    assert derived.key == prompt_identity("a raw prompt, with another ending", 10)
    assert prompt_identity("\ud800 lone surrogate", 5) is not None


# -- a keyless fleet against mptok serve ----------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # The default routing policy, as an operator runs it.
    yield from serving(tmp_path_factory, "affinity", "--frontends", str(FRONTENDS))


def _render(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, chat_template=DEEPSEEK_V3_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_keyless_fleet_is_routed_exact_and_spread(server, tokenizer):
    rng = random.Random(13)
    system = {"role": "system", "content": plain_delta(rng, 1500)}  # ~9k characters, shared by all
    chats = [[system, {"role": "user", "content": f"Task {i}: " + plain_delta(rng, 30)}] for i in range(FLEET)]
    before = scrape(server.port)
    for turn in range(TURNS):
        for messages in chats:
            if turn:
                messages += [{"role": "assistant", "content": plain_delta(rng, 60)}, {"role": "user", "content": plain_delta(rng, 40)}]
            answer = tokenize(server.port, {"messages": messages, "add_generation_prompt": True})
            assert answer["tokens"] == _render(tokenizer, messages)
    wait_for_snapshots()
    after = scrape(server.port)

    def grown(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    requests = FLEET * TURNS
    assert grown("mptok_prompts_total", identity="derived") == requests
    assert grown("mptok_prompts_total", identity="keyless") == 0
    # Every turn after a conversation's first extends what its owner kept.
    failures = grown("mptok_route_failures_total")
    assert grown("mptok_cache_hits_total") >= requests - FLEET - failures
    work = [
        grown("mptok_cache_hits_total", frontend=str(f)) + grown("mptok_cache_misses_total", frontend=str(f))
        for f in range(FRONTENDS)
    ]
    assert sum(work) == requests
    # The fleet is spread by its owners: each conversation's first turn is
    # tokenized in full by the owner its identity hashes to (where later
    # turns are tokenized follows where the kernel hands their connections,
    # which a loaded machine can skew towards one frontend).
    owned = Counter(owner_order(chat_identity(chat[:2]), FRONTENDS)[0] for chat in chats)
    assert max(owned.values()) <= FLEET / 2, owned
    misses = [grown("mptok_cache_misses_total", frontend=str(f)) for f in range(FRONTENDS)]
    assert all(abs(misses[f] - owned[f]) <= failures for f in range(FRONTENDS)), (misses, owned, failures)


def test_a_session_id_still_wins_over_the_derived_identity(server, tokenizer):
    messages = [{"role": "system", "content": "x " * 200}, {"role": "user", "content": "keyed"}]
    before = scrape(server.port)
    answer = tokenize(server.port, {"messages": messages}, {"X-Session-Id": "affinity-keyed"})
    assert answer["tokens"] == _render(tokenizer, messages)
    wait_for_snapshots()
    after = scrape(server.port)
    assert total(after, "mptok_prompts_total", identity="keyed") - total(before, "mptok_prompts_total", identity="keyed") == 1


def test_conversations_sharing_an_identity_keep_a_branch_each(tokenizer):
    """Two chats with the same first messages share a derived key (and so an
    owner); each extends its own branch instead of evicting the other's."""
    rng = random.Random(21)
    opening = [{"role": "system", "content": plain_delta(rng, 300)}, {"role": "user", "content": "Hi"}]
    key = chat_identity(opening)
    cache = mptok.PrefixTokenCache(mptok.CacheConfig(min_chars=0))
    chats = [list(opening), list(opening)]
    for turn in range(4):
        for messages in chats:
            if turn:
                messages += [{"role": "assistant", "content": plain_delta(rng, 80)}, {"role": "user", "content": plain_delta(rng, 20)}]
            text = tokenizer.apply_chat_template(messages, chat_template=DEEPSEEK_V3_TEMPLATE, add_generation_prompt=True, tokenize=False)
            assert cache.encode(tokenizer, text, key=key) == tokenizer(text, add_special_tokens=False)["input_ids"]
    stats = cache.stats()
    assert stats["entries"] == 2  # a branch each
    assert stats["hits"] == 7 and stats["misses"] == 1
    # A peer holding the first chat's previous version is answered from its
    # branch, though the second chat was kept after it.
    text = tokenizer.apply_chat_template(chats[0] + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}], chat_template=DEEPSEEK_V3_TEMPLATE, add_generation_prompt=True, tokenize=False)
    whole = PeerService(cache, tokenizer).answer(PeerRequest(text, key))
    assert whole is not None and whole.ids.tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]

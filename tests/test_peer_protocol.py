"""The peer protocol without a transport: fingerprints on the asker's side
(``HeldFingerprints``), the owner's one-call answer (``PeerService``) on a
real cache and tokenizer between them. A wrong fingerprint never yields
wrong ids; a conversation the owner no longer keeps is answered None, and
the asker then sends the whole text."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mptok import CacheConfig, PrefixTokenCache
from mptok.core.protocol import BLOCK_CHARS, Fingerprint, PeerRequest, checkpoint_blocks, extend_chain
from mptok.routing.owners import PeerService
from mptok.routing.router import HeldFingerprints
from mptok_harness.conversations import chat_turns, plain_delta

START, END = "<｜User｜>", "<｜end▁of▁sentence｜>"


def full_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def answer_peer(cache, tokenizer, text, key, since=None, shared_chars=0):
    return PeerService(cache, tokenizer).answer(PeerRequest(text, key, since, shared_chars))


def ask(held: HeldFingerprints, owner, key: str, text: str, cache, tokenizer, sent: list) -> tuple[np.ndarray, bool]:
    """The asker's exchange with an owner answering from ``cache`` (as
    ``Router._ask`` has it, the transport left out), recording what was
    sent: the ids, and whether a delta got them."""
    service = PeerService(cache, tokenizer)
    request, chain = held.request(owner, key, text)
    sent.append((len(request.text), request.delta))
    reply = service.answer(request)
    answered_delta = reply is not None
    if reply is None:
        assert request.delta, "a whole text is always answered"
        sent.append((len(text), False))
        reply = service.answer(PeerRequest(text, key))
    held.remember(owner, key, text, chain, reply.kept)
    return reply.ids, answered_delta and request.delta


def test_askers_with_fingerprints_get_exact_ids_and_send_only_new_characters(tokenizer):
    """Three askers take turns on one conversation; each holds only a
    fingerprint of what it last sent; the owner keeps every turn."""
    cache = PrefixTokenCache()
    prompts = chat_turns(random.Random(13), START, END, turns=14, words_per_message=400)
    assert len(prompts[2]) > 2 * BLOCK_CHARS
    askers = [HeldFingerprints() for _ in range(3)]
    last_sent: dict[int, str] = {}
    from_fingerprint = 0
    for turn, text in enumerate(prompts):
        asker = turn * 7 % 3
        held = askers[asker]
        sent: list = []
        had_fingerprint = held.get("owner", "conv") is not None
        ids, answered_since = ask(held, "owner", "conv", text, cache, tokenizer, sent)
        assert answered_since == had_fingerprint
        assert isinstance(ids, np.ndarray) and ids.dtype == np.int32
        assert ids.tolist() == full_ids(tokenizer, text)
        if answered_since:
            from_fingerprint += 1
            # Only the characters after the fingerprint crossed: the new turn,
            # the slack and less than a block more.
            assert sent == [(len(text) - checkpoint_blocks(len(last_sent[asker])) * BLOCK_CHARS, True)]
        last_sent[asker] = text
    # Every asker after its first turn long enough to fingerprint (the first
    # prompt is not) answered from its fingerprint.
    assert from_fingerprint == len(prompts) - 4
    assert cache.stats()["hits"] == len(prompts) - 1
    assert cache.stats()["entries"] == 1
    assert all(h.stats()["held_bytes"] < 1024 for h in askers)  # tens of bytes plus the key, not the text


def test_a_wrong_fingerprint_is_answered_none_never_with_other_ids(tokenizer):
    cache = PrefixTokenCache()
    rng = random.Random(3)
    text = plain_delta(rng, 3000)
    assert cache.extend_after(tokenizer, text, "conv").kept
    chain = extend_chain(text)
    good = Fingerprint.of(text, chain)
    assert good is not None
    tail = text[good.chars :] + plain_delta(rng, 30)
    reply = answer_peer(cache, tokenizer, tail, "conv", since=good.since, shared_chars=good.chars)
    assert reply.ids.tolist() == full_ids(tokenizer, text[: good.chars] + tail)
    # A digest off by one bit, a fingerprint of other text, one that covers
    # another block count, a count that is not a whole block, nonsense.
    other = Fingerprint.of("x" + text[1:], extend_chain("x" + text[1:]))
    wrong = [
        (good.since ^ 1, good.chars),
        (other.since, other.chars),
        (good.since, good.chars - BLOCK_CHARS),
        (good.since, good.chars + 1),
        (good.since, 0),
        (0, good.chars),
        (-good.since, good.chars),
        (1 << 200, good.chars),
    ]
    for since, shared in wrong:
        assert answer_peer(cache, tokenizer, tail, "conv", since=since, shared_chars=shared) is None
    # Another conversation, or no key: nothing to match.
    assert answer_peer(cache, tokenizer, tail, "other", since=good.since, shared_chars=good.chars) is None
    assert answer_peer(cache, tokenizer, tail, None, since=good.since, shared_chars=good.chars) is None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edit_at=st.integers(0, 9000), new_char=st.sampled_from(["a", "Z", " ", "\n", "é", "🙂"]))
def test_an_asker_whose_text_differs_anywhere_never_gets_wrong_ids(tokenizer, edit_at, new_char):
    """The asker's prompt differs from what the owner keeps at one
    character: before, at or after the fingerprint's end. Whatever the
    asker then sends, the ids it gets are those of its own text."""
    cache = PrefixTokenCache()
    kept = plain_delta(random.Random(5), 1800)[:9000]
    cache.encode(tokenizer, kept, "conv")
    held = HeldFingerprints()
    held.put("owner", "conv", Fingerprint.of(kept, extend_chain(kept)))
    position = min(edit_at, len(kept) - 1)
    text = kept[:position] + new_char + kept[position + 1 :] + " and more words"
    ids, _ = ask(held, "owner", "conv", text, cache, tokenizer, [])
    assert ids.tolist() == full_ids(tokenizer, text)


def test_a_conversation_the_owner_forgot_is_answered_none_then_sent_whole(tokenizer):
    cache = PrefixTokenCache()
    rng = random.Random(4)
    text = plain_delta(rng, 3000)
    held = HeldFingerprints()
    sent: list = []
    ask(held, "owner", "conv", text, cache, tokenizer, sent)
    assert sent == [(len(text), False)]
    fingerprint = held.get("owner", "conv")
    cache.clear()
    longer = text + plain_delta(rng, 20)
    assert answer_peer(cache, tokenizer, longer[fingerprint.chars :], "conv",
                       since=fingerprint.since, shared_chars=fingerprint.chars) is None
    sent.clear()
    ids, answered_since = ask(held, "owner", "conv", longer, cache, tokenizer, sent)
    assert not answered_since and ids.tolist() == full_ids(tokenizer, longer)
    assert sent == [(len(longer) - fingerprint.chars, True), (len(longer), False)]


def test_an_owner_that_keeps_nothing_leaves_no_fingerprint(tokenizer):
    """A prompt the owner did not keep (too long for its budget) comes back
    not kept: the asker holds nothing and sends the next turn whole."""
    cache = PrefixTokenCache(CacheConfig(max_bytes=4096))
    text = plain_delta(random.Random(6), 3000)
    held = HeldFingerprints()
    reply = answer_peer(cache, tokenizer, text, "conv")
    assert not reply.kept and reply.ids.tolist() == full_ids(tokenizer, text)
    ids, _ = ask(held, "owner", "conv", text, cache, tokenizer, [])
    assert ids.tolist() == full_ids(tokenizer, text) and held.get("owner", "conv") is None


def test_fingerprints_are_bounded_by_bytes_and_entries():
    text = "word " * 2000
    fingerprint = Fingerprint.of(text, extend_chain(text))
    held = HeldFingerprints(max_entries=10, max_bytes=10_000)
    for i in range(100):
        held.put("owner", f"conv-{i}", fingerprint)
        stats = held.stats()
        assert stats["held_entries"] <= 10 and stats["held_bytes"] <= 10_000
    assert held.get("owner", "conv-99") == fingerprint and held.get("owner", "conv-0") is None


def test_the_fingerprint_chain_extends_what_it_knows():
    rng = random.Random(8)
    text = plain_delta(rng, 4000)
    whole = extend_chain(text)
    assert len(whole) == len(text) // BLOCK_CHARS * 16
    for blocks in (0, 1, 3):
        assert extend_chain(text, whole[: blocks * 16]) == whole
    assert extend_chain(text, upto_blocks=2) == whole[:32]
    changed = text[: 2 * BLOCK_CHARS + 5] + "!" + text[2 * BLOCK_CHARS + 6 :]
    other = extend_chain(changed)
    assert other[:32] == whole[:32] and other[32:48] != whole[32:48]

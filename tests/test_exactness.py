"""Every id list the cache returns equals full tokenization, on every family.

Real tokenizers of eight families (mptok_harness.families), conversations
whose seams fall where splicing is hardest (mptok_harness.conversations),
and both the Rust tokenizer and its transformers wrapper as the caller's
tokenizer; every test runs on every engine that loads the family
(fastokens, gigatoken; the default choice, "auto", is one of them), and on
`tokenizers` where no engine does (it is the default there) and for the
embedded tokenizer's family (forced). An engine that should load a family
(``ENGINE_FAMILIES``) and does not fails the test.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mptok import CacheConfig, PrefixTokenCache
from mptok.cache.backend import backend_for
from mptok_harness.conversations import ADVERSARIAL_PIECES, adversarial_delta, chat_turns, plain_delta
from mptok_harness.families import CHAT_MARKERS, ENGINE_FAMILIES, FAMILIES, load_family, load_family_hf


def reference_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


BACKEND = "tokenizers"  # the module fixture below sets it for every test


@pytest.fixture(scope="module", params=["tokenizers", "fastokens", "gigatoken"], autouse=True)
def backend(request):
    """Runs the whole module once per backend (grouped, so that the
    process-wide backends are built once per family and backend)."""
    global BACKEND
    BACKEND = request.param
    yield request.param
    BACKEND = "tokenizers"


@pytest.fixture(autouse=True)
def engine_loads_its_families(request, backend):
    """An engine's run covers the families it loads; the others are
    `tokenizers`' run. Where the engine should load, it must."""
    family = getattr(request.node, "callspec", None) and request.node.callspec.params.get("family")
    if family is None:
        return
    if backend == "tokenizers":
        # The default where no engine loads; forced, it is the same path on
        # every family, so one engine-loaded family covers it there.
        if family != "deepseek" and any(family in loaded for loaded in ENGINE_FAMILIES.values()):
            pytest.skip(f"{family} runs on the engines that load it (tokenizers forced: deepseek's run)")
        return
    if family not in ENGINE_FAMILIES[backend]:
        pytest.skip(f"{backend} does not load {family} (the tokenizers run covers it)")
    assert backend_for(load_family(family), backend).engines.name == backend


# Where adversarial text leaves fewer provable seams, and why (docs/CACHE.md,
# "The proof of a seam"): the share of turns that must still splice.
ADVERSARIAL_HIT_FLOORS = {
    # Unigram vocabularies of 4000 pieces with no byte fallback, and
    # WordPiece's: the adversarial pieces' characters are <unk> ([UNK] for a
    # whole word), of a length the ids do not tell, so a seam before one is
    # proven by tokenizing the kept text from it, which must cost less than
    # tokenizing the prompt whole: a prompt that parts early has none.
    "metaspace_first": 0.8,
    "metaspace_always": 0.8,
    "wordpiece": 0.8,
    # A vocabulary trained on whole segments spans every pair of characters
    # of plain text: only points around rarer characters are forced.
    "metaspace_always_nosplit": 0.15,
}


def cache_of(**config) -> PrefixTokenCache:
    return PrefixTokenCache(CacheConfig(tokenizer_backend=BACKEND, **config))


def every_turn_cache() -> PrefixTokenCache:
    return cache_of(min_chars=0)


@st.composite
def conversations(draw, family: str) -> list[str]:
    """Prompts of one conversation: each extends the last, sometimes after
    cutting its tail back (a rewritten generation prompt, an edit)."""
    start, end = CHAT_MARKERS[family]
    alphabet = st.sampled_from(ADVERSARIAL_PIECES + (start, end, start + "assistant\n"))
    piece_runs = st.lists(alphabet, max_size=12).map("".join)
    text = draw(piece_runs)
    prompts = [text]
    for _ in range(draw(st.integers(1, 6))):
        if text and draw(st.booleans()):
            text = text[: draw(st.integers(0, len(text)))]
        text += draw(piece_runs)
        prompts.append(text)
    return prompts


@pytest.mark.parametrize("family", FAMILIES)
def test_adversarial_conversations_are_exact(family):
    tokenizer = load_family(family)

    @settings(
        max_examples=36,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        derandomize=True,
    )
    @given(prompts=conversations(family))
    def check(prompts):
        cache = every_turn_cache()
        for prompt in prompts:
            assert cache.encode(tokenizer, prompt, key="c") == reference_ids(tokenizer, prompt)

    check()


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_wrapper_is_exact_and_untouched(family):
    """The cache drives its own copy of the Rust tokenizer; the caller's
    transformers tokenizer answers exactly as before, and as the cache."""
    hf = load_family_hf(family)
    rng = random.Random(family)
    cache = every_turn_cache()
    text = ""
    for _ in range(12):
        text += adversarial_delta(rng, CHAT_MARKERS[family], pieces=15)
        assert cache.encode(hf, text, key="c") == hf(text, add_special_tokens=False)["input_ids"]
    assert cache.stats()["hits"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_long_adversarial_conversations_hit_and_stay_exact(family):
    """Turns that each append an adversarial delta to a long history: every
    result exact, and the cache splices on nearly every turn."""
    tokenizer = load_family(family)
    start, end = CHAT_MARKERS[family]
    rng = random.Random(1)
    cache = cache_of()
    text = plain_delta(rng, 400)
    turns = 28
    for _ in range(turns):
        text += f"{start}user\n" + adversarial_delta(rng, (start, end), pieces=60) + end
        assert cache.encode(tokenizer, text, key="c") == reference_ids(tokenizer, text)
    stats = cache.stats()
    assert stats["hits"] >= ADVERSARIAL_HIT_FLOORS.get(family, 0.95) * (turns - 1), stats


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_rewrites_still_hit(family):
    """The next turn replaces the last prompt's generation prompt; the
    common prefix is still reused."""
    tokenizer = load_family(family)
    start, end = CHAT_MARKERS[family]
    cache = cache_of()
    prompts = chat_turns(random.Random(2), start, end, turns=30)
    for prompt in prompts:
        assert cache.encode(tokenizer, prompt, key="chat") == reference_ids(tokenizer, prompt)
    stats = cache.stats()
    assert stats["hits"] >= 0.95 * (len(prompts) - 1), stats


@pytest.mark.parametrize("family", ["deepseek", "qwen", "legacy_sp", "metaspace_first"])
def test_plain_growing_conversation_always_hits(family):
    """Plain text has no added token to splice at: with a fast engine the
    second turn gets the reference tokenizer's offsets, and every turn after
    the first splices anywhere, as with `tokenizers`."""
    tokenizer = load_family(family)
    rng = random.Random(3)
    cache = cache_of()
    text = plain_delta(rng, 300)
    cache.encode(tokenizer, text, key="plain")
    for _ in range(25):
        text += plain_delta(rng, 60)
        assert cache.encode(tokenizer, text, key="plain") == reference_ids(tokenizer, text)
    assert cache.stats()["hits"] == 25
    assert cache.stats()["misses"] == 1


@pytest.mark.parametrize("family", ["qwen", "legacy_sp", "metaspace_first", "wordpiece"])
def test_seams_inside_combining_mark_runs(family):
    """NFC composes a mark with a base far back; a long run of marks leaves
    no clean seam near the end, and the result is still exact."""
    tokenizer = load_family(family)
    cache = every_turn_cache()
    text = "word " * 50 + "e"
    for mark in "\u0301\u0323\u0308\u0304\u0301\u0327" * 5:
        text += mark
        assert cache.encode(tokenizer, text, key="marks") == reference_ids(tokenizer, text)
    text += " after"
    assert cache.encode(tokenizer, text, key="marks") == reference_ids(tokenizer, text)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompts_without_key_extend_longest_cached_prefix(family):
    tokenizer = load_family(family)
    start, end = CHAT_MARKERS[family]
    rng = random.Random(4)
    cache = cache_of()

    def message() -> str:
        return f"{start}user\n{plain_delta(rng, 50)}{end}"

    base = plain_delta(rng, 2000) + message() + message()
    other = plain_delta(rng, 2000) + message()
    assert cache.encode(tokenizer, base) == reference_ids(tokenizer, base)
    assert cache.encode(tokenizer, other) == reference_ids(tokenizer, other)
    longer = base + message()
    assert cache.encode(tokenizer, longer) == reference_ids(tokenizer, longer)
    longest = longer + message()
    assert cache.encode(tokenizer, longest) == reference_ids(tokenizer, longest)
    stats = cache.stats()
    assert stats["hits"] == 2 and stats["misses"] == 2
    # The keyless conversation advanced in place: one entry each.
    assert stats["entries"] == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_a_second_prompt_splices_at_any_seam(family):
    """A prompt, then one that parts from it at a random point among hard
    pieces and goes on: the second is exact, and splices (its seam is
    proven) in nearly every case, wherever the prompts part, except where
    ``ADVERSARIAL_HIT_FLOORS`` says why not."""
    tokenizer = load_family(family)
    rng = random.Random(5)
    markers = CHAT_MARKERS[family]
    cases, hits = 40, 0
    for _ in range(cases):
        cache = every_turn_cache()
        first = plain_delta(rng, rng.randint(20, 120)) + adversarial_delta(rng, markers, pieces=rng.randint(5, 30))
        second = first[: rng.randint(len(first) // 2, len(first))] + adversarial_delta(rng, markers, pieces=rng.randint(1, 15))
        for prompt in (first, second):
            assert cache.encode(tokenizer, prompt, key="c") == reference_ids(tokenizer, prompt)
        hits += cache.stats()["hits"]
    assert hits >= ADVERSARIAL_HIT_FLOORS.get(family, 0.97) * cases, hits


@pytest.mark.parametrize("family", FAMILIES)
def test_a_template_without_added_tokens_still_hits(family):
    """A GPT-2-style template: the roles are plain text, so no added token
    opens a turn, and the generation prompt is rewritten every turn."""
    tokenizer = load_family(family)
    rng = random.Random(6)
    cache = cache_of()
    history, turns = "A conversation between a user and an assistant.\n\n", 20
    for _ in range(turns):
        history += f"User: {plain_delta(rng, 40)}\n\n"
        prompt = history + "Assistant:"
        assert cache.encode(tokenizer, prompt, key="gpt2") == reference_ids(tokenizer, prompt)
        history += f"Assistant: {plain_delta(rng, 40)}\n\n"
    assert cache.stats()["hits"] >= turns - 2, cache.stats()

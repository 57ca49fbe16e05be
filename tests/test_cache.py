"""The cache's contract apart from exactness of splices: bounds, counters,
the routing hook, concurrency, bad input, configuration, loading."""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import warnings

import pytest
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizer

import mptok
import mptok.cache.prefix_cache
from mptok import CacheConfig, PrefixTokenCache
from mptok_harness.checks import expected_ids as full_ids
from mptok_harness.conversations import adversarial_delta, plain_delta
from mptok_harness.families import CHAT_MARKERS, load_family
from mptok_harness.prompts import TEMPLATE_MARKERS, conversation


def prompt(rng: random.Random, words: int) -> str:
    return plain_delta(rng, words)


# -- bounds ---------------------------------------------------------------------


def test_lru_evicts_by_entry_count(tokenizer):
    cache = PrefixTokenCache(CacheConfig(max_entries=3, min_chars=0))
    rng = random.Random(0)
    texts = {f"c{i}": prompt(rng, 30) for i in range(5)}
    for key, text in texts.items():
        cache.encode(tokenizer, text, key=key)
    assert cache.stats()["entries"] == 3
    # c0 and c1 were evicted: extending them misses; c4 is still there.
    cache.encode(tokenizer, texts["c0"] + prompt(rng, 5), key="c0")
    cache.encode(tokenizer, texts["c4"] + prompt(rng, 5), key="c4")
    stats = cache.stats()
    assert stats["misses"] == 6 and stats["hits"] == 1
    assert stats["entries"] == 3


def test_prompt_longer_than_the_budget_is_tokenized_not_kept(tokenizer):
    cache = PrefixTokenCache(CacheConfig(max_bytes=2_000, min_chars=0))
    text = prompt(random.Random(2), 500)
    assert cache.encode(tokenizer, text, key="big") == full_ids(tokenizer, text)
    assert cache.stats()["entries"] == 0
    assert cache.stats()["uncached"] == 1


def test_short_prompts_are_tokenized_normally(tokenizer):
    cache = PrefixTokenCache(CacheConfig(min_chars=500))
    short = "Hello there, a short prompt."
    assert cache.encode(tokenizer, short, key="s") == full_ids(tokenizer, short)
    stats = cache.stats()
    assert stats["entries"] == 0 and stats["uncached"] == 1
    assert stats["hits"] == stats["misses"] == 0


def test_one_entry_per_conversation(tokenizer):
    cache = PrefixTokenCache(CacheConfig(min_chars=0))
    rng = random.Random(3)
    text = prompt(rng, 100)
    for _ in range(10):
        text += prompt(rng, 10)
        cache.encode(tokenizer, text, key="one")
    assert cache.stats()["entries"] == 1
    assert cache.stats()["cached_chars"] == len(text)


def test_returned_lists_are_the_callers_own(tokenizer):
    cache = PrefixTokenCache(CacheConfig(min_chars=0))
    text = prompt(random.Random(4), 200)
    first = cache.encode(tokenizer, text, key="k")
    first.clear()
    again = cache.encode(tokenizer, text, key="k")
    assert again == full_ids(tokenizer, text)
    again.append(-1)
    longer = text + " More."
    assert cache.encode(tokenizer, longer, key="k") == full_ids(tokenizer, longer)


def test_conversations_of_different_tokenizers_do_not_mix(tokenizer):
    other = load_family("qwen")
    cache = PrefixTokenCache(CacheConfig(min_chars=0))
    text = prompt(random.Random(5), 200)
    cache.encode(tokenizer, text, key="same-key")
    longer = text + " And more."
    assert cache.encode(other, longer, key="same-key") == other.encode(
        longer, add_special_tokens=False
    ).ids
    assert cache.encode(tokenizer, longer, key="same-key") == full_ids(tokenizer, longer)


# -- concurrency ------------------------------------------------------------------


def test_threads_sharing_one_transformers_tokenizer(tokenizer):
    """64 threads, 16 conversations, one cache and one transformers tokenizer
    that the caller also uses with truncation at the same time: no "Already
    borrowed", every result exact, and the caller's settings do not leak in."""
    cache = PrefixTokenCache(CacheConfig(min_chars=0))
    conversations = 16
    turns = 12
    rng = random.Random(9)
    histories = [[prompt(rng, 200)] for _ in range(conversations)]
    for history in histories:
        for _ in range(turns - 1):
            history.append(history[-1] + adversarial_delta(rng, CHAT_MARKERS["deepseek"], 10))
    expected = [[full_ids(tokenizer, text) for text in history] for history in histories]
    errors: list[BaseException] = []
    wrong: list[tuple[int, int]] = []
    barrier = threading.Barrier(64)

    def worker(index: int) -> None:
        conversation = index % conversations
        try:
            barrier.wait(timeout=60)
            for turn, text in enumerate(histories[conversation]):
                got = cache.encode(tokenizer, text, key=f"c{conversation}")
                if got != expected[conversation][turn]:
                    wrong.append((conversation, turn))
                if index % 8 == 0:
                    # The caller's own use of its tokenizer, truncating.
                    tokenizer(text, truncation=True, max_length=16)
        except BaseException as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(64)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    # The caller's concurrent transformers calls may themselves fail with
    # "Already borrowed" (that is transformers' bug); the cache's never do.
    assert all("Already borrowed" in str(e) for e in errors), errors
    assert not wrong
    assert cache.stats()["hits"] > 0
    assert cache.stats()["entries"] == conversations


# -- bad input --------------------------------------------------------------------


@pytest.mark.parametrize("bad", [b"bytes", 42, None, ["a", "list"]])
def test_text_that_is_not_a_str_is_a_type_error(tokenizer, bad):
    cache = PrefixTokenCache()
    with pytest.raises(TypeError, match=type(bad).__name__):
        cache.encode(tokenizer, bad, key="k")
    assert cache.stats()["entries"] == 0


def test_key_that_is_not_a_str_is_a_type_error(tokenizer):
    with pytest.raises(TypeError, match="int"):
        PrefixTokenCache().encode(tokenizer, "text", key=7)


def test_empty_text_is_empty_ids(tokenizer):
    cache = PrefixTokenCache(CacheConfig(min_chars=0))
    assert cache.encode(tokenizer, "", key="k") == [] == full_ids(tokenizer, "")


@pytest.mark.parametrize("rust", [False, True])
def test_lone_surrogates_get_what_the_tokenizer_itself_does(tokenizer, rust):
    caller = tokenizer.backend_tokenizer if rust else tokenizer
    cache = PrefixTokenCache(CacheConfig(min_chars=0))
    base = prompt(random.Random(10), 100)
    cache.encode(caller, base, key="k")
    text = base + "broken \ud800 surrogate"
    with pytest.raises(Exception) as from_tokenizer:
        caller.encode(text, add_special_tokens=False) if rust else caller(
            text, add_special_tokens=False
        )
    with pytest.raises(type(from_tokenizer.value)):
        cache.encode(caller, text, key="k")
    # The conversation's entry is untouched and still extends correctly.
    longer = base + " fine."
    assert cache.encode(caller, longer, key="k") == full_ids(tokenizer, longer)
    assert cache.stats()["hits"] == 1


class CharTokenizer(PreTrainedTokenizer):
    """A slow (pure Python) tokenizer: one id per printable ASCII character."""

    def __init__(self, **kwargs):
        self._vocab = {chr(i): i for i in range(32, 127)}
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def _tokenize(self, text, **kwargs):
        return list(text)

    def _convert_token_to_id(self, token):
        return self._vocab.get(token, 0)

    def _convert_id_to_token(self, index):
        return chr(index)


def test_slow_tokenizer_is_tokenized_in_full_with_one_warning():
    slow = CharTokenizer()
    cache = PrefixTokenCache(CacheConfig(min_chars=0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.encode(slow, "hello", key="k") == [104, 101, 108, 108, 111]
        assert cache.encode(slow, "hello world", key="k") == full_ids(slow, "hello world")
    assert len([w for w in caught if "slow" in str(w.message)]) == 1
    assert cache.stats()["entries"] == 0


def test_internal_error_disables_cache_with_one_warning(tokenizer, monkeypatch, caplog):
    """Fault injection: the seam logic raising must not fail requests."""
    cache = PrefixTokenCache(CacheConfig(min_chars=0))
    rng = random.Random(11)
    text = prompt(rng, 100)
    cache.encode(tokenizer, text, key="k")

    def broken(*args, **kwargs):
        raise IndexError("injected")

    monkeypatch.setattr(mptok.cache.prefix_cache, "extend_prompt", broken)
    with caplog.at_level(logging.WARNING, logger="mptok.cache.prefix_cache"):
        for _ in range(3):
            text += prompt(rng, 10)
            assert cache.encode(tokenizer, text, key="k") == full_ids(tokenizer, text)
    assert len([r for r in caplog.records if "disabled" in r.getMessage()]) == 1
    stats = cache.stats()
    assert stats["disabled"] == 1 and stats["entries"] == 0


# -- configuration ------------------------------------------------------------------


def test_config_from_environment():
    config = CacheConfig.from_env(
        {"MPTOK_CACHE_MAX_ENTRIES": "64", "MPTOK_CACHE_MIN_CHARS": "0"}, max_seam_attempts=2
    )
    assert (config.max_entries, config.min_chars, config.max_seam_attempts) == (64, 0, 2)
    assert config.max_bytes == CacheConfig().max_bytes


def test_cache_reads_environment_by_default(monkeypatch):
    monkeypatch.setenv("MPTOK_CACHE_MAX_ENTRIES", "5")
    assert PrefixTokenCache().config.max_entries == 5


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"MPTOK_CACHE_MAX_ENTRIES": "lots"}, "MPTOK_CACHE_MAX_ENTRIES"),
        ({"MPTOK_CACHE_MAX_ENTRIES": "0"}, "MPTOK_CACHE_MAX_ENTRIES=.0. must be at least 1"),
        ({"MPTOK_CACHE_MIN_CHARS": "-1"}, "MPTOK_CACHE_MIN_CHARS=.-1. must be at least 0"),
        ({"MPTOK_CACHE_MAX_BYTES": "lots"}, "MPTOK_CACHE_MAX_BYTES=.lots. is not a size in bytes"),
        ({"MPTOK_CACHE_TOKENIZER_BACKEND": "fast"}, "MPTOK_CACHE_TOKENIZER_BACKEND=.fast. must be one of auto, "),
    ],
)
def test_bad_config_is_a_clear_error(environ, message):
    with pytest.raises(ValueError, match=message):
        CacheConfig.from_env(environ)


def test_config_rejects_wrong_types():
    with pytest.raises(TypeError, match="max_entries must be an int"):
        CacheConfig(max_entries="10")


# -- loading --------------------------------------------------------------------------


def test_load_default_tokenizer_offline(tokenizer):
    assert tokenizer.is_fast
    assert tokenizer("Hello world", add_special_tokens=False)["input_ids"] == [19923, 2058]


def test_load_tokenizer_from_file_and_directory(tmp_path, tokenizer):
    path = tmp_path / "tokenizer.json"
    tokenizer.backend_tokenizer.save(str(path))
    from_file = mptok.load_tokenizer(path)
    from_dir = mptok.load_tokenizer(tmp_path)
    text = "Exactly the same ids 123 😀"
    assert full_ids(from_file, text) == full_ids(from_dir, text) == full_ids(tokenizer, text)


@pytest.mark.parametrize("name", ["deepseek-ai/DeepSeek-V3", "/no/such/dir"])
def test_load_tokenizer_refuses_what_it_cannot_load(name):
    with pytest.raises(ValueError, match="never downloads"):
        mptok.load_tokenizer(name)


def test_rust_tokenizer_works_directly():
    rust = Tokenizer.from_str(mptok.load_tokenizer().backend_tokenizer.to_str())
    cache = PrefixTokenCache(CacheConfig(min_chars=0))
    text = plain_delta(random.Random(12), 100)
    cache.encode(rust, text, key="k")
    longer = text + json.dumps({"more": [1, 2, 3]})
    assert cache.encode(rust, longer, key="k") == rust.encode(longer, add_special_tokens=False).ids
    assert cache.stats()["hits"] == 1


def test_long_tokenization_lets_other_threads_run(tokenizer):
    """A frontend's event loop and owner threads keep running while a long
    prompt is tokenized in full (Tokenizer.encode would hold the GIL).

    Forces `tokenizers`: a fast engine takes a few milliseconds, too short to
    tell, while the reference tokenizer still tokenizes long texts whenever
    a fast engine's prompt needs offsets."""
    cache = PrefixTokenCache(CacheConfig(tokenizer_backend="tokenizers"))
    text = prompt(random.Random(16), 60_000)
    ticks = 0
    stop = threading.Event()

    def ticker():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.001)

    thread = threading.Thread(target=ticker)
    thread.start()
    try:
        ids = cache.encode(tokenizer, text, key="long")
    finally:
        stop.set()
        thread.join()
    assert ids == full_ids(tokenizer, text)
    # Holding the GIL throughout, the ticker would get one or two turns.
    assert ticks >= 20, ticks


def test_tokens_reused_and_tokenized_add_up_to_the_ids_returned(tokenizer):
    cache = PrefixTokenCache(CacheConfig(tokenizer_backend="tokenizers"))
    first = "A system prompt that is long enough to be cached. " * 20
    second = first + "And a new user turn with a few more words in it."
    returned = len(cache.encode(tokenizer, first, key="c")) + len(cache.encode(tokenizer, second, key="c"))
    stats = cache.stats()
    assert stats["misses"] == 1 and stats["hits"] == 1
    assert stats["tokens_reused"] + stats["tokens_tokenized"] == returned
    # The hit tokenized only its tail: most of the second prompt was reused.
    assert stats["tokens_reused"] > len(tokenizer(first, add_special_tokens=False)["input_ids"]) // 2


def test_a_copy_turns_behind_is_extended_at_a_segment_by_the_engine(tokenizer, monkeypatch):
    """A frontend's copy of a chat, many turns behind the prompt that reaches
    it (the new prompt more than twice as long), is extended at the last
    added token by the fast engine (the default configuration), with no
    pass of the reference tokenizer, which costs tens of times more."""
    from mptok.cache.backend import TokenizerBackend, backend_for

    assert backend_for(tokenizer, "auto").engines.fast, "the default configuration tokenizes with a fast engine"
    prompts = conversation(3, 7, first_chars=6000, turn_chars=1200, markers=TEMPLATE_MARKERS)
    assert len(prompts[-1]) > 2 * len(prompts[0])
    cache = PrefixTokenCache()
    cache.encode(tokenizer, prompts[0], key="chat")
    reference_calls = []
    real_encode = TokenizerBackend.encode

    def counted(self, text):
        # Only this thread's: the background checker re-checks samples of the engine's results.
        if threading.current_thread() is threading.main_thread():
            reference_calls.append(len(text))
        return real_encode(self, text)

    monkeypatch.setattr(TokenizerBackend, "encode", counted)
    assert cache.encode(tokenizer, prompts[-1], key="chat") == full_ids(tokenizer, prompts[-1])
    assert cache.stats()["hits"] == 1
    assert reference_calls == []

"""Splices at added tokens (the fast engines' seams): each opener's reach, and
that a chat hits from its second turn on without ever bending exactness."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer
from transformers import PreTrainedTokenizerFast

from mptok import CacheConfig, PrefixTokenCache
from mptok.cache.backend import backend_for
from mptok.cache.seam import SegmentOpeners
from mptok_harness.conversations import chat_turns
from mptok_harness.families import CHAT_MARKERS, load_family, load_family_hf

HEAD = "a line of words, and some more words\n" * 40
# A system prompt long enough that a splice at the generation prompt is
# worth it from the second turn on, and short enough that one at the last
# user message is not.
SYSTEM = "a line of words, and some more words\n" * 12


def _with_special(*tokens: AddedToken) -> PreTrainedTokenizerFast:
    rust = Tokenizer.from_str(load_family("deepseek").to_str())
    rust.add_special_tokens(list(tokens))
    return PreTrainedTokenizerFast(tokenizer_object=rust)


def _reference(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_an_opener_reaches_as_far_as_the_tokens_that_hold_it_or_begin_inside_it():
    rust = Tokenizer.from_str(load_family("deepseek").to_str())
    rust.add_special_tokens(
        [
            AddedToken("<|turn|>", normalized=False),
            AddedToken("ab<|turn|>cd", normalized=False),  # holds it at offset 2: 8 characters from there
            AddedToken("<|end|>", normalized=False),
            AddedToken("<n>", normalized=True),
            AddedToken("n>zzzz", normalized=False),  # raw, begins inside the normalized <n>
        ]
    )
    openers = SegmentOpeners(rust.get_added_tokens_decoder(), has_normalizer=False, split_special=False)
    reach = {content: openers.reach_of(rust.token_to_id(content)) for content in ("<|turn|>", "<|end|>", "<n>")}
    assert reach == {"<|turn|>": 10, "<|end|>": 7, "<n>": 1 + len("n>zzzz")}
    assert openers.max_reach == max(len(t.content) for t in rust.get_added_tokens_decoder().values())


def test_a_token_that_the_new_text_completes_around_an_opener_is_not_spliced_past():
    """The kept prompt ends inside ``ab<|turn|>cd``, so it matched ``<|turn|>``;
    the new prompt completes the longer token, which starts before that seam."""
    tokenizer = _with_special(
        AddedToken("<|turn|>", normalized=False),
        AddedToken("ab<|turn|>cd", normalized=False),
        AddedToken("<|end|>", normalized=False),
    )
    # One engine forced (the cache's own backend for it): no choice between engines to time.
    if not backend_for(tokenizer, "fastokens").engines.fast:
        pytest.skip("fastokens is not trusted for this tokenizer here")
    cache = PrefixTokenCache(CacheConfig(tokenizer_backend="fastokens", min_chars=0))
    kept = HEAD + "<|end|>ab<|turn|>c"
    new = HEAD + "<|end|>ab<|turn|>cd and the answer"
    assert cache.encode(tokenizer, kept, key="k") == _reference(tokenizer, kept)
    assert cache.encode(tokenizer, new, key="k") == _reference(tokenizer, new)
    assert cache.stats()["hits"] == 1  # spliced at <|end|>, which the new text leaves alone


def test_a_chat_hits_from_its_second_turn_with_a_fast_engine():
    """The generation prompt's opener, just before where the next turn parts
    from the kept prompt, is a seam from the second turn on (a splice
    re-tokenizes at most half the prompt)."""
    tokenizer = load_family_hf("deepseek")
    if not backend_for(tokenizer, "auto").engines.fast:
        pytest.skip("no fast engine is trusted for this tokenizer here")
    start, end = CHAT_MARKERS["deepseek"]
    cache = PrefixTokenCache(CacheConfig(tokenizer_backend="auto", min_chars=0))
    prompts = [SYSTEM + prompt for prompt in chat_turns(random.Random(3), start, end, turns=8)]
    for prompt in prompts:
        assert cache.encode(tokenizer, prompt, key="chat") == _reference(tokenizer, prompt)
    stats = cache.stats()
    assert (stats["misses"], stats["hits"]) == (1, len(prompts) - 1)

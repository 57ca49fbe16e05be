"""The seam rules: which layouts have them, the start-up check refuting a
rule that does not hold, and the background check switching a tokenizer to
splices at added tokens only when a rule turns out wrong at run time."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest
import regex
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from mptok import CacheConfig, PrefixTokenCache
from mptok.cache.backend import backend_for, backend_stats
from mptok.cache.seam_rules import derive_rules
from mptok.core.ids import IdPieces
from mptok_harness.conversations import plain_delta
from mptok_harness.families import FAMILIES, load_family
from mptok.engines import choice


pytestmark = pytest.mark.usefixtures("trust_restored")


def reference_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


WITHOUT_RULES = {
    "metaspace_always_nosplit": "no pre-tokenizer rule that splits wherever it starts",
    "wordpiece": "WordPiece model",
}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_layout_with_rules_passes_its_check_and_the_others_say_why(family, caplog):
    """The families' verdicts, as the start log gives them."""
    caplog.set_level("INFO", logger="mptok.cache.backend")
    tokenizer = load_family(family)
    backend = backend_for(tokenizer, "tokenizers")
    if family in WITHOUT_RULES:
        assert backend.seam_rules is None
        rules = derive_rules(json.loads(tokenizer.to_str()), False, tokenizer.get_vocab_size(with_added_tokens=True))
        assert rules == WITHOUT_RULES[family]
        assert backend_stats()["backend_added_tokens_only"] >= 1
    else:
        assert backend.seam_rules is not None


def _pattern_tokenizer(pattern: str) -> Tokenizer:
    """A byte-level BPE over an isolating regex Split, trained here."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(pattern=Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    rng = random.Random(0)
    tokenizer.train_from_iterator([plain_delta(rng, 400) for _ in range(20)], trainer)
    return tokenizer


def test_a_pattern_that_runs_words_into_the_spaces_after_them_is_refuted_and_stays_exact():
    """`\\w+\\s*` keeps a word and the whitespace after it together: the
    GPT-2 family's rule (a letter before whitespace is a boundary) is false
    for it. The start-up check finds that, and the tokenizer splices at
    added tokens only; plain growth is then tokenized in full, exactly."""
    tokenizer = _pattern_tokenizer(r"\w+\s*|[^\w\s]+\s*|\s+")
    backend = backend_for(tokenizer, "tokenizers")
    assert backend.seam_rules is None
    cache = PrefixTokenCache(CacheConfig(min_chars=0, tokenizer_backend="tokenizers"))
    rng = random.Random(1)
    text = plain_delta(rng, 100)
    for _ in range(6):
        text += plain_delta(rng, 20)
        assert cache.encode(tokenizer, text, key="k") == reference_ids(tokenizer, text)
    assert cache.stats()["hits"] == 0


def test_a_pattern_of_the_gpt2_family_trained_here_has_rules_and_hits():
    """The same trainer with the GPT-2 pattern: the rules hold, and a plain
    prompt growing by text cut anywhere splices every turn."""
    tokenizer = _pattern_tokenizer(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
    backend = backend_for(tokenizer, "tokenizers")
    assert backend.seam_rules is not None
    cache = PrefixTokenCache(CacheConfig(min_chars=0, tokenizer_backend="tokenizers"))
    rng = random.Random(2)
    source = " ".join(plain_delta(rng, 2000).split())
    end = 600
    cache.encode(tokenizer, source[:end], key="k")
    for _ in range(20):
        end += rng.randint(30, 90)  # anywhere: inside words, on spaces
        assert cache.encode(tokenizer, source[:end], key="k") == reference_ids(tokenizer, source[:end])
    assert cache.stats()["hits"] == 20


def test_a_splice_that_differs_from_tokenizers_switches_to_added_tokens_only(caplog):
    """The tripwire behind the rules: a splice's ids are checked against
    `tokenizers` in the background (the first ones always), and a difference
    (handed here as a splice's result: the tail check, check 4, refuses the
    wrong splices a corrupted rule makes before they reach it) switches the
    tokenizer to splices at added tokens only, counts it, and makes every
    cache forget what the rules made."""
    tokenizer = _pattern_tokenizer(r" ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
    backend = backend_for(tokenizer, "tokenizers")
    assert backend.seam_rules is not None
    serial = backend.serial
    before = backend_stats()["backend_mismatches"]
    text = plain_delta(random.Random(3), 200)
    wrong = IdPieces.of(reference_ids(tokenizer, text)[:-1])
    backend.check_splice(text, wrong, tokenized=len(text))
    assert choice.VERIFIER.drain(timeout=60)
    assert backend_stats()["backend_mismatches"] == before + 1
    assert backend.seam_rules is None and backend.serial != serial
    assert "splicing at added tokens only" in caplog.text
    assert backend_for(tokenizer, "tokenizers").seam_rules is None
    cache = PrefixTokenCache(CacheConfig(min_chars=0, tokenizer_backend="tokenizers"))
    for grown in (text, text + " and more words"):
        assert cache.encode(tokenizer, grown, key="k") == reference_ids(tokenizer, grown)
    assert cache.stats()["hits"] == 0


@pytest.mark.parametrize("wrong", ["lengths", "forced"])
def test_wrong_rules_make_no_wrong_splice_past_the_tail_check(wrong):
    """Rules wrong in either fact (every multi-byte token a byte too long;
    a boundary claimed between any two letters) and a prompt growing by
    text cut anywhere: every result is still exact, because a seam's tail
    must reproduce the kept ids up to the next seam candidate (check 4)."""
    tokenizer = _pattern_tokenizer(r" ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
    backend = backend_for(tokenizer, "tokenizers")
    rules = backend.seam_rules
    if wrong == "lengths":
        lengths = rules.lengths.copy()
        lengths[lengths > 1] += 1
        backend.seam_rules = dataclasses.replace(rules, lengths=lengths)
    else:
        backend.seam_rules = dataclasses.replace(rules, forced=regex.compile(r"(?<=\p{L})(?=\p{L})"))
    try:
        cache = PrefixTokenCache(CacheConfig(min_chars=0, tokenizer_backend="tokenizers"))
        rng = random.Random(6)
        source = " ".join(plain_delta(rng, 3000).split())
        end = 300
        for _ in range(40):
            end += rng.randint(5, 60)
            assert cache.encode(tokenizer, source[:end], key="k") == reference_ids(tokenizer, source[:end])
    finally:
        backend.seam_rules = rules


@pytest.mark.parametrize("family", ["deepseek", "qwen", "metaspace_first", "legacy_sp"])
def test_a_prompt_that_parts_within_its_first_characters_is_exact(family):
    """Two prompts that part at the very start (less than the longest added
    token in): no seam can lie before that, and nothing is spliced."""
    tokenizer = load_family(family)
    kept = plain_delta(random.Random(5), 400)
    for parts_at in (0, 1, 5, 20, 40):
        cache = PrefixTokenCache(CacheConfig(min_chars=0))
        cache.encode(tokenizer, kept, key="k")
        text = kept[:parts_at] + "Z" + kept[parts_at + 1 :] + " and more words"
        assert cache.encode(tokenizer, text, key="k") == reference_ids(tokenizer, text)


def test_no_forced_boundary_is_looked_for_in_an_empty_range():
    rules = backend_for(load_family("deepseek"), "tokenizers").seam_rules
    text = "words and words. " * 20
    assert rules.forced_boundaries(text, 0, -5) == []
    assert rules.forced_boundaries(text, 10, 10) == []
    assert all(0 < x < 30 for x in rules.forced_boundaries(text, 0, 30))


def test_tokens_are_located_where_tokenizers_puts_them_on_long_text():
    """The walk back from the end of a long prompt, at many points, against
    `tokenizers`' own offsets (the embedded tokenizer, byte-level)."""
    tokenizer = load_family("deepseek")
    backend = backend_for(tokenizer, "tokenizers")
    rng = random.Random(4)
    text = plain_delta(rng, 3000) + "\u4f60\u597d\u4e16\u754c\u3002 caf\u00e9 \U0001f600 " + plain_delta(rng, 300)
    encoding = backend.encode(text)
    ids = np.asarray(encoding.ids)
    for _ in range(30):
        upto = rng.randrange(200, len(text))
        located = backend.seam_rules.token_starts(ids, text, upto - 150, upto)
        assert located is not None and len(located.positions)
        for position, index in zip(located.positions.tolist(), located.indices.tolist()):
            assert encoding.offsets[index][0] == position

"""The seam rules: which layouts have them, the start-up check refuting a
rule that does not hold, and the background check switching a tokenizer to
splices at added tokens only when a rule turns out wrong at run time."""

from __future__ import annotations

import dataclasses
import functools
import json
import random

import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

from mptok import CacheConfig, PrefixTokenCache
from mptok.cache.backend import backend_for, backend_stats
from mptok.cache.seam import ForcedPairs
from mptok.cache.seam_rules import derive_rules
from mptok.core.ids import IdPieces
from mptok_harness.conversations import plain_delta
from mptok_harness.families import CHAT_MARKERS, FAMILIES, load_family
from mptok.engines import choice


pytestmark = pytest.mark.usefixtures("trust_restored")


def reference_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_has_rules_that_pass_their_check(family):
    """Every family's layout has forced boundaries that survive their check."""
    rules = backend_for(load_family(family), "tokenizers").seam_rules
    assert rules is not None and rules.forced.claim_count != 0


def test_a_layout_without_rules_says_why():
    """No pre-tokenizer split and a normalizer that rewrites characters: no
    point is known to be forced (a lowercased letter may join a piece)."""
    tokenizer = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    tokenizer.normalizer = normalizers.Lowercase()
    rules = derive_rules(json.loads(tokenizer.to_str()), False, tokenizer.get_vocab_size(with_added_tokens=True))
    assert rules == "no pre-tokenizer split, and a normalizer that rewrites the pieces' characters"
    assert backend_for(tokenizer, "tokenizers").seam_rules is None
    assert backend_stats()["backend_added_tokens_only"] >= 1


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


def test_a_pattern_that_runs_words_into_the_spaces_after_them_loses_only_those_claims():
    """`\\w+\\s*` keeps a word and the whitespace after it together: no
    boundary lies between a letter and a space there. That claim is dropped
    (measured or refuted at start); the claim that a word begins after
    whitespace holds, so plain growth still splices, exactly."""
    tokenizer = _pattern_tokenizer(r"\w+\s*|[^\w\s]+\s*|\s+")
    rules = backend_for(tokenizer, "tokenizers").seam_rules
    assert rules is not None
    text = "words and more words"
    assert 5 not in rules.forced.between(text, 0, len(text))  # "words| and"
    assert 6 in rules.forced.between(text, 0, len(text))  # "words |and"
    cache = PrefixTokenCache(CacheConfig(min_chars=0, tokenizer_backend="tokenizers"))
    rng = random.Random(1)
    text = plain_delta(rng, 100)
    for _ in range(6):
        text += plain_delta(rng, 20)
        assert cache.encode(tokenizer, text, key="k") == reference_ids(tokenizer, text)
    assert cache.stats()["hits"] == 5


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
    a boundary claimed between any two characters) and a prompt growing by
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
        classes = rules.forced.classes
        everywhere = ForcedPairs(classes, np.ones((classes.count, classes.count), dtype=bool))
        backend.seam_rules = dataclasses.replace(rules, forced=everywhere)
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
    assert len(rules.forced.between(text, 0, -5)) == 0
    assert len(rules.forced.between(text, 10, 10)) == 0
    assert all(0 < x < 30 for x in rules.forced.between(text, 0, 30))


def test_tokens_are_located_where_tokenizers_puts_them_on_long_text():
    """The walk back from the end of a long prompt, at many points, against
    `tokenizers`' own offsets (the embedded tokenizer, byte-level)."""
    tokenizer = load_family("deepseek")
    backend = backend_for(tokenizer, "tokenizers")
    rng = random.Random(4)
    text = plain_delta(rng, 3000) + "\u4f60\u597d\u4e16\u754c\u3002 caf\u00e9 \U0001f600 " + plain_delta(rng, 300)
    encoding = backend.encode(text)
    ids = np.asarray(encoding.ids)
    starts = [start for start, _ in encoding.offsets]  # a new list of every offset at each read of the property
    for _ in range(30):
        upto = rng.randrange(200, len(text))
        located = backend.seam_rules.token_starts(ids, text, upto - 150, upto)
        assert located is not None and len(located.positions)
        for position, index in zip(located.positions.tolist(), located.indices.tolist()):
            assert starts[index] == position


# -- the matrix: every family against every kind of cut ------------------------------

QWEN2_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


@functools.cache
def _with_pattern(pattern: str, nfc: bool) -> Tokenizer:
    """The Qwen vocabulary under another split regex: Qwen2/2.5's (letters
    without marks; a punctuation run takes the newlines after it) with NFC,
    or GPT-2's without a normalizer."""
    spec = json.loads(load_family("qwen").to_str())
    for step in spec["pre_tokenizer"]["pretokenizers"]:
        if step["type"] == "Split":
            step["pattern"] = {"Regex": pattern}
    if not nfc:
        spec["normalizer"] = None
    return Tokenizer.from_str(json.dumps(spec))


MATRIX_FAMILIES = FAMILIES + ("qwen2", "gpt2")


def _matrix_tokenizer(family: str) -> Tokenizer:
    if family == "qwen2":
        return _with_pattern(QWEN2_PATTERN, nfc=True)
    if family == "gpt2":
        return _with_pattern(GPT2_PATTERN, nfc=False)
    return load_family(family)


def _cut_text(kind: str, rng: random.Random, markers: tuple[str, str]) -> str:
    """Text of one kind, for a cut to fall inside."""
    start, end = markers
    choose = {
        "mid-word": lambda: rng.choice(["tokenization", "internationalization", "hello ", "answers "]),
        "digits": lambda: str(rng.randrange(10 ** rng.randint(1, 12))) + rng.choice(" ,."),
        "spaces-newlines": lambda: rng.choice(["a", " ", "  ", "\n", "\n\n", " \n", "word", "\t"]),
        "crlf": lambda: rng.choice(["line", "\r\n", "\r\n\r\n", " x", "\r", "\n"]),
        "marks": lambda: rng.choice(["e", "\u0301", "\u0323", "a\u0308", " ", "word", "\u0301\u0301"]),
        "emoji": lambda: rng.choice(["😀", "👨\u200d👩\u200d👧", "❤️", "\n", "\n\n", " ", "🏳️\u200d🌈", "ok"]),
        "cjk": lambda: rng.choice(["中文", "字", "日本語のテキスト", "。", "가", " ", "\n"]),
        "added-tokens": lambda: rng.choice([start, end, "user\n", "hi", " ", "\n", start + "assistant\n"]),
        "nfc-far": lambda: rng.choice(["e\u0301", "Å", " word", " other", "."]),
    }
    if kind == "long-runs":
        return rng.choice(["a", " ", "-", "\u0301", "7", "\n", "é"]) * rng.randint(200, 600) + " tail"
    return "".join(choose[kind]() for _ in range(60))


CUT_KINDS = ("mid-word", "digits", "spaces-newlines", "crlf", "marks", "emoji", "cjk", "added-tokens", "long-runs", "nfc-far")
# Each family's share of seams that must splice over every kind of cut, and why it is lower where it is.
MATRIX_HIT_FLOORS = {
    # Its vocabulary (trained on whole segments) spans every pair of
    # characters of plain text: only points around rarer characters are forced.
    "metaspace_always_nosplit": 0.75,
    # A word with a character the vocabulary lacks is one [UNK] (and so is any
    # word longer than 100 characters): a cut inside it has no seam, and one
    # before it none whose first token the new text keeps.
    "wordpiece": 0.95,
}


@pytest.mark.parametrize("family", MATRIX_FAMILIES)
def test_every_kind_of_cut_splices_exactly(family):
    """A prompt, then one that parts from it inside text of each kind and
    goes on: every id list equal to `tokenizers`', and the family's floor of
    seams spliced."""
    tokenizer = _matrix_tokenizer(family)
    markers = CHAT_MARKERS.get(family, CHAT_MARKERS["qwen"])
    hits = cases = 0
    for kind in CUT_KINDS:
        rng = random.Random(f"{family} {kind}")
        for _ in range(8):
            cache = PrefixTokenCache(CacheConfig(min_chars=0))
            # A run longer than the prompt before it would cost more to splice than to tokenize whole.
            history = plain_delta(rng, rng.randint(20, 80) + (400 if kind == "long-runs" else 0))
            first = history + _cut_text(kind, rng, markers)
            second = first[: rng.randint(len(first) * 2 // 3, len(first))] + _cut_text(kind, rng, markers)[: rng.randint(1, 60)]
            for prompt in (first, second):
                assert cache.encode(tokenizer, prompt, key="c") == reference_ids(tokenizer, prompt), (kind, prompt)
            hits += cache.stats()["hits"]
            cases += 1
    assert hits >= MATRIX_HIT_FLOORS.get(family, 0.97) * cases, (hits, cases)


@pytest.mark.parametrize("family", ["qwen", "qwen2", "legacy_sp", "metaspace_first"])
def test_plain_growth_back_to_back_hits(family):
    """A plain prompt growing by text cut anywhere, turn after turn: every turn splices."""
    tokenizer = _matrix_tokenizer(family)
    rng = random.Random(9)
    source = plain_delta(rng, 3000)
    cache = PrefixTokenCache(CacheConfig(min_chars=0))
    end, turns = 600, 40
    cache.encode(tokenizer, source[:end], key="p")
    for _ in range(turns):
        end += rng.randint(20, 120)
        assert cache.encode(tokenizer, source[:end], key="p") == reference_ids(tokenizer, source[:end])
    assert cache.stats()["hits"] >= 0.99 * turns


def test_a_search_for_a_seam_widens_to_the_start_of_a_long_run():
    """A cut deep inside a run with no boundary in it: the search goes back
    to where the run starts (growing windows), and the prompt splices there."""
    tokenizer = load_family("deepseek")
    rules = backend_for(tokenizer, "tokenizers").seam_rules
    text = "Some words before. " + "x" * 5000
    # DeepSeek's pattern runs a space into the letters after it: the boundary is before it.
    assert rules.forced.nearest(text, len(text) - 10, 0, 1) == [len("Some words before.")]
    cache = PrefixTokenCache(CacheConfig(min_chars=0))
    cache.encode(tokenizer, text, key="r")
    grown = text[:-10] + "yz tail"
    assert cache.encode(tokenizer, grown, key="r") == reference_ids(tokenizer, grown)
    assert cache.stats()["hits"] == 1


def test_where_nothing_splits_a_segment_the_vocabulary_says_which_points_are_forced():
    """The legacy SentencePiece layout: no piece holds ▁ after a letter, so
    the point before a space after a word is forced; the Metaspace family
    without split was trained on whole segments (pieces such as `e▁`), so
    that point is not forced there, and both tokenize exactly around it."""
    legacy = backend_for(load_family("legacy_sp"), "tokenizers").seam_rules
    nosplit = backend_for(load_family("metaspace_always_nosplit"), "tokenizers").seam_rules
    text = "the model reads"
    assert list(legacy.forced.between(text, 0, len(text))) == [3, 9]
    assert 3 not in nosplit.forced.between(text, 0, len(text))

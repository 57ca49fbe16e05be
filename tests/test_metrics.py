"""The /metrics declaration: a value that is missing or left over is found, never shown as 0.

``test_serve.py`` audits a real server's snapshots; these tests show what
the audit and the renderer do with a snapshot that does not match, and what
``PromptIds`` counts for the catalogue's prompt series (both exporters').
``tests/vllm/test_plugin.py`` compares a real ``mptok serve``'s families
with the plugin's.
"""

from __future__ import annotations

import math

import pytest

import mptok
from mptok.api.affinity import named
from mptok.core.counting import Histogram
from mptok.front.catalogue import PROMPT_COUNTS
from mptok.front.prompt_ids import PromptIds
from mptok.supervise.metrics import render_prometheus
from mptok.supervise.snapshots import SUPERVISOR_SNAPSHOT
from mptok_harness.checks import expected_ids as expected
from mptok_harness.metrics import audit, example_frontend_snapshot
from mptok_harness.prompts import conversation


def test_a_declared_snapshot_renders_whole():
    snapshots = {"0": example_frontend_snapshot(), SUPERVISOR_SNAPSHOT: {"up": {"0": 1}, "restarts": {"0": 2}, "given_up": {"0": 0}, "spares": 1}}
    assert audit(snapshots) == []
    text = render_prometheus(snapshots)
    assert 'mptok_cache_hits_total{frontend="0"} 7' in text
    assert 'mptok_http_requests_total{frontend="0",path="/tokenize",code="200"} 1' in text
    assert 'mptok_tokenize_seconds_bucket{frontend="0",le="+Inf"} 1' in text
    assert 'mptok_frontend_restarts_total{frontend="0"} 2' in text
    assert 'mptok_frontend_spares 1' in text


def test_a_renamed_value_is_reported_and_left_out_never_zero():
    snapshot = example_frontend_snapshot()
    snapshot["cache"]["hit"] = snapshot["cache"].pop("hits")
    snapshot["routing"].pop("fallback_timeout")
    problems = audit({"0": snapshot})
    assert any("mptok_cache_hits_total has no value" in p for p in problems), problems
    assert any("cache.hit is not rendered" in p for p in problems), problems
    assert any("mptok_route_fallbacks_total has no value" in p for p in problems), problems
    assert len(problems) == 3, problems
    text = render_prometheus({"0": snapshot})
    assert "mptok_cache_hits_total{" not in text and "mptok_route_fallbacks_total{" not in text
    assert 'mptok_cache_misses_total{frontend="0"} 7' in text


def test_histogram_buckets_are_cumulative_and_end_at_inf():
    snapshot = example_frontend_snapshot()
    histogram = Histogram(bounds=(0.1, 1.0))
    for value in (0.05, 0.5, 0.5, 5.0):
        histogram.observe(value)
    snapshot["tokenize_seconds"] = histogram.snapshot()
    lines = [line for line in render_prometheus({"0": snapshot}).splitlines() if line.startswith("mptok_tokenize_seconds")]
    assert lines == [
        'mptok_tokenize_seconds_bucket{frontend="0",le="0.1"} 1',
        'mptok_tokenize_seconds_bucket{frontend="0",le="1.0"} 3',
        'mptok_tokenize_seconds_bucket{frontend="0",le="+Inf"} 4',
        f'mptok_tokenize_seconds_sum{{frontend="0"}} {float(0.05 + 0.5 + 0.5 + 5.0)!r}',
        'mptok_tokenize_seconds_count{frontend="0"} 4',
    ]
    assert math.isclose(histogram.snapshot()["sum"], 6.05)


class _FailingRouting:
    """Routing whose every call raises, as a broken encoder would."""

    def encode(self, tokenizer, text, key=None, deadline=None):
        raise RuntimeError("no")

    encode_array = encode

    def stats(self):
        return {"routed": 0}


def test_prompt_ids_are_exact_and_counted_by_identity_direct_call_and_error(tokenizer):
    prompts = PromptIds(tokenizer, mptok.PrefixTokenCache())
    first, second = conversation(3, 2)
    assert prompts.ids(first, False, named("c", None)) == expected(tokenizer, first, False)
    assert prompts.ids_array(second, True, named(None, "chat:x")).tolist() == expected(tokenizer, second, True)
    assert prompts.ids_array("", True, named(None, None)).tolist() == expected(tokenizer, "", True)
    prompts.count_direct(5)
    counts = prompts.snapshot()["prompts"]
    assert set(counts) == set(PROMPT_COUNTS)
    through = len(expected(tokenizer, first, False)) + len(expected(tokenizer, second, True))
    assert counts == {"keyed": 1, "derived": 1, "keyless": 0, "tokens": through, "direct": 2,
                      "direct_tokens": 5 + len(expected(tokenizer, "", True)), "errors": 0}  # fmt: skip
    assert "routing" not in prompts.snapshot()

    routed = PromptIds(tokenizer, mptok.PrefixTokenCache(), _FailingRouting())
    assert routed.ids("", True, named(None, None)) is None  # only the tokenizer's own call frames an empty text
    for call in (routed.ids, routed.ids_array):
        with pytest.raises(RuntimeError):
            call(first, False, named("c", None))
    snapshot = routed.snapshot()
    assert snapshot["prompts"]["errors"] == 2 and snapshot["prompts"]["keyed"] == 0
    assert snapshot["routing"] == {"routed": 0}

"""mptok's counters on vLLM's own ``/metrics``, summed over its API servers.

vLLM serves ``/metrics`` from whichever API server the scrape lands on. With
``--api-server-count`` > 1 it runs ``prometheus_client`` in multiprocess
mode (``PROMETHEUS_MULTIPROC_DIR``, made by ``vllm serve`` for its API
servers): each process writes its values into files there and the scraped
process reads them all. So each API server copies mptok's counters into
``prometheus_client`` series every ``SYNC_INTERVAL_S`` (counters by the
amount they grew, gauges as they are), labelled with its ``api_server``
rank; with one API server the same series are in the default registry.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from mptok.core.periodic import PeriodicTask
from mptok.routing.liveness import FALLBACK_REASONS

logger = logging.getLogger("vllm.mptok")

SYNC_INTERVAL_S = 0.5


@dataclass(frozen=True)
class Series:
    """One mptok series: its name, kind, help, and the stats key it reads."""

    name: str
    kind: str  # "counter" or "gauge"
    key: str
    help: str


# Names as ``mptok serve`` names them (docs/SERVE.md), with an api_server label.
SERIES = (
    Series("mptok_cache_hits", "counter", "hits", "Prompts tokenized from a cached prefix (by the API server that did the work)."),
    Series("mptok_cache_misses", "counter", "misses", "Cacheable prompts tokenized in full (no kept prompt, or no provable seam)."),
    Series("mptok_cache_resync_failures", "counter", "resync_failures", "Kept prompts whose seam could not be proven."),
    Series("mptok_cache_uncached", "counter", "uncached", "Prompts too short or too long to cache, tokenized in full."),
    Series("mptok_cache_tokens_reused", "counter", "tokens_reused", "Token ids answered from kept prompts, without tokenizing them again."),
    Series("mptok_cache_tokens_tokenized", "counter", "tokens_tokenized", "Token ids the tokenizer backend produced: new tails and full tokenizations."),
    Series("mptok_cache_allocation_failures", "counter", "allocation_failures", "MemoryErrors while caching; each emptied the cache."),
    Series("mptok_cache_entries", "gauge", "entries", "Conversations kept by the cache."),
    Series("mptok_cache_bytes", "gauge", "cached_bytes", "Bytes the cache holds for its conversations."),
    Series("mptok_cache_max_bytes", "gauge", "max_bytes", "The cache's byte budget (MPTOK_CACHE_MAX_BYTES)."),
    Series("mptok_cache_disabled", "gauge", "disabled", "1 once the cache disabled itself after an internal error."),
    Series("mptok_routed", "counter", "routed", "Prompts arriving here that their conversation's owner (another API server) tokenized."),
    Series("mptok_routed_since", "counter", "routed_since", "Routed prompts sent as the characters after a held fingerprint."),
    Series("mptok_route_failures", "counter", "route_failures", "Calls to an owner that failed; the prompt was tokenized here."),
    Series("mptok_crossing_local_cheaper", "counter", "crossing_local_cheaper", "Prompts tokenized here in full because a call to their owner was expected to cost more (not kept here)."),
    Series("mptok_owned_here", "counter", "owned_here", "Keyed prompts whose owner is this API server."),
    Series("mptok_taken_over_here", "counter", "taken_over_here", "Keyed prompts tokenized here because their owners were down."),
    Series("mptok_served", "counter", "served", "Prompts this API server tokenized for the others."),
    Series("mptok_serve_errors", "counter", "serve_errors", "Peer calls this API server failed to answer."),
    Series("mptok_held_reply_bytes", "gauge", "held_bytes", "Bytes of the fingerprints held here of the conversations this API server routed."),
    Series("mptok_prompt_tokens", "counter", "prompt_tokens", "Prompt tokens returned through mptok (cache or owner)."),
    Series("mptok_vllm_prompt_tokens", "counter", "vllm_prompt_tokens", "Prompt tokens tokenized by vLLM's own path (multimodal, offsets, truncation, a tokenizer mptok cannot serve)."),
    Series("mptok_prompts", "counter", "prompts", "Prompts tokenized through mptok."),
    Series("mptok_prompts_keyed", "counter", "prompts_keyed", "Prompts through mptok named by the client's session header."),
    Series("mptok_prompts_derived", "counter", "prompts_derived", "Prompts through mptok of chats named by their first messages."),
    Series("mptok_prompts_keyless", "counter", "prompts_keyless", "Prompts through mptok with no name (not routed; matched by content)."),
    Series("mptok_vllm_prompts", "counter", "vllm_prompts", "Prompts left to vLLM's own tokenization."),
) + tuple(
    Series(f"mptok_route_fallback_{reason}", "counter", f"fallback_{reason}", f"Owners skipped or failed: {reason}.")
    for reason in FALLBACK_REASONS
)


ENGINE_SERIES = "mptok_tokenizer_engine"
ENGINES = ("tokenizers", "fastokens", "gigatoken")


class MetricsExport:
    """Copies ``stats()`` into prometheus series every ``interval_s`` on a daemon thread until ``stop()``.

    ``engines()`` names the engine of short and of long texts (``TokenizerBackend.engine_names``):
    ``mptok_tokenizer_engine{engine, texts}`` is 1 for each, 0 for the others, so a start's engine choice
    (a timing at start) is seen beside the figures it shapes.
    """

    def __init__(
        self,
        api_server: int,
        stats: Callable[[], Mapping[str, int]],
        interval_s: float = SYNC_INTERVAL_S,
        engines: Callable[[], Mapping[str, str]] = dict,
    ):
        from prometheus_client import Counter, Gauge

        self._stats = stats
        self._engines = engines
        self._engine_gauge = Gauge(
            ENGINE_SERIES,
            "1 for the engine that tokenizes this API server's texts in full, per length (texts: short, long).",
            ["api_server", "engine", "texts"],
            multiprocess_mode="livesum",
        )
        self._label = str(api_server)
        self._lock = threading.Lock()
        self._last: dict[str, int] = {}
        label = str(api_server)
        self._series = []
        for series in SERIES:
            if series.kind == "counter":
                metric = Counter(series.name, series.help, ["api_server"])
            else:
                metric = Gauge(series.name, series.help, ["api_server"], multiprocess_mode="livesum")
            self._series.append((series, metric.labels(api_server=label)))
        self._task = PeriodicTask("mptok-metrics", self._synced, interval_s)

    def start(self) -> None:
        """Copy the counters now, then every ``interval_s`` on a daemon thread."""
        self._task.start()

    def sync(self) -> None:
        """Bring every series up to ``stats()`` now."""
        with self._lock:
            stats = self._stats()
            for series, metric in self._series:
                value = stats.get(series.key)
                if value is None:
                    continue
                if series.kind == "counter":
                    grown = value - self._last.get(series.key, 0)
                    if grown > 0:
                        metric.inc(grown)
                    self._last[series.key] = value
                else:
                    metric.set(value)
            chosen = self._engines()
            for texts, engine in chosen.items():
                for name in ENGINES:
                    self._engine_gauge.labels(api_server=self._label, engine=name, texts=texts).set(int(name == engine))

    def stop(self, join_s: float = 1.0) -> None:
        """Stop the thread (waiting at most ``join_s``) and copy the counters a last time."""
        self._task.stop(join_s)

    def _synced(self) -> None:
        try:
            self.sync()
        except Exception:
            logger.warning("mptok: copying the counters to /metrics failed", exc_info=True)

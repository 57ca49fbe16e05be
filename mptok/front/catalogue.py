"""Every mptok series, declared once: what ``mptok serve`` and the engine plugins export alike.

A series is a name, a kind, a help text, its labels, where its values are in
a process's snapshot, and which exporters show it, so nothing can drift
between ``mptok serve``'s own text (``mptok.supervise.metrics``) and the
plugins' ``prometheus_client`` series (``mptok.front.prometheus``). A set
of values is a label, never one series per value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from mptok.api.affinity import IdentityKind
from mptok.core.settings import ENGINES
from mptok.routing.liveness import FALLBACK_REASONS
from mptok.routing.policy import POLICIES as ROUTING_POLICIES

SnapshotPath = tuple[str, ...]
Labels = dict[str, Any]

SERVE = "serve"
VLLM = "vllm"
BOTH = (SERVE, VLLM)
# The label each exporter puts first on a process's series: which process counted.
PROCESS_LABEL = {SERVE: "frontend", VLLM: "api_server"}


def _at(snapshot: Mapping[str, Any], path: SnapshotPath) -> Any:
    """The value at ``path``; raises ``KeyError`` when it is not there (never a default)."""
    value: Any = snapshot
    for part in path:
        value = value[part]
    return value


@dataclass(frozen=True)
class Value:
    """One value at ``path``; ``labels`` maps label names to the paths of their values."""

    path: SnapshotPath
    labels: Mapping[str, SnapshotPath] = field(default_factory=dict)

    def samples(self, snapshot: Mapping[str, Any]) -> Iterator[tuple[Labels, Any]]:
        yield {name: _at(snapshot, path) for name, path in self.labels.items()}, _at(snapshot, self.path)

    def paths(self) -> list[SnapshotPath]:
        return [self.path, *self.labels.values()]

    def label_names(self) -> tuple[str, ...]:
        return tuple(self.labels)

    def fixed_labels(self) -> list[Labels] | None:
        """Every label set this source gives, when they are known before a snapshot (else None)."""
        return None if self.labels else [{}]


@dataclass(frozen=True)
class OnePerLabel:
    """One value per value of ``label``, each at its own path (a fixed set)."""

    label: str
    paths_by_value: Mapping[str, SnapshotPath]

    def samples(self, snapshot: Mapping[str, Any]) -> Iterator[tuple[Labels, Any]]:
        for value, path in self.paths_by_value.items():
            yield {self.label: value}, _at(snapshot, path)

    def paths(self) -> list[SnapshotPath]:
        return list(self.paths_by_value.values())

    def label_names(self) -> tuple[str, ...]:
        return (self.label,)

    def fixed_labels(self) -> list[Labels] | None:
        return [{self.label: value} for value in self.paths_by_value]


@dataclass(frozen=True)
class Table:
    """Every entry of the mapping at ``path``; ``split`` turns an entry's key into the values of ``labels``."""

    path: SnapshotPath
    labels: tuple[str, ...]
    split: Callable[[str], tuple[str, ...]]
    order: Callable[[str], Any] = str

    def samples(self, snapshot: Mapping[str, Any]) -> Iterator[tuple[Labels, Any]]:
        for key, value in sorted(_at(snapshot, self.path).items(), key=lambda item: self.order(item[0])):
            yield dict(zip(self.labels, self.split(key), strict=True)), value

    def paths(self) -> list[SnapshotPath]:
        return [self.path]

    def label_names(self) -> tuple[str, ...]:
        return self.labels

    def fixed_labels(self) -> list[Labels] | None:
        return None


@dataclass(frozen=True)
class Grid:
    """One value per pair of values of two labels (fixed sets): ``path``'s
    mapping, indexed by the first label's value, then the second's."""

    path: SnapshotPath
    rows: tuple[str, tuple[str, ...]]
    columns: tuple[str, tuple[str, ...]]

    def samples(self, snapshot: Mapping[str, Any]) -> Iterator[tuple[Labels, Any]]:
        for labels in self.fixed_labels():
            yield labels, _at(snapshot, self._path_of(labels))

    def paths(self) -> list[SnapshotPath]:
        return [self._path_of(labels) for labels in self.fixed_labels()]

    def _path_of(self, labels: Labels) -> SnapshotPath:
        return (*self.path, labels[self.rows[0]], labels[self.columns[0]])

    def label_names(self) -> tuple[str, ...]:
        return (self.rows[0], self.columns[0])

    def fixed_labels(self) -> list[Labels]:
        return [{self.rows[0]: row, self.columns[0]: column} for row in self.rows[1] for column in self.columns[1]]


Source = Value | OnePerLabel | Table | Grid

# The lengths of text a backend may give different engines (``Engines.names``), and the engines it may give them.
TEXT_LENGTHS = ("short", "long")
ENGINE_NAMES = ("tokenizers", *ENGINES)


@dataclass(frozen=True)
class Metric:
    """One Prometheus metric: ``kind`` is counter, gauge or histogram (a histogram's value is a
    ``Histogram.snapshot()``). A process's series get its exporter's ``PROCESS_LABEL`` before
    ``labels``; ``exporters`` are those that show it (``SERVE``, ``VLLM``)."""

    name: str
    kind: str
    help: str
    source: Source
    exporters: tuple[str, ...] = BOTH

    def __post_init__(self) -> None:
        if self.kind not in ("counter", "gauge", "histogram"):
            raise ValueError(f"{self.name}: kind {self.kind!r} is not counter, gauge or histogram")
        if (self.kind == "counter") != self.name.endswith("_total"):
            raise ValueError(f"{self.name}: a counter's name, and only a counter's, ends with _total")
        if VLLM in self.exporters and (self.kind == "histogram" or self.source.fixed_labels() is None):
            # prometheus_client's series are made before the first snapshot, and its
            # histograms are observed one value at a time, not copied.
            raise ValueError(f"{self.name}: the plugin exports counters and gauges with fixed label sets only")

    @property
    def labels(self) -> tuple[str, ...]:
        return self.source.label_names()


def _path_and_code(key: str) -> tuple[str, str]:
    path, _, code = key.rpartition(" ")
    return path, code


def _frontend_id(key: str) -> tuple[str]:
    return (key,)


def _counter(name: str, section: str, key: str, help_text: str) -> Metric:
    return Metric(name, "counter", help_text, Value((section, key)))


def _gauge(name: str, section: str, key: str, help_text: str) -> Metric:
    return Metric(name, "gauge", help_text, Value((section, key)))


# The keys of a snapshot's "prompts" section (PromptIds.snapshot()): one per identity kind, then these.
PROMPT_TOKENS = "tokens"
DIRECT_PROMPTS = "direct"
DIRECT_PROMPT_TOKENS = "direct_tokens"
ERRORS = "errors"
PROMPT_COUNTS = (*(kind.value for kind in IdentityKind), PROMPT_TOKENS, DIRECT_PROMPTS, DIRECT_PROMPT_TOKENS, ERRORS)

# A process's snapshot: "cache", "routing" and "prompts" (both exporters); mptok serve's also "routing_seconds"
# (TokenizationOwners.timings()), "tokenize_seconds" and "requests" (TokenizeService.snapshot()), "pid" and "started" (Frontend).
FRONTEND_METRICS: tuple[Metric, ...] = (
    _counter("mptok_cache_hits_total", "cache", "hits", "Prompts tokenized from a cached prefix (by the cache that did the work)."),
    _counter("mptok_cache_misses_total", "cache", "misses", "Cacheable prompts tokenized in full (no kept prompt, or no provable seam)."),
    _counter("mptok_cache_resync_failures_total", "cache", "resync_failures", "Kept prompts whose seam could not be proven."),
    _counter("mptok_cache_uncached_total", "cache", "uncached", "Prompts too short or too long to cache, tokenized in full."),
    _gauge("mptok_cache_entries", "cache", "entries", "Conversations kept by the cache."),
    _gauge("mptok_cache_cached_chars", "cache", "cached_chars", "Prompt characters kept by the cache."),
    _gauge("mptok_cache_bytes", "cache", "cached_bytes", "Bytes the cache holds for its conversations (text, ids, offsets, fingerprint chains, keys, bookkeeping)."),
    _gauge("mptok_cache_max_bytes", "cache", "max_bytes", "The cache's byte budget (--cache-bytes, MPTOK_CACHE_MAX_BYTES)."),
    _counter("mptok_cache_tokens_reused_total", "cache", "tokens_reused", "Token ids answered from kept prompts, without tokenizing them again."),
    _counter("mptok_cache_tokens_tokenized_total", "cache", "tokens_tokenized", "Token ids the tokenizer backend produced: new tails and full tokenizations."),
    _counter("mptok_cache_allocation_failures_total", "cache", "allocation_failures", "MemoryErrors while caching; each emptied the cache and the prompt was tokenized in full."),
    _gauge("mptok_held_fingerprint_bytes", "routing", "held_bytes", "Bytes of the fingerprints held here of the conversations this process routed."),
    _gauge("mptok_held_fingerprint_entries", "routing", "held_entries", "Fingerprints held here, one per routed conversation and owner."),
    _gauge("mptok_held_fingerprint_max_bytes", "routing", "held_max_bytes", "The budget of the fingerprints held here (MPTOK_CACHE_MAX_HELD_BYTES)."),
    Metric("mptok_tokenizer_engine", "gauge", "1 for the engine that tokenizes this process's texts in full now, per length (texts: short, or long from the long-text threshold on); the machine's first start chose it by a timing, later ones read it from the engine memo.",
           Grid(("engines",), ("texts", TEXT_LENGTHS), ("engine", ENGINE_NAMES))),
    _gauge("mptok_tokenizer_backend_tokenizers", "cache", "backend_tokenizers", "Tokenizers this process tokenizes in full with `tokenizers` (no fast engine trusted, or switched back)."),
    _gauge("mptok_tokenizer_backend_fastokens", "cache", "backend_fastokens", "Tokenizers this process tokenizes in full with fastokens (passed the start-up check)."),
    _gauge("mptok_tokenizer_backend_gigatoken", "cache", "backend_gigatoken", "Tokenizers this process tokenizes in full with gigatoken (passed the start-up check)."),
    _gauge("mptok_tokenizer_added_tokens_only", "cache", "backend_added_tokens_only", "Tokenizers this process splices at added tokens only: no seam rules for their layout, or rules the start-up check or a background check refuted."),
    _counter("mptok_tokenizer_backend_checks_total", "cache", "backend_checks", "Fast-engine results and splices re-checked against `tokenizers` in the background."),
    _counter("mptok_tokenizer_backend_checks_dropped_total", "cache", "backend_checks_dropped", "Sampled re-checks dropped because the check queue was full."),
    _counter("mptok_tokenizer_backend_check_cpu_seconds_total", "cache", "backend_check_cpu_seconds", "CPU seconds of the background re-checks (the checking thread's own time)."),
    _counter("mptok_tokenizer_backend_mismatches_total", "cache", "backend_mismatches", "Fast-engine results or splices that differed from `tokenizers`; each switched that tokenizer back to `tokenizers` and to splices at added tokens only."),
    _gauge("mptok_cache_disabled", "cache", "disabled", "1 once the cache disabled itself after an internal error."),
    _counter("mptok_routed_total", "routing", "routed", "Prompts arriving here that their conversation's owner (another process) tokenized."),
    _counter("mptok_routed_since_total", "routing", "routed_since", "Routed prompts sent as the characters after a held fingerprint."),
    _counter("mptok_routed_copies_kept_total", "routing", "copies_kept", "Routed prompts whose owner's ids this process also kept as its own copy (where that evicted nothing), to extend here."),
    _counter("mptok_kept_here_total", "routing", "kept_here", "Prompts another process owns, extended here because this process keeps a copy of their conversation."),
    _counter("mptok_route_failures_total", "routing", "route_failures", "Calls to an owner that failed; the prompt was tokenized here."),
    _counter("mptok_owned_here_total", "routing", "owned_here", "Keyed prompts whose owner is this process."),
    _counter("mptok_taken_over_here_total", "routing", "taken_over_here", "Keyed prompts tokenized here because their owners were down."),
    _counter("mptok_served_total", "routing", "served", "Prompts this process tokenized for its peers."),
    _counter("mptok_served_since_total", "routing", "served_since", "Peer prompts this process rebuilt from a kept prompt a fingerprint named."),
    _counter("mptok_serve_errors_total", "routing", "serve_errors", "Peer calls this process failed to answer."),
    _counter("mptok_owner_connections_accepted_total", "routing", "accepted", "Peer connections this process accepted as an owner."),
    _counter("mptok_owner_connections_refused_total", "routing", "refused", "Peer connections closed at once because this owner served its maximum already."),
    _gauge("mptok_owner_connections", "routing", "active_connections", "Peer connections this owner serves now."),
    _counter("mptok_owner_handshake_failures_total", "routing", "handshake_failures", "Peer connections dropped during the authkey handshake."),
    _counter("mptok_owner_refused_requests_total", "routing", "refused_requests", "Authenticated peer connections that asked for something other than encode."),
    Metric("mptok_route_fallbacks_total", "counter", "Prompts not tokenized by their owner, by reason.",
           OnePerLabel("reason", {reason: ("routing", f"fallback_{reason}") for reason in FALLBACK_REASONS})),
    Metric("mptok_routing_policy", "gauge", "1 for the routing policy this process follows (--routing, MPTOK_ROUTING): kept, always or never.",
           OnePerLabel("policy", {policy: ("routing", f"policy_{policy}") for policy in ROUTING_POLICIES})),
    Metric("mptok_prompts_total", "counter", "Prompts tokenized through mptok (the cache or its owner), by where their conversation's name came from: keyed (the client named it), derived (from a chat's first messages, or --affinity-chars of a prompt), keyless (not routed).",
           OnePerLabel("identity", {kind.value: ("prompts", kind.value) for kind in IdentityKind})),
    _counter("mptok_prompt_tokens_total", "prompts", PROMPT_TOKENS, "Prompt tokens returned through mptok (the cache or its owner), special tokens included."),
    _counter("mptok_direct_prompts_total", "prompts", DIRECT_PROMPTS, "Prompts left to the tokenizer's own call: no fixed special-token frame (mptok serve), or vLLM's own path (multimodal, offsets, truncation, a tokenizer mptok cannot serve, an error)."),
    _counter("mptok_direct_prompt_tokens_total", "prompts", DIRECT_PROMPT_TOKENS, "Prompt tokens of the prompts left to the tokenizer's own call."),
    _counter("mptok_errors_total", "prompts", ERRORS, "Prompts whose tokenization through mptok raised (mptok serve answers 500; the plugin leaves them to vLLM)."),
    Metric("mptok_http_requests_total", "counter", "HTTP requests answered, by path and status code.", Table(("requests",), ("path", "code"), _path_and_code), (SERVE,)),
    Metric("mptok_tokenize_seconds", "histogram", "Seconds to tokenize a request's text (routing included).", Value(("tokenize_seconds",)), (SERVE,)),
    Metric("mptok_route_seconds", "histogram", "Seconds from choosing the owner of a prompt arriving here to holding the ids it answered (liveness check, transport, the owner's work); calls that failed and fell back are not counted.",
           Value(("routing_seconds", "route_seconds")), (SERVE,)),
    Metric("mptok_peer_serve_seconds", "histogram", "Seconds of this process's own work per peer call it answered (its waits for its own GIL included, the transport not); calls it could not answer are not counted.",
           Value(("routing_seconds", "serve_seconds")), (SERVE,)),
    Metric("mptok_frontend_start_time_seconds", "gauge", "Unix time the frontend process started serving.", Value(("started",), {"pid": ("pid",)}), (SERVE,)),
)  # fmt: skip

# The supervisor's snapshot (mptok serve, mptok render): one value per frontend id.
SUPERVISOR_METRICS: tuple[Metric, ...] = (
    Metric("mptok_frontend_up", "gauge", "1 while the supervisor has a ready process for this frontend id.", Table(("up",), ("frontend",), _frontend_id, int), (SERVE,)),
    Metric("mptok_frontend_restarts_total", "counter", "Times the supervisor restarted this frontend id.", Table(("restarts",), ("frontend",), _frontend_id, int), (SERVE,)),
    Metric("mptok_frontend_given_up", "gauge", "1 while the supervisor has given up restarting this frontend id (--max-restarts within --restart-window).", Table(("given_up",), ("frontend",), _frontend_id, int), (SERVE,)),
    Metric("mptok_frontend_spares", "gauge", "Processes built and waiting to take the place of a frontend that exits (mptok render --spares).", Value(("spares",)), (SERVE,)),
)  # fmt: skip


def exported_by(exporter: str) -> tuple[Metric, ...]:
    """The process series ``exporter`` (``SERVE``, ``VLLM``) shows, in declaration order."""
    return tuple(metric for metric in FRONTEND_METRICS if exporter in metric.exporters)

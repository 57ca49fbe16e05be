"""Every /metrics series, declared once, and the Prometheus text of every process's snapshot.

Each process writes its counters as a snapshot (``mptok.serve.snapshots``);
whichever frontend a scrape reaches renders them all here, with a
``frontend`` label on every series: when a frontend restarts, its counters
restart from zero in its own series, which Prometheus reads as a counter
reset, not as a drop of the whole server. The supervisor's snapshot gives
whether each frontend is up, its restarts, whether it was given up.

Every series is declared once, in ``FRONTEND_METRICS`` and
``SUPERVISOR_METRICS``: its name, kind, help, labels and where its values
are in a snapshot. ``audit`` lists what a snapshot lacks of that
declaration and what it holds that nothing renders; the tests run it on a
real server's snapshots, so a renamed counter fails there instead of
showing zeros.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from mptok.api.affinity import IdentityKind
from mptok.routing.crossing import CHOICES as CROSSING_CHOICES
from mptok.routing.liveness import FALLBACK_REASONS
from mptok.routing.policy import POLICIES as ROUTING_POLICIES
from mptok.serve.snapshots import SUPERVISOR_SNAPSHOT

logger = logging.getLogger(__name__)


# -- what each series is and where its values come from ----------------------

SnapshotPath = tuple[str, ...]
Labels = dict[str, Any]


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


Source = Value | OnePerLabel | Table


@dataclass(frozen=True)
class Metric:
    """One Prometheus metric: ``kind`` is counter, gauge or histogram (a histogram's value is a
    ``Histogram.snapshot()``). Frontend metrics get a ``frontend`` label before ``labels``."""

    name: str
    kind: str
    help: str
    source: Source

    def __post_init__(self) -> None:
        if self.kind not in ("counter", "gauge", "histogram"):
            raise ValueError(f"{self.name}: kind {self.kind!r} is not counter, gauge or histogram")
        if (self.kind == "counter") != self.name.endswith("_total"):
            raise ValueError(f"{self.name}: a counter's name, and only a counter's, ends with _total")

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


# A frontend's snapshot: "cache" (PrefixTokenCache.stats()), "routing"
# (TokenizationOwners.stats()), "routing_seconds" (its timings()),
# "tokenize_seconds", "requests" and "identities" (TokenizeService.snapshot()),
# "pid" and "started" (Frontend).
FRONTEND_METRICS: tuple[Metric, ...] = (
    _counter("mptok_cache_hits_total", "cache", "hits", "Prompts tokenized from a cached prefix (by the cache that did the work)."),
    _counter("mptok_cache_misses_total", "cache", "misses", "Cacheable prompts tokenized in full (no kept prompt, or no provable seam)."),
    _counter("mptok_cache_resync_failures_total", "cache", "resync_failures", "Kept prompts whose seam could not be proven."),
    _counter("mptok_cache_uncached_total", "cache", "uncached", "Prompts too short or too long to cache, tokenized in full."),
    _gauge("mptok_cache_entries", "cache", "entries", "Conversations kept by the cache."),
    _gauge("mptok_cache_cached_chars", "cache", "cached_chars", "Prompt characters kept by the cache."),
    _gauge("mptok_cache_bytes", "cache", "cached_bytes", "Bytes the cache holds for its conversations (text, ids, offsets, versions, keys, bookkeeping)."),
    _gauge("mptok_cache_max_bytes", "cache", "max_bytes", "The cache's byte budget (--cache-bytes)."),
    _counter("mptok_cache_tokens_reused_total", "cache", "tokens_reused", "Token ids answered from kept prompts, without tokenizing them again."),
    _counter("mptok_cache_tokens_tokenized_total", "cache", "tokens_tokenized", "Token ids the tokenizer backend produced: new tails and full tokenizations."),
    _counter("mptok_cache_allocation_failures_total", "cache", "allocation_failures", "MemoryErrors while caching; each emptied the cache and the prompt was tokenized in full."),
    _gauge("mptok_held_reply_bytes", "routing", "held_bytes", "Bytes of the fingerprints held here of the conversations this frontend routed."),
    _gauge("mptok_held_reply_entries", "routing", "held_entries", "Fingerprints held here, one per routed conversation and owner."),
    _gauge("mptok_held_reply_max_bytes", "routing", "held_max_bytes", "The budget of the fingerprints held here (MPTOK_CACHE_MAX_HELD_BYTES)."),
    _gauge("mptok_tokenizer_backend_tokenizers", "cache", "backend_tokenizers", "Tokenizers this frontend tokenizes in full with `tokenizers` (no fast engine trusted, or switched back)."),
    _gauge("mptok_tokenizer_backend_fastokens", "cache", "backend_fastokens", "Tokenizers this frontend tokenizes in full with fastokens (passed the start-up check)."),
    _gauge("mptok_tokenizer_backend_gigatoken", "cache", "backend_gigatoken", "Tokenizers this frontend tokenizes in full with gigatoken (passed the start-up check)."),
    _counter("mptok_tokenizer_backend_checks_total", "cache", "backend_checks", "Fast-engine results re-checked against `tokenizers` in the background."),
    _counter("mptok_tokenizer_backend_checks_dropped_total", "cache", "backend_checks_dropped", "Sampled re-checks dropped because the check queue was full."),
    _counter("mptok_tokenizer_backend_mismatches_total", "cache", "backend_mismatches", "Fast-engine results that differed from `tokenizers`; each switched that tokenizer back to `tokenizers`."),
    _gauge("mptok_cache_disabled", "cache", "disabled", "1 once the cache disabled itself after an internal error."),
    _counter("mptok_routed_total", "routing", "routed", "Prompts arriving here that their conversation's owner tokenized."),
    _counter("mptok_routed_since_total", "routing", "routed_since", "Routed prompts sent as the characters after a held fingerprint."),
    _counter("mptok_route_failures_total", "routing", "route_failures", "Calls to an owner that failed; the prompt was tokenized here."),
    _counter("mptok_owned_here_total", "routing", "owned_here", "Keyed prompts whose owner is this frontend."),
    _counter("mptok_taken_over_here_total", "routing", "taken_over_here", "Keyed prompts tokenized here because their owners were down."),
    _counter("mptok_served_total", "routing", "served", "Prompts this frontend tokenized for its peers."),
    _counter("mptok_served_since_total", "routing", "served_since", "Peer prompts this frontend rebuilt from a kept prompt a fingerprint named."),
    _counter("mptok_serve_errors_total", "routing", "serve_errors", "Peer calls this frontend failed to answer."),
    _counter("mptok_owner_connections_accepted_total", "routing", "accepted", "Peer connections this frontend accepted as an owner."),
    _counter("mptok_owner_connections_refused_total", "routing", "refused", "Peer connections closed at once because this owner served its maximum already."),
    _gauge("mptok_owner_connections", "routing", "active_connections", "Peer connections this owner serves now."),
    _counter("mptok_owner_handshake_failures_total", "routing", "handshake_failures", "Peer connections dropped during the authkey handshake."),
    _counter("mptok_owner_refused_requests_total", "routing", "refused_requests", "Authenticated peer connections that asked for something other than encode."),
    Metric("mptok_route_fallbacks_total", "counter", "Prompts not tokenized by their owner, by reason.",
           OnePerLabel("reason", {reason: ("routing", f"fallback_{reason}") for reason in FALLBACK_REASONS})),
    Metric("mptok_routing_policy", "gauge", "1 for the routing policy this frontend follows (--routing, MPTOK_ROUTING): cheaper, always or never.",
           OnePerLabel("policy", {policy: ("routing", f"policy_{policy}") for policy in ROUTING_POLICIES})),
    Metric("mptok_crossing_choices_total", "counter", "Prompts this frontend could send its owner as new characters, by choice: route_cheaper, route_unknown (no estimate yet), route_probe (refreshing the estimate), local_cheaper (tokenized here: cheaper than the crossing), local_kept (extending the version kept here).",
           OnePerLabel("choice", {choice: ("routing", f"crossing_{choice}") for choice in CROSSING_CHOICES})),
    Metric("mptok_prompts_total", "counter", "Prompts tokenized, by where their conversation key came from: keyed (the client named it), derived (from a chat's first messages, or --affinity-chars of a prompt), keyless (not routed).",
           OnePerLabel("identity", {kind.value: ("identities", kind.value) for kind in IdentityKind})),
    Metric("mptok_http_requests_total", "counter", "HTTP requests answered, by path and status code.", Table(("requests",), ("path", "code"), _path_and_code)),
    Metric("mptok_tokenize_seconds", "histogram", "Seconds to tokenize a request's text (routing included).", Value(("tokenize_seconds",))),
    Metric("mptok_route_seconds", "histogram", "Seconds from choosing the owner of a prompt arriving here to holding the ids it answered (liveness check, transport, the owner's work); calls that failed and fell back are not counted.",
           Value(("routing_seconds", "route_seconds"))),
    Metric("mptok_peer_serve_seconds", "histogram", "Seconds of this frontend's own work per peer call it answered (its waits for its own GIL included, the transport not); calls it could not answer are not counted.",
           Value(("routing_seconds", "serve_seconds"))),
    Metric("mptok_frontend_start_time_seconds", "gauge", "Unix time the frontend process started serving.", Value(("started",), {"pid": ("pid",)})),
)  # fmt: skip

SUPERVISOR_METRICS: tuple[Metric, ...] = (
    Metric("mptok_frontend_up", "gauge", "1 while the supervisor has a ready process for this frontend id.", Table(("up",), ("frontend",), _frontend_id, int)),
    Metric("mptok_frontend_restarts_total", "counter", "Times the supervisor restarted this frontend id.", Table(("restarts",), ("frontend",), _frontend_id, int)),
    Metric("mptok_frontend_given_up", "gauge", "1 while the supervisor has given up restarting this frontend id (--max-restarts within --restart-window).", Table(("given_up",), ("frontend",), _frontend_id, int)),
    Metric("mptok_frontend_spares", "gauge", "Processes built and waiting to take the place of a frontend that exits (mptok render --spares).", Value(("spares",))),
)  # fmt: skip


# -- the Prometheus text format -----------------------------------------------


def render_prometheus(snapshots: Mapping[str, Mapping[str, Any]]) -> str:
    """The Prometheus text exposition (version 0.0.4) of every snapshot.

    Frontend snapshots (``SnapshotDir`` names that are frontend ids) give
    ``FRONTEND_METRICS`` with a ``frontend`` label; the supervisor's gives
    ``SUPERVISOR_METRICS``. A value missing from a snapshot is left out of
    the text, with a warning, never shown as 0 (``audit`` finds it first).
    """
    frontends = sorted(
        ((int(name), snap) for name, snap in snapshots.items() if name.isdigit()), key=lambda item: item[0]
    )
    out: list[str] = []
    for metric in FRONTEND_METRICS:
        _header(out, metric)
        for frontend, snap in frontends:
            _samples(out, metric, snap, {"frontend": frontend})
    supervisor = snapshots.get(SUPERVISOR_SNAPSHOT)
    if supervisor is not None:
        out.append(render_supervisor(supervisor))
    return "\n".join(out) + "\n"


def render_supervisor(snapshot: Mapping[str, Any]) -> str:
    """``SUPERVISOR_METRICS`` of the supervisor's snapshot, without a trailing newline
    (also what ``mptok render`` adds to vLLM's own /metrics)."""
    out: list[str] = []
    for metric in SUPERVISOR_METRICS:
        _header(out, metric)
        _samples(out, metric, snapshot, {})
    return "\n".join(out)


def audit(snapshots: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """What keeps ``render_prometheus`` from showing these snapshots whole: every declared
    value a snapshot lacks, and every value it holds that no metric renders. Empty when all is well."""
    problems = []
    for name, snap in sorted(snapshots.items()):
        if name.isdigit():
            metrics = FRONTEND_METRICS
        elif name == SUPERVISOR_SNAPSHOT:
            metrics = SUPERVISOR_METRICS
        else:
            problems.append(f"snapshot {name!r} is neither a frontend's nor the supervisor's")
            continue
        for metric in metrics:
            try:
                list(metric.source.samples(snap))
            except (KeyError, TypeError) as e:
                problems.append(f"snapshot {name}: {metric.name} has no value ({type(e).__name__}: {e})")
        rendered = {path for metric in metrics for path in metric.source.paths()}
        problems.extend(
            f"snapshot {name}: {'.'.join(path)} is not rendered"
            for path in _leaves(snap)
            if not any(path[: len(prefix)] == prefix for prefix in rendered)
        )
    return problems


def _leaves(snapshot: Mapping[str, Any], prefix: SnapshotPath = ()) -> Iterator[SnapshotPath]:
    """The paths of a snapshot's values; a histogram (a mapping with ``bounds``) is one value."""
    for key, value in snapshot.items():
        if isinstance(value, Mapping) and value and "bounds" not in value:
            yield from _leaves(value, (*prefix, key))
        else:
            yield (*prefix, key)


def _header(out: list[str], metric: Metric) -> None:
    out.append(f"# HELP {metric.name} {metric.help}")
    out.append(f"# TYPE {metric.name} {metric.kind}")


def _samples(out: list[str], metric: Metric, snap: Mapping[str, Any], base: Labels) -> None:
    try:
        samples = list(metric.source.samples(snap))
    except (KeyError, TypeError) as e:
        logger.warning("metric %s left out of %s: its value is missing (%r)", metric.name, base or "the supervisor", e)
        return
    for labels, value in samples:
        if metric.kind == "histogram":
            _histogram(out, metric.name, {**base, **labels}, value)
        else:
            _sample(out, metric.name, {**base, **labels}, value)


def _sample(out: list[str], metric: str, labels: Mapping[str, Any], value: float) -> None:
    rendered = ",".join(f'{name}="{_label_value(value)}"' for name, value in labels.items())
    out.append(f"{metric}{{{rendered}}} {_number(value)}" if rendered else f"{metric} {_number(value)}")


def _histogram(out: list[str], metric: str, labels: Labels, snap: Mapping[str, Any]) -> None:
    cumulative = 0
    for bound, count in zip([*snap["bounds"], math.inf], snap["counts"], strict=True):
        cumulative += count
        le = "+Inf" if bound == math.inf else repr(float(bound))
        _sample(out, f"{metric}_bucket", {**labels, "le": le}, cumulative)
    _sample(out, f"{metric}_sum", labels, snap["sum"])
    _sample(out, f"{metric}_count", labels, cumulative)


def _label_value(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    return repr(float(value))

"""Metrics of every frontend, served by whichever frontend a scrape lands on.

Behind one SO_REUSEPORT port a scrape of ``/metrics`` reaches one frontend
picked by the kernel, yet the operator needs the whole server. So each
process writes a JSON snapshot of its counters into the private ipc
directory (atomically, every ``SNAPSHOT_INTERVAL_S`` and at exit), and the
frontend that answers reads them all and renders the Prometheus text format
with a ``frontend`` label on every series: when a frontend restarts, its
counters restart from zero in its own series, which Prometheus reads as a
counter reset, not as a drop of the whole server.

The supervisor writes one snapshot too (``supervisor.json``): restarts and
whether each frontend is up.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import tempfile
import threading
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from mptok.affinity import IdentityKind
from mptok.routing import FALLBACK_REASONS

logger = logging.getLogger(__name__)

SNAPSHOT_INTERVAL_S = 0.5
SUPERVISOR_SNAPSHOT = "supervisor"
_SNAPSHOT_PREFIX = "metrics-"
_SNAPSHOT_SUFFIX = ".json"

class SnapshotDir:
    """The snapshots in one ipc directory: written atomically, read all at once."""

    def __init__(self, ipc_dir: str):
        self._dir = ipc_dir

    def write(self, name: str | int, data: Mapping[str, Any]) -> None:
        """Replace snapshot ``name`` atomically (readers see the old or the new one, whole)."""
        fd, tmp = tempfile.mkstemp(dir=self._dir, prefix=".tmp-metrics-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(orjson.dumps(data))
            os.replace(tmp, os.path.join(self._dir, f"{_SNAPSHOT_PREFIX}{name}{_SNAPSHOT_SUFFIX}"))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def read_all(self) -> dict[str, dict[str, Any]]:
        """Every snapshot by name; one that vanishes or is unreadable is left out, with a warning."""
        snapshots = {}
        try:
            names = os.listdir(self._dir)
        except FileNotFoundError:
            return {}
        for filename in sorted(names):
            if not (filename.startswith(_SNAPSHOT_PREFIX) and filename.endswith(_SNAPSHOT_SUFFIX)):
                continue
            name = filename[len(_SNAPSHOT_PREFIX) : -len(_SNAPSHOT_SUFFIX)]
            try:
                with open(os.path.join(self._dir, filename), "rb") as f:
                    snapshots[name] = orjson.loads(f.read())
            except FileNotFoundError:
                continue
            except (OSError, orjson.JSONDecodeError) as e:
                logger.warning("unreadable metrics snapshot %s: %s", filename, e)
        return snapshots


class PeriodicTask:
    """Run ``tick`` every ``interval_s`` on a daemon thread until ``stop()``.

    ``stop()`` wakes the thread, runs ``tick`` one last time on the caller's
    thread (so the final state is written), and waits at most ``join_s`` for
    the thread. A ``tick`` that raises is logged and does not stop the loop.
    """

    def __init__(self, name: str, tick: Callable[[], None], interval_s: float = SNAPSHOT_INTERVAL_S):
        self._tick = tick
        self._interval_s = interval_s
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._tick_logged()
        self._thread.start()

    def stop(self, join_s: float = 5.0) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(join_s)
        self._tick_logged()

    def _run(self) -> None:
        while not self._stopping.wait(self._interval_s):
            self._tick_logged()

    def _tick_logged(self) -> None:
        try:
            self._tick()
        except Exception:
            logger.warning("periodic task %s failed", self._thread.name, exc_info=True)


# -- the Prometheus text format -----------------------------------------------

# (metric name, type, help, where in a frontend snapshot, key there)
_FRONTEND_SERIES = (
    ("mptok_cache_hits_total", "counter", "Prompts tokenized from a cached prefix (by the cache that did the work).", "cache", "hits"),
    ("mptok_cache_misses_total", "counter", "Cacheable prompts tokenized in full (no kept prompt, or no provable seam).", "cache", "misses"),
    ("mptok_cache_resync_failures_total", "counter", "Kept prompts whose seam could not be proven.", "cache", "resync_failures"),
    ("mptok_cache_uncached_total", "counter", "Prompts too short or too long to cache, tokenized in full.", "cache", "uncached"),
    ("mptok_cache_entries", "gauge", "Conversations kept by the cache.", "cache", "entries"),
    ("mptok_cache_cached_chars", "gauge", "Prompt characters kept by the cache.", "cache", "cached_chars"),
    ("mptok_cache_bytes", "gauge", "Bytes the cache holds for its conversations (text, ids, offsets, versions, keys, bookkeeping).", "cache", "cached_bytes"),
    ("mptok_cache_max_bytes", "gauge", "The cache's byte budget (--cache-bytes).", "cache", "max_bytes"),
    ("mptok_cache_allocation_failures_total", "counter", "MemoryErrors while caching; each emptied the cache and the prompt was tokenized in full.", "cache", "allocation_failures"),
    ("mptok_held_reply_bytes", "gauge", "Bytes held here of owners' replies for the conversations this frontend routed.", "routing", "held_bytes"),
    ("mptok_held_reply_entries", "gauge", "Owners' replies held here, one per routed conversation.", "routing", "held_entries"),
    ("mptok_cache_disabled", "gauge", "1 once the cache disabled itself after an internal error.", "cache", "disabled"),
    ("mptok_routed_total", "counter", "Prompts arriving here that their conversation's owner tokenized.", "routing", "routed"),
    ("mptok_routed_since_total", "counter", "Routed prompts sent as the characters after a held version, answered with the ids that changed.", "routing", "routed_since"),
    ("mptok_route_failures_total", "counter", "Calls to an owner that failed; the prompt was tokenized here.", "routing", "route_failures"),
    ("mptok_owned_here_total", "counter", "Keyed prompts whose owner is this frontend.", "routing", "owned_here"),
    ("mptok_taken_over_here_total", "counter", "Keyed prompts tokenized here because their owners were down.", "routing", "taken_over_here"),
    ("mptok_served_total", "counter", "Prompts this frontend tokenized for its peers.", "routing", "served"),
    ("mptok_served_since_total", "counter", "Peer prompts this frontend rebuilt from a version it remembered.", "routing", "served_since"),
    ("mptok_serve_errors_total", "counter", "Peer calls this frontend failed to answer.", "routing", "serve_errors"),
)  # fmt: skip


# (metric name, key in a frontend snapshot's "routing_seconds", help)
_ROUTING_HISTOGRAMS = (
    ("mptok_route_seconds", "route_seconds", "Seconds from choosing the owner of a prompt arriving here to holding the ids it answered (liveness check, transport, the owner's work); calls that failed and fell back are not counted."),
    ("mptok_peer_serve_seconds", "serve_seconds", "Seconds of this frontend's own work per peer call it answered (its waits for its own GIL included, the transport not); calls it could not answer are not counted."),
)  # fmt: skip


def render_prometheus(snapshots: Mapping[str, Mapping[str, Any]]) -> str:
    """The Prometheus text exposition (version 0.0.4) of every snapshot.

    Frontend snapshots (``SnapshotDir`` names that are frontend ids) give
    the ``mptok_*`` cache, routing, request, ``mptok_tokenize_seconds``,
    ``mptok_route_seconds`` and ``mptok_peer_serve_seconds`` series with a
    ``frontend`` label; the supervisor's gives
    ``mptok_frontend_up`` and ``mptok_frontend_restarts_total``.
    """
    frontends = sorted(
        ((int(name), snap) for name, snap in snapshots.items() if name.isdigit()), key=lambda item: item[0]
    )
    out: list[str] = []
    for metric, kind, help_text, section, key in _FRONTEND_SERIES:
        _header(out, metric, kind, help_text)
        for frontend, snap in frontends:
            _sample(out, metric, {"frontend": frontend}, snap.get(section, {}).get(key, 0))
    _header(out, "mptok_route_fallbacks_total", "counter", "Prompts not tokenized by their owner, by reason.")
    for frontend, snap in frontends:
        for reason in FALLBACK_REASONS:
            value = snap.get("routing", {}).get(f"fallback_{reason}", 0)
            _sample(out, "mptok_route_fallbacks_total", {"frontend": frontend, "reason": reason}, value)
    _header(out, "mptok_prompts_total", "counter", "Prompts tokenized, by where their conversation key came from: keyed (the client named it), derived (from a chat's first messages, or --affinity-chars of a prompt), keyless (not routed).")
    for frontend, snap in frontends:
        for kind in IdentityKind:
            _sample(out, "mptok_prompts_total", {"frontend": frontend, "identity": kind.value}, snap.get("identities", {}).get(kind.value, 0))
    _header(out, "mptok_http_requests_total", "counter", "HTTP requests answered, by path and status code.")
    for frontend, snap in frontends:
        for path_code, value in sorted(snap.get("requests", {}).items()):
            path, _, code = path_code.rpartition(" ")
            _sample(out, "mptok_http_requests_total", {"frontend": frontend, "path": path, "code": code}, value)
    _header(out, "mptok_tokenize_seconds", "histogram", "Seconds to tokenize a request's text (routing included).")
    for frontend, snap in frontends:
        _histogram(out, "mptok_tokenize_seconds", frontend, snap.get("tokenize_seconds"))
    for metric, key, help_text in _ROUTING_HISTOGRAMS:
        _header(out, metric, "histogram", help_text)
        for frontend, snap in frontends:
            _histogram(out, metric, frontend, snap.get("routing_seconds", {}).get(key))
    _header(out, "mptok_frontend_start_time_seconds", "gauge", "Unix time the frontend process started serving.")
    for frontend, snap in frontends:
        _sample(out, "mptok_frontend_start_time_seconds", {"frontend": frontend, "pid": snap.get("pid", 0)}, snap.get("started", 0))
    supervisor = snapshots.get(SUPERVISOR_SNAPSHOT)
    if supervisor is not None:
        _header(out, "mptok_frontend_up", "gauge", "1 while the supervisor has a ready process for this frontend id.")
        for frontend, up in sorted(supervisor.get("up", {}).items(), key=lambda item: int(item[0])):
            _sample(out, "mptok_frontend_up", {"frontend": frontend}, up)
        _header(out, "mptok_frontend_restarts_total", "counter", "Times the supervisor restarted this frontend id.")
        for frontend, n in sorted(supervisor.get("restarts", {}).items(), key=lambda item: int(item[0])):
            _sample(out, "mptok_frontend_restarts_total", {"frontend": frontend}, n)
    return "\n".join(out) + "\n"


def _header(out: list[str], metric: str, kind: str, help_text: str) -> None:
    out.append(f"# HELP {metric} {help_text}")
    out.append(f"# TYPE {metric} {kind}")


def _sample(out: list[str], metric: str, labels: Mapping[str, Any], value: float) -> None:
    rendered = ",".join(f'{name}="{_label_value(value)}"' for name, value in labels.items())
    out.append(f"{metric}{{{rendered}}} {_number(value)}")


def _histogram(out: list[str], metric: str, frontend: int, snap: Mapping[str, Any] | None) -> None:
    if not snap:
        return
    cumulative = 0
    for bound, count in zip([*snap["bounds"], math.inf], snap["counts"]):
        cumulative += count
        le = "+Inf" if bound == math.inf else repr(float(bound))
        _sample(out, f"{metric}_bucket", {"frontend": frontend, "le": le}, cumulative)
    _sample(out, f"{metric}_sum", {"frontend": frontend}, snap["sum"])
    _sample(out, f"{metric}_count", {"frontend": frontend}, cumulative)


def _label_value(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    return repr(float(value))

"""The Prometheus text of every process's snapshot: ``mptok serve``'s /metrics.

Each process writes its counters as a snapshot (``mptok.supervise.snapshots``);
whichever frontend a scrape reaches renders them all here, with a
``frontend`` label on every series: when a frontend restarts, its counters
restart from zero in its own series, which Prometheus reads as a counter
reset, not as a drop of the whole server.

Every series is declared once, in ``mptok.front.catalogue``; the tests
audit a real server's snapshots against it (``mptok_harness.metrics.audit``),
so a renamed counter fails there instead of showing zeros.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from mptok.front.catalogue import PROCESS_LABEL, SERVE, SUPERVISOR_METRICS, Labels, Metric, exported_by
from mptok.supervise.snapshots import SUPERVISOR_SNAPSHOT

logger = logging.getLogger(__name__)

# A frontend's series: the catalogue's, as mptok serve exports them.
FRONTEND_SERIES = exported_by(SERVE)


def render_prometheus(snapshots: Mapping[str, Mapping[str, Any]]) -> str:
    """The Prometheus text exposition (version 0.0.4) of every snapshot.

    Frontend snapshots (``SnapshotDir`` names that are frontend ids) give
    ``FRONTEND_SERIES`` with a ``frontend`` label; the supervisor's gives
    ``SUPERVISOR_METRICS``. A value missing from a snapshot is left out of
    the text, with a warning, never shown as 0.
    """
    frontends = sorted(((int(name), snap) for name, snap in snapshots.items() if name.isdigit()), key=lambda item: item[0])
    out: list[str] = []
    for metric in FRONTEND_SERIES:
        _header(out, metric)
        for frontend, snap in frontends:
            _samples(out, metric, snap, {PROCESS_LABEL[SERVE]: frontend})
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


def _header(out: list[str], metric: Metric) -> None:
    out.append(f"# HELP {metric.name} {metric.help}")
    out.append(f"# TYPE {metric.name} {metric.kind}")


def _samples(out: list[str], metric: Metric, snap: Mapping[str, Any], base: Labels) -> None:
    try:
        samples = list(metric.source.samples(snap))
    except (KeyError, TypeError) as e:
        logger.warning("metric %s left out of %s: its value is missing (%r)", metric.name, base or "the supervisor", e)
        return
    write = _histogram if metric.kind == "histogram" else _sample
    for labels, value in samples:
        write(out, metric.name, {**base, **labels}, value)


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
    return str(int(value)) if isinstance(value, int) else repr(float(value))  # a bool too: 1 or 0

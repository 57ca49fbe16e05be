"""A frontend snapshot that holds a value at every path /metrics declares, for tests and benchmarks, and the audit
of snapshots against the catalogue.

The server never needs either: its snapshots come from its counters. The
metrics tests and ``scripts/bench_metrics.py`` render and audit the example;
``tests/test_serve.py`` audits a real server's snapshots.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from mptok.core.counting import Histogram
from mptok.front.catalogue import FRONTEND_METRICS, SUPERVISOR_METRICS, SnapshotPath, Table
from mptok.supervise.metrics import FRONTEND_SERIES
from mptok.supervise.snapshots import SUPERVISOR_SNAPSHOT


def example_frontend_snapshot() -> dict[str, Any]:
    """A value at every path ``FRONTEND_METRICS`` names and nothing else: counts 7, one
    request (``/tokenize 200``), one observation (2 ms) per histogram."""
    snapshot: dict[str, Any] = {}
    for metric in FRONTEND_METRICS:
        for path in metric.source.paths():
            *sections, key = path
            place = snapshot
            for section in sections:
                place = place.setdefault(section, {})
            if isinstance(metric.source, Table):
                place[key] = {"/tokenize 200": 1}
            elif metric.kind == "histogram" and path == metric.source.paths()[0]:
                histogram = Histogram()
                histogram.observe(0.002)
                place[key] = histogram.snapshot()
            else:
                place.setdefault(key, 7)
    return snapshot


def audit(snapshots: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """What keeps ``render_prometheus`` from showing these snapshots whole: every declared
    value a snapshot lacks, and every value it holds that no metric renders. Empty when all is well."""
    problems = []
    for name, snap in sorted(snapshots.items()):
        if name.isdigit():
            metrics = FRONTEND_SERIES
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

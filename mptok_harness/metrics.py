"""A frontend snapshot that holds a value at every path /metrics declares, for tests and benchmarks.

The server never needs one: its snapshots come from its counters. The
metrics tests and ``scripts/bench_metrics.py`` render and audit this one.
"""

from __future__ import annotations

from typing import Any

from mptok.core.counting import Histogram
from mptok.front.catalogue import FRONTEND_METRICS, Table


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

"""mptok's series on an engine's own ``/metrics`` (vLLM's, SGLang's), summed over its processes.

With several processes the engines run ``prometheus_client`` in
multiprocess mode: each process writes its values into files and the
scraped one reads them all. So each process copies its snapshot into
``prometheus_client`` series every ``SYNC_INTERVAL_S`` (counters by the
amount they grew, gauges as they are), labelled with its seat. The series
are the catalogue's (``mptok.front.catalogue``), as ``mptok serve`` shows them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from mptok.core.periodic import PeriodicTask
from mptok.front.catalogue import VLLM, exported_by

SYNC_INTERVAL_S = 0.5
_STOP_JOIN_S = 1.0
PLUGIN_SERIES = exported_by(VLLM)


def _labels_key(labels: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple((name, str(value)) for name, value in labels.items())


class MetricsExport:
    """Copies ``snapshot()`` into prometheus series, labelled ``process_label=seat``, every
    ``SYNC_INTERVAL_S`` on a daemon thread until ``stop()``."""

    def __init__(self, seat: int, snapshot: Callable[[], Mapping[str, Any]], process_label: str):
        from prometheus_client import Counter, Gauge

        self._snapshot = snapshot
        self._lock = threading.Lock()
        # The last value copied of each counter's sample, by series and labels.
        self._last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._children: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
        for metric in PLUGIN_SERIES:
            names = [process_label, *metric.labels]
            if metric.kind == "counter":
                family = Counter(metric.name.removesuffix("_total"), metric.help, names)
            else:
                family = Gauge(metric.name, metric.help, names, multiprocess_mode="livesum")
            # Every label set made now, so that each series shows (at 0) before its first count.
            for labels in metric.source.fixed_labels() or []:
                key = (metric.name, _labels_key(labels))
                self._children[key] = family.labels(**{process_label: str(seat), **labels})
        self._task = PeriodicTask("mptok-metrics", self.sync, SYNC_INTERVAL_S)

    def start(self) -> None:
        self._task.start()

    def sync(self) -> None:
        """Bring every series up to ``snapshot()`` now; a section the snapshot lacks (no routing) is left as it is."""
        with self._lock:
            snapshot = self._snapshot()
            for metric in PLUGIN_SERIES:
                try:
                    samples = list(metric.source.samples(snapshot))
                except KeyError:
                    continue
                for labels, value in samples:
                    key = (metric.name, _labels_key(labels))
                    child = self._children[key]
                    if metric.kind == "counter":
                        grown = value - self._last.get(key, 0)
                        if grown > 0:
                            child.inc(grown)
                        self._last[key] = value
                    else:
                        child.set(value)

    def stop(self) -> None:
        self._task.stop(_STOP_JOIN_S)  # and copies the counters a last time

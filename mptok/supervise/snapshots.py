"""Each process's counters as a JSON file in the ipc dir, so any frontend can show them all.

Behind one port a scrape of ``/metrics`` reaches whichever frontend
accepts it, yet the operator needs the whole server. So each
process writes a snapshot of its counters into the private ipc directory
(atomically, every ``SNAPSHOT_INTERVAL_S`` and at exit), and the frontend
that answers reads them all (``mptok.supervise.metrics`` renders them). The
supervisor writes one too, named ``SUPERVISOR_SNAPSHOT``. Why files and
not ``prometheus_client``'s multiprocess mode: docs/SERVE.md ("Why
snapshot files", measured by ``scripts/bench_metrics.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import orjson

from mptok.core.private_files import replace_private_file

logger = logging.getLogger(__name__)

SNAPSHOT_INTERVAL_S = 0.5
SUPERVISOR_SNAPSHOT = "supervisor"
_SNAPSHOT_PREFIX = "metrics-"
_SNAPSHOT_SUFFIX = ".json"


class SnapshotDir:
    """The snapshots in one ipc directory, named by frontend id (the supervisor's: ``SUPERVISOR_SNAPSHOT``)."""

    def __init__(self, ipc_dir: str):
        self._dir = ipc_dir

    def write(self, name: str | int, data: Mapping[str, Any]) -> None:
        """Replace snapshot ``name`` atomically (readers see the old or the new one, whole)."""
        replace_private_file(os.path.join(self._dir, f"{_SNAPSHOT_PREFIX}{name}{_SNAPSHOT_SUFFIX}"), orjson.dumps(data))

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

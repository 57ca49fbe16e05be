"""Snapshot files against prometheus_client's multiprocess mode, for mptok's /metrics.

mptok's frontends count with ``mptok.core.counting`` and write one JSON snapshot
each into the 0700 ipc dir; whichever frontend a scrape reaches renders them
all (``mptok.supervise.snapshots``, ``mptok.supervise.metrics``). ``prometheus_client``'s multiprocess mode is what
multi-process Python servers usually do instead: every process writes its
values into mmap files in ``PROMETHEUS_MULTIPROC_DIR``, one set per pid, and
``MultiProcessCollector`` merges them at scrape time. This script measures,
in one run, what matters here:

- the hot path: one counter increment, one labelled increment whose labels
  are known only then (``mptok_http_requests_total``), one histogram observe;
- one scrape with 4 and 8 frontends, and after every frontend restarted
  a few times;
- semantics: what a restarted frontend's counters and a SIGKILLed
  frontend's gauges show, how many files a run leaves, their modes.

prometheus_client is not a dependency of mptok: ``.venv/bin/pip install
prometheus_client`` first. Usage: ``.venv/bin/python scripts/bench_metrics.py``.
Every prometheus_client measurement runs in a child process, because the
library picks its multiprocess mode when it is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
import timeit

from mptok.core.counting import SECONDS_BUCKETS, Counters, Histogram
from mptok.front.catalogue import FRONTEND_METRICS, OnePerLabel, Table
from mptok.supervise.metrics import render_prometheus
from mptok.supervise.snapshots import SNAPSHOT_INTERVAL_S, SnapshotDir
from mptok_harness.metrics import example_frontend_snapshot

HOT_CALLS = 200_000
SCRAPES = 30
RESTARTS = 5
PATHS_AND_CODES = [(path, code) for path in ("/tokenize", "/detokenize", "/health", "/metrics", "-") for code in ("200", "400")]


def best_per_call(statement, calls: int = HOT_CALLS, repeat: int = 5) -> float:
    """Seconds per call of ``statement``, the best of ``repeat`` runs (the least disturbed)."""
    return min(timeit.repeat(statement, number=calls, repeat=repeat)) / calls


# -- prometheus_client, in child processes ------------------------------------


def declare_prometheus_metrics():
    """FRONTEND_METRICS as prometheus_client metrics: (name, metric, per-frontend label sets)."""
    from prometheus_client import Counter, Gauge
    from prometheus_client import Histogram as PromHistogram

    declared = []
    for metric in FRONTEND_METRICS:
        labels = ["frontend", *metric.labels]
        if metric.kind == "counter":
            made = Counter(metric.name.removesuffix("_total"), metric.help, labels)
        elif metric.kind == "gauge":
            made = Gauge(metric.name, metric.help, labels, multiprocess_mode="livesum")
        else:
            made = PromHistogram(metric.name, metric.help, labels, buckets=SECONDS_BUCKETS)
        if isinstance(metric.source, OnePerLabel):
            label_sets = [[value] for value in metric.source.paths_by_value]
        elif isinstance(metric.source, Table):
            label_sets = [list(pair) for pair in PATHS_AND_CODES]
        elif metric.labels:  # the start time's pid
            label_sets = [[str(os.getpid())]]
        else:
            label_sets = [[]]
        declared.append((metric, made, label_sets))
    return declared


def child_frontend(frontend: str, count: int, hang: bool) -> None:
    """Give every series of frontend ``frontend`` a value (counters ``count``), as a frontend would."""
    for metric, made, label_sets in declare_prometheus_metrics():
        for label_set in label_sets:
            child = made.labels(frontend, *label_set)
            if metric.kind == "counter":
                child.inc(count)
            elif metric.kind == "gauge":
                child.set(count)
            else:
                child.observe(0.002)
    if hang:
        print("ready", flush=True)
        time.sleep(600)


def child_hot_path() -> None:
    from prometheus_client import Counter
    from prometheus_client import Histogram as PromHistogram

    hits = Counter("hits", "h", ["frontend"]).labels("0")
    requests = Counter("requests", "r", ["frontend", "path", "code"])
    seconds = PromHistogram("seconds", "s", ["frontend"], buckets=SECONDS_BUCKETS).labels("0")
    print(
        json.dumps(
            {
                "inc": best_per_call(lambda: hits.inc()),
                "labelled_inc": best_per_call(lambda: requests.labels("0", "/tokenize", "200").inc()),
                "observe": best_per_call(lambda: seconds.observe(0.003)),
            }
        )
    )


def child_scrape() -> None:
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    def scrape() -> bytes:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)

    text = scrape().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith(("mptok_cache_hits_total{", "mptok_cache_entries{")):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    print(json.dumps({"seconds": best_per_call(scrape, SCRAPES, 3), "bytes": len(text), "values": values}))


def run_child(prom_dir: str, *args: str, wait: bool = True):
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": prom_dir}
    command = [sys.executable, __file__, "--child", *args]
    if not wait:
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True, timeout=300)
    return json.loads(done.stdout) if done.stdout.strip() else None


# -- snapshot files, in this process --------------------------------------------


def snapshot_scrape(ipc_dir: str) -> tuple[float, int]:
    snapshots = SnapshotDir(ipc_dir)
    text = render_prometheus(snapshots.read_all())
    return best_per_call(lambda: render_prometheus(snapshots.read_all()), SCRAPES, 3), len(text)


def series(name: str, frontend: int) -> str:
    return f'{name}{{frontend="{frontend}"}}'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        role, *rest = args.child
        if role == "frontend":
            child_frontend(rest[0], int(rest[1]), rest[2] == "hang")
        elif role == "hot":
            child_hot_path()
        else:
            child_scrape()
        return

    print("hot path, ns per call (best of 5 x 200k, one thread)")
    counters, requests, histogram = Counters(("hits",)), Counters(), Histogram()
    ours = {
        "inc": best_per_call(lambda: counters.add("hits")),
        "labelled_inc": best_per_call(lambda: requests.add(f"{'/tokenize'} {200}")),
        "observe": best_per_call(lambda: histogram.observe(0.003)),
    }
    with tempfile.TemporaryDirectory() as prom_dir:
        theirs = run_child(prom_dir, "hot")
    for what in ours:
        print(f"  {what:13s} snapshots {ours[what] * 1e9:6.0f}   prometheus_client {theirs[what] * 1e9:6.0f}   ratio {theirs[what] / ours[what]:.1f}x")

    with tempfile.TemporaryDirectory() as ipc_dir:
        snapshot = example_frontend_snapshot()
        write_s = best_per_call(lambda: SnapshotDir(ipc_dir).write(0, snapshot), 500, 3)
    print(f"  snapshot write (each frontend, every {SNAPSHOT_INTERVAL_S} s): {write_s * 1e6:.0f} us = {write_s / SNAPSHOT_INTERVAL_S:.3%} of a CPU")
    print(f"\none scrape, ms (best of 3 x {SCRAPES}); series text size")
    for frontends in (4, 8):
        with tempfile.TemporaryDirectory() as ipc_dir, tempfile.TemporaryDirectory() as prom_dir:
            for frontend in range(frontends):
                SnapshotDir(ipc_dir).write(frontend, example_frontend_snapshot())
                run_child(prom_dir, "frontend", str(frontend), "7", "exit")
            ours_s, ours_bytes = snapshot_scrape(ipc_dir)
            fresh = run_child(prom_dir, "scrape")
            for generation in range(RESTARTS):
                for frontend in range(frontends):
                    run_child(prom_dir, "frontend", str(frontend), "7", "exit")
                    SnapshotDir(ipc_dir).write(frontend, example_frontend_snapshot())
            restarted_s, _ = snapshot_scrape(ipc_dir)
            restarted = run_child(prom_dir, "scrape")
            print(
                f"  {frontends} frontends: snapshots {ours_s * 1e3:.2f} ms ({ours_bytes} B), "
                f"prometheus_client {fresh['seconds'] * 1e3:.2f} ms ({fresh['bytes']} B), ratio {fresh['seconds'] / ours_s:.1f}x"
            )
            print(
                f"  {frontends} frontends after {RESTARTS} restarts each: snapshots {restarted_s * 1e3:.2f} ms "
                f"({len(os.listdir(ipc_dir))} files), prometheus_client {restarted['seconds'] * 1e3:.2f} ms "
                f"({len(os.listdir(prom_dir))} files), ratio {restarted['seconds'] / restarted_s:.1f}x"
            )

    print("\nsemantics")
    with tempfile.TemporaryDirectory() as ipc_dir, tempfile.TemporaryDirectory() as prom_dir:
        os.chmod(prom_dir, 0o700)
        run_child(prom_dir, "frontend", "0", "5", "exit")
        run_child(prom_dir, "frontend", "0", "3", "exit")  # the same frontend id, restarted
        values = run_child(prom_dir, "scrape")["values"]
        hits, entries = values[series("mptok_cache_hits_total", 0)], values[series("mptok_cache_entries", 0)]
        print(
            f"  frontend 0 counted 5, restarted, counted 3: prometheus_client shows hits={hits:g} (the sum over "
            f"every pid: no reset), entries={entries:g} (livesum keeps a dead pid's gauge until "
            "mark_process_dead); its snapshot shows 3 and 3"
        )
        killed = run_child(prom_dir, "frontend", "1", "4", "hang", wait=False)
        killed.stdout.readline()
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        entries = run_child(prom_dir, "scrape")["values"][series("mptok_cache_entries", 1)]
        print(f"  frontend 1 set entries=4, SIGKILLed: prometheus_client shows entries={entries:g} until mark_process_dead({killed.pid})")
        SnapshotDir(ipc_dir).write(0, example_frontend_snapshot())
        modes = sorted({oct(stat.S_IMODE(os.stat(os.path.join(prom_dir, f)).st_mode)) for f in os.listdir(prom_dir)})
        ours_mode = {oct(stat.S_IMODE(os.stat(os.path.join(ipc_dir, f)).st_mode)) for f in os.listdir(ipc_dir)}
        print(f"  file modes: prometheus_client {modes} (the umask's), snapshots {sorted(ours_mode)} (mkstemp)")


if __name__ == "__main__":
    main()

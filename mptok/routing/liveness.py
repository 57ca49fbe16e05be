"""Decide in microseconds whether a peer frontend is worth asking.

A call to an owner that is dead, stopped or stuck costs a timeout, seconds,
while tokenizing locally costs milliseconds. So each owner publishes who it
is (``{pid, start_ticks, create_time, address}``) in the ipc dir once it
listens, and before each call a peer checks that process with psutil: an
owner that is gone, a zombie, stopped, or whose pid now names another
process is skipped at once. Which process a pid names is decided by its
start in clock ticks since boot, which no clock step moves (elsewhere than
Linux by ``create_time()``, so no verdict is final: each is re-verified
after ``revalidate_s``). An owner alive but stuck is seen only by a
timeout, after which it is backed off. The record is cached (a check costs
a ``stat`` and a status read); ``recently_live`` names an owner found live
within ``revalidate_s`` without a syscall, so that a caller can run the
check while the owner works. docs/ROUTING.md has the whole account.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import threading
import time
from dataclasses import asdict, dataclass

import psutil

from mptok.core.private_files import open_private_file, replace_private_file

logger = logging.getLogger(__name__)

RECORD_NAME = "owner-{}.json"

# Why a check said to skip an owner.
NOT_PUBLISHED = "not_published"
DEAD = "dead"
ZOMBIE = "zombie"
STOPPED = "stopped"
PID_REUSED = "pid_reused"
BACKOFF = "backoff"
SKIP_REASONS = (NOT_PUBLISHED, DEAD, ZOMBIE, STOPPED, PID_REUSED, BACKOFF)
# Why a call to an owner failed: past the route timeout, past the patience
# for an owner asked only for what changed, or any other failure.
TIMEOUT = "timeout"
PATIENCE = "patience"
ERROR = "error"
# Why a prompt was not tokenized by its conversation's owner: the owner was
# skipped without a call, or the call failed. Routing counts each as
# ``fallback_<reason>``; mptok_route_fallbacks_total{reason} shows them.
FALLBACK_REASONS = SKIP_REASONS + (TIMEOUT, PATIENCE, ERROR)

_STATUS_REASONS = {
    psutil.STATUS_ZOMBIE: ZOMBIE,
    psutil.STATUS_DEAD: DEAD,
    psutil.STATUS_STOPPED: STOPPED,
    psutil.STATUS_TRACING_STOP: STOPPED,
}
# create_time is computed from clock ticks (10 ms) since boot.
_CREATE_TIME_TOLERANCE_S = 0.05
# Field 22 of /proc/<pid>/stat, counted after the ")" that ends field 2.
_STARTTIME_AFTER_COMM = 22 - 3


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (no clock step
    moves it, unlike ``create_time()``); None where /proc cannot tell. Raises
    ``psutil.NoSuchProcess`` if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            raise psutil.NoSuchProcess(pid) from None
        return None
    except OSError:
        return None
    try:
        # The command name (field 2) may hold spaces and parentheses.
        return int(stat[stat.rindex(b")") + 2 :].split()[_STARTTIME_AFTER_COMM])
    except (ValueError, IndexError):
        return None


@dataclass(frozen=True)
class OwnerRecord:
    """Who serves a frontend id: its process, and where it listens. ``nonce``
    tells apart two owners one process ran one after another; ``start_ticks``
    identifies the process where the platform tells it, else ``create_time`` does."""

    pid: int
    create_time: float
    address: str
    nonce: str
    start_ticks: int | None = None

    @property
    def incarnation(self) -> tuple[int, float, str]:
        """Equal for two records of the same serving owner, and only then."""
        return (self.pid, self.create_time, self.nonce)


def record_path(ipc_dir: str, frontend_id: int) -> str:
    return os.path.join(ipc_dir, RECORD_NAME.format(frontend_id))


def publish(ipc_dir: str, frontend_id: int, address: str) -> OwnerRecord:
    """Publish this process as ``frontend_id``'s owner, listening at ``address``;
    atomic: a reader sees the previous record or this one, never part of one."""
    pid = os.getpid()
    record = OwnerRecord(pid, psutil.Process().create_time(), address, secrets.token_hex(8), start_ticks(pid))
    replace_private_file(record_path(ipc_dir, frontend_id), json.dumps(asdict(record)).encode())
    return record


def unpublish(ipc_dir: str, frontend_id: int, record: OwnerRecord) -> None:
    """Remove ``frontend_id``'s record if it is still ``record``: only one owner
    of an id serves at a time (``mptok.transport`` holds a lock while it does)
    and it unpublishes before it stops serving, so this cannot race with a
    successor's publish."""
    path = record_path(ipc_dir, frontend_id)
    current = read_record(path)
    if current is not None and current.incarnation == record.incarnation:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def read_record(path: str) -> OwnerRecord | None:
    """The record at ``path``, or None if there is none or it is not one (a link, or
    a file group or others may write, is not: ``open_private_file``)."""
    try:
        with open(open_private_file(path, os.O_RDONLY), encoding="utf-8") as f:
            fields = json.load(f)
        return OwnerRecord(
            pid=int(fields["pid"]),
            create_time=float(fields["create_time"]),
            address=str(fields["address"]),
            nonce=str(fields["nonce"]),
            start_ticks=None if fields.get("start_ticks") is None else int(fields["start_ticks"]),
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("ignoring unreadable owner record %s: %r", path, e)
        return None


@dataclass(frozen=True)
class _Verdict:
    """What reading one version of a record concluded."""

    stamp: tuple[int, int, int]
    record: OwnerRecord | None
    process: psutil.Process | None
    reason: str | None
    verified_at: float


class OwnerWatch:
    """What this process knows about the owner of one frontend id: its record, its process, its back-off.

    ``check()`` returns ``(record, None)`` when the owner is worth calling,
    else ``(record or None, reason)`` with a reason from ``SKIP_REASONS``.
    Report a timed-out call with ``timed_out(record)`` (the owner is skipped
    for ``backoff_s`` unless replaced meanwhile), any other failed call with
    ``forget()``. Only re-reading a record takes a lock (concurrent callers do
    it once); the fast path reads immutable snapshots.
    """

    def __init__(self, ipc_dir: str, frontend_id: int, *, backoff_s: float = 10.0, revalidate_s: float = 1.0):
        if backoff_s < 0 or revalidate_s < 0:
            raise ValueError("backoff_s and revalidate_s must be >= 0")
        self._path = record_path(ipc_dir, frontend_id)
        self._backoff_s = backoff_s
        self._revalidate_s = revalidate_s
        self._lock = threading.Lock()
        self._verdict: _Verdict | None = None
        self._backoff_until = 0.0
        self._backoff_incarnation: tuple | None = None
        # The record the last full check found worth calling, and when; a
        # check that began before a ``forget()`` does not set it.
        self._live: tuple[OwnerRecord, float] | None = None
        self._forgotten = 0

    def check(self) -> tuple[OwnerRecord | None, str | None]:
        forgotten = self._forgotten
        try:
            st = os.stat(self._path)
        except FileNotFoundError:
            self._live = None
            return None, NOT_PUBLISHED
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        now = time.monotonic()
        verdict = self._verdict
        if verdict is None or verdict.stamp != stamp or self._stale(verdict, now):
            verdict = self._reload(stamp, now)
        if verdict.reason is not None:
            self._live = None
            return verdict.record, verdict.reason
        assert verdict.record is not None and verdict.process is not None
        if now < self._backoff_until and verdict.record.incarnation == self._backoff_incarnation:
            self._live = None
            return verdict.record, BACKOFF
        try:
            status = verdict.process.status()
        except psutil.NoSuchProcess:
            self.forget()  # the next check caches the verdict
            return verdict.record, DEAD
        except psutil.Error as e:
            logger.debug("cannot read the status of owner pid %d: %r", verdict.record.pid, e)
            status = None
        reason = _STATUS_REASONS.get(status)
        if reason is not None:
            self._live = None
        elif forgotten == self._forgotten:
            self._live = (verdict.record, now)
        return verdict.record, reason

    def recently_live(self) -> OwnerRecord | None:
        """The record a full ``check`` found worth calling less than
        ``revalidate_s`` ago, if nothing failed since. It costs no syscall,
        and proves nothing about the owner now: a caller that calls on it
        runs ``check`` while its call is in flight."""
        live = self._live
        if live is None or time.monotonic() - live[1] > self._revalidate_s:
            return None
        return live[0]

    def answered(self, record: OwnerRecord) -> None:
        """``record``'s owner just answered a call: ``recently_live`` counts
        from now (if no check has since found it not worth calling)."""
        live = self._live
        if live is not None and live[0] == record:
            self._live = (record, time.monotonic())

    def timed_out(self, record: OwnerRecord) -> None:
        self._backoff_incarnation = record.incarnation
        self._backoff_until = time.monotonic() + self._backoff_s
        self.forget()

    def forget(self) -> None:
        """Re-read the record and re-verify the owner at the next check."""
        self._forgotten += 1
        self._verdict = None
        self._live = None

    def _stale(self, verdict: _Verdict, now: float) -> bool:
        # Skip verdicts too: one reached on a wrong reading (a clock step
        # fooling create_time) must not stop routing to a live owner for
        # good.
        return now - verdict.verified_at > self._revalidate_s

    def _reload(self, stamp: tuple[int, int, int], now: float) -> _Verdict:
        with self._lock:
            verdict = self._verdict
            if verdict is not None and verdict.stamp == stamp and not self._stale(verdict, now):
                return verdict
            verdict = _verify(self._path, stamp, now)
            self._verdict = verdict
            return verdict


def _verify(path: str, stamp: tuple[int, int, int], now: float) -> _Verdict:
    record = read_record(path)
    if record is None:
        return _Verdict(stamp, None, None, NOT_PUBLISHED, now)
    try:
        proc = psutil.Process(record.pid)
        same = _same_process(proc, record)
    except psutil.NoSuchProcess:
        return _Verdict(stamp, record, None, DEAD, now)
    if not same:
        return _Verdict(stamp, record, None, PID_REUSED, now)
    return _Verdict(stamp, record, proc, None, now)


def _same_process(proc: psutil.Process, record: OwnerRecord) -> bool:
    """Whether ``proc`` is the process that published ``record``."""
    if record.start_ticks is not None:
        ticks = start_ticks(record.pid)
        if ticks is not None:
            return ticks == record.start_ticks
    return abs(proc.create_time() - record.create_time) <= _CREATE_TIME_TOLERANCE_S

"""The engine memo: a start's verdict on the fast engines, kept for the next start on this machine.

Choosing a tokenizer's engine (``mptok.engines.fast.Chooser``) checks and
times every fast engine: seconds of CPU, and a race that two processes of
one server could decide apart. The first start writes its verdict here; a
later start with an equal key loads only the engines it names. Skipping
the check keeps exactness: the check is a pure function of its inputs, and
the key holds all of them (``memo_key``); the background checks run as
before, and a difference removes the memo. A verdict is decided again when
stale (``Verdict.stale``), under the key's lock, so that one start decides
and the others read it. What cannot be used is ignored with a WARNING once
per process and directory. docs/CACHE.md, "The engine memo", says more.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import platform
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from mptok.core.deadline import Deadline
from mptok.core.file_locks import lock_by
from mptok.core.private_files import open_private_file, private_cache_dir, replace_private_file
from mptok.core.settings import ENGINE_MEMO_VARIABLE, ENGINES, engine_memo_dir

logger = logging.getLogger(__name__)

# Raised when what a memo holds, or how its key is made, changes meaning.
FORMAT = 2
_PREFIX = "engines-"
# How long a start waits for another deciding the same key (a decision takes seconds).
LOCK_WAIT_S = 60.0
_LOCK_POLL_S = 0.05
# Stale: older than MAX_AGE_S (what else the machine runs changes); or unsettled (decided at
# BUSY_LOAD per CPU or more, as many runnable threads as cores, or with rounds
# more than UNSETTLED_SPREAD apart), RETRY_S after it was decided, at a load
# below BUSY_LOAD or below half the verdict's.
MAX_AGE_S = 7 * 24 * 3600.0
BUSY_LOAD = 1.0
UNSETTLED_SPREAD = 0.10
RETRY_S = 15 * 60.0


@dataclass(frozen=True)
class Verdict:
    """What a start decided for one key (docs/CACHE.md, "The engine memo"): the
    engines of short and long texts ("tokenizers" for none), and what else it kept."""

    short: str
    long: str
    passed: tuple[str, ...]
    ratio: float
    report: str
    decided_by: int
    decided_at: float
    load: float
    spread: float

    def stale(self, now: float, load: float) -> str | None:
        """Why a start at time ``now`` with load average per CPU ``load`` decides this verdict again, or None."""
        if len(self.passed) < 2:
            return None  # no engines to choose between
        age = now - self.decided_at
        if not 0 <= age <= MAX_AGE_S:
            return f"it was decided {age / 86400:.1f} days ago"
        unsettled = self.load >= BUSY_LOAD or self.spread > UNSETTLED_SPREAD
        if unsettled and age >= RETRY_S and (load < BUSY_LOAD or load < self.load / 2):
            return (
                f"it was decided at a load average of {self.load:.2f} per CPU with rounds {self.spread:.0%} apart, "
                f"and the load is {load:.2f} now"
            )
        return None

    @property
    def engines(self) -> tuple[str, ...]:
        """The fast engines a start that reads this loads."""
        return tuple(name for name in ENGINES if name in (self.short, self.long))

    @classmethod
    def from_json(cls, data: Any) -> Verdict:
        """``ValueError`` unless ``data`` is a verdict whose engines are ones mptok knows."""
        names = ("tokenizers", *ENGINES)
        try:
            verdict = cls(
                data["short"], data["long"], tuple(data["passed"]), float(data["ratio"]), str(data["report"]),
                int(data["decided_by"]), float(data["decided_at"]), float(data["load"]), float(data["spread"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a verdict: {e!r}") from None
        if verdict.short not in names or verdict.long not in names or not set(verdict.passed) <= set(ENGINES):
            raise ValueError("names an engine mptok does not have")
        if not set(verdict.engines) <= set(verdict.passed) or not verdict.ratio > 0:
            raise ValueError("chooses an engine that did not pass, or has no cost ratio")
        if not (verdict.load >= 0 and verdict.spread >= 0):
            raise ValueError("has no load or spread")
        return verdict


def memo_key(spec_digest: str, split_special: bool, choice: str, check_texts: Iterable[str]) -> dict[str, Any]:
    """Everything a verdict depends on (docs/CACHE.md, "The engine memo")."""
    corpus = hashlib.sha256()
    for text in check_texts:
        corpus.update(text.encode("utf-8", "surrogatepass") + b"\0")
    return {
        "format": FORMAT,
        "spec": spec_digest,
        "split_special": split_special,
        "choice": choice,
        "check_texts": corpus.hexdigest(),
        "mptok": _decider(),
        "packages": {name: _package(name) for name in ("tokenizers", *ENGINES)},
        "python": f"{sys.implementation.name} {sys.version}",
        "machine": _machine(),
    }


@dataclass(frozen=True)
class EngineMemo:
    """The verdicts kept in one directory: a file per key, named by its digest."""

    directory: str

    def path(self, key: dict[str, Any]) -> str:
        return os.path.join(self.directory, f"{_PREFIX}{_digest(key)}.json")

    def read(self, key: dict[str, Any]) -> Verdict | None:
        """The verdict kept for ``key``, or None (none kept, or one that
        cannot be used: said once, as a WARNING)."""
        path = self.path(key)
        try:
            with open(open_private_file(path, os.O_RDONLY), "rb") as f:
                data = orjson.loads(f.read())
            if not isinstance(data, dict) or data.get("key") != key:
                # The digest names the file; the key inside is compared whole.
                raise ValueError("it was written for another key")
            return Verdict.from_json(data.get("verdict"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:  # orjson.JSONDecodeError is a ValueError
            _warn_once(self.directory, f"engine memo {path} is not used: {e}")
            return None

    def write(self, key: dict[str, Any], verdict: Verdict) -> bool:
        """Keep ``verdict`` for ``key``; False (said once) if it cannot be written."""
        try:
            replace_private_file(self.path(key), orjson.dumps({"key": key, "verdict": asdict(verdict)}))
        except OSError as e:
            _warn_once(self.directory, f"engine memo in {self.directory} cannot be written: {e}")
            return False
        return True

    def forget(self, key: dict[str, Any]) -> None:
        """Remove the verdict kept for ``key``, if any."""
        with contextlib.suppress(OSError):
            os.unlink(self.path(key))

    @contextlib.contextmanager
    def deciding(self, key: dict[str, Any]) -> Iterator[bool]:
        """Hold ``key``'s lock while deciding it: yields whether it was taken within ``LOCK_WAIT_S`` (if not, said once)."""
        path = os.path.join(self.directory, f"{_PREFIX}{_digest(key)}.lock")
        try:
            fd = open_private_file(path, os.O_RDWR | os.O_CREAT)
        except OSError as e:
            _warn_once(self.directory, f"engine memo lock {path} cannot be used: {e}")
            yield False
            return
        try:
            held = lock_by(fd, Deadline.after(LOCK_WAIT_S), poll_s=_LOCK_POLL_S)
            if not held:
                _warn_once(self.directory, f"engine memo lock {path} held for more than {LOCK_WAIT_S:g} s; deciding without it")
            yield held
        finally:
            os.close(fd)  # releases the lock


def from_env() -> EngineMemo | None:
    """The memo ``MPTOK_ENGINE_MEMO`` names (default: the user's cache
    directory), or None: turned off, or not usable (said once)."""
    try:
        directory = engine_memo_dir()
    except ValueError as e:
        # mptok serve refuses this before it starts; a library user is told here.
        _warn_once(ENGINE_MEMO_VARIABLE, f"engine memo off: {e}")
        return None
    if directory is None:
        return None
    try:
        return EngineMemo(private_cache_dir(directory))
    except OSError as e:
        _warn_once(directory, f"engine memo off: {e}")
        return None


_warned: set[str] = set()
_warned_lock = threading.Lock()


def machine_load() -> float:
    """The 1-minute load average per CPU (0 where the system does not say)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 0.0


def _warn_once(topic: str, message: str) -> None:
    """A WARNING, the first time in this process that ``topic`` (a directory) has a problem."""
    with _warned_lock:
        if topic in _warned:
            return
        _warned.add(topic)
    logger.warning("%s; the engines are chosen as if there were no memo", message)


def _digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(orjson.dumps(key, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]


@functools.cache
def _decider() -> dict[str, Any]:
    """mptok's version, and the digest of the modules whose code makes a verdict."""
    # Found, not imported: fast.py imports this module.
    sources = b"".join(Path(__file__).with_name(name).read_bytes() for name in ("fast.py", "timing.py"))
    return {"version": _version("mptok"), "sources": hashlib.sha256(sources).hexdigest()}


@functools.cache
def _package(name: str) -> dict[str, Any] | None:
    """A package's version and its compiled libraries (name, size, mtime),
    found without importing it; None if it is not installed."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        return None
    libraries = []
    for location in spec.submodule_search_locations or ():
        with contextlib.suppress(OSError), os.scandir(location) as entries:
            for entry in entries:
                if entry.name.endswith((".so", ".pyd", ".dylib")):
                    st = entry.stat()
                    libraries.append([entry.name, st.st_size, st.st_mtime_ns])
    return {"version": _version(name), "libraries": sorted(libraries)}


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def _machine() -> dict[str, Any]:
    """The processor (its model and how many): an engine's code may take
    other paths on another one, and the timing surely would."""
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith(("model name", "Model", "CPU part")):
                model = line.split(":", 1)[1].strip()
                break
    return {"arch": platform.machine(), "model": model, "cpus": os.cpu_count()}

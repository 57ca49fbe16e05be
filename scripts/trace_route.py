"""What one routed first landing runs below the front floor: mptok's modules, threads, lock acquisitions, and the copies of its ids.

    .venv/bin/python -m scripts.trace_route [--no-write]

Two frontends in this process (``TokenizationOwners`` over ``PrefixTokenCache``,
the embedded tokenizer, the default policy), as a serving frontend has them:
warm engines, warm peer workers, this thread's connection to the owner
made by earlier routed prompts. The owner keeps a conversation; its next
turn lands on the other frontend, which keeps nothing of it (a first
landing): the trace runs from ``TokenizationOwners.encode_array`` to the
ids, on every thread of the process (the asker's, the owner's connection
thread and its peer worker), and counts the mptok functions called, the
modules and threads they ran in, and every acquisition of a
``threading`` lock (a counting shim installed before mptok is imported;
the locks inside C extensions are not seen). The ids' copies in transit
are measured apart, with tracemalloc, on one connection: the bytes the
owner's send and the asker's receive allocate at their peak, against the
bytes of the ids. Writes docs/results/trace_route.md.
"""

from __future__ import annotations

import argparse
import collections
import socket
import sys
import tempfile
import threading
import tracemalloc
from pathlib import Path
from typing import Any

_real_lock, _real_rlock = threading.Lock, threading.RLock
_tracing = False
_acquired: collections.Counter = collections.Counter()  # (thread, caller's file) -> acquisitions


class _CountingLock:
    """A ``threading`` lock that counts its acquisitions while tracing."""

    def __init__(self, lock: Any):
        self._lock = lock

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if _tracing:
            caller = sys._getframe(1)
            if caller.f_code.co_name == "__enter__":
                caller = caller.f_back
            _acquired[(threading.current_thread().name, caller.f_code.co_filename)] += 1
        return self._lock.acquire(blocking, timeout)

    def __enter__(self) -> bool:
        return self.acquire()

    def release(self) -> None:
        self._lock.release()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __getattr__(self, name: str) -> Any:  # RLock's _is_owned, _release_save, _acquire_restore
        return getattr(self._lock, name)


threading.Lock = lambda: _CountingLock(_real_lock())  # type: ignore[assignment,misc]
threading.RLock = lambda: _CountingLock(_real_rlock())  # type: ignore[assignment,misc]

import numpy as np  # noqa: E402

import mptok  # noqa: E402
from mptok.core.protocol import PeerReply  # noqa: E402
from mptok.routing.owners import TokenizationOwners, lower_switch_interval  # noqa: E402
from mptok.transport.wire import TimedConnection  # noqa: E402
from mptok_harness.checks import expected_ids  # noqa: E402
from mptok_harness.frontends import AUTHKEY, key_owned_by  # noqa: E402
from mptok_harness.prompts import TEMPLATE_MARKERS, conversation  # noqa: E402
from scripts.report import write_report  # noqa: E402

PACKAGE = str(Path(mptok.__file__).resolve().parent)
_calls: collections.Counter = collections.Counter()  # (thread, module, function) -> calls


def _profile(frame: Any, event: str, arg: Any) -> None:
    if _tracing and event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
        module = frame.f_code.co_filename[len(PACKAGE) - len("mptok") :].removesuffix(".py").replace("/", ".")
        _calls[(threading.current_thread().name, module, frame.f_code.co_name)] += 1


def _module_of(path: str) -> str:
    return path[len(PACKAGE) - len("mptok") :].removesuffix(".py").replace("/", ".") if path.startswith(PACKAGE) else Path(path).name


def trace_first_landing(turns: int, first_chars: int) -> dict[str, Any]:
    """Trace the first landing of a conversation's turn ``turns - 1`` on a
    frontend that does not own it; the owner tokenized the turns before."""
    global _tracing
    lower_switch_interval()
    tokenizer = mptok.load_tokenizer()
    threading.setprofile(_profile)  # every thread the owners start
    with tempfile.TemporaryDirectory(prefix="mptok-trace-") as ipc_dir:
        caches = [mptok.PrefixTokenCache(), mptok.PrefixTokenCache()]
        owners = [TokenizationOwners(ipc_dir, i, 2, caches[i], tokenizer, authkey=AUTHKEY) for i in range(2)]
        try:
            # Warm: routed prompts of other conversations made this thread's
            # connection and ran the owner's workers.
            for i in range(12):
                warm = conversation(100 + i, 1, first_chars=first_chars, markers=TEMPLATE_MARKERS)[0]
                owners[1].encode_array(tokenizer, warm, key_owned_by(0, 2, f"warm-{i}"))
            key = key_owned_by(0, 2, "traced")
            prompts = conversation(7, turns, first_chars=first_chars, markers=TEMPLATE_MARKERS)
            for prompt in prompts[:-1]:
                owners[0].encode_array(tokenizer, prompt, key)
            before = owners[1].stats()
            sys.setprofile(_profile)
            _tracing = True
            try:
                ids = owners[1].encode_array(tokenizer, prompts[-1], key)
            finally:
                _tracing = False
                sys.setprofile(None)
            after = owners[1].stats()
            assert ids.tolist() == expected_ids(tokenizer, prompts[-1])
        finally:
            threading.setprofile(None)
            for owner in owners:
                owner.close()
    changed = {name: after[name] - before[name] for name in after if after[name] != before[name]}
    assert changed.get("routed") == 1 and changed.get("copies_kept") == 1, changed
    return {"chars": len(prompts[-1]), "ids": len(ids), "changed": changed}


def copies_in_transit(n_ids: int) -> tuple[float, float]:
    """Bytes allocated at the peak of the owner's send and of the asker's
    receive of a reply of ``n_ids`` ids, each against the ids' bytes."""
    a, b = socket.socketpair(socket.AF_UNIX)
    owner, asker = TimedConnection(a, 1 << 30), TimedConnection(b, 1 << 30)
    ids = np.arange(n_ids, dtype=np.int32)
    ids.flags.writeable = False
    reply = PeerReply(True, ids)
    # Once first, as on a connection in use: the asker's buffer grows to its messages once.
    owner.send(("#RETURN", reply.to_wire()))
    asker.recv()
    peaks = []
    for step in (lambda: owner.send(("#RETURN", reply.to_wire())), asker.recv):
        tracemalloc.start()
        result = step()
        peaks.append(tracemalloc.get_traced_memory()[1] / ids.nbytes)
        tracemalloc.stop()
        del result
    owner.close()
    asker.close()
    return peaks[0], peaks[1]


def report(traced: dict[str, Any], copies: dict[int, tuple[float, float]]) -> str:
    modules = sorted({module for _, module, _ in _calls})
    threads = sorted({thread for thread, _, _ in _calls} | {thread for thread, _ in _acquired})
    by_function = collections.Counter()
    for (_, module, function), n in _calls.items():
        by_function[f"{module}.{function}"] += n
    locks_by_module = collections.Counter()
    for (_, path), n in _acquired.items():
        locks_by_module[_module_of(path)] += n
    lines = [
        f"A conversation's turn of {traced['chars']:,} characters ({traced['ids']:,} ids) landing on the frontend "
        f"that does not own it and keeps nothing of it; what changed in its counters: "
        + ", ".join(f"`{name}` +{n}" for name, n in sorted(traced["changed"].items()))
        + ".",
        "",
        "| what | count |",
        "|---|---:|",
        f"| mptok function calls | {sum(_calls.values())} |",
        f"| mptok modules | {len(modules)} |",
        f"| threads | {len(threads)} |",
        f"| `threading` lock acquisitions | {sum(_acquired.values())} |",
        "",
        "Modules: " + ", ".join(f"`{m}`" for m in modules) + ".",
        "",
        "Threads, each with the mptok modules it ran: "
        + ", ".join(f"`{t}` {len({m for th, m, _ in _calls if th == t})}" for t in threads)
        + ".",
        "",
        "Lock acquisitions by the module that took them: "
        + ", ".join(f"`{m}` {n}" for m, n in locks_by_module.most_common())
        + ".",
        "",
        "The functions called most: " + ", ".join(f"`{f}` {n}" for f, n in by_function.most_common(12)) + ".",
        "",
        "The ids in transit, on one connection (tracemalloc: bytes allocated at the peak of each step, "
        "against the bytes of the ids; one copy is 1x, the pickler's buffer growth adds up to half; "
        "ids of 64 KiB or more are sent from their own buffer, not copied):",
        "",
        "| ids | owner's send | asker's receive |",
        "|---:|---:|---:|",
        *(f"| {n:,} | {send:.2f}x | {recv:.2f}x |" for n, (send, recv) in copies.items()),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=6, help="the traced turn is the conversation's last (default 6)")
    parser.add_argument("--first-chars", type=int, default=20_000, help="characters of the conversation's first prompt (default 20000)")
    parser.add_argument("--no-write", action="store_true", help="print the report, do not write docs/results/trace_route.md")
    args = parser.parse_args()
    traced = trace_first_landing(args.turns, args.first_chars)
    copies = {n: copies_in_transit(n) for n in (traced["ids"], 200_000)}
    body = report(traced, copies)
    if args.no_write:
        print(body)
    else:
        print(write_report("trace_route", "What a routed first landing runs", body))


if __name__ == "__main__":
    main()

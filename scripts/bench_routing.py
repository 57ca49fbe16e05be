"""Measure what routing a conversation to its owner costs, against what it saves.

Rows, each a median over repeated runs, with ratios against baselines measured
in the same run (the machine is noisy; read the ratios):

* a routed hit (the prompt tokenized by the owner's cache, in another
  process) vs a local hit (this process's cache) vs full tokenization, for
  conversations of about 38k and 200k tokens growing about 300 tokens a turn,
  through ``encode`` (a list) and ``encode_array`` (the int32 array, as
  ``mptok serve`` writes it to JSON). The turns carry the chat template's
  markers, which the tokenizer holds as added tokens, so each turn is a hit
  spliced at one; the run stops if a measured turn missed in either cache
  (plain prompts this long turn after turn, faster than the background work
  that gives a kept prompt its offsets, would measure misses);
* a routed hit whose asker holds no fingerprint (all of the prompt sent, all
  of its ids back), as under a tight ``max_held_bytes``;
* the transport round trip of ``EncodeProxy`` (150k characters in, 38k ids
  out) vs a plain length-prefixed AF_UNIX socket (the protocol of the
  reference module), both served by another process with the same work;
* turns of a conversation whose owner's main thread runs Python code, which
  shares the owner's GIL with its serving threads: asked by a frontend with
  the default patience (it gives up on the owner and tokenizes here) and by
  one that waits for its timeout;
* the per-call cost of choosing and checking the owner.

Writes docs/results/bench_routing.md (scripts/report.py).

Usage: python scripts/bench_routing.py [--runs 5] [--turns 12]
"""

from __future__ import annotations

import argparse
import functools
import math
import multiprocessing
import os
import random
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from array import array
from collections.abc import Callable

import numpy as np

import mptok
from mptok.routing.liveness import OwnerWatch
from mptok.routing.router import owner_of, owner_order
from mptok.routing.owners import TokenizationOwners, lower_switch_interval
from mptok.routing.policy import ALWAYS
from mptok.core.protocol import PeerReply, PeerRequest
from mptok.transport import EncodeProxy, serve_encode

# The conversations of the tests: prose in several scripts, each prompt ending
# in a generation prompt that the next turn rewrites, as chat templates do.
from mptok_harness.checks import warm_up
from mptok_harness.prompts import TEMPLATE_MARKERS, conversation
from scripts.report import write_report

AUTHKEY = os.urandom(16)
TURN_CHARS = 1000  # about 300 tokens of the tests' mixed-script prose
BACKOFF_S = 2.0  # how long an asker skips an owner that it gave up on
# The askers route every keyed prompt (the "always" policy): what a crossing
# costs is measured on every turn, not only on a conversation's first turn
# to land on a frontend, as under the default policy.
ROUTE_EVERY_PROMPT = ALWAYS
_LENGTH = struct.Struct("!q")


# -- the other process: an owner frontend, and two round-trip servers ----------


def _serve_raw(listener: socket.socket, ids: list[int]) -> None:
    """The baseline: length-prefixed text in, length-prefixed int32 ids out."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=_answer_raw, args=(conn, ids), daemon=True).start()


def _answer_raw(conn: socket.socket, ids: list[int]) -> None:
    with conn:
        while True:
            header = _recv_exactly(conn, _LENGTH.size)
            if header is None:
                return
            (size,) = _LENGTH.unpack(header)
            text = _recv_exactly(conn, size)
            assert text is not None
            text.decode(errors="surrogatepass")
            # The same int32 packing as the owner's, so that the row
            # compares the transports.
            reply = np.asarray(ids, dtype=np.int32).tobytes()
            conn.sendall(_LENGTH.pack(len(ids)) + reply)


def _recv_exactly(conn: socket.socket, size: int) -> bytearray | None:
    buf = bytearray(size)
    view = memoryview(buf)
    while view:
        n = conn.recv_into(view)
        if n == 0:
            return None
        view = view[n:]
    return buf


def owner_main(conn, ipc_dir: str, authkey: bytes, fixed_ids: list[int]) -> None:
    lower_switch_interval()  # as mptok serve's frontends do
    tokenizer = mptok.load_tokenizer()
    cache = mptok.PrefixTokenCache()
    owners = TokenizationOwners(ipc_dir, 0, 2, cache, tokenizer, authkey=authkey)
    warm_up(cache, tokenizer)
    manager = serve_encode(os.path.join(ipc_dir, "roundtrip.sock"), lambda request: PeerReply(False, fixed_ids), authkey)
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.bind(os.path.join(ipc_dir, "raw.sock"))
    raw.listen(socket.SOMAXCONN)
    threading.Thread(target=_serve_raw, args=(raw, fixed_ids), daemon=True).start()
    busy = threading.Event()
    conn.send("ready")
    while True:
        command = conn.recv()
        if command == "busy":
            busy.set()
            conn.send("ok")
            # Python-bound work on the main thread, as a serving frontend does.
            while busy.is_set() and not conn.poll():
                sum(i * i for i in range(2000))
            busy.clear()
        elif command == "stats":
            conn.send(cache.stats())
        elif command == "exit":
            break
    raw.close()
    manager.shutdown()
    owners.close()


# -- measuring -----------------------------------------------------------------


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def owner_hits(owner_conn) -> int:
    owner_conn.send("stats")
    return owner_conn.recv()["hits"]


def conversation_run(
    tokenizer, local_cache, owners, owner_conn, seed: int, first_chars: int, turns: int, full_reps: int
) -> dict[str, float]:
    """Median seconds per turn of a routed hit (a list, and an int32 array),
    a local hit (both ways), and full tokenization."""
    routed_before = owners.stats()["routed"]
    prompts = conversation(seed, turns + 1, first_chars=first_chars, turn_chars=TURN_CHARS, markers=TEMPLATE_MARKERS)
    routed_key = _key_owned_by(0, f"routed-{seed}")
    local_key = f"local-{seed}"
    # Turn 0 fills both caches (a miss); the measured turns are hits.
    owners.encode(tokenizer, prompts[0], key=routed_key)
    local_cache.encode(tokenizer, prompts[0], key=local_key)
    hits_before = (owner_hits(owner_conn), local_cache.stats()["hits"])
    routed, local, routed_array, local_array = [], [], [], []
    for i, text in enumerate(prompts[1:]):
        # Each turn once, alternately as a list or an array, so that every
        # measured call is a hit on a new turn.
        if i % 2:
            routed_array.append(timed(functools.partial(owners.encode_array, tokenizer, text, key=routed_key)))
            local_array.append(timed(functools.partial(local_cache.encode_array, tokenizer, text, key=local_key)))
        else:
            routed.append(timed(functools.partial(owners.encode, tokenizer, text, key=routed_key)))
            local.append(timed(functools.partial(local_cache.encode, tokenizer, text, key=local_key)))
    last = prompts[-1]
    want = tokenizer(last, add_special_tokens=False)["input_ids"]
    if owners.encode(tokenizer, last, key=routed_key) != want or local_cache.encode(
        tokenizer, last, key=local_key
    ) != want:
        raise SystemExit("a cached result differs from full tokenization")
    if owners.stats()["routed"] - routed_before != turns + 2:
        raise SystemExit(f"routed calls fell back to local tokenization: {owners.stats()}")
    hits = (owner_hits(owner_conn) - hits_before[0], local_cache.stats()["hits"] - hits_before[1])
    if hits != (turns + 1, turns + 1):  # the measured turns, and the last again
        raise SystemExit(f"measured turns missed: {hits} hits at the owner and here of {turns + 1} turns each")
    full = [timed(lambda: tokenizer(last, add_special_tokens=False)) for _ in range(full_reps)]
    return {
        "routed": statistics.median(routed),
        "local": statistics.median(local),
        "routed_array": statistics.median(routed_array) if routed_array else math.nan,
        "local_array": statistics.median(local_array) if local_array else math.nan,
        "full": statistics.median(full),
        "tokens": len(want),
    }


def _key_owned_by(owner: int, prefix: str) -> str:
    i = 0
    while owner_of(f"{prefix}-{i}", 2) != owner:
        i += 1
    return f"{prefix}-{i}"


class RawClient:
    """The baseline client: one persistent length-prefixed connection."""

    def __init__(self, path: str):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)

    def encode(self, text: str) -> list[int]:
        data = text.encode(errors="surrogatepass")
        self._sock.sendall(_LENGTH.pack(len(data)) + data)
        header = _recv_exactly(self._sock, _LENGTH.size)
        assert header is not None
        (count,) = _LENGTH.unpack(header)
        body = _recv_exactly(self._sock, count * 4)
        assert body is not None
        ids = array("i")
        ids.frombytes(body)
        return ids.tolist()


def round_trip_run(proxy: EncodeProxy, raw: RawClient, text: str, calls: int) -> dict[str, float]:
    manager_times, raw_times = [], []
    for _ in range(calls):  # interleaved, so both see the same noise
        manager_times.append(timed(lambda: proxy.ask(PeerRequest(text, None)).ids.tolist()))
        raw_times.append(timed(lambda: raw.encode(text)))
    return {"manager": statistics.median(manager_times), "raw": statistics.median(raw_times)}


def per_call_overhead(ipc_dir: str) -> dict[str, float]:
    live = OwnerWatch(ipc_dir, 0)
    live.check()
    n = 2000
    check = timed(lambda: [live.check() for _ in range(n)]) / n
    order = timed(lambda: [owner_order(f"conversation-{i}", 8) for i in range(n)]) / n
    return {"check": check, "order": order}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="repeated runs per row (default 5)")
    parser.add_argument("--turns", type=int, default=12, help="measured turns per conversation (default 12)")
    args = parser.parse_args()

    lower_switch_interval()  # this process's owner serves its peer too
    tokenizer = mptok.load_tokenizer()
    rng = random.Random(1)
    fixed_ids = [rng.randrange(128_000) for _ in range(38_000)]
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="mptok-bench-") as ipc_dir:
        parent, child = ctx.Pipe()
        owner = ctx.Process(target=owner_main, args=(child, ipc_dir, AUTHKEY, fixed_ids), daemon=True)
        owner.start()
        try:
            if not parent.poll(120) or parent.recv() != "ready":
                raise SystemExit("the owner process did not start")
            routed_cache = mptok.PrefixTokenCache()
            local_cache = mptok.PrefixTokenCache()
            warm_up(local_cache, tokenizer)
            with TokenizationOwners(
                ipc_dir, 1, 2, routed_cache, tokenizer, authkey=AUTHKEY, backoff_s=BACKOFF_S, routing=ROUTE_EVERY_PROMPT
            ) as owners:
                rows = measure(args, tokenizer, local_cache, owners, ipc_dir, parent)
                rows += owner_busy_rows(args, tokenizer, owners, parent, "patience (default)")
            # An asker that holds no fingerprint (a budget of 1 byte): every
            # routed prompt goes whole, and all its ids come back.
            with TokenizationOwners(
                ipc_dir, 1, 2, mptok.PrefixTokenCache(mptok.CacheConfig(max_held_bytes=1)), tokenizer,
                authkey=AUTHKEY, backoff_s=BACKOFF_S, routing=ROUTE_EVERY_PROMPT,
            ) as owners:
                rows += whole_prompt_rows(args, tokenizer, local_cache, owners, parent)
            # The same busy owner, asked by a frontend that waits for its timeout.
            with TokenizationOwners(
                ipc_dir, 1, 2, mptok.PrefixTokenCache(), tokenizer, authkey=AUTHKEY, backoff_s=BACKOFF_S,
                patience_factor=0, routing=ROUTE_EVERY_PROMPT,
            ) as owners:
                rows += owner_busy_rows(args, tokenizer, owners, parent, "no patience (waits up to timeout_s)")
            rows += overhead_rows(ipc_dir)
            parent.send("exit")
        finally:
            owner.join(30)
            if owner.is_alive():
                owner.kill()
                owner.join(10)
    print_table(rows, args)


def measure(args, tokenizer, local_cache, owners, ipc_dir: str, owner_conn) -> list[tuple]:
    rows = []
    for label, first_chars, full_reps in (("38k", 137_000, 7), ("200k", 720_000, 3)):
        runs = [
            conversation_run(
                tokenizer, local_cache, owners, owner_conn, 100 * r + len(label), first_chars, args.turns, full_reps
            )
            for r in range(args.runs)
        ]
        routed = statistics.median(r["routed"] for r in runs)
        local = statistics.median(r["local"] for r in runs)
        routed_array = statistics.median(r["routed_array"] for r in runs)
        local_array = statistics.median(r["local_array"] for r in runs)
        full = statistics.median(r["full"] for r in runs)
        speedup = statistics.median(r["full"] / r["routed"] for r in runs)
        vs_local = statistics.median(r["routed"] / r["local"] for r in runs)
        tokens = int(statistics.median(r["tokens"] for r in runs))
        target = label == "38k"
        rows += [
            (f"full tokenization, {tokens} tokens", full, "baseline", "", None),
            (f"local hit, {tokens} tokens", local, f"{full / local:.0f}x faster than full", "", None),
            (
                f"routed hit, {tokens} tokens",
                routed,
                f"{speedup:.0f}x faster than full; {vs_local:.2f}x a local hit",
                ">= 40x faster; <= 1.5x local" if target else "",
                (speedup >= 40 and vs_local <= 1.5) if target else None,
            ),
            (f"local hit as an int32 array, {tokens} tokens", local_array, f"{local_array / local:.2f}x a local hit as a list", "", None),
            (f"routed hit as an int32 array, {tokens} tokens", routed_array, f"{routed_array / local_array:.2f}x a local hit as an array", "", None),
        ]

    text = conversation(2, 1, first_chars=150_000)[0][:150_000]
    proxy = EncodeProxy(os.path.join(ipc_dir, "roundtrip.sock"), AUTHKEY, timeout_s=10)
    raw = RawClient(os.path.join(ipc_dir, "raw.sock"))
    for _ in range(20):  # connections made, caches warm
        proxy.ask(PeerRequest(text, None)).ids.tolist()
        raw.encode(text)
    runs = [round_trip_run(proxy, raw, text, 100) for _ in range(args.runs)]
    manager = statistics.median(r["manager"] for r in runs)
    raw_s = statistics.median(r["raw"] for r in runs)
    ratio = statistics.median(r["manager"] / r["raw"] for r in runs)
    rows += [
        ("raw length-prefixed socket, 150k chars -> 38k ids", raw_s, "baseline", "", None),
        ("EncodeProxy round trip, 150k chars -> 38k ids", manager, f"{ratio:.2f}x raw", "<= 1.3x raw", ratio <= 1.3),
    ]
    proxy.close()

    return rows


def whole_prompt_rows(args, tokenizer, local_cache, owners: TokenizationOwners, owner_conn) -> list[tuple]:
    runs = [
        conversation_run(tokenizer, local_cache, owners, owner_conn, 7000 + r, 137_000, args.turns, 1)
        for r in range(args.runs)
    ]
    routed = statistics.median(r["routed"] for r in runs)
    vs_local = statistics.median(r["routed"] / r["local"] for r in runs)
    tokens = int(statistics.median(r["tokens"] for r in runs))
    return [
        (
            f"routed hit sent whole (the asker holds no fingerprint), {tokens} tokens",
            routed,
            f"{vs_local:.2f}x a local hit",
            "",
            None,
        )
    ]


def overhead_rows(ipc_dir: str) -> list[tuple]:
    overhead = per_call_overhead(ipc_dir)
    return [
        ("liveness check of an owner (stat + psutil status)", overhead["check"], "per routed call", "", None),
        ("owner_order over 8 frontends", overhead["order"], "per routed call", "", None),
    ]


def busy_run(tokenizer, owners: TokenizationOwners, owner_conn, seed: int, turns: int) -> dict[str, float]:
    """Seconds per turn of a conversation the owner holds while its main
    thread runs Python (its serving threads then starve for its GIL)."""
    key = _key_owned_by(0, f"busy-{seed}")
    prompts = conversation(seed, turns + 1, first_chars=137_000, turn_chars=TURN_CHARS, markers=TEMPLATE_MARKERS)
    routed_before = owners.stats()["routed"]
    owners.encode(tokenizer, prompts[0], key=key)  # the owner holds it, this frontend its fingerprint
    before = owners.stats()
    if before["routed"] != routed_before + 1:
        raise SystemExit("the owner did not take the conversation's first turn")
    owner_conn.send("busy")
    owner_conn.recv()
    times, answers = [], []
    try:
        for text in prompts[1:]:
            started = time.perf_counter()
            answers.append(owners.encode(tokenizer, text, key=key))
            times.append(time.perf_counter() - started)
    finally:
        owner_conn.send("stop")
    after = owners.stats()
    for text, ids in zip(prompts[1:], answers, strict=True):
        if ids != tokenizer(text, add_special_tokens=False)["input_ids"]:
            raise SystemExit("a result differs from full tokenization")
    return {
        "p50": statistics.median(times),
        "max": max(times),
        "routed": after["routed"] - before["routed"],
        "given_up": sum(after[f"fallback_{r}"] - before[f"fallback_{r}"] for r in ("patience", "timeout")),
    }


def owner_busy_rows(args, tokenizer, owners: TokenizationOwners, owner_conn, label: str) -> list[tuple]:
    runs = []
    for r in range(max(1, args.runs // 2)):
        runs.append(busy_run(tokenizer, owners, owner_conn, 9000 + r, args.turns))
        time.sleep(BACKOFF_S)  # an owner given up on is callable again for the next run
    p50 = statistics.median(r["p50"] for r in runs)
    worst = max(r["max"] for r in runs)
    routed = sum(r["routed"] for r in runs)
    given_up = sum(r["given_up"] for r in runs)
    turns = len(runs) * args.turns
    return [
        (
            f"turn of a 38k-token conversation, owner's main thread busy in Python, {label}",
            p50,
            f"slowest turn {worst * 1e3:.0f} ms; {routed} of {turns} turns answered by the owner, "
            f"{given_up} calls given up (switch interval {sys.getswitchinterval() * 1e3:.0f} ms)",
            "",
            None,
        )
    ]


def print_table(rows: list[tuple], args) -> None:
    lines = [
        f"Medians over {args.runs} runs, {args.turns} turns each; ratios against baselines measured in the same run.",
        "",
        "| measurement | median | vs baseline (same run) | target | met |",
        "| --- | ---: | --- | --- | --- |",
    ]
    for name, seconds, versus, target, met in rows:
        shown = f"{seconds * 1e3:.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"
        verdict = "" if met is None else ("yes" if met else "**no**")
        lines.append(f"| {name} | {shown} | {versus} | {target} | {verdict} |")
    print("\n".join(lines))
    write_report("bench_routing", "What routing a conversation to its owner costs", "\n".join(lines), packages=("mptok", "tokenizers", "numpy"))


if __name__ == "__main__":
    main()

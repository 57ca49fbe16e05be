"""Seats claimed by the engine processes themselves (SGLang's workers have no rank).

Each process here makes its ``PromptTokens`` with ``ANY_SEAT``, as an
SGLang worker does: it joins the ipc directory named after its parent (this
test's process) and serves the first seat no live process serves, with real
sockets and locks. A second process takes the next seat; one more than the
seats finds none and uses its cache alone, with the same ids; when a seat's
holder is SIGKILLed, the next process takes the seat it held.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import tempfile

import pytest

from mptok_harness.checks import HANG_GUARD_S

TEXT_CHARS = 4000


def _hold_a_seat(ipc_parent: str, conn) -> None:
    """A process that loads its tokenizer, claims a seat of 2 when told to,
    reports (seat or None, ids right), then waits to be told to go."""
    tempfile.tempdir = ipc_parent
    import mptok
    from mptok.api.affinity import named
    from mptok.front.engine_tokens import ANY_SEAT, EngineFront, PromptTokens
    from mptok_harness.vllm_requests import text_source

    tokenizer = mptok.load_tokenizer()
    if conn.recv() != "claim":
        return
    tokens = PromptTokens(tokenizer, ANY_SEAT, 2, EngineFront("a test", "worker", "test worker", "mptok.test"))
    text = text_source(5)(TEXT_CHARS)
    right = all(
        tokens.tokenize(text, False, named(None, f"chat:{n}")) == tokenizer(text, add_special_tokens=False)["input_ids"]
        for n in range(4)
    )
    conn.send((tokens.rank if tokens.snapshot().get("routing") is not None else None, right))
    conn.recv()
    tokens.close()


class _Holder:
    """One seat holder's process: started (and loading) at once; ``claim()`` has it take a seat, in the order the test says."""

    def __init__(self, ipc_parent: str):
        self.conn, child = multiprocessing.get_context("spawn").Pipe()
        self.process = multiprocessing.get_context("spawn").Process(target=_hold_a_seat, args=(ipc_parent, child))
        self.process.start()

    def claim(self) -> _Holder:
        self.conn.send("claim")
        assert self.conn.poll(HANG_GUARD_S), "no report from the seat holder"
        self.seat, self.right = self.conn.recv()
        return self

    def stop(self) -> None:
        if self.process.is_alive():
            self.conn.send("go")
        self.process.join(HANG_GUARD_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


@pytest.fixture
def holders():
    """``holders(n)``: n seat holders, their processes started together (each
    loads a tokenizer: seconds of CPU), none claiming a seat before told to."""
    # A short parent: a Unix socket's path has at most 107 bytes.
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="seats-") as parent:
        made: list[_Holder] = []

        def start(count: int) -> list[_Holder]:
            made.extend(_Holder(parent) for _ in range(count))
            return made[-count:]

        yield start
        for holder in made:
            holder.stop()


def test_processes_claim_free_seats_and_a_replacement_takes_the_dead_ones(holders):
    first, second, extra, replacement = holders(4)
    assert (first.claim().seat, second.claim().seat) == (0, 1)
    assert extra.claim().seat is None  # every seat served: its cache alone
    assert first.right and second.right and extra.right
    os.kill(first.process.pid, signal.SIGKILL)
    first.process.join(HANG_GUARD_S)
    assert replacement.claim().seat == 0
    assert replacement.right

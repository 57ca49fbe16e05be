"""The owner's side of the peer protocol: what this frontend answers a peer.

A peer sends a ``PeerRequest``: either a whole prompt, or the characters
after those its fingerprint covers (``mptok.core.protocol``). ``PeerService``
answers either in one cache call (``keep``), with all the prompt's ids and
whether the prompt is kept here; None when no prompt kept here has that
fingerprint, and the peer then sends the whole text. ``PeerWorkers`` runs those answers on a few threads of their own,
warmed before peers can call. The transport
(``mptok.transport.serve_encode``) decodes the request and encodes the
reply; this module only decides what the reply is, and on which thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from mptok.cache.protocols import TokenCache
from mptok.core.deadline import Deadline
from mptok.core.fingerprint import Fingerprint
from mptok.core.protocol import PeerReply, PeerRequest

logger = logging.getLogger(__name__)

# Threads answering peers: more than the cores cannot tokenize more at once
# (the engines release the GIL), and each one warms caches of its own.
PEER_WORKERS = max(1, min(4, os.cpu_count() or 1))
PEER_WORKER_PREFIX = "mptok-peer"
# Requests a connection's thread hands to the workers before it warms itself
# and answers its connection's later requests on its own.
HANDED_OVER_FIRST = 8


class PeerService:
    """This frontend's answers to its peers: ``cache`` tokenizing with ``tokenizer``."""

    def __init__(self, cache: TokenCache, tokenizer: Any):
        self._cache = cache
        self._tokenizer = tokenizer

    def answer(self, request: PeerRequest) -> PeerReply | None:
        """The reply to ``request``: all the prompt's ids, and whether it is kept
        here. None when a delta's fingerprint matches no prompt kept here; a
        prompt without a key has no fingerprint and is answered whole, not
        kept. Raises what ``cache.encode`` raises for bad input. Called on
        the transport's threads, concurrently."""
        if request.key is None:
            return None if request.delta else PeerReply(False, self._cache.encode_array(self._tokenizer, request.text))
        after = None
        if request.since is not None:
            after = Fingerprint.from_wire(request.since, request.shared_chars)
            if after is None:
                return None
        kept = self._cache.keep(self._tokenizer, request.text, request.key, after=after)
        return None if kept is None else PeerReply(kept.kept, kept.ids)


class PeerWorkers:
    """The threads that answer peers: a fixed few, each warmed once before peers can call.

    The transport reads each peer connection on a thread of its own, one per
    connection (a peer's every tokenizing thread has one to each owner, made
    again after an idle timeout). A fast engine builds per-thread state on a
    thread's first tokenizations: fastokens spends tens of milliseconds of
    CPU on a new thread's first prompt, so answering on the connection
    threads paid that on nearly every connection's first call, and where
    routing is rare, on most routed prompts. These threads stay, and so do
    their caches; a connection's thread hands its first requests over and
    waits for each reply. The hand-over costs two more thread wake-ups, and
    each one a wait for this process's GIL, long when its main thread is
    busy in Python; so a connection that has handed over
    ``HANDED_OVER_FIRST`` requests is a busy one, and its thread warms
    itself while a worker answers the last of them (the cost a worker paid
    once, now paid once per busy connection) and answers the rest itself.

    Threads of their own, not the frontend's: an answer never routes, so
    owners waiting on each other's workers can never wait in a cycle.
    ``answer`` waits ``wait_s`` at most for a worker's reply (past it, the
    peer has given up too), then raises ``TimeoutError``, which the
    transport answers as an error: the peer tokenizes the prompt itself.
    """

    def __init__(
        self,
        answer: Callable[[PeerRequest], PeerReply | None],
        warm: Callable[[], object] | None,
        *,
        wait_s: float,
        workers: int = PEER_WORKERS,
        name: str = PEER_WORKER_PREFIX,
    ):
        if workers < 1 or not wait_s > 0:
            raise ValueError("PeerWorkers needs workers >= 1 and wait_s > 0")
        self._answer = answer
        self._warm = warm
        self._wait_s = wait_s
        self._requests: queue.SimpleQueue[tuple[Future[PeerReply | None], PeerRequest] | None] = queue.SimpleQueue()
        self._warmed = threading.Semaphore(0)
        # Per connection thread: requests handed over, and whether it is warm.
        self._here = threading.local()
        # Daemons: a worker still in a tokenization when close() gives up
        # on it finishes it, touching nothing, and never holds up the exit.
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()
        deadline = Deadline.after(wait_s)
        for _ in self._threads:
            if not self._warmed.acquire(timeout=deadline.left()):
                # Only the first calls pay for it later: peers are still answered.
                logger.warning("peer workers still warming after %g s; serving peers anyway", wait_s)
                break

    def answer(self, request: PeerRequest) -> PeerReply | None:
        """``answer(request)`` on a worker, or on the calling thread once it is
        warm; raises what it raises, or ``TimeoutError`` after ``wait_s`` without a worker's reply."""
        here = self._here
        if self._warm is None or getattr(here, "warm", False):
            return self._answer(request)
        future: Future[PeerReply | None] = Future()
        self._requests.put((future, request))
        here.handed = getattr(here, "handed", 0) + 1
        if here.handed >= HANDED_OVER_FIRST:
            self._warm_quietly()
            here.warm = True
        try:
            return future.result(timeout=self._wait_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no peer worker answered within {self._wait_s:g} s") from None

    def close(self, deadline: Deadline) -> None:
        """Fail the requests not yet started and stop the workers, waiting
        until ``deadline`` at most for one still in an answer."""
        while True:
            try:
                item = self._requests.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in self._threads:
            self._requests.put(None)
        for thread in self._threads:
            thread.join(deadline.left())

    def _warm_quietly(self) -> None:
        # A warm-up that fails costs only the first call's speed.
        try:
            if self._warm is not None:
                self._warm()
        except Exception:
            logger.warning("warming a thread that answers peers failed", exc_info=True)

    def _work(self) -> None:
        try:
            self._warm_quietly()
        finally:
            self._warmed.release()
        while (item := self._requests.get()) is not None:
            future, request = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._answer(request))
            except BaseException as e:  # the waiting connection thread raises it
                future.set_exception(e)

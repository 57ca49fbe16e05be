"""One engine process's prompt tokenization through mptok: the cache, and routing between its peers.

Each process of an engine that tokenizes prompts (vLLM's API servers,
SGLang's tokenizer workers) gets one ``PromptTokens`` (``of_process``): its
cache, and with N > 1 processes ``TokenizationOwners`` in the ipc directory
they share (``mptok.front.ipc_dir``). A process learns its seat (its
frontend id of N) from the engine's rank (vLLM's ``_api_process_rank``); by
claiming the first seat no live process serves (``ANY_SEAT``: SGLang's
workers have no rank, and a replacement takes the dead one's seat); or from
an outside supervisor (``mptok render``, ``take_seat``), for a spare
(``stand_by``) only once it gets an id: until then its cache and backend
are built and warm, and nothing routes, serves or exports. With one
process, or if routing cannot start, the cache alone.

The ids are either exactly ``tokenizer(text, add_special_tokens=...)["input_ids"]``
or None, which sends the prompt down the engine's own path: mptok never
turns a request the engine would answer into an error.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from mptok.api.affinity import ConversationIdentity
from mptok.cache.backend import SlowTokenizerError, backend_for
from mptok.cache.config import CacheConfig
from mptok.cache.prefix_cache import PrefixTokenCache
from mptok.engines.choice import LONG_TEXT_CHARS
from mptok.front.prompt_ids import PromptIds
from mptok.routing.owners import OwnerAlreadyServing, TokenizationOwners, lower_switch_interval, seat_taken
from mptok.front.ipc_dir import SharedIpcDir
from mptok.front.prometheus import MetricsExport

CLOSE_TIMEOUT_S = 2.0
# The rank of a process that claims the first free seat itself.
ANY_SEAT = -1


@dataclass(frozen=True)
class EngineFront:
    """How the user turned mptok on, the label of its processes' series, what its log calls one, its log."""

    switch: str
    process_label: str
    process_name: str
    logger_name: str

    @property
    def logger(self) -> logging.Logger:
        return logging.getLogger(self.logger_name)


_lock = threading.Lock()
_of_process: PromptTokens | None = None


@dataclass(frozen=True)
class Seat:
    """This process's place among the N processes of an outside supervisor (``mptok render``)."""

    frontend_id: int
    count: int
    ipc_dir: str
    authkey: bytes = field(repr=False)
    # Keyword arguments of TokenizationOwners (timeouts, back-off, patience).
    routing: dict[str, Any] = field(default_factory=dict)


_seat: Seat | None = None
_standing_by = False


def stand_by() -> None:
    """This process's seat comes after the engine builds its renderer: build the cache and wait for ``take_seat``."""
    global _standing_by
    with _lock:
        _standing_by = True


def take_seat(seat: Seat) -> None:
    """Route this process's prompts as ``seat`` says: before the engine builds its renderer, or after it when standing by."""
    global _seat
    with _lock:
        if _seat is not None:
            raise RuntimeError("a process takes one seat")
        if _of_process is not None and _of_process._metrics is not None:  # seated
            raise RuntimeError("take_seat after the renderer was built: the seat would be ignored")
        _seat = seat
        waiting = _of_process
    if waiting is not None:
        waiting.seat(seat.frontend_id, seat.count)


class PromptTokens:
    """Exact prompt ids through mptok for process ``rank`` of ``count`` of the engine ``front``.

    ``close()`` stops routing and serving within ``CLOSE_TIMEOUT_S`` and
    leaves the ipc directory; it runs at process exit and is idempotent.
    Made with ``rank`` None it waits for ``seat(rank, count)`` (its cache
    alone meanwhile, counted but not exported).
    """

    def __init__(self, tokenizer: Any, rank: int | None, count: int, front: EngineFront):
        self._tokenizer = tokenizer
        self.front = front
        self.name = getattr(tokenizer, "name_or_path", None)
        self.rank = rank
        self._cache = PrefixTokenCache(CacheConfig.from_env())
        self._ipc_dir: SharedIpcDir | None = None
        self._owners: TokenizationOwners | None = None
        self._metrics: MetricsExport | None = None
        self._closed = False
        # The cache alone until the seat starts routing (a spare's seat comes late).
        self._ids = PromptIds(tokenizer, self._cache)
        atexit.register(self.close)
        # Building the backend copies the Rust tokenizer, and warming it loads the long texts' engine
        # (seconds each for 128k ids): here, so that a spare has it done before it takes its seat.
        with contextlib.suppress(SlowTokenizerError):
            backend_for(tokenizer, self._cache.config.tokenizer_backend).engines.warm()
        if rank is not None:
            self.seat(rank, count)

    def seat(self, rank: int, count: int) -> None:
        """Start routing (with ``count`` > 1) and the metrics export as process ``rank`` (or ``ANY_SEAT``) of ``count``."""
        self.rank = rank
        routing = f"off: one {self.front.process_name}"
        if count > 1 and (rank == ANY_SEAT or 0 <= rank < count):
            routing = self._start_routing(rank, count)
        if self._owners is not None:
            self._ids.route_through(self._owners)
        self._metrics = MetricsExport(max(self.rank, 0), self.snapshot, self.front.process_label)
        self._metrics.start()
        self._log_start(routing)

    @classmethod
    def of_process(cls, tokenizer: Any, rank: int, count: int, front: EngineFront) -> PromptTokens | None:
        """This process's instance, made on first call; None for a renderer of another tokenizer."""
        global _of_process
        with _lock:
            if _of_process is None:
                seat_rank: int | None = rank
                if _seat is not None:
                    seat_rank, count = _seat.frontend_id, _seat.count
                elif _standing_by:
                    seat_rank = None
                _of_process = cls(tokenizer, seat_rank, count, front)
            elif _of_process.name != getattr(tokenizer, "name_or_path", None):
                front.logger.warning("mptok: a second tokenizer in this process (%r) is tokenized by the engine alone", tokenizer)
                return None
            return _of_process

    def tokenize(self, text: str, add_special_tokens: bool, identity: ConversationIdentity) -> list[int] | None:
        """The exact ids of ``text``, routed under ``identity.key``; None to let the engine tokenize it."""
        try:
            return self._ids.ids(text, add_special_tokens, identity)
        except Exception:
            # The engine's own path then gives the request whatever it gives it.
            self.front.logger.debug("mptok: tokenizing through the cache raised; the engine tokenizes it", exc_info=True)
            return None

    def count_direct(self, tokens: int) -> None:
        """One prompt that the engine tokenized itself, of ``tokens`` tokens."""
        self._ids.count_direct(tokens)

    def snapshot(self) -> dict[str, Any]:
        """The cache's, routing's and the prompts' counts, for /metrics (``mptok.front.catalogue``)."""
        return self._ids.snapshot()

    def close(self) -> None:
        with _lock:
            if self._closed:
                return
            self._closed = True
        if self._metrics is not None:
            self._metrics.stop()
        if self._owners is not None:
            self._owners.close(CLOSE_TIMEOUT_S)
        if self._ipc_dir is not None:
            self._ipc_dir.close()

    def _start_routing(self, rank: int, count: int) -> str:
        seat = _seat
        try:
            if seat is None:
                self._ipc_dir = SharedIpcDir()
                path, authkey, options = self._ipc_dir.path, self._ipc_dir.authkey, {}
            else:
                path, authkey, options = seat.ipc_dir, seat.authkey, seat.routing
            # Peers' calls wait for this process's GIL: about 1 ms instead of 5.
            lower_switch_interval()
            self._owners = self._owners_at(path, rank, count, authkey, options)
        except Exception as e:
            self.front.logger.warning("mptok: routing between processes is off (%s); this process uses its cache alone", e)
            if self._ipc_dir is not None:
                self._ipc_dir.close()
                self._ipc_dir = None
            return f"off: {e}"
        return f"on: {self.front.process_name} {self.rank} of {count}, ipc dir {path}"

    def _owners_at(self, path: str, rank: int, count: int, authkey: bytes, options: dict[str, Any]) -> TokenizationOwners:
        """Owners serving seat ``rank``, or with ``ANY_SEAT`` the first seat no live process serves."""
        seats = [rank] if rank != ANY_SEAT else [i for i in range(count) if not seat_taken(path, i)]
        for seat in seats:
            try:
                owners = TokenizationOwners(path, seat, count, self._cache, self._tokenizer, authkey=authkey, **options)
            except OwnerAlreadyServing:
                if rank != ANY_SEAT:
                    raise
                continue  # another process claimed it since the look
            self.rank = seat
            return owners
        raise OwnerAlreadyServing(f"every seat of {count} in {path} is served by a live process")

    def _log_start(self, routing: str) -> None:
        choice = self._cache.config.tokenizer_backend
        try:
            backend = backend_for(self._tokenizer, choice)
            engines = backend.engines.chosen_names
            backend_text = (
                f"{engines['short']}, {engines['long']} for texts of {LONG_TEXT_CHARS:,} characters or more "
                f"(chosen from {choice!r}: {backend.engines.report or 'no fast engine asked for'})"
            )
        except SlowTokenizerError as e:
            backend_text = f"none ({e}): the engine's own tokenization"
        config, framed = self._cache.config, self._ids.frame is not None
        self.front.logger.info(
            "mptok is on (%s): tokenizer %s, backend %s; cache max_bytes=%d max_entries=%d min_chars=%d; add_special_tokens %s; routing %s",
            self.front.switch, self.name, backend_text, config.max_bytes, config.max_entries, config.min_chars,
            "framed by the cache" if framed else "tokenized by the engine", routing,
        )

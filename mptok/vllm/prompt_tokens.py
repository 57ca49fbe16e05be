"""One API server's prompt tokenization through mptok: the cache, and routing between API servers.

vLLM builds its renderer (and may build more than one) in each API server
process; the cache and the owner serving it to the other API servers must
exist once per process, under the API server's rank. ``PromptTokens.of_process``
makes that one instance on first use and hands it to every renderer of the
same tokenizer.

With ``--api-server-count N`` > 1, vLLM gives API server i the rank i of N
(``parallel_config._api_process_rank`` / ``_api_process_count``, set from
``client_index`` / ``client_count`` when ``vllm serve`` spawns it): that is
the frontend id and count of ``TokenizationOwners``, in the ipc directory the
API servers of one ``vllm serve`` share (``mptok.vllm.ipc_dir``). With one
process (``vllm serve`` with one API server, ``vllm launch render``), or if
routing cannot start, the cache alone. A process of an outside supervisor
(``mptok render``) takes its seat instead (``take_seat``): before vLLM
builds its renderer, or, for a process built as a spare (``stand_by``),
once the supervisor gives it an id: until then its cache and tokenizer
backend are built and warm, and nothing routes, serves or exports.

Whatever happens inside mptok, the ids are either exactly
``tokenizer(text, add_special_tokens=...)["input_ids"]`` or ``None``, and
``None`` sends the prompt down vLLM's own path: mptok never turns a request
vLLM would answer into an error.
"""

from __future__ import annotations

import atexit
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
from mptok.routing.owners import TokenizationOwners, lower_switch_interval
from mptok.vllm.ipc_dir import SharedIpcDir
from mptok.vllm.metrics import MetricsExport

logger = logging.getLogger("vllm.mptok")

CLOSE_TIMEOUT_S = 2.0

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
    """This process's seat comes after vLLM builds its renderer: build the cache and wait for ``take_seat``."""
    global _standing_by
    with _lock:
        _standing_by = True


def take_seat(seat: Seat) -> None:
    """Route this process's prompts as ``seat`` says: before vLLM builds its renderer, or after it when standing by."""
    global _seat
    with _lock:
        if _seat is not None:
            raise RuntimeError("a process takes one seat")
        if _of_process is not None and _of_process.seated:
            raise RuntimeError("take_seat after the renderer was built: the seat would be ignored")
        _seat = seat
        waiting = _of_process
    if waiting is not None:
        waiting.seat(seat.frontend_id, seat.count)


class PromptTokens:
    """Exact prompt ids through mptok for API server ``rank`` of ``count``.

    ``tokenize`` returns ``tokenizer(text, add_special_tokens=...)["input_ids"]``
    or None (the caller then tokenizes as vLLM does). ``close()`` stops routing
    and serving within ``CLOSE_TIMEOUT_S`` and leaves the ipc directory; it runs
    at process exit and is idempotent. Made with ``rank`` None it waits for
    ``seat(rank, count)`` (its cache alone meanwhile, counted but not exported).
    """

    def __init__(self, tokenizer: Any, rank: int | None, count: int):
        self._tokenizer = tokenizer
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
        # The engine check (seconds) happens here, so a spare has it done before it takes its seat.
        self._warm_backend()
        if rank is not None:
            self.seat(rank, count)

    @property
    def seated(self) -> bool:
        return self._metrics is not None

    def seat(self, rank: int, count: int) -> None:
        """Start routing (with ``count`` > 1) and the metrics export as API server ``rank`` of ``count``."""
        self.rank = rank
        routing = "off: one API server"
        if count > 1 and 0 <= rank < count:
            routing = self._start_routing(rank, count)
        if self._owners is not None:
            self._ids.route_through(self._owners)
        self._metrics = MetricsExport(max(rank, 0), self.snapshot)
        self._metrics.start()
        self._log_start(routing, count)

    @classmethod
    def of_process(cls, tokenizer: Any, rank: int, count: int) -> PromptTokens | None:
        """This process's instance, made on first call; None for a renderer of another tokenizer."""
        global _of_process
        with _lock:
            if _of_process is None:
                seat_rank: int | None = rank
                if _seat is not None:
                    seat_rank, count = _seat.frontend_id, _seat.count
                elif _standing_by:
                    seat_rank = None
                _of_process = cls(tokenizer, seat_rank, count)
            elif _of_process.name != getattr(tokenizer, "name_or_path", None):
                logger.warning("mptok: a second tokenizer in this process (%r) is tokenized by vLLM alone", tokenizer)
                return None
            return _of_process

    def tokenize(self, text: str, add_special_tokens: bool, identity: ConversationIdentity) -> list[int] | None:
        """The exact ids of ``text``, routed under ``identity.key``; None to let vLLM tokenize it."""
        try:
            return self._ids.ids(text, add_special_tokens, identity)
        except Exception:
            # vLLM's own path then gives the request whatever vLLM gives it.
            logger.debug("mptok: tokenizing through the cache raised; vLLM tokenizes it", exc_info=True)
            return None

    def count_vllm(self, tokens: int) -> None:
        """One prompt that vLLM tokenized itself, of ``tokens`` tokens."""
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
            self._owners = TokenizationOwners(path, rank, count, self._cache, self._tokenizer, authkey=authkey, **options)
        except Exception as e:
            logger.warning("mptok: routing between API servers is off (%s); this API server uses its cache alone", e)
            if self._ipc_dir is not None:
                self._ipc_dir.close()
                self._ipc_dir = None
            return f"off: {e}"
        return f"on: API server {rank} of {count}, ipc dir {path}"

    def _warm_backend(self) -> None:
        # Building it copies the Rust tokenizer, and warming it loads the long
        # texts' engine (seconds each for 128k ids): at start, not on a request.
        try:
            backend_for(self._tokenizer, self._cache.config.tokenizer_backend).engines.warm()
        except SlowTokenizerError:
            pass

    def _log_start(self, routing: str, count: int) -> None:
        choice = self._cache.config.tokenizer_backend
        try:
            backend = backend_for(self._tokenizer, choice)
            engines = backend.engines.chosen_names
            backend_text = (
                f"{engines['short']}, {engines['long']} for texts of {LONG_TEXT_CHARS:,} characters or more "
                f"(chosen from {choice!r}: {backend.engines.report or 'no fast engine asked for'})"
            )
        except SlowTokenizerError as e:
            backend_text = f"none ({e}): vLLM's own tokenization"
        config = self._cache.config
        logger.info(
            "mptok is on (--tokenizer-mode mptok): tokenizer %s, backend %s; cache max_bytes=%d max_entries=%d "
            "min_chars=%d; add_special_tokens %s; routing %s",
            self.name,
            backend_text,
            config.max_bytes,
            config.max_entries,
            config.min_chars,
            "framed by the cache" if self._ids.frame is not None else "tokenized by vLLM",
            routing,
        )

"""Turn a ``/tokenize`` body into exact ids and a JSON answer, in a bounded thread pool.

``TokenizeService`` is everything a frontend does for one request apart from
HTTP: parse it (``mptok.tokenize_request``), render the chat template,
tokenize through the frontend's ``PrefixTokenCache`` (which may route the
prompt to its owner), and serialize the ids with orjson. The HTTP app
(``mptok.frontend``) only reads bodies and writes answers.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import orjson

from mptok.affinity import IdentityKind, identify
from mptok.chat_template import ChatTemplate, ChatTemplateError
from mptok.counting import Counters, Histogram
from mptok.logfmt import log_event
from mptok.tokenize_request import RequestError, TokenizeRequest, error_body, parse_tokenize_request

logger = logging.getLogger("mptok.frontend")  # its log lines are the frontend's

# Two different texts whose tokenizations, with and without special tokens,
# reveal what the post-processor adds around a single sequence.
_SENTINELS = ("Hello world", "x = 1;\n\n\t\u00e9\U0001f642 end")
# JSON may spell one character as a 12-byte surrogate-pair escape; bodies
# larger than this many bytes per allowed prompt character are refused unread.
_BODY_BYTES_PER_CHAR = 12
_BODY_OVERHEAD_BYTES = 1 << 20


@dataclass(frozen=True)
class Answer:
    """A /tokenize response: status, JSON body, and for a tokenized prompt
    the seconds from the parsed request to its ids (template rendering
    excluded, routing included)."""

    status: int
    payload: bytes
    tokenize_s: float | None = None


@dataclass(frozen=True)
class SpecialTokenFrame:
    """The ids the tokenizer's post-processor puts around one sequence.

    The cache only knows ``add_special_tokens=False``. For ``True`` the ids
    are ``prefix + ids + suffix`` when the post-processor adds fixed ids
    around the sequence; ``derive`` proves that on two different texts and
    returns None otherwise (then prompts are tokenized in full).
    """

    prefix: tuple[int, ...]
    suffix: tuple[int, ...]

    @classmethod
    def derive(cls, tokenizer: Any, sentinels: tuple[str, ...] = _SENTINELS) -> SpecialTokenFrame | None:
        frames = set()
        for text in sentinels:
            with_special = list(tokenizer(text, add_special_tokens=True)["input_ids"])
            without = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            frame = cls._split(with_special, without)
            if frame is None:
                return None
            frames.add(frame)
        return frames.pop() if len(frames) == 1 else None

    @classmethod
    def _split(cls, with_special: list[int], without: list[int]) -> SpecialTokenFrame | None:
        n = len(without)
        for start in range(len(with_special) - n + 1):
            if with_special[start : start + n] == without:
                return cls(tuple(with_special[:start]), tuple(with_special[start + n :]))
        return None


class TokenizeService:
    """Turns a ``/tokenize`` body into a JSON answer, in a bounded thread pool.

    Everything a request costs runs in the pool's ``threads`` workers.
    Returned ids always equal ``tokenizer(text, add_special_tokens=...)
    ["input_ids"]`` for the rendered text. ``close()`` lets running work
    finish for at most ``timeout_s`` and refuses new work.
    """

    def __init__(
        self,
        frontend_id: int,
        tokenizer: Any,
        cache: Any,
        template: ChatTemplate,
        *,
        max_prompt_chars: int,
        threads: int,
        affinity_chars: int = 0,
    ):
        self.frontend_id = frontend_id
        self.max_prompt_chars = max_prompt_chars
        self._affinity_chars = affinity_chars
        self.max_body_bytes = max_prompt_chars * _BODY_BYTES_PER_CHAR + _BODY_OVERHEAD_BYTES
        self._tokenizer = tokenizer
        self._cache = cache
        self._template = template
        self._frame = SpecialTokenFrame.derive(tokenizer)
        # transformers' __call__ is not thread-safe ("Already borrowed"); it is
        # only called when the cache cannot serve add_special_tokens=True.
        self._direct_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=f"tokenize-{frontend_id}")
        self._in_flight: set[concurrent.futures.Future] = set()
        self._in_flight_lock = threading.Lock()
        self.tokenize_seconds = Histogram()
        self._identities = Counters(tuple(kind.value for kind in IdentityKind))
        self._requests: Counter[str] = Counter()
        self._requests_lock = threading.Lock()
        log_event(
            logger,
            logging.INFO,
            "special_tokens",
            mode="cache" if self._frame is not None else "full",
            prefix=list(self._frame.prefix) if self._frame else "",
            suffix=list(self._frame.suffix) if self._frame else "",
            chat_template=template.origin,
        )

    def submit(self, body: bytes, header_conversation_id: str | None) -> concurrent.futures.Future:
        """A future of an ``Answer``; raises ``RequestError`` (503) once closed."""
        try:
            future = self._pool.submit(self._answer, body, header_conversation_id)
        except RuntimeError:
            raise RequestError(503, "this frontend is shutting down; retry") from None
        with self._in_flight_lock:
            self._in_flight.add(future)
        future.add_done_callback(self._done)
        return future

    def tokenize(self, text: str, add_special_tokens: bool, key: str | None) -> list[int]:
        """Exactly ``tokenizer(text, add_special_tokens=...)["input_ids"]``, through the cache when it can."""
        if not add_special_tokens:
            return self._cache.encode(self._tokenizer, text, key=key)
        if self._frame is not None and text:
            return [*self._frame.prefix, *self._cache.encode(self._tokenizer, text, key=key), *self._frame.suffix]
        with self._direct_lock:
            return list(self._tokenizer(text, add_special_tokens=True)["input_ids"])

    def count_request(self, path: str, status: int) -> None:
        with self._requests_lock:
            self._requests[f"{path} {status}"] += 1

    def snapshot(self) -> dict[str, Any]:
        with self._requests_lock:
            requests = dict(self._requests)
        return {
            "cache": self._cache.stats(),
            "tokenize_seconds": self.tokenize_seconds.snapshot(),
            "requests": requests,
            "identities": self._identities.snapshot(),
        }

    def close(self, timeout_s: float) -> None:
        with self._in_flight_lock:
            pending = set(self._in_flight)
        _, not_done = concurrent.futures.wait(pending, timeout=timeout_s)
        if not_done:
            log_event(logger, logging.WARNING, "abandoned_tokenizations", count=len(not_done), after_s=timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _done(self, future: concurrent.futures.Future) -> None:
        with self._in_flight_lock:
            self._in_flight.discard(future)

    def _answer(self, body: bytes, header_conversation_id: str | None) -> Answer:
        try:
            request = parse_tokenize_request(body, header_conversation_id)
            text = self._text_of(request)
            identity = identify(request.conversation_id, request.messages, request.prompt, self._affinity_chars)
            self._identities.add(identity.kind.value)
            started = time.perf_counter()
            ids = self.tokenize(text, request.add_special_tokens, identity.key)
            tokenize_s = time.perf_counter() - started
            self.tokenize_seconds.observe(tokenize_s)
        except RequestError as e:
            return Answer(e.status, error_body(e.status, e.message))
        except Exception as e:
            log_event(logger, logging.ERROR, "tokenize_failed", error=f"{type(e).__name__}: {e}")
            return Answer(500, error_body(500, f"tokenization failed: {type(e).__name__}"))
        payload = orjson.dumps({"tokens": ids, "count": len(ids), "frontend": self.frontend_id})
        return Answer(200, payload, tokenize_s)

    def _text_of(self, request: TokenizeRequest) -> str:
        if request.prompt is not None:
            text = request.prompt
        else:
            assert request.messages is not None
            if sum(len(m["content"]) for m in request.messages) > self.max_prompt_chars:
                raise self._too_long("the messages' contents")
            try:
                text = self._template.render(self._tokenizer, request.messages, request.add_generation_prompt)
            except ChatTemplateError as e:
                raise RequestError(400, str(e)) from None
        if len(text) > self.max_prompt_chars:
            raise self._too_long("the prompt")
        return text

    def _too_long(self, what: str) -> RequestError:
        return RequestError(413, f"{what} exceeds --max-prompt-chars={self.max_prompt_chars} characters")

"""Turn a ``/tokenize`` body into exact ids and a JSON answer, in a bounded thread pool.

``TokenizeService`` is everything a frontend does for one request apart from
HTTP (``mptok.serve.frontend``): parse it, render the chat template,
tokenize through ``mptok.front.prompt_ids``, write the JSON. The pool is
what overload fills: ``Admission`` bounds the requests a frontend holds at
once and refuses the rest at once (503, Retry-After), and work that waited
too long for a thread, or whose client has gone, is not started.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from mptok.api.affinity import ChatNames, identify
from mptok.api.chat_template import ChatTemplate, ChatTemplateError, vllm_tools
from mptok.api.chat_turns import ChatTurn, ChatTurns
from mptok.api.tokenize_request import RETRY_AFTER_S, RequestError, TokenizeRequest, error_body, parse_detokenize_request, parse_tokenize_request
from mptok.api.vllm_contract import RequestLimits
from mptok.cache.protocols import TokenCache
from mptok.core.counting import Counters, Histogram
from mptok.core.deadline import Deadline
from mptok.core.warm_threads import warm_every_thread
from mptok.front.prompt_ids import PromptIds, Routing
from mptok.serve.ids_json import IdsJson
from mptok.supervise.admission import Admission
from mptok.supervise.logfmt import log_event

logger = logging.getLogger("mptok.frontend")  # its log lines are the frontend's

# JSON may spell one character as a 12-byte surrogate-pair escape; bodies
# larger than this many bytes per allowed prompt character are refused unread.
_BODY_BYTES_PER_CHAR = 12
_BODY_OVERHEAD_BYTES = 1 << 20
# How long a start waits for the pool's threads to be warmed; past it the
# frontend serves anyway and only their first requests pay.
_WARM_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Answer:
    """An HTTP response: status, body, for a tokenized prompt the seconds from
    the parsed request to its ids (template rendering excluded, routing
    included), Retry-After, content type and other headers."""

    status: int
    payload: bytes
    tokenize_s: float | None = None
    retry_after_s: int | None = None
    media_type: bytes = b"application/json"
    headers: tuple[tuple[bytes, bytes], ...] = ()

    @classmethod
    def of_error(cls, error: RequestError) -> Answer:
        return cls(error.status, error_body(error.status, error.message, error.param), retry_after_s=error.retry_after_s)


class TokenizeService:
    """Turns a ``/tokenize`` body into a JSON answer, in a bounded thread pool.

    Returned ids always equal ``tokenizer(text, add_special_tokens=...)["input_ids"]``
    for the rendered text. ``close()`` lets running work finish for at most ``timeout_s``
    and refuses new work. ``warm`` (``TokenizationOwners.warm_thread``) runs once on
    every pool thread at start, so that no request pays a fast engine's first call there.
    """

    def __init__(
        self, frontend_id: int, tokenizer: Any, cache: TokenCache, template: ChatTemplate, *, max_prompt_chars: int, threads: int,
        max_in_flight: int, queue_timeout_s: float, max_messages: int, max_model_len: int | None = None,
        served_model_names: tuple[str, ...] = (), affinity_chars: int = 0, routing: Routing | None = None,
        warm: Callable[[], object] | None = None,
    ):
        self.frontend_id = frontend_id
        self.max_prompt_chars = max_prompt_chars
        self.admission = Admission(max_in_flight)
        self.queue_timeout_s = queue_timeout_s
        self.max_messages = max_messages
        self._affinity_chars = affinity_chars
        self.max_body_bytes = max_prompt_chars * _BODY_BYTES_PER_CHAR + _BODY_OVERHEAD_BYTES
        self._tokenizer = tokenizer
        self.prompt_ids = PromptIds(tokenizer, cache, routing)
        self._ids_json = IdsJson()
        self._chats = ChatTurns(pieces=template.pieces is not None)
        self._chat_names = ChatNames()
        self._template = template
        self._limits = RequestLimits(tokenizer, max_model_len, served_model_names)
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=f"tokenize-{frontend_id}")
        if warm is not None:
            warm_every_thread(self._pool, threads, warm, Deadline.after(_WARM_TIMEOUT_S))
        self._in_flight: set[concurrent.futures.Future] = set()
        self._in_flight_lock = threading.Lock()
        self.tokenize_seconds = Histogram()
        self._requests = Counters()  # by "<path> <status>"
        self._template_failures = itertools.count(1)
        frame = self.prompt_ids.frame
        log_event(
            logger, logging.INFO, "special_tokens", mode="cache" if frame is not None else "full",
            prefix=list(frame.prefix) if frame else "", suffix=list(frame.suffix) if frame else "", chat_template=template.origin,
        )
        log_event(
            logger, logging.INFO, "vllm_contract", max_model_len=max_model_len if max_model_len is not None else "unknown",
            served_model_names=",".join(served_model_names) or "any",
        )

    def submit_detokenize(self, body: bytes) -> concurrent.futures.Future:
        """A future of the ``/detokenize`` ``Answer``; raises ``RequestError`` (503) once closed."""
        return self._submit(self._detokenize_answer, body)

    def _submit(self, work: Any, *args: Any) -> concurrent.futures.Future:
        try:
            future = self._pool.submit(work, *args)
        except RuntimeError:
            raise RequestError(503, "this frontend is shutting down; retry", retry_after_s=RETRY_AFTER_S) from None
        with self._in_flight_lock:
            self._in_flight.add(future)
        future.add_done_callback(self._done)
        return future

    async def answer(self, body: bytes, header_conversation_id: str | None, client_gone: asyncio.Future, deadline: Deadline) -> Answer | None:
        """The answer to a read body, or None if ``client_gone`` finished before its work started.

        Work still waiting for a pool thread at ``deadline`` (the request's, from
        its arrival) is not started (503 with Retry-After); started work's route
        takes what is left of it, and has always finished when this returns (a
        thread cannot be stopped), so a caller's ``Admission`` place is held while
        it runs. ``RequestError`` (503) once closed.
        """
        future = self._submit(self._answer, body, header_conversation_id, deadline)
        work = asyncio.wrap_future(future)
        await asyncio.wait({work, client_gone}, timeout=deadline.left(), return_when=asyncio.FIRST_COMPLETED)
        if not work.done() and future.cancel():  # still queued: never started
            if client_gone.done():
                return None
            return Answer.of_error(
                RequestError(
                    503,
                    f"this frontend is busy: the request waited --queue-timeout={self.queue_timeout_s:g} s for a tokenizing thread; retry",
                    retry_after_s=RETRY_AFTER_S,
                )
            )
        await asyncio.wait({work})
        return work.result()

    def count_request(self, path: str, status: int) -> None:
        self._requests.add(f"{path} {status}")

    def snapshot(self) -> dict[str, Any]:
        return {**self.prompt_ids.snapshot(), "tokenize_seconds": self.tokenize_seconds.snapshot(), "requests": self._requests.snapshot()}

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

    def _answer(self, body: bytes, header_conversation_id: str | None, deadline: Deadline) -> Answer:
        try:
            request = parse_tokenize_request(body, header_conversation_id)
            identity = identify(request.conversation_id, request.messages, request.prompt, self._affinity_chars, self._chat_names.of)
            chat = None
            if request.messages is not None:
                chat = self._chats.turn(identity.key, request.messages)
                chat.check()
            self._limits.check_model(request.model)
            text = self._text_of(request, chat)
            started = time.perf_counter()
            ids = self.prompt_ids.ids_array(text, request.add_special_tokens, identity, deadline=deadline)
            tokenize_s = time.perf_counter() - started
            self.tokenize_seconds.observe(tokenize_s)
            self._limits.check_length(len(ids))
        except Exception as e:
            return _error_answer(e, "tokenize_failed", "tokenization")
        return Answer(200, self._tokenize_payload(ids, request.return_token_strs, identity.key), tokenize_s)

    def _text_of(self, request: TokenizeRequest, chat: ChatTurn | None) -> str:
        if chat is None:
            assert request.prompt is not None
            text = request.prompt
        else:
            if len(chat.messages) > self.max_messages:
                raise RequestError(413, f'"messages" has {len(chat.messages)} messages; at most --max-messages={self.max_messages}')
            if chat.content_chars() > self.max_prompt_chars:
                raise self._too_long("the messages' contents")
            text = self._render(request, chat)
        if len(text) > self.max_prompt_chars:
            raise self._too_long("the prompt")
        return text

    def _render(self, request: TokenizeRequest, chat: ChatTurn) -> str:
        """The chat as vLLM renders it: its view of the messages and tools, the
        accepted ``chat_template_kwargs``, ``continue_final_message`` (docs/SERVE.md, "Endpoints")."""
        try:
            prepared = chat.prepared()
            template_kwargs = self._template.accepted_kwargs(request.chat_template_kwargs or {})
            if not (template_kwargs or request.continue_final_message):
                text = chat.built_in_text(request.add_generation_prompt)
                if text is not None:
                    return text
            tools = vllm_tools(request.tools) if request.tools is not None else None
            return self._template.render(
                self._tokenizer, prepared, request.add_generation_prompt, continue_final_message=request.continue_final_message,
                tools=tools, template_kwargs=template_kwargs, prepared=True,
            )
        except ChatTemplateError as e:
            raise RequestError(400, str(e)) from None
        except Exception as e:
            # A template's own code failed on these messages (a TypeError from
            # `content + 1`, say): the client learns why, as vLLM answers it
            # (400); the operator hears of it, at 1, 2, 4, 8... failures.
            failures = next(self._template_failures)
            if failures & (failures - 1) == 0:
                log_event(logger, logging.WARNING, "chat_template_failed", error=f"{type(e).__name__}: {e}", count=failures)
            raise RequestError(400, f"the chat template failed on these messages: {type(e).__name__}: {e}") from None

    def _too_long(self, what: str) -> RequestError:
        return RequestError(413, f"{what} exceeds --max-prompt-chars={self.max_prompt_chars} characters")

    def _tokenize_payload(self, ids: np.ndarray, return_token_strs: bool, key: str | None) -> bytes:
        """``{"count", "max_model_len", "tokens", "token_strs", "frontend"}`` as orjson writes it,
        the ids' JSON reused from the conversation's last answer where they agree (``IdsJson``)."""
        token_strs = None
        if return_token_strs:
            with self.prompt_ids.tokenizer_lock:  # the tokenizer object's own call
                token_strs = self._tokenizer.convert_ids_to_tokens(ids.tolist())
        head = b'{"count":%d,"max_model_len":%b,"tokens":' % (len(ids), orjson.dumps(self._limits.max_model_len))
        tail = b',"token_strs":%b,"frontend":%d}' % (orjson.dumps(token_strs), self.frontend_id)
        return b"".join((head, *self._ids_json.parts(ids, key), tail))

    def _detokenize_answer(self, body: bytes) -> Answer:
        try:
            request = parse_detokenize_request(body)
            self._limits.check_model(request.model)
            self._limits.check_length(len(request.tokens))
            self._limits.check_ids(request.tokens)
            with self.prompt_ids.tokenizer_lock:  # the tokenizer object's own call
                text = self._tokenizer.decode(request.tokens)
        except Exception as e:
            return _error_answer(e, "detokenize_failed", "detokenization")
        return Answer(200, orjson.dumps({"prompt": text}))


def _error_answer(error: Exception, event: str, work: str) -> Answer:
    """The answer to a request whose ``work`` raised ``error``: a client's
    mistake gets its own status and message, anything else a 500 logged as ``event``."""
    if isinstance(error, RequestError):
        return Answer.of_error(error)
    log_event(logger, logging.ERROR, event, error=f"{type(error).__name__}: {error}")
    return Answer(500, error_body(500, f"{work} failed: {type(error).__name__}"))


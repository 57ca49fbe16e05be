"""The render endpoints' hit path: vLLM's prompt and vLLM's answer bytes, without vLLM's per-request objects.

``RenderHits``, an ASGI middleware in front of vLLM's app, answers
``/v1/chat/completions/render`` and ``/v1/completions/render`` itself when a
request is plain: vLLM's own ``OnlineRenderer`` renders a copy of an already
validated request of the same options with this request's messages or
prompt put in, and the answer is the bytes vLLM's server gave the first
request of those options (a ``Shape``), with the values that change per
request put in; a shape is kept only once proven byte for byte (``_shape``).
Everything else goes to vLLM's app as it came (``_Route.to_vllm``). Why, and
which requests are plain: docs/VLLM.md, "The hit path".
"""

from __future__ import annotations

import contextvars
import copy
import functools
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from mptok.api.asgi import Message, Receive, Scope, Send, read_body, respond

CHAT_PATH = "/v1/chat/completions/render"
COMPLETION_PATH = "/v1/completions/render"
# Request fields the hit path honours: each either reaches vLLM's own rendering on the request copy, or only changes the answer's
# bytes that a shape keeps. Left out (vLLM's path): fields that make the answer depend on the prompt in ways a shape does not keep
# (token reuse from transfer params, token offsets, multimodal, echo, suffix, prompt embeddings, truncation).
_COMMON_FIELDS = frozenset(
    {
        "model", "request_id", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n",
        "stop", "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "length_penalty",
        "logprobs", "prompt_logprobs", "logprob_token_ids", "ignore_eos", "skip_special_tokens",
        "spaces_between_special_tokens", "include_stop_str_in_output", "logit_bias", "bad_words", "allowed_token_ids",
        "response_format", "structured_outputs", "stream", "stream_options", "stream_interval", "user", "priority",
        "cache_salt", "add_special_tokens", "return_token_ids", "return_tokens_as_token_ids", "use_beam_search",
        "thinking_token_budget", "vllm_xargs", "watermarking", "repetition_detection", "routed_experts_prompt_start",
        "session_id", "return_weight_versions",
    }
)  # fmt: skip
CHAT_FIELDS = _COMMON_FIELDS | {
    "messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template", "chat_template_kwargs",
    "add_generation_prompt", "continue_final_message", "documents", "reasoning_effort", "include_reasoning",
    "max_completion_tokens", "top_logprobs", "return_prompt_text",
}  # fmt: skip
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt"}
# Keys of a plain message, by role; every value a string (the assistant's content may be null, its tool calls plain function calls).
_MESSAGE_KEYS = {
    **dict.fromkeys(("system", "developer", "user"), frozenset({"role", "content", "name"})),
    "assistant": frozenset({"role", "content", "name", "tool_calls", "reasoning"}),
    "tool": frozenset({"role", "content", "tool_call_id"}),
}
_TOOL_CALL_KEYS = frozenset({"id", "type", "function"})
_FUNCTION_KEYS = frozenset({"name", "arguments"})
# Shapes kept per process: one per option set clients send (a deployment sends a few).
MAX_SHAPES = 64
# Values put in a shape's holes to find them and to prove them: none can appear elsewhere in an answer.
_PROBES = ({"id": 987_654_321, "max_tokens": 918_273_645, "count": 192_837_465, "request_id": "mptok-probe-a"},
           {"id": 987_654_322, "max_tokens": 918_273_646, "count": 192_837_466, "request_id": "mptok-probe-b"})  # fmt: skip
# A counter in each render process (prometheus_client's multiprocess mode sums them on /metrics).
ANSWERS_METRIC = "mptok_render_answers"

logger = logging.getLogger("vllm.mptok")


def plain_request(chat: bool, headers: dict[bytes, bytes], body: bytes) -> dict[str, Any] | None:
    """The request's JSON when the hit path may answer it (a chat render's when ``chat``, else a completion
    render's); None when it goes to vLLM's app. Cheap: no vLLM object is built."""
    content_type = headers.get(b"content-type", b"").lower().split(b";", 1)[0]
    if content_type != b"application/json" or b"origin" in headers:
        return None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if type(data) is not dict:
        return None
    if chat:
        if not data.keys() <= CHAT_FIELDS or not _normalized_plain(data):
            return None
    elif not data.keys() <= COMPLETION_FIELDS or type(data.get("prompt")) is not str:
        return None
    return data


def plain_messages(messages: Any) -> bool:
    """True when every message is one whose validation by vLLM's request model gives it back unchanged."""
    if type(messages) is not list or not messages:
        return False
    for message in messages:
        if type(message) is not dict:
            return False
        keys = _MESSAGE_KEYS.get(message.get("role"))  # type: ignore[arg-type]
        if keys is None or not message.keys() <= keys:
            return False
        for key, value in message.items():
            if type(value) is str or (key == "content" and value is None and message["role"] == "assistant"):
                continue
            if key != "tool_calls" or not _plain_tool_calls(value):
                return False
        if "content" not in message and message["role"] != "assistant":
            return False
    return True


def _plain_tool_calls(calls: Any) -> bool:
    if type(calls) is not list:
        return False
    for call in calls:
        if type(call) is not dict or call.keys() != _TOOL_CALL_KEYS or call["type"] != "function":
            return False
        function = call["function"]
        if type(call["id"]) is not str or type(function) is not dict or function.keys() != _FUNCTION_KEYS:
            return False
        if type(function["name"]) is not str or type(function["arguments"]) is not str:
            return False
    return True


@dataclass(frozen=True)
class Cut:
    """An answer's bytes cut at its holes: ``pieces`` alternate with the holes named in ``holes``
    (``request_id``, ``ids``, ``max_tokens``, ``count``)."""

    pieces: tuple[bytes, ...]
    holes: tuple[str, ...]

    def answer(self, values: dict[str, bytes]) -> bytes:
        parts = [self.pieces[0]]
        for hole, piece in zip(self.holes, self.pieces[1:]):
            parts.extend((values[hole], piece))
        return b"".join(parts)


@dataclass(frozen=True)
class Shape:
    """vLLM's answers to one option set, cut at the values that change per request.

    ``request`` is vLLM's validated request of these options (its messages
    or prompt replaced per request). vLLM writes ``max_tokens`` elsewhere
    in the answer when it equals ``SamplingParams``' default (it omits
    defaults, then appends that one): ``cuts`` holds a cut for each case
    seen, by whether ``max_tokens`` is the default.
    """

    request: Any
    headers: tuple[tuple[bytes, bytes], ...]
    min_max_tokens: int
    cuts: dict[bool, Cut]


def _hole_values(request_id: str, ids: Any, max_tokens: int | None, count: int | None) -> dict[str, bytes]:
    """What fills each hole: ``max_tokens`` None where the answer holds none (the default's
    place), ``count`` None for a completion (a chat's answer counts the tool calls in its history)."""
    values = {"request_id": orjson.dumps(request_id), "ids": orjson.dumps(ids)}
    if max_tokens is not None:
        values["max_tokens"] = str(max_tokens).encode()
    if count is not None:
        values["count"] = str(count).encode()
    return values


def _cut(body: bytes, values: dict[str, bytes]) -> Cut | None:
    """``body`` cut at each hole's value, which must occur once; None if one does not."""
    at = sorted((body.find(value), hole) for hole, value in values.items() if body.count(value) == 1)
    if len(at) != len(values):
        return None
    pieces, holes, start = [], [], 0
    for position, hole in at:
        pieces.append(body[start:position])
        holes.append(hole)
        start = position + len(values[hole])
    pieces.append(body[start:])
    return Cut(tuple(pieces), tuple(holes))


@dataclass
class _Capture:
    """What vLLM's path made of one request: its validated request and its answer (``GenerateRequest``(s))."""

    request: Any = None
    result: Any = None


_CAPTURE: contextvars.ContextVar[_Capture | None] = contextvars.ContextVar("mptok_render_capture", default=None)


class RenderHits:
    """ASGI middleware: the two render endpoints answered from kept shapes when it can, vLLM's app otherwise."""

    def __init__(self, app: Any, vllm_app: Any) -> None:
        self.app = app
        self._state = vllm_app.state
        self._serving: Any = None
        self._shapes: OrderedDict[bytes, Shape] = OrderedDict()
        from prometheus_client import Counter

        self._answers = Counter(ANSWERS_METRIC, "Render answers by who made them: the hit path or vLLM's app", ["path"])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path")
        if scope.get("type") != "http" or scope.get("method") != "POST" or path not in (CHAT_PATH, COMPLETION_PATH):
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        if body is None:  # the client left before its body ended
            return
        route = _Route(self, scope, body, receive, send)
        if not await route.answered_here():
            await route.to_vllm()

    def serving(self) -> Any:
        """vLLM's ``ServingRender``, with its two render calls wrapped to capture what they make; None if it
        has a setting the hit path does not model."""
        if self._serving is None:
            serving = getattr(self._state, "serving_render", None)
            if serving is None or not _modelled(serving.online_renderer):
                return None
            for name in ("render_chat_request", "render_completion_request"):
                setattr(serving, name, _capturing(getattr(serving, name)))
            self._serving = serving
        return self._serving


class _Route:
    """One request to a render endpoint: answered here from a shape, or by vLLM's app."""

    def __init__(self, hits: RenderHits, scope: Scope, body: bytes, receive: Receive, send: Send):
        self._hits = hits
        self._scope = scope
        self._headers: dict[bytes, bytes] = dict(scope.get("headers") or ())
        self._body = body
        self._receive = receive
        self._send = send
        self._chat = scope["path"] == CHAT_PATH
        self._key: bytes | None = None  # a plain request's endpoint and options (every field but its messages or prompt)

    async def answered_here(self) -> bool:
        data = plain_request(self._chat, self._headers, self._body)
        serving = self._hits.serving() if data is not None else None
        if data is None or serving is None:
            return False
        options = {k: v for k, v in data.items() if k not in ("messages", "prompt")}
        self._key = self._scope["path"].encode() + b" " + orjson.dumps(options, option=orjson.OPT_SORT_KEYS)
        shape = self._hits._shapes.get(self._key)
        if shape is None:
            return False
        self._hits._shapes.move_to_end(self._key)
        answer = await self._render(serving, shape, data)
        if answer is None:
            return False
        self._hits._answers.labels("hit").inc()  # before the answer: a client that reads the counter after it sees it
        await respond(self._send, 200, answer, shape.headers)
        return True

    async def _render(self, serving: Any, shape: Shape, data: dict[str, Any]) -> bytes | None:
        """vLLM's rendering of this request on a copy of the shape's request; None where vLLM's path must answer."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
        from vllm.parser.utils import count_chat_history_tool_calls
        from vllm.renderers.inputs.preprocess import extract_prompt_components, extract_prompt_len
        from vllm.utils import random_uuid

        online = serving.online_renderer
        history_tool_calls = count_chat_history_tool_calls(data["messages"]) if self._chat else 0
        try:
            if self._chat:
                request = shape.request.model_copy(update={"messages": data["messages"]})
                rendered = await online.render_chat(request, skip_mm_cache=True)
                engine_inputs = rendered if isinstance(rendered, ErrorResponse) else rendered[1]
            else:
                request = shape.request.model_copy(update={"prompt": data["prompt"]})
                engine_inputs = await online.render_completion(request, skip_mm_cache=True)
            if isinstance(engine_inputs, ErrorResponse) or len(engine_inputs) != 1:
                return None
            engine_input = engine_inputs[0]
            ids = extract_prompt_components(serving.model_config, engine_input).token_ids
            if not ids or engine_input.get("prompt_token_offsets") is not None or engine_input.get("mm_kwargs"):
                return None
            max_output = request.max_completion_tokens if self._chat and request.max_completion_tokens is not None else request.max_tokens
            max_tokens = get_max_tokens(
                serving.model_config.max_model_len, max_output, extract_prompt_len(serving.model_config, engine_input),
                serving.default_sampling_params, serving.override_max_tokens, truncate_prompt_tokens=request.truncate_prompt_tokens,
            )  # fmt: skip
        except Exception:  # vLLM's path answers it, with vLLM's error
            return None
        cut = shape.cuts.get(max_tokens == _default_max_tokens())
        if max_tokens < shape.min_max_tokens or cut is None:
            return None
        request_id = self._headers.get(b"x-request-id")
        prefix = "chatcmpl-" if self._chat else "cmpl-"
        base = request_id.decode("latin-1") if request_id is not None else data["request_id"] if "request_id" in data else random_uuid()
        ids = ids if type(ids) is list else list(ids)
        return cut.answer(_hole_values(prefix + base, ids, max_tokens, history_tool_calls if self._chat else None))

    async def to_vllm(self) -> None:
        """vLLM's app answers; a 200 answer to a plain request whose options have no shape yet makes one."""
        capture = _Capture() if self._key is not None and self._hits.serving() is not None else None
        token = _CAPTURE.set(capture)
        started: list[Message] = []
        body: list[bytes] = []

        async def send(message: Message) -> None:
            if capture is not None:
                if message["type"] == "http.response.start":
                    started.append(message)
                elif message["type"] == "http.response.body":
                    body.append(message.get("body", b""))
            await self._send(message)

        replayed: list[Message] = [{"type": "http.request", "body": self._body, "more_body": False}]

        async def receive() -> Message:
            return replayed.pop() if replayed else await self._receive()

        self._hits._answers.labels("vllm").inc()
        try:
            await self._hits.app(self._scope, receive, send)
        finally:
            _CAPTURE.reset(token)
        if capture is not None and capture.result is not None and started and started[0]["status"] == 200:
            self._keep(capture, started[0], b"".join(body))

    def _keep(self, capture: _Capture, start: Message, answer: bytes) -> None:
        assert self._key is not None
        shapes = self._hits._shapes
        shape = _shape(self._hits.serving(), capture, start, answer, self._chat, shapes.get(self._key))
        if shape is None:
            logger.debug("mptok render: no shape for %s", self._scope["path"])
            return
        shapes[self._key] = shape
        while len(shapes) > MAX_SHAPES:
            shapes.popitem(last=False)


def _shape(serving: Any, capture: _Capture, start: Message, answer: bytes, chat: bool, kept: Shape | None) -> Shape | None:
    """``kept`` (or a new shape) with the cut of vLLM's answer ``answer`` to ``capture.request``, proven on the
    answer's own values and on two probes; None if it cannot be proven."""
    from vllm.entrypoints.scale_out.render.serving import _hoist_transfer_params
    from vllm.entrypoints.serve.utils.api_utils import create_json_response

    request, result = capture.request, capture.result
    generated = result if chat else (result[0] if isinstance(result, list) and len(result) == 1 else None)
    if generated is None or type(generated).__name__ != "GenerateRequest":
        return None
    headers = tuple((name, value) for name, value in start.get("headers", []) if name.lower() != b"content-length")
    if any(name.lower() == b"x-request-id" for name, _ in headers):
        return None  # vLLM echoes a request id header per request
    default_max_tokens = generated.sampling_params.max_tokens == _default_max_tokens()

    def dumped(probe: dict[str, Any]) -> bytes:
        max_tokens = generated.sampling_params.max_tokens if default_max_tokens else probe["max_tokens"]
        params = request.to_sampling_params(max_tokens, serving.default_sampling_params)
        _hoist_transfer_params(params)
        update: dict[str, Any] = {"request_id": probe["request_id"], "token_ids": [probe["id"]], "sampling_params": params}
        if chat and generated.parse_context is not None:
            update["parse_context"] = generated.parse_context.model_copy(update={"history_tool_call_cnt": probe["count"]})
        filled = generated.model_copy(update=update)
        return bytes(create_json_response(filled if chat else [filled]).body)

    def probe_values(probe: dict[str, Any]) -> dict[str, bytes]:
        max_tokens = None if default_max_tokens else probe["max_tokens"]
        return _hole_values(probe["request_id"], [probe["id"]], max_tokens, probe["count"] if chat else None)

    try:
        real = _hole_values(
            generated.request_id, generated.token_ids, None if default_max_tokens else generated.sampling_params.max_tokens,
            generated.parse_context.history_tool_call_cnt if chat else None,
        )  # fmt: skip
        cut = _cut(dumped(_PROBES[0]), probe_values(_PROBES[0]))
        if cut is None or cut.answer(probe_values(_PROBES[1])) != dumped(_PROBES[1]):
            return None
        if set(cut.holes) != set(real) or cut.answer(real) != answer:
            return None
    except Exception:
        logger.debug("mptok render: a shape could not be proven", exc_info=True)
        return None
    shape = kept if kept is not None and kept.headers == headers else Shape(request, headers, max(1, request.min_tokens or 0), {})
    shape.cuts[default_max_tokens] = cut
    return shape


@functools.cache
def _default_max_tokens() -> int | None:
    from vllm.sampling_params import SamplingParams

    return SamplingParams().max_tokens


def _normalized_plain(data: dict[str, Any]) -> bool:
    """vLLM's own normalization of the messages (``reasoning_content`` renamed), then ``plain_messages``."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    ChatCompletionRequest._normalize_messages_before(data)
    return plain_messages(data.get("messages"))


def _capturing(render: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """``render`` (a ``ServingRender`` method) that also hands its request and result to a capture, if one is set."""

    async def captured(request: Any, *args: Any, **kwargs: Any) -> Any:
        capture = _CAPTURE.get()
        # vLLM may change the request as it renders: the shape keeps it as validated.
        kept = copy.copy(request) if capture is not None else None
        result = await render(request, *args, **kwargs)
        if capture is not None:
            capture.request, capture.result = kept, result
        return result

    return captured


def _modelled(online_renderer: Any) -> bool:
    """True when vLLM's answer depends on a request only as a shape keeps it: no tool or reasoning parser
    (they read the prompt's ids), no Harmony, no Mistral tokenizer."""
    from vllm.utils.mistral import is_mistral_tokenizer

    return (
        online_renderer.parser is None
        and not online_renderer.use_harmony
        and not is_mistral_tokenizer(online_renderer.renderer.tokenizer)
    )

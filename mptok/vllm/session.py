"""A request's session header, seen where vLLM tokenizes its prompt.

vLLM's renderer never sees the HTTP request. So ``SessionHeaders``, a pure
ASGI middleware that ``vllm serve --middleware
mptok.vllm.session.SessionHeaders`` adds to each API server, puts the
header (``mptok.api.affinity.CONVERSATION_HEADERS``) in a ``ContextVar``
for the time of the request, and ``session_id()`` reads it back: in the
request's task, in tasks it starts, and in the renderer's executor thread
(``run_in_context``). Without the middleware, or outside a request, it is
None. A header that cannot be a cache key (``check_key``) names nothing:
the request is served as if it had none, never refused for it.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

from mptok.api.affinity import CONVERSATION_HEADERS, header_conversation_id
from mptok.cache.config import check_key

_T = TypeVar("_T")

_SESSION: contextvars.ContextVar[str | None] = contextvars.ContextVar("mptok_session_id", default=None)
_HEADER_NAMES = frozenset(name.encode("latin-1") for name in CONVERSATION_HEADERS)


class SessionHeaders:
    """ASGI middleware: the request's session header, for ``session_id()``
    while the request runs. Anything but an HTTP request passes untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        token = _SESSION.set(_session_of(scope.get("headers") or ()))
        try:
            await self.app(scope, receive, send)
        finally:
            _SESSION.reset(token)


def session_id() -> str | None:
    """The session id of the request being served here, or None."""
    return _SESSION.get()


def run_in_context(func: Callable[..., _T], executor: Executor) -> Callable[..., Awaitable[_T]]:
    """``func`` run on ``executor`` in a copy of the calling task's context
    (``loop.run_in_executor`` alone runs it in the thread's own context)."""

    def call(*args: Any, **kwargs: Any) -> Awaitable[_T]:
        context = contextvars.copy_context()
        return asyncio.get_running_loop().run_in_executor(executor, functools.partial(context.run, func, *args, **kwargs))

    return call


def _session_of(headers: Any) -> str | None:
    found = {name.lower().decode("latin-1"): value.decode("latin-1") for name, value in headers if name.lower() in _HEADER_NAMES}
    value = header_conversation_id(found.get)
    if value is None:
        return None
    try:
        check_key(value)
    except ValueError:
        return None
    return value

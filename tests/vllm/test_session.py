"""The session header from ``SessionHeaders`` to where vLLM tokenizes: the
request's task, tasks it starts, and an executor thread entered through
``run_in_context``. Needs no vLLM (the middleware is plain ASGI), so it runs
in ``make test`` as well."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from mptok.cache.config import MAX_KEY_BYTES
from mptok.vllm.session import SessionHeaders, run_in_context, session_id


def _serve_once(headers: list[tuple[bytes, bytes]], scope_type: str = "http") -> dict[str, Any]:
    """One request through ``SessionHeaders`` to an app that records where it sees which session id."""
    seen: dict[str, Any] = {}
    executor = ThreadPoolExecutor(1)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen["task"] = session_id()
        seen["child task"] = await asyncio.create_task(_in_task())
        seen["run_in_context"] = await run_in_context(session_id, executor)()
        seen["run_in_executor"] = await asyncio.get_running_loop().run_in_executor(executor, session_id)

    async def _in_task() -> str | None:
        return session_id()

    async def request() -> None:
        await SessionHeaders(app)({"type": scope_type, "headers": headers}, None, None)
        seen["after"] = session_id()

    try:
        asyncio.run(request())
    finally:
        executor.shutdown(wait=True)
    return seen


def test_the_header_reaches_the_task_its_children_and_the_executor_through_run_in_context():
    seen = _serve_once([(b"content-type", b"application/json"), (b"x-session-id", b"agent-7")])
    assert seen == {
        "task": "agent-7",
        "child task": "agent-7",
        "run_in_context": "agent-7",
        # Why the renderer needs run_in_context: an executor thread has its own context.
        "run_in_executor": None,
        "after": None,
    }


def test_x_session_id_wins_over_x_correlation_id_and_an_empty_one_counts_as_absent():
    assert _serve_once([(b"x-correlation-id", b"c"), (b"x-session-id", b"s")])["task"] == "s"
    assert _serve_once([(b"x-session-id", b""), (b"x-correlation-id", b"c")])["task"] == "c"
    assert _serve_once([(b"X-Session-Id", b"mixed case")])["task"] == "mixed case"
    assert _serve_once([])["task"] is None


@pytest.mark.parametrize("value, named", [(b"k" * MAX_KEY_BYTES, True), (b"k" * (MAX_KEY_BYTES + 1), False)])
def test_a_header_longer_than_a_conversation_id_names_nothing(value, named):
    assert (_serve_once([(b"x-session-id", value)])["task"] is not None) is named


def test_what_is_not_an_http_request_passes_untouched():
    assert _serve_once([(b"x-session-id", b"s")], scope_type="websocket")["task"] is None

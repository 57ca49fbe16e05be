"""Admission control of ``mptok serve``, against a real server.

One frontend with one tokenizing thread and room for two requests: a third
is refused at once (503, Retry-After, the error shape); work that waits
longer than --queue-timeout for the thread is not started (503); queued
work whose client has gone is skipped. The overload figures (a burst of 60
long prompts) come from ``make drill``, not from here: no timed assertions.
"""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

from mptok_harness.checks import HANG_GUARD_S
from mptok_harness.conversations import plain_delta
from mptok_harness.raw_http import RawClient, post_head, statuses
from mptok_harness.serve import request, scrape, serving, total, wait_for_snapshots

MAX_IN_FLIGHT = 2
QUEUE_TIMEOUT_S = 0.5
# Long enough (about a second or more here, on `tokenizers`) that requests
# sent meanwhile find the only thread busy; each test uses its own text, so
# never a cache hit.
LONG_PROMPT_CHARS = 1_500_000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # The tokenizers backend: a fast engine tokenizes even the long prompt in
    # milliseconds, and the queue timeout needs a thread busy for longer.
    args = [
        "--frontends", "1", "--threads", "1", "--max-in-flight", str(MAX_IN_FLIGHT),
        "--queue-timeout", str(QUEUE_TIMEOUT_S), "--tokenizer-backend", "tokenizers",
    ]
    yield from serving(tmp_path_factory, "admission", *args)


def text(seed: int, chars: int) -> str:
    rng = random.Random(seed)
    parts, size = [], 0
    while size < chars:
        parts.append(plain_delta(rng, 2000))
        size += len(parts[-1])
    return "".join(parts)[:chars]


def assert_busy(payload: bytes, headers: dict[str, str], says: str) -> None:
    error = json.loads(payload)
    assert error["object"] == "error" and error["code"] == 503 and error["type"] == "ServiceUnavailable", error
    assert says in error["message"], error
    assert headers["retry-after"] == "1"


class Background:
    """One request in a thread: ``result`` is (status, payload, headers) once ``join()`` returns."""

    def __init__(self, port: int, body: dict):
        self.result: tuple[int, bytes, dict[str, str]] | None = None
        self._thread = threading.Thread(target=self._run, args=(port, body), daemon=True)
        self._thread.start()

    def _run(self, port: int, body: dict) -> None:
        self.result = request(port, "POST", "/tokenize", body, timeout_s=HANG_GUARD_S)

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> tuple[int, bytes, dict[str, str]]:
        self._thread.join(HANG_GUARD_S)
        assert self.result is not None
        return self.result


def test_beyond_max_in_flight_a_request_is_refused_at_once(server, tokenizer):
    prompts = [text(100 + i, 300) for i in range(MAX_IN_FLIGHT)]
    bodies = [json.dumps({"prompt": p}).encode() for p in prompts]
    holders = [RawClient(server.port) for _ in bodies]
    try:
        for client, body in zip(holders, bodies):  # each holds a place while its body is being read
            client.send(post_head("/tokenize", len(body)) + body[:10])
        deadline = time.monotonic() + HANG_GUARD_S
        while True:  # until the frontend has read both heads
            status, payload, headers = request(server.port, "POST", "/tokenize", {"prompt": "one more"})
            if status == 503:
                break
            assert status == 200 and time.monotonic() < deadline, (status, payload)
        assert_busy(payload, headers, "--max-in-flight=2")
        # The held requests are served once their bodies arrive, exactly.
        for client, body, prompt in zip(holders, bodies, prompts):
            received = client.send(body[10:]).read_response()
            assert statuses(received) == [200]
            assert json.loads(received.split(b"\r\n\r\n", 1)[1])["tokens"] == tokenizer(prompt)["input_ids"]
    finally:
        for client in holders:
            client.close()


def test_queued_work_times_out_or_is_skipped_when_its_client_left(server, tokenizer):
    before = scrape(server.port)
    long_prompt = text(7, LONG_PROMPT_CHARS)
    running = Background(server.port, {"prompt": long_prompt})
    # Until a request finds the thread busy for --queue-timeout (the long
    # prompt has started): then it is not started, and answered 503.
    while True:
        status, payload, headers = request(server.port, "POST", "/tokenize", {"prompt": text(8, 200)}, timeout_s=HANG_GUARD_S)
        if status == 503:
            break
        assert status == 200 and not running.done, "the long prompt ended before any request had to wait for it"
    assert_busy(payload, headers, "--queue-timeout=0.5")
    # A request whose client leaves while it waits for the thread is never tokenized.
    body = json.dumps({"prompt": text(9, 200_000)}).encode()
    with RawClient(server.port) as client:
        client.send(post_head("/tokenize", len(body)) + body)
        time.sleep(0.1)  # ordering only: the frontend reads the request, then the client leaves
    assert not running.done, "the long prompt ended before the leaving client was queued behind it"
    status, payload, _ = running.join()
    assert status == 200 and json.loads(payload)["tokens"] == tokenizer(long_prompt)["input_ids"]
    wait_for_snapshots()
    after = scrape(server.port)

    def grew(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert grew("mptok_http_requests_total", path="/tokenize", code="499") == 1
    assert grew("mptok_http_requests_total", path="/tokenize", code="503") == 1
    served = grew("mptok_http_requests_total", path="/tokenize", code="200")
    # Tokenized: the long prompt and the probes served before it started; not the one that left.
    assert grew("mptok_tokenize_seconds_count") == served

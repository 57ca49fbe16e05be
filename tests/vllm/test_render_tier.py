"""``mptok render``: vLLM's render server in two processes on one port, answering as one ``vllm launch render``.

One ``mptok render MODEL --frontends 2`` answers every request the render
server's tests send (``render_cases``: agentic chats with tools,
``add_special_tokens`` both ways, ``continue_final_message``, completion and
``/tokenize`` renders, ``/v1/messages/render`` and ``/v1/responses/render``),
each on a new connection, so the kernel spreads them over both processes;
every answer must carry the ids of ``vllm launch render`` without the
switch, and every answer of ``render_cases.ANSWER_CASES`` (sent three times,
so that each option set is answered by the hit path at least once) must be
that server's answer: status, content type, every field and value in order
(a random request id aside). The hit path answers the plain ones, vLLM's app
the others and every bad request, as ``mptok_render_answers_total`` shows;
its check is complete: every field of vLLM's request models it does not
know, and one vLLM may add, sends a request to vLLM's app. Its one ``/metrics`` must show both processes' counters, vLLM's and
mptok's (the keyless agents' later turns hitting, conversations routed
between the processes) and the supervisor's. Then, on the same server:
admission under a burst (503 with Retry-After), a SIGKILLed and a SIGSTOPped
process under load (the other keeps answering with the right ids; the
supervisor's warm spare takes its place and answers within seconds), and a
clean SIGTERM that stops the spare too.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import orjson
import psutil
import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from mptok.render.hits import CHAT_FIELDS, COMPLETION_FIELDS, plain_messages, plain_request

from mptok_harness.serve import request, scrape
from mptok_harness.vllm import MptokRender
from mptok_harness.vllm_requests import text_source

from render_cases import ANSWER_CASES, API_CASES, LATER_TURNS, Answer, answer_every_format, answer_of
from test_plugin import CASES, _mptok_totals, _scraped, _settled_totals

FRONTENDS = 2
# Small, so that a burst fills it; the sequential cases never do.
MAX_IN_FLIGHT = 2
HANG_TIMEOUT_S = 5.0
# A new process (the spare behind one that was used) loads vLLM: a minute of CPU on a busy machine.
BACK_TIMEOUT_S = 180.0
# A warm spare only takes its id, starts routing and listens: about 1.5 s on
# these 2 cores with another load beside the tests. Ten times that leaves room
# for a machine busier than that, and is still far below a cold start (about
# 45 s here, more under load), so a restart that did not use the spare fails.
SPARE_BACK_S = 15.0
# The agents' chats, replayed as load while a process is killed.
LOAD = [name for name in CASES if name.startswith("agent")]


@pytest.fixture(scope="module")
def tier(model_dir: Path, logs_dir: Path, render_plain_ids: dict[str, list[int]]):
    mptok_args = ("--max-in-flight", str(MAX_IN_FLIGHT), "--hang-timeout", str(HANG_TIMEOUT_S))
    with MptokRender(model_dir, logs_dir / "mptok-render.log", frontends=FRONTENDS, mptok_args=mptok_args) as server:
        yield server


@pytest.fixture(scope="module")
def answered(tier: MptokRender) -> dict[str, list[int]]:
    return answer_every_format(tier)


@pytest.mark.parametrize("name", [*CASES, *API_CASES])
def test_every_request_gets_the_ids_of_vllm_launch_render(render_plain_ids, answered, name):
    assert answered[name] == render_plain_ids[name]


# Each answer case is sent this often: a new option set is answered by vLLM's app once per process.
SENDS = FRONTENDS + 1
# Answer cases the hit path leaves to vLLM's app: a field it does not know, content parts, echo, several prompts.
LEFT_TO_VLLM = ("unknown-field", "content-parts", "echo", "several-prompts")


def _answers_by_path(server: MptokRender) -> Counter[str]:
    return Counter({labels["path"]: value for name, labels, value in scrape(server.port) if name == "mptok_render_answers_total"})


@pytest.fixture(scope="module")
def answered_cases(tier: MptokRender, answered) -> dict[str, tuple[list[Answer], Counter[str]]]:
    """Each answer case's answers (sent ``SENDS`` times) and who answered them."""
    cases = {}
    for name, case in ANSWER_CASES.items():
        before = _answers_by_path(tier)
        answers = [answer_of(tier, *case) for _ in range(SENDS)]
        after = _answers_by_path(tier)
        after.subtract(before)
        cases[name] = (answers, after)
    return cases


@pytest.mark.parametrize("name", ANSWER_CASES)
def test_every_answer_is_vllm_launch_renders_field_by_field(render_plain, answered_cases, name):
    answers, by_path = answered_cases[name]
    expected = render_plain.answers[name]
    for answer in answers:
        assert answer == expected
    assert by_path["hit"] + by_path["vllm"] == SENDS, by_path
    if name in LEFT_TO_VLLM or name.startswith("bad-"):
        assert by_path["hit"] == 0, by_path
        assert name.startswith("bad-") == (expected.status != 200)
    else:
        assert expected.status == 200
        assert by_path["hit"] >= 1, by_path


def test_the_hit_path_knows_only_vllms_fields_and_leaves_every_other_to_vllm():
    json_type = {b"content-type": b"application/json"}
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    completion = {"model": "m", "prompt": "x"}
    for fields, model, base, is_chat in ((CHAT_FIELDS, ChatCompletionRequest, chat, True), (COMPLETION_FIELDS, CompletionRequest, completion, False)):
        assert fields <= set(model.model_fields)
        assert plain_request(is_chat, json_type, orjson.dumps(base)) is not None
        for field in set(model.model_fields) - fields | {"a_field_of_a_later_vllm"}:
            assert plain_request(is_chat, json_type, orjson.dumps({**base, field: None})) is None, field
    assert plain_request(True, {**json_type, b"origin": b"http://a"}, orjson.dumps(chat)) is None
    assert plain_request(True, {b"content-type": b"text/plain"}, orjson.dumps(chat)) is None


def test_a_plain_message_is_what_vllms_request_model_makes_of_it():
    """The messages the hit path takes without validating them come out of vLLM's validation unchanged."""
    chats = [body["messages"] for _, body, _ in ANSWER_CASES.values() if isinstance(body, dict) and "messages" in body]
    chats.append([{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}])
    plain = 0
    for messages in chats:
        data = orjson.loads(orjson.dumps({"model": "m", "messages": messages}))
        taken = plain_request(True, {b"content-type": b"application/json"}, orjson.dumps(data))
        if taken is not None:
            plain += 1
            assert ChatCompletionRequest.model_validate(data).messages == taken["messages"]
    assert plain >= len(chats) - 3
    for message in ({"role": "user", "content": "x", "extra": 1}, {"role": "user", "content": 3}, {"role": "tool", "content": "x", "name": "n"},
                    {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]}):  # fmt: skip
        assert not plain_messages([message]), message


def test_the_start_is_one_ready_line_and_every_process_routes(tier, answered):
    log = tier.log()
    assert log.count("event=ready ") == 1, tier.log_tail()
    for frontend in range(FRONTENDS):
        assert f"routing on: API server {frontend} of {FRONTENDS}" in log, tier.log_tail()


def test_one_metrics_shows_every_process_vllms_series_and_mptoks_hits(tier, answered):
    _scraped(tier, "mptok_cache_hits_total", LATER_TURNS)
    # Each process copies its counters every 0.5 s: a routed prompt's two ends are compared once they agree.
    totals = _settled_totals(tier)
    # Keyless agents' later turns hit, on whichever process holds them.
    assert sum(totals["mptok_cache_hits_total"].values()) >= LATER_TURNS, totals
    assert set(totals["mptok_prompts_total"]) == {str(i) for i in range(FRONTENDS)}, totals
    assert sum(totals["mptok_routed_total"].values()) > 0, totals
    assert sum(totals["mptok_served_total"].values()) == sum(totals["mptok_routed_total"].values()), totals
    text = _metrics_text(tier)
    # vLLM's own series, summed over the processes (prometheus_client's multiprocess mode).
    assert re.search(r'^http_requests_total\{.*handler="/v1/chat/completions/render".*\} \d', text, re.M), text[:3000]
    for frontend in range(FRONTENDS):
        assert f'mptok_frontend_up{{frontend="{frontend}"}} 1' in text
    # Each process names the one engine of its short texts and of its long ones (auto's choice at its start).
    chosen = [
        (labels["api_server"], labels["texts"])
        for name, labels, value in scrape(tier.port)
        if name == "mptok_tokenizer_engine" and value == 1
    ]
    assert sorted(chosen) == [(str(f), texts) for f in range(FRONTENDS) for texts in ("long", "short")], chosen


def test_a_full_process_answers_503_with_retry_after_at_once(tier):
    piece = text_source(7)
    # Fresh long prompts (nothing to hit), many at once: more than MAX_IN_FLIGHT per process.
    bodies = [{"model": tier.model, "prompt": piece(200_000)} for _ in range(6 * FRONTENDS * MAX_IN_FLIGHT)]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda body: request(tier.port, "POST", "/tokenize", body, timeout_s=120), bodies))
    statuses = Counter(status for status, _, _ in answers)
    assert set(statuses) <= {200, 503} and statuses[503] > 0 and statuses[200] > 0, statuses
    for status, payload, headers in answers:
        if status == 503:
            assert headers["retry-after"] == "1"
            assert json.loads(payload)["error"]["code"] == 503


def _metrics_text(server: MptokRender) -> str:
    status, payload, _ = request(server.port, "GET", "/metrics")
    assert status == 200
    return payload.decode()


class _Load:
    """Agents' turns sent over and over from two threads, each on a new connection, until ``stop()``;
    every 200 answer's ids are checked against vLLM's own."""

    def __init__(self, server: MptokRender, expected: dict[str, list[int]]):
        self._server = server
        self._expected = expected
        self._stop = threading.Event()
        self.answered: list[float] = []  # monotonic time of each right answer
        self.wrong: list[str] = []
        self.failed = Counter[str]()
        self._threads = [threading.Thread(target=self._run, args=(n,), daemon=True) for n in range(2)]

    def __enter__(self) -> _Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _run(self, n: int) -> None:
        turn = n
        while not self._stop.is_set():
            name = LOAD[turn % len(LOAD)]
            turn += 2
            _, body = CASES[name]
            try:
                status, payload, _ = request(
                    self._server.port, "POST", "/v1/chat/completions/render", {"model": self._server.model, **body}, timeout_s=10
                )
            except OSError as e:  # a connection the killed or stopped process held
                self.failed[type(e).__name__] += 1
                continue
            if status != 200:
                self.failed[str(status)] += 1
                continue
            if json.loads(payload)["token_ids"] != self._expected[name]:
                self.wrong.append(name)
            self.answered.append(time.monotonic())

    def answered_after(self, moment: float) -> int:
        return sum(1 for t in self.answered if t > moment)


def _poll(what: str, server: MptokRender, timeout_s: float, probe):
    """Seconds until ``probe()`` is true, polled every 0.1 s (a scrape that lands on a dying process is retried)."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        try:
            if probe():
                return time.monotonic() - began
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{what} not within {timeout_s} s:\n{server.log_tail()}")


def _prompts(server: MptokRender, frontend: int) -> float:
    """Prompts frontend ``frontend``'s processes answered through mptok (counters survive their processes)."""
    return _mptok_totals(server).get("mptok_prompts_total", {}).get(str(frontend), 0.0)


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_a_killed_or_stopped_process_is_back_within_seconds_and_the_other_keeps_answering(
    tier, render_plain_ids, answered, fault
):
    frontend = 0 if fault == "SIGKILL" else 1
    # The spare is built after start-up, and again after each use: as long as a start.
    _poll("a warm spare", tier, BACK_TIMEOUT_S, lambda: _mptok_totals(tier)["mptok_frontend_spares"][""] >= 1)
    pid = tier.frontend_pids()[frontend]
    # A stopped process is only replaced once it has missed its heartbeats for --hang-timeout.
    bound_s = SPARE_BACK_S + (HANG_TIMEOUT_S if fault == "SIGSTOP" else 0.0)
    with _Load(tier, render_plain_ids) as load:
        time.sleep(2)
        os.kill(pid, getattr(signal, fault))
        faulted = time.monotonic()
        ready_s = _poll(f"frontend {frontend} ready", tier, bound_s, lambda: tier.frontend_pids()[frontend] != pid)
        answered_before = _prompts(tier, frontend)
        # The new process's own answers: its frontend's counter grows again.
        answering_s = ready_s + _poll(
            f"frontend {frontend} answering", tier, bound_s - ready_s, lambda: _prompts(tier, frontend) > answered_before
        )
        time.sleep(2)
    assert not load.wrong, load.wrong
    # The other process answered while this one was down.
    assert load.answered_after(faulted) >= 3, (load.failed, tier.log_tail())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    event = "frontend_exited" if fault == "SIGKILL" else "frontend_hung"
    log = tier.log()
    assert re.search(rf"event={event} frontend={frontend} pid={pid}\b", log), tier.log_tail()
    new_pid = tier.frontend_pids()[frontend]
    assert re.search(rf'event=frontend_started frontend={frontend} pid={new_pid} .*start="warm spare"', log), tier.log_tail()
    print(f"{fault}: ready after {ready_s:.1f} s, answering after {answering_s:.1f} s; failures while down: {dict(load.failed)}")


def test_sigterm_stops_every_process_and_spare_and_removes_the_ipc_dir(tier):
    _poll("a warm spare", tier, BACK_TIMEOUT_S, lambda: _mptok_totals(tier)["mptok_frontend_spares"][""] >= 1)
    assert tier.process is not None
    children = psutil.Process(tier.process.pid).children()
    pids = [child.pid for child in children if "resource_tracker" not in " ".join(child.cmdline())]
    assert len(pids) == FRONTENDS + 1, pids  # the spare beside the frontends
    ipc_dir = re.search(r"event=ready .*ipc_dir=(\S+)", tier.log()).group(1)  # type: ignore[union-attr]
    tier.process.send_signal(signal.SIGTERM)
    assert tier.process.wait(60) == 0, tier.log_tail()
    log = tier.log()
    assert "event=stopped" in log
    stopped = re.findall(r"event=frontend_stopped frontend=(\S+) pid=\d+ exit=(.*)", log)
    assert sorted(frontend for frontend, _ in stopped) == [*map(str, range(FRONTENDS)), "spare"], stopped
    assert all(exit == '"code 0"' for _, exit in stopped), stopped
    assert not any(psutil.pid_exists(pid) for pid in pids), pids
    assert not os.path.exists(ipc_dir)
    assert ipc_dir.startswith(tempfile.gettempdir())

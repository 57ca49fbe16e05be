"""SGLang with ``mptok sglang`` against SGLang with the plugin installed but off: the same ids, routed, bounded faults.

Two servers, one after the other, each with two tokenizer workers. The
first is ``python -m sglang.launch_server`` in the environment where the
plugin is installed: SGLang loads it and it registers nothing, so no code
of mptok is on any path (its log shows the plugin run and no hook of it
applied); its answers are stock SGLang's and give every expected id. The
second is ``mptok sglang`` with the same arguments: every request of
``CASES`` must get the same ids (``/v1/tokenize`` with a prompt and with
messages, ``/generate``'s prompt ids, a chat's ``usage.prompt_tokens``),
keyless chats' later turns must hit wherever they land, and a worker
SIGKILLed under load must cost no wrong and no lost answer (a request
whose connection the dying worker held is sent again, as a client does).
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections import Counter, defaultdict
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import psutil
import pytest

from mptok_harness.serve import request, scrape, settled
from mptok_harness.sglang import SglangServer
from mptok_harness.vllm_requests import AWKWARD, TOOLS, agent_turns, text_source

AGENTS = 3
TURNS = 6
WORKERS = 2
KILL_BACK_S = 240.0


def _cases() -> dict[str, tuple[str, Any]]:
    """Every request, by name: (kind, body or text)."""
    cases: dict[str, tuple[str, Any]] = {}
    for turn in range(TURNS):
        for agent in range(AGENTS):
            messages = list(agent_turns(agent, TURNS))[turn]
            cases[f"agent{agent}-turn{turn}"] = ("tokenize", {"messages": messages, "tools": TOOLS})
    piece = text_source(99)
    chat = [{"role": "user", "content": piece(2000)}, {"role": "assistant", "content": piece(600)}, {"role": "user", "content": piece(900)}]
    cases["tokenize-messages-no-tools"] = ("tokenize", {"messages": chat})
    cases["tokenize-messages-no-generation-prompt"] = ("tokenize", {"messages": chat, "add_generation_prompt": False})
    cases["tokenize-messages-awkward"] = ("tokenize", {"messages": [{"role": "user", "content": " ".join(AWKWARD * 40) + piece(500)}]})
    prompt = piece(3000)
    cases["tokenize-prompt"] = ("tokenize", {"prompt": prompt})
    cases["tokenize-prompt-longer"] = ("tokenize", {"prompt": prompt + piece(400)})
    cases["tokenize-prompt-no-special-tokens"] = ("tokenize", {"prompt": prompt + piece(200), "add_special_tokens": False})
    cases["tokenize-prompt-list"] = ("tokenize", {"prompt": [prompt, piece(300)]})
    cases["tokenize-prompt-empty"] = ("tokenize", {"prompt": ""})
    cases["generate"] = ("generate", prompt + piece(100))
    cases["generate-longer"] = ("generate", prompt + piece(100) + piece(700))
    cases["chat-usage"] = ("chat", {"messages": chat})
    cases["chat-usage-tools"] = ("chat", {"messages": list(agent_turns(7, 3))[2], "tools": TOOLS})
    return cases


CASES = _cases()


def _answer(server: SglangServer, name: str) -> Any:
    kind, body = CASES[name]
    if kind == "tokenize":
        return server.tokenize_ids(body)
    if kind == "generate":
        return server.generate_ids(body)
    return server.chat_prompt_tokens(body)


@pytest.fixture(scope="module")
def plugin_off(model_dir: Path, logs_dir: Path) -> tuple[str, dict[str, Any], str]:
    """Stock SGLang with the plugin installed: its log, its answer to every case, and its /metrics."""
    server = SglangServer(model_dir, logs_dir / "off.log", mptok=False, workers=WORKERS)
    try:
        server.start()
        answers = {name: _answer(server, name) for name in CASES}
        status, metrics, _ = request(server.port, "GET", "/metrics")
        assert status == 200
        return server.log(), answers, metrics.decode()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def switched(model_dir: Path, logs_dir: Path, plugin_off):
    """``mptok sglang``, its answers to every case, and mptok's totals after them."""
    # Routing "always": every turn goes to its conversation's owner, so the
    # seat and hit tests below see each worker route (by default a worker
    # asks the owner once per conversation and then extends its own copy).
    server = SglangServer(model_dir, logs_dir / "mptok.log", mptok=True, workers=WORKERS, env={"MPTOK_ROUTING": "always"})
    try:
        server.start()
        answers = {name: _answer(server, name) for name in CASES}
        yield server, answers, _settled_totals(server)
    finally:
        server.stop()


def _mptok_totals(server: SglangServer) -> dict[str, dict[str, float]]:
    """mptok's series by name, then by tokenizer_worker label (other labels summed)."""
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for name, labels, value in scrape(server.port):
        if name.startswith("mptok_"):
            totals[name][labels.get("tokenizer_worker", "")] += value
    return {name: dict(by_seat) for name, by_seat in totals.items()}


def _settled_totals(server: SglangServer) -> dict[str, dict[str, float]]:
    return settled(lambda: _mptok_totals(server))


def test_installed_but_off_the_plugin_starts_nothing(plugin_off):
    """The plugin is installed where the server runs (SGLang runs it in every process), and it started nothing."""
    log, _, metrics = plugin_off
    assert "mptok" in {entry.name for entry in entry_points(group="sglang.srt.plugins")}
    assert "mptok is on" not in log
    assert "sglang:" in metrics and "mptok_" not in metrics


@pytest.mark.parametrize("name", list(CASES))
def test_every_request_gets_stock_sglangs_ids(plugin_off, switched, name):
    _, expected, _ = plugin_off
    _, answers, _ = switched
    assert answers[name] == expected[name]


def test_each_worker_claims_its_own_seat_and_routes(switched):
    server, _, _ = switched
    seats = re.findall(r"mptok is on \(mptok sglang\).*routing on: tokenizer worker (\d+) of 2", server.log())
    assert sorted(seats) == ["0", "1"], server.log_tail()


def test_keyless_chats_hit_on_whichever_worker_their_turns_land(switched):
    """Every agent turn after the first can hit; turns landing on the other worker are routed to the owner."""
    _, _, totals = switched
    can_hit = AGENTS * (TURNS - 1)
    hits = sum(totals.get("mptok_cache_hits_total", {}).values())
    routed = sum(totals.get("mptok_routed_total", {}).values())
    print(f"hits {hits:.0f} (agents' turns that can hit: {can_hit}), routed {routed:.0f}")
    assert hits >= 0.9 * can_hit, totals
    assert routed >= 1, totals


def test_a_killed_worker_costs_no_wrong_and_no_lost_answer(switched, plugin_off):
    server, _, _ = switched
    _, expected, _ = plugin_off
    load = [name for name in CASES if name.startswith("agent")]
    before = server.worker_pids()
    assert len(before) == WORKERS, before
    wrong: list[str] = []
    retried = Counter[str]()
    answered = [0]
    stop = threading.Event()

    def client(n: int) -> None:
        turn = n
        while not stop.is_set():
            name = load[turn % len(load)]
            turn += 2
            for attempt in range(5):
                try:
                    status, payload, _ = request(
                        server.port, "POST", "/v1/tokenize", {"model": server.model, **CASES[name][1]}, timeout_s=60
                    )
                except OSError as e:  # a connection the killed worker held: sent again
                    retried[type(e).__name__] += 1
                    continue
                if status == 200:
                    break
                retried[str(status)] += 1
            else:
                wrong.append(f"{name}: lost")
                continue
            if json.loads(payload)["tokens"] != expected[name]:
                wrong.append(name)
            answered[0] += 1

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(2)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(2)
        victim = before[0]
        os.kill(victim, signal.SIGKILL)
        killed_at, answered_at_kill = time.monotonic(), answered[0]
        while time.monotonic() - killed_at < KILL_BACK_S:
            now = server.worker_pids()
            if len(now) == WORKERS and victim not in now:
                break
            time.sleep(0.5)
        back_s = time.monotonic() - killed_at
        # The new worker starts, claims the seat the dead one held, and answers.
        deadline = time.monotonic() + KILL_BACK_S
        while server.log().count("mptok is on (mptok sglang)") < WORKERS + 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(3)
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
    print(f"worker back after {back_s:.1f} s; answered {answered[0]} ({answered[0] - answered_at_kill} after the kill); retried {dict(retried)}")
    assert not wrong, wrong
    assert answered[0] > answered_at_kill
    assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE
    seats = re.findall(r"mptok is on \(mptok sglang\).*routing on: tokenizer worker (\d+) of 2", server.log())
    assert len(seats) == WORKERS + 1 and sorted(set(seats)) == ["0", "1"], server.log_tail()

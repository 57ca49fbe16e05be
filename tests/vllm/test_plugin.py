"""vLLM with ``--tokenizer-mode mptok`` against vLLM without it: the same ids, one cache, bounded faults.

One ``vllm serve`` without the switch answers every request of ``CASES``
first and is stopped; then one with the switch (two API servers, on an
empty engine memo: a machine's first start) answers the same requests, and
must give every one the same ``token_ids``; a later start of it must hit
on as many turns. The
same server then shows the routing and counters on its ``/metrics``, and
serves through a SIGSTOPped API server. Expected ids always come from vLLM
itself without the switch, never from mptok. The requests that carry a
session header come last, so that the counters they move are measured
alone.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from mptok.api.affinity import chat_identity
from mptok.front.catalogue import PROCESS_LABEL, SERVE, SUPERVISOR_METRICS, VLLM, exported_by
from mptok.routing.router import owner_of
from mptok_harness.serve import Server, request, scrape, settled
from mptok_harness.vllm import VllmServer
from mptok_harness.vllm_requests import AWKWARD, TOOLS, agent_turns, text_source

AGENTS = 3
TURNS = 8
SESSION_TURNS = 5
SESSION_HEADER = "X-Session-Id"


def _session_owned_by(rank: int) -> str:
    """A session id whose owner is API server ``rank`` of 2."""
    return next(f"session-{n}" for n in range(1000) if owner_of(f"session-{n}", 2) == rank)


def _cases() -> dict[str, tuple[str, dict[str, Any]]]:
    """Every request, by name: (endpoint kind, body)."""
    cases: dict[str, tuple[str, dict[str, Any]]] = {}
    # Agentic chats with tools; their turns interleaved, as agents run at once.
    for turn in range(TURNS):
        for agent in range(AGENTS):
            messages = list(agent_turns(agent, TURNS))[turn]
            cases[f"agent{agent}-turn{turn}"] = ("chat", {"messages": messages, "tools": TOOLS, "tool_choice": "none"})
    piece = text_source(99)
    chat = [{"role": "user", "content": piece(2000)}, {"role": "assistant", "content": piece(600)}, {"role": "user", "content": piece(900)}]
    cases["chat-no-tools"] = ("chat", {"messages": chat})
    cases["chat-add-special-tokens"] = ("chat", {"messages": chat, "add_special_tokens": True})
    cases["chat-no-generation-prompt"] = ("chat", {"messages": chat, "add_generation_prompt": False})
    cases["chat-template-kwargs"] = ("chat", {"messages": chat, "chat_template_kwargs": {"thinking": True}})
    partial = [*chat, {"role": "assistant", "content": "Let me look at " + piece(300)}]
    cases["chat-continue-final-message"] = (
        "chat", {"messages": partial, "continue_final_message": True, "add_generation_prompt": False}
    )
    cases["chat-awkward-text"] = ("chat", {"messages": [{"role": "user", "content": " ".join(AWKWARD * 40) + piece(500)}]})
    cases["chat-short"] = ("chat", {"messages": [{"role": "user", "content": "hi"}]})
    prompt = piece(3000)
    cases["completion"] = ("completion", {"prompt": prompt})
    cases["completion-longer"] = ("completion", {"prompt": prompt + piece(400)})
    cases["completion-no-special-tokens"] = ("completion", {"prompt": prompt + piece(200), "add_special_tokens": False})
    cases["completion-truncated"] = ("completion", {"prompt": prompt, "truncate_prompt_tokens": 100})
    # Offsets: vLLM's own path (mptok's ids carry none).
    cases["completion-offsets"] = ("completion", {"prompt": prompt + piece(50), "return_token_offsets": True})
    cases["chat-offsets"] = ("chat", {"messages": chat, "return_token_offsets": True})
    cases["tokenize-prompt"] = ("tokenize", {"prompt": prompt + piece(100)})
    cases["tokenize-prompt-no-special-tokens"] = ("tokenize", {"prompt": prompt, "add_special_tokens": False})
    cases["tokenize-messages"] = ("tokenize", {"messages": chat, "tools": TOOLS, "tool_choice": "none"})
    cases["tokenize-messages-continue"] = (
        "tokenize", {"messages": partial, "continue_final_message": True, "add_generation_prompt": False}
    )
    return cases


def _session_cases() -> tuple[dict[str, tuple[str, dict[str, Any]]], dict[str, str]]:
    """Requests with a session header, by name, and each one's session id:
    two chats with the same first messages under two sessions (owned by API
    servers 0 and 1), their turns interleaved, and a completion prompt that
    grows under a third session."""
    cases: dict[str, tuple[str, dict[str, Any]]] = {}
    sessions: dict[str, str] = {}
    first_messages = list(agent_turns(10, 1))[0][:2]
    chats = {_session_owned_by(0): list(agent_turns(11, SESSION_TURNS)), _session_owned_by(1): list(agent_turns(12, SESSION_TURNS))}
    for turn in range(SESSION_TURNS):
        for n, (session, turns) in enumerate(chats.items()):
            name = f"session{n}-turn{turn}"
            cases[name] = ("chat", {"messages": first_messages + turns[turn][2:]})
            sessions[name] = session
    piece = text_source(98)
    prompt = piece(3000)
    for name, text in (("session-completion", prompt), ("session-completion-longer", prompt + piece(500))):
        cases[name] = ("completion", {"prompt": text})
        sessions[name] = "session-completion"
    return cases, sessions


SESSION_CASES, SESSIONS = _session_cases()
CASES = {**_cases(), **SESSION_CASES}


def _ids(server: VllmServer, kind: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> list[int]:
    if kind == "chat":
        return server.chat_ids(body, headers=headers)
    if kind == "completion":
        return server.completion_ids(body, headers=headers)
    return server.tokenize_ids(body)


def _case_ids(server: VllmServer, name: str) -> list[int]:
    """The ids of case ``name``, sent with its session header if it has one."""
    headers = {SESSION_HEADER: SESSIONS[name]} if name in SESSIONS else None
    return _ids(server, *CASES[name], headers=headers)


def _answer_all(server: VllmServer) -> dict[str, list[int]]:
    return {name: _case_ids(server, name) for name in CASES}


@pytest.fixture(scope="module")
def plain_ids(model_dir: Path, logs_dir: Path) -> dict[str, list[int]]:
    with VllmServer(model_dir, logs_dir / "plain.log", mptok=False) as server:
        return _answer_all(server)


@pytest.fixture(scope="module")
def engine_memo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An engine memo of the module's own, empty until the first server with
    the switch starts: that start is a machine's first (it checks and times
    the engines and keeps the verdict), the hardest start for routing."""
    return {"MPTOK_ENGINE_MEMO": str(tmp_path_factory.mktemp("engine-memo"))}


@pytest.fixture(scope="module")
def switched(model_dir: Path, logs_dir: Path, plain_ids: dict[str, list[int]], engine_memo: dict[str, str]):
    """The server with the switch, its ids for every case, and mptok's totals
    before and after the session cases (which it answers last)."""
    with VllmServer(model_dir, logs_dir / "mptok.log", mptok=True, env=engine_memo) as server:
        ids = {name: _case_ids(server, name) for name in CASES if name not in SESSION_CASES}
        before = _settled_totals(server)
        ids.update((name, _case_ids(server, name)) for name in SESSION_CASES)
        yield server, ids, (before, _settled_totals(server))


def _mptok_totals(server: VllmServer) -> dict[str, dict[str, float]]:
    """mptok's series by name (summed over their labels but api_server), and by name with
    those labels (``mptok_prompts_total{identity="keyed"}``); then by api_server label."""
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for name, labels, value in scrape(server.port):
        if name.startswith("mptok_"):
            rank = labels.pop("api_server", "")
            totals[name][rank] += value
            if labels:
                totals[name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"][rank] += value
    return {name: dict(by_rank) for name, by_rank in totals.items()}


def _scraped(server: VllmServer, series: str, at_least: float, timeout_s: float = 10.0) -> dict[str, dict[str, float]]:
    """The totals once ``series`` summed over API servers reaches ``at_least`` (counters are copied every 0.5 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        totals = _mptok_totals(server)
        if sum(totals.get(series, {}).values()) >= at_least or time.monotonic() > deadline:
            return totals
        time.sleep(0.25)


def _settled_totals(server: VllmServer, timeout_s: float = 10.0) -> dict[str, dict[str, float]]:
    """The totals once two scrapes a sync interval apart agree (counters are copied every 0.5 s)."""
    return settled(lambda: _mptok_totals(server), timeout_s)


@pytest.mark.parametrize("name", list(CASES))
def test_every_request_gets_the_ids_vllm_gives_without_the_switch(plain_ids, switched, name):
    _, mptok_ids, _ = switched
    assert mptok_ids[name] == plain_ids[name]


def test_the_start_log_says_mptok_is_on_with_backend_limits_and_routing(switched):
    server, _, _ = switched
    log = server.log()
    assert log.count("mptok is on (--tokenizer-mode mptok)") == 2, server.log_tail()
    for rank in (0, 1):
        assert f"routing on: API server {rank} of 2" in log
    # The engines the cache's backend choice settled on (short and long texts), the choice and its timing.
    engine = "(fastokens|gigatoken|tokenizers)"
    assert re.search(
        rf"backend {engine}, {engine} for texts of [\d,]+ characters or more \(chosen from '(auto|fastokens|gigatoken|tokenizers)': ",
        log,
    ), server.log_tail()
    assert "cache max_bytes=" in log


def test_each_api_server_names_the_engines_of_its_start_on_metrics(switched):
    server, _, _ = switched
    chosen = {
        (labels["api_server"], labels["texts"]): labels["engine"]
        for name, labels, value in scrape(server.port)
        if name == "mptok_tokenizer_engine" and value == 1
    }
    assert sorted(chosen) == [(rank, texts) for rank in ("0", "1") for texts in ("long", "short")], chosen
    # The long texts' engine the start log names was loaded at start: no
    # prompt here is long, so the short texts' engine would stand in for it
    # until the first one.
    started = set(re.findall(r"backend (\w+), (\w+) for texts of", server.log()))
    assert len(started) == 1, started
    [(short, longer)] = started
    assert chosen == {(rank, texts): name for rank in ("0", "1") for texts, name in (("short", short), ("long", longer))}


def test_turns_landing_on_both_api_servers_are_served_by_one_cache(switched):
    server, _, _ = switched
    totals = _scraped(server, "mptok_routed_total", 1)
    prompts = totals["mptok_prompts_total"]
    assert set(prompts) == {"0", "1"} and all(v > 0 for v in prompts.values()), prompts
    assert sum(totals["mptok_routed_total"].values()) > 0, totals
    # Not one served per routed: an asker answers a prompt it already holds the
    # owner's ids for without a call, and an owner may be asked twice for one.
    assert sum(totals["mptok_served_total"].values()) > 0, totals
    assert sum(totals["mptok_cache_hits_total"].values()) > 0, totals
    # Each agent's later turns extended its earlier ones in its owner's cache.
    assert sum(totals["mptok_cache_hits_total"].values()) >= AGENTS * (TURNS - 2)


@pytest.fixture(scope="module")
def later_start(model_dir: Path, logs_dir: Path, switched, engine_memo: dict[str, str]):
    """The server with the switch started again on the engine memo its first start kept
    (a later start on the machine), answering the same cases but the session ones; its log and totals."""
    with VllmServer(model_dir, logs_dir / "mptok-later.log", mptok=True, env=engine_memo) as server:
        for name in CASES:
            if name not in SESSION_CASES:
                _case_ids(server, name)
        return server.log(), _settled_totals(server)


def test_a_machines_first_start_hits_as_a_later_start_does(switched, later_start):
    """The first start decides the engines (timing them for seconds) while the
    other API server waits for its verdict; neither may route worse for it."""
    server, _, (first, _) = switched
    later_log, later = later_start
    assert "decided at this start, kept in the engine memo" in server.log(), server.log_tail()
    assert "decided at this start" not in later_log and "from the engine memo" in later_log
    first_hits, later_hits = (sum(totals["mptok_cache_hits_total"].values()) for totals in (first, later))
    assert later_hits >= AGENTS * (TURNS - 2), later
    assert first_hits >= later_hits - 1, (first, later)


def test_a_session_header_names_the_conversation_as_mptok_serve_does(switched):
    """Two chats with the same first messages under two session ids are two
    conversations, each kept by its session's owner whichever API server its
    turns reached; without the header they would be one name, one owner."""
    server, _, (before, after) = switched

    def grown(series: str) -> dict[str, float]:
        return {rank: after.get(series, {}).get(rank, 0) - before.get(series, {}).get(rank, 0) for rank in ("0", "1")}

    assert sum(grown('mptok_prompts_total{identity="keyed"}').values()) == len(SESSION_CASES)
    assert sum(grown('mptok_prompts_total{identity="derived"}').values()) == 0
    owners = Counter(str(owner_of(session, 2)) for session in set(SESSIONS.values()))
    entries = grown("mptok_cache_entries")
    # Every session is kept by its owner. An API server keeps a copy of a
    # session it does not own only where it tokenized a turn itself (the
    # owner was too slow on a loaded machine) or kept the owner's answer
    # (the default policy, where there is room). Those are counted, so the
    # copies are bounded by them.
    copies_made = {
        rank: grown("mptok_route_fallbacks_total")[rank]
        + grown("mptok_routed_copies_kept_total")[rank]
        for rank in ("0", "1")
    }
    for rank in ("0", "1"):
        assert owners[rank] <= entries[rank] <= owners[rank] + copies_made[rank], (entries, owners, before, after)
    assert sum(grown("mptok_routed_total").values()) > 0, (before, after)
    assert sum(grown("mptok_cache_hits_total").values()) >= 2 * (SESSION_TURNS - 2)


def test_metrics_show_tokens_through_mptok_and_through_vllm(switched):
    server, _, _ = switched
    totals = _scraped(server, "mptok_prompt_tokens_total", 1)
    assert sum(totals["mptok_prompt_tokens_total"].values()) > 0
    # The requests for offsets go down vLLM's own path.
    assert sum(totals["mptok_direct_prompts_total"].values()) >= 2
    assert sum(totals["mptok_cache_max_bytes"].values()) > 0


def test_a_stopped_api_server_never_holds_up_the_other(switched, plain_ids):
    """SIGSTOP the owner of an agent's conversation; the other API server's answers
    come within the route timeout and carry vLLM's ids; the stopped server's own
    connections wait for it (the kernel gave them to it), so they are let go."""
    server, _, _ = switched
    pids = server.api_server_pids()
    agent = 0
    turn_messages = list(agent_turns(agent, TURNS))
    key = chat_identity(turn_messages[0])
    owner = owner_of(key, 2)
    names = [f"agent{agent}-turn{turn}" for turn in range(TURNS)]
    before = _mptok_totals(server)
    stopped_fallbacks = sum(before.get(STOPPED_FALLBACKS, {}).values())
    pool = concurrent.futures.ThreadPoolExecutor(8)
    os.kill(pids[owner], signal.SIGSTOP)
    try:
        futures = {pool.submit(_timed_chat, server, CASES[name][1]): name for name in names * 2}
        done, _ = concurrent.futures.wait(futures, timeout=60)
        answered = [(futures[f], *f.result()) for f in done if f.exception() is None]
    finally:
        os.kill(pids[owner], signal.SIGCONT)
    concurrent.futures.wait(futures, timeout=60)
    pool.shutdown(wait=True)
    assert answered, "no request reached the API server that was not stopped"
    for name, ids, seconds in answered:
        assert ids == plain_ids[name], name
        assert seconds < 20.0, (name, seconds)  # the route timeout is 5 s; a hang would be the 60 s guard
    # The other API server answered without the stopped owner: it skipped it
    # (a "stopped" fallback), or it extended the copy of the conversation it
    # keeps from earlier turns (kept here: no call, no look at the owner).
    after = _settled_totals(server)
    skipped = sum(after.get(STOPPED_FALLBACKS, {}).values()) - stopped_fallbacks
    kept_here = sum(after.get(KEPT_HERE, {}).values()) - sum(before.get(KEPT_HERE, {}).values())
    assert skipped > 0 or kept_here > 0, after


STOPPED_FALLBACKS = 'mptok_route_fallbacks_total{reason="stopped"}'
KEPT_HERE = "mptok_kept_here_total"


def _timed_chat(server: VllmServer, body: dict[str, Any]) -> tuple[list[int], float]:
    started = time.monotonic()
    ids = server.chat_ids(body, timeout_s=60)
    return ids, time.monotonic() - started



def _families(port: int) -> dict[str, tuple[str, str]]:
    """The mptok families a /metrics declares: name -> (type, help)."""
    status, payload, _ = request(port, "GET", "/metrics")
    assert status == 200
    helps, families = {}, {}
    for line in payload.decode().splitlines():
        if line.startswith("# HELP mptok_"):
            _, _, name, text = line.split(" ", 3)
            helps[name] = text
        elif line.startswith("# TYPE mptok_"):
            _, _, name, kind = line.split()
            if not name.endswith("_created"):  # prometheus_client's own, outside multiprocess mode
                families[name] = (kind, helps[name])
    return families


def _label_names(port: int, process_label: str) -> dict[str, set[str]]:
    """Every mptok sample's family and its label names but ``process_label``."""
    names: dict[str, set[str]] = defaultdict(set)
    for name, labels, _ in scrape(port):
        family = re.sub(r"_(bucket|sum|count)$", "", name) if "le" in labels or name.endswith(("_sum", "_count")) else name
        if family.startswith("mptok_"):
            names[family] |= set(labels) - {process_label, "le"}
    return names


def test_mptok_serve_and_the_plugin_export_the_catalogue_alike(switched, tmp_path):
    """A real mptok serve and vLLM with the switch: the families each declares are the
    catalogue's (name, type, help), labelled as it says; those both export, alike."""
    server, _, _ = switched
    with Server(tmp_path / "serve.log", "--frontends", "2") as serve:
        serve_families = _families(serve.port)
        serve_labels = _label_names(serve.port, PROCESS_LABEL[SERVE])
    plugin_families = _families(server.port)
    plugin_labels = _label_names(server.port, PROCESS_LABEL[VLLM])
    declared = {metric.name: (metric.kind, metric.help) for metric in exported_by(SERVE) + SUPERVISOR_METRICS}
    assert serve_families == declared
    assert plugin_families == {metric.name: (metric.kind, metric.help) for metric in exported_by(VLLM)}
    shared = set(plugin_families) & set(serve_families)
    for name in ("mptok_prompts_total", "mptok_route_fallbacks_total", "mptok_kept_here_total", "mptok_errors_total"):
        assert name in shared, name
    for metric in exported_by(VLLM):
        assert plugin_labels[metric.name] == set(metric.labels), metric.name
        assert serve_labels[metric.name] == set(metric.labels), metric.name


SINGLE_CASES = [name for name in CASES if name.startswith("agent0-") or not name.startswith("agent")]


@pytest.fixture(scope="module")
def single(model_dir: Path, logs_dir: Path, plain_ids: dict[str, list[int]]):
    with VllmServer(model_dir, logs_dir / "mptok-single.log", mptok=True, api_servers=1) as server:
        yield server, {name: _case_ids(server, name) for name in SINGLE_CASES}


def test_one_api_server_uses_its_cache_alone_with_the_same_ids(single, plain_ids):
    server, ids = single
    assert {name: ids[name] for name in SINGLE_CASES} == {name: plain_ids[name] for name in SINGLE_CASES}
    assert "routing off: one API server" in server.log()
    totals = _scraped(server, "mptok_cache_hits_total", TURNS - 2)
    assert sum(totals["mptok_cache_hits_total"].values()) >= TURNS - 2, totals
    assert sum(totals.get("mptok_routed_total", {}).values()) == 0

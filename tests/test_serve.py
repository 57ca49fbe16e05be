"""``mptok serve`` end to end: a real supervisor process, real frontends, HTTP over loopback.

Every request opens a new connection (http.client), so the kernel spreads
them over the frontends as it would spread clients. Every id list is
compared with the tokenizer's own full tokenization of the same text.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import pickle
import random
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

import mptok
from mptok.api.affinity import named
from mptok.api.chat_template import DEEPSEEK_V3_TEMPLATE, ChatTemplate, ChatTemplateError
from mptok.api.special_tokens import SpecialTokenFrame
from mptok.cache.config import CacheConfig
from mptok.core.file_locks import try_lock
from mptok.front.catalogue import FRONTEND_METRICS, SUPERVISOR_METRICS
from mptok.front.prompt_ids import PromptIds
from mptok.routing.liveness import FALLBACK_REASONS
from mptok.routing.owners import TokenizationOwners
from mptok.cli import parse_serve_options
from mptok.serve import frontend, launch
from mptok.serve.frontend import FrontendSettings
from mptok.serve.service import TokenizeService
from mptok.supervise import supervisor
from mptok.supervise.options import Option, ServeOptions, Use, declared_options
from mptok.supervise.port import listening_socket
from mptok.supervise.snapshots import SUPERVISOR_SNAPSHOT, SnapshotDir
from mptok_harness.checks import HANG_GUARD_S
from mptok_harness.checks import expected_ids as expected
from mptok_harness.conversations import plain_delta
from mptok_harness.families import _tokenizer_file, load_family_hf
from mptok_harness.metrics import audit
from mptok_harness.prompts import conversation
from mptok_harness.serve import SUPERVISE, Server, free_port, request, scrape, serving, startup_timeout_s, tokenize, total, wait_for_snapshots

FRONTENDS = 4
MAX_PROMPT_CHARS = 1_500_000
CONVERSATIONS = 12
TURNS = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # The default routing policy, as an operator runs it (test_routing_policy_is_the_operators sets the others).
    yield from serving(tmp_path_factory, "serve", "--frontends", str(FRONTENDS), "--max-prompt-chars", str(MAX_PROMPT_CHARS))


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    return tokenizer.apply_chat_template(
        messages, chat_template=DEEPSEEK_V3_TEMPLATE, add_generation_prompt=add_generation_prompt, tokenize=False
    )


class Chat:
    """One conversation, sent turn by turn in one of the request shapes."""

    def __init__(self, index: int):
        self.index = index
        self.key = f"serve-conversation-{index}"
        self.rng = random.Random(index)
        self.prompts = conversation(index, TURNS) if index < 6 else None
        self.messages = [{"role": "system", "content": plain_delta(self.rng, 300)}]

    def turn(self, turn: int, tokenizer) -> tuple[dict, dict[str, str], list[int]]:
        """(body, headers, expected ids) of turn ``turn``."""
        if self.prompts is not None:
            # Half the prompt conversations ask for special tokens (vLLM's default for prompts).
            special = self.index % 2 == 0
            body = {"prompt": self.prompts[turn], "conversation_id": self.key, "add_special_tokens": special}
            return body, {}, expected(tokenizer, self.prompts[turn], special)
        if turn > 0:
            self.messages.append({"role": "assistant", "content": plain_delta(self.rng, 80)})
        self.messages.append({"role": "user", "content": plain_delta(self.rng, 80)})
        header = "X-Session-Id" if self.index < 9 else "X-Correlation-Id"
        body = {"messages": list(self.messages), "add_generation_prompt": True}
        return body, {header: self.key}, expected(tokenizer, render(tokenizer, self.messages), False)


def wait_for_counts(port: int, names: tuple[str, ...], at_least: float, before: list, timeout_s: float = 20.0) -> list:
    """Scrape until every one of ``names`` grew by ``at_least`` since ``before``
    (each frontend's snapshot is up to 0.5 s old, and a routed turn is
    counted by two frontends: timed where it arrived, a hit or miss at its
    owner). A name may be a sum, "a+b"."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(port)
        grown = {
            name: sum(total(samples, part) - total(before, part) for part in name.split("+")) for name in names
        }
        if all(value >= at_least for value in grown.values()):
            return samples
        assert time.monotonic() < deadline, f"did not all grow by {at_least}: {grown}"
        time.sleep(0.1)


# -- conversations, exact and cached -----------------------------------------------


def test_conversations_are_exact_and_hit_across_frontends(server, tokenizer):
    before = scrape(server.port)
    chats = [Chat(i) for i in range(CONVERSATIONS)]
    answered_by = set()
    for turn in range(TURNS):
        for chat in chats:
            body, headers, want = chat.turn(turn, tokenizer)
            answer = tokenize(server.port, body, headers)
            assert answer["tokens"] == want, (chat.index, turn)
            assert answer["count"] == len(want)
            answered_by.add(answer["frontend"])
    requests = CONVERSATIONS * TURNS
    wait_for_counts(
        server.port, ("mptok_tokenize_seconds_count", "mptok_cache_hits_total+mptok_cache_misses_total"), requests, before
    )
    # Every count was made before the answer that needed it went out, but a
    # snapshot written mid-call may hold one count and not its partner (the
    # routed total and its timing, a hit and the call served): compare
    # snapshots that every frontend wrote after the last answer.
    wait_for_snapshots()
    after = scrape(server.port)

    def grew(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    can_hit = CONVERSATIONS * (TURNS - 1)
    hits, misses = grew("mptok_cache_hits_total"), grew("mptok_cache_misses_total")
    print(f"\nhit rate over turns that can hit: {hits}/{can_hit} = {hits / can_hit:.1%}; misses {misses}")
    assert hits >= 0.95 * can_hit, (hits, misses)
    assert hits + misses == requests
    # The kernel spread the connections; routing brought the turns to their owners.
    assert len(answered_by) >= 3
    routed = grew("mptok_routed_total")
    assert routed > 0
    assert grew("mptok_route_failures_total") == 0
    # Every routed prompt was timed where it arrived, every peer call where it
    # was answered; the owner's work is a part of the routed time.
    assert grew("mptok_route_seconds_count") == routed
    assert grew("mptok_peer_serve_seconds_count") == grew("mptok_served_total") >= routed
    assert 0 < grew("mptok_peer_serve_seconds_sum") < grew("mptok_route_seconds_sum")


def test_metrics_cover_every_frontend_whichever_answers(server):
    samples = scrape(server.port)
    for name in (
        "mptok_cache_hits_total",
        "mptok_cache_misses_total",
        "mptok_routed_total",
        "mptok_route_failures_total",
        "mptok_route_seconds_count",
        "mptok_peer_serve_seconds_count",
    ):
        assert {ls["frontend"] for n, ls, _ in samples if n == name} == {str(i) for i in range(FRONTENDS)}, name
    reasons = {ls["reason"] for n, ls, _ in samples if n == "mptok_route_fallbacks_total"}
    assert reasons == set(FALLBACK_REASONS)
    buckets = [(ls["le"], v) for n, ls, v in samples if n == "mptok_tokenize_seconds_bucket" and ls["frontend"] == "0"]
    assert buckets[-1][0] == "+Inf"
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative
    assert total(samples, "mptok_frontend_up") == FRONTENDS


def test_the_running_supervisor_maps_no_tokenizer_stack(server):
    # The kernel's list of what each process mapped: the frontends hold
    # tokenizers' and numpy's shared objects, the supervisor neither.
    def mapped(pid: int) -> str:
        with open(f"/proc/{pid}/maps") as f:
            return f.read()

    frontend_maps = mapped(server.frontend_pids()[0])
    assert "/tokenizers/" in frontend_maps and "/numpy/" in frontend_maps
    supervisor_maps = mapped(server.process.pid)
    assert "/tokenizers/" not in supervisor_maps and "/numpy/" not in supervisor_maps


def test_frontends_serve_on_uvloop(server):
    # uvloop is a dependency wherever it installs, so the frontends run on
    # it as shipped; each says so when ready, and maps its library.
    for frontend_id in range(FRONTENDS):
        server.wait_for_log(rf"role=frontend frontend={frontend_id} .*event=frontend_ready .* loop=uvloop")
    with open(f"/proc/{server.frontend_pids()[0]}/maps") as f:
        assert "/uvloop/" in f.read()


def test_routing_policy_is_the_operators(tmp_path, tokenizer, monkeypatch):
    """--routing never: each frontend a cache of its own (nothing crosses),
    every answer exact; MPTOK_ROUTING is the default the flag overrides; the
    policy is on /metrics and in each frontend's ready line."""
    monkeypatch.setenv("MPTOK_ROUTING", "always")
    with Server(tmp_path / "serve.log", "--frontends", "2", "--routing", "never") as server:
        for turn, prompt in enumerate(conversation(31, 4)):
            body = {"prompt": prompt, "conversation_id": "policy", "add_special_tokens": False}
            assert tokenize(server.port, body)["tokens"] == expected(tokenizer, prompt), turn
        wait_for_snapshots()
        samples = scrape(server.port)
        log = server.log()
    assert total(samples, "mptok_routed_total") == 0
    assert total(samples, "mptok_routing_policy", policy="never") == 2
    assert total(samples, "mptok_routing_policy", policy="always") == 0
    assert log.count("routing=never") == 2  # one ready line per frontend


def test_every_declared_metric_has_a_value_and_every_value_a_metric(server):
    # A renamed counter or a moved snapshot key fails here instead of showing zeros.
    wait_for_snapshots()
    snapshots = SnapshotDir(server.ipc_dir()).read_all()
    assert set(snapshots) == {str(i) for i in range(FRONTENDS)} | {SUPERVISOR_SNAPSHOT}
    assert audit(snapshots) == []
    scraped = {name for name, _, _ in scrape(server.port)}
    for metric in FRONTEND_METRICS + SUPERVISOR_METRICS:
        suffixes = ("_bucket", "_sum", "_count") if metric.kind == "histogram" else ("",)
        assert {metric.name + suffix for suffix in suffixes} <= scraped, metric.name


def test_prompts_without_a_conversation_id_are_exact(server, tokenizer):
    prompts = conversation(99, 4)
    for prompt in prompts:
        for special in (True, False):
            answer = tokenize(server.port, {"prompt": prompt, "add_special_tokens": special})
            assert answer["tokens"] == expected(tokenizer, prompt, special)
    assert tokenize(server.port, {"prompt": ""})["tokens"] == expected(tokenizer, "", True)


def test_200k_ids_answer_exactly(server, tokenizer):
    rng = random.Random(7)
    text = ""
    while len(text) < 1_300_000:
        text += plain_delta(rng, 200) + "\n"
    status, payload, _ = request(server.port, "POST", "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert status == 200
    answer = json.loads(payload)
    assert answer["count"] > 190_000
    assert answer["tokens"] == expected(tokenizer, text, False)


def test_each_answer_says_how_long_its_tokenization_took(server):
    body = {"prompt": "A prompt long enough to be cached. " * 40, "conversation_id": "timed"}
    status, _, headers = request(server.port, "POST", "/tokenize", body)
    assert status == 200
    timing = re.fullmatch(r"tokenize;dur=(\d+\.\d{3})", headers["server-timing"])
    assert timing is not None, headers["server-timing"]
    status, _, headers = request(server.port, "POST", "/tokenize", {"prompt": 5})
    assert status == 400
    assert "server-timing" not in headers


# -- the client's mistakes ------------------------------------------------------------


BAD_REQUESTS = [
    (b'{"prompt": "unterminated', 400, "not valid JSON"),
    (b"", 400, "not valid JSON"),
    (b"\xff\xfe", 400, "not valid JSON"),
    (b'["prompt"]', 400, "JSON object"),
    (b"{}", 400, "exactly one of"),
    (b'{"prompt": "a", "messages": []}', 400, "exactly one of"),
    (b'{"prompt": 5}', 400, '"prompt" must be a string'),
    (b'{"prompt": "a", "add_special_tokens": "yes"}', 400, '"add_special_tokens" must be a boolean'),
    (b'{"prompt": "a", "conversation_id": 5}', 400, '"conversation_id" must be a string'),
    (b'{"messages": "hi"}', 400, '"messages" must be a non-empty list'),
    (b'{"messages": []}', 400, '"messages" must be a non-empty list'),
    (b'{"messages": [5]}', 400, "messages[0] must be an object"),
    (b'{"messages": [{"role": "user", "content": 5}]}', 400, 'messages[0]["content"] must be a string'),
    (b'{"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": 1}', 400, "must be a boolean"),
    (b'{"messages": [{"role": "tool", "content": "hi"}]}', 400, "unsupported role tool"),
    (b'{"prompt": "\\ud800"}', 400, "lone UTF-16 surrogate"),
    (b'{"prompt": "ok \\udc00 no"}', 400, "lone UTF-16 surrogate"),
    (b'{"prompt": "' + b"x" * (MAX_PROMPT_CHARS + 1) + b'"}', 413, "--max-prompt-chars"),
    (json.dumps({"messages": [{"role": "user", "content": "x" * MAX_PROMPT_CHARS}]}).encode(), 413, "--max-prompt-chars"),
]


@pytest.mark.parametrize(("body", "status", "message"), BAD_REQUESTS, ids=range(len(BAD_REQUESTS)))
def test_bad_requests_get_4xx_with_a_message(server, body, status, message):
    got, payload, _ = request(server.port, "POST", "/tokenize", body)
    assert got == status, payload[:300]
    error = json.loads(payload)
    assert message in error["message"], error
    assert error["code"] == status


def test_a_body_too_large_to_read_is_refused_unread(server):
    got, payload, _ = request(server.port, "POST", "/tokenize", b"x" * (12 * MAX_PROMPT_CHARS + 2**20 + 1))
    assert got == 413, payload[:300]


# -- restarts ------------------------------------------------------------------------


def test_a_killed_frontend_is_replaced_and_service_goes_on(server, tokenizer):
    victim = 1
    old_pid = server.frontend_pids()[victim]
    offset = len(server.log())
    os.kill(old_pid, signal.SIGKILL)
    server.wait_for_log(rf"event=frontend_exited frontend={victim} pid={old_pid} exit=\"signal SIGKILL\"", after=offset)
    # Conversations keep going while the frontend restarts: every answer exact.
    chats = [Chat(100 + i) for i in range(4)]
    for turn in range(3):
        for chat in chats:
            body, headers, want = chat.turn(turn, tokenizer)
            assert tokenize(server.port, body, headers)["tokens"] == want
    match = server.wait_for_log(rf"role=supervisor .*event=frontend_ready frontend={victim} pid=(\d+) restarts=1", after=offset)
    new_pid = int(match.group(1))
    assert new_pid != old_pid
    deadline = time.monotonic() + 30
    while True:  # new connections reach every frontend sooner or later
        status, payload, _ = request(server.port, "GET", "/health")
        assert status == 200
        health = json.loads(payload)
        if health["frontend"] == victim:
            assert health["pid"] == new_pid
            break
        assert time.monotonic() < deadline, "the new frontend never answered /health"
    for turn in range(3, 5):
        for chat in chats:
            body, headers, want = chat.turn(turn, tokenizer)
            assert tokenize(server.port, body, headers)["tokens"] == want
    samples = scrape(server.port)
    assert total(samples, "mptok_frontend_restarts_total", frontend=str(victim)) == 1
    assert total(samples, "mptok_frontend_up") == FRONTENDS


def test_a_stopped_frontend_is_handed_no_new_connection(server, tokenizer):
    """The frontends accept from one listening socket, so while one is
    SIGSTOPped the others take every new connection. Sockets of their own
    in an SO_REUSEPORT group would each be handed a share by the kernel,
    and a stopped frontend's share would wait until it is continued: this
    supervisor kills no hung ``mptok serve`` frontend, so forever. Its
    conversations are tokenized where they land (its owner is stopped)."""
    victim = 0
    pid = server.frontend_pids()[victim]
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline, "the frontend did not stop"
            time.sleep(0.05)
        chats = [Chat(200 + i) for i in range(6)]
        for turn in range(4):  # 24 new connections: 1 in 4 would reach the stopped one by hash
            for chat in chats:
                body, headers, want = chat.turn(turn, tokenizer)
                status, payload, _ = request(server.port, "POST", "/tokenize", body, headers, timeout_s=10)
                assert status == 200, payload[:300]
                answer = json.loads(payload)
                assert answer["tokens"] == want and answer["frontend"] != victim
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.slow
def test_a_crash_looping_frontend_is_given_up_loudly(tmp_path):
    with Server(tmp_path / "serve.log", "--frontends", "1", "--max-restarts", "1", "--restart-window", "60") as server:
        for restarts in (0, 1):
            pid = server.frontend_pids()[0]
            offset = len(server.log())
            os.kill(pid, signal.SIGKILL)
            if restarts == 0:
                server.wait_for_log(r"event=frontend_ready frontend=0 pid=\d+ restarts=1", after=offset)
        assert server.wait(60) == 3
        log = server.log()
        assert "level=CRITICAL role=supervisor" in log and "event=frontend_given_up frontend=0" in log
        assert "event=all_frontends_given_up" in log


# -- stopping and failing to start -----------------------------------------------------


def test_sigterm_finishes_in_flight_requests_and_leaves_nothing_behind(tmp_path, tokenizer):
    server = Server(tmp_path / "serve.log", "--frontends", "2")
    try:
        parent = psutil.Process(server.process.pid)
        children = parent.children(recursive=True)
        assert len([c for c in children if c.pid in server.frontend_pids().values()]) == 2
        ipc_dir = server.ipc_dir()
        assert os.path.isdir(ipc_dir) and os.stat(ipc_dir).st_mode & 0o777 == 0o700
        # A request in flight at SIGTERM: its body is half sent. The frontend
        # must wait for the rest and answer before it exits.
        text = "".join(conversation(3, 1))
        body = json.dumps({"prompt": text}).encode()
        client = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        client.sendall(
            b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body[: len(body) // 2]
        )
        time.sleep(0.3)  # the frontend has the request's head and is reading its body
        offset = len(server.log())
        server.process.send_signal(signal.SIGTERM)
        server.wait_for_log("Waiting for connections to close", after=offset, timeout_s=30)
        client.sendall(body[len(body) // 2 :])
        response = b""
        while chunk := client.recv(1 << 20):
            response += chunk
            head, _, payload = response.partition(b"\r\n\r\n")
            if payload and len(payload) >= int(re.search(rb"content-length: (\d+)", head.lower()).group(1)):
                break
        client.close()
        assert head.startswith(b"HTTP/1.1 200"), response[:300]
        assert json.loads(payload)["tokens"] == expected(tokenizer, text, True)
        assert server.wait(60) == 0
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert alive == [], alive
        assert not os.path.exists(ipc_dir)
        with listening_socket("127.0.0.1", server.port):  # nobody listens on the port any more
            pass
        log = server.log()
        assert "event=stopping signal=SIGTERM" in log and "event=stopped" in log
    finally:
        server.kill()


def run_cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, SUPERVISE, *args], capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
    )


@pytest.mark.parametrize("reuse_port", [False, True], ids=["plain", "so_reuseport"])
def test_a_port_in_use_is_a_one_line_error(reuse_port):
    with socket.socket() as holder:
        if reuse_port:  # an SO_REUSEPORT listener of this user would silently share the port
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        result = run_cli("--port", str(port), "--frontends", "1")
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last == f"mptok serve: cannot start: cannot bind 127.0.0.1:{port}: Address already in use", last


def test_a_bad_tokenizer_path_is_a_one_line_error(tmp_path):
    result = run_cli("--port", str(free_port()), "--tokenizer", str(tmp_path / "missing"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith("missing: no such file or directory")
    # A path that exists but holds no tokenizer: the frontends fail at start-up.
    result = run_cli("--port", str(free_port()), "--frontends", "1", "--tokenizer", str(tmp_path))
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("mptok serve: cannot start: frontend 0 failed to start: ValueError: cannot load tokenizer"), last
    ipc_dir = re.search(r"event=starting .*ipc_dir=(\S+)", result.stderr).group(1)
    assert not os.path.exists(ipc_dir)


def test_help_explains_every_option():
    result = run_cli("--help", timeout_s=60)
    assert result.returncode == 0
    for option in (
        "--frontends", "--host", "--port", "--tokenizer", "--chat-template", "--max-prompt-chars", "--threads",
        "--route-timeout", "--route-backoff", "--route-patience", "--graceful-timeout", "--startup-timeout", "--max-restarts",
        "--restart-window", "--given-up-retry", "--max-in-flight", "--queue-timeout", "--read-timeout",
        "--max-connections", "--max-messages", "--max-model-len", "--served-model-name",
        "--enable-tokenizer-info-endpoint",
    ):  # fmt: skip
        assert option in result.stdout
    for _, declared in declared_options():
        assert declared.flag in result.stdout
    for variable in ("MPTOK_CACHE_MAX_ENTRIES", "MPTOK_CACHE_MIN_CHARS", "MPTOK_LOG_LEVEL"):
        assert variable in result.stdout


def _non_default_words(declared: Option, default: object) -> list[str]:
    """A command line giving ``declared`` a value other than its default."""
    if declared.parse is None:
        return [declared.flag]
    if declared.many:
        return [declared.flag, "a", "b"]
    if declared.choices:
        return [declared.flag, next(choice for choice in declared.choices if choice != default)]
    if isinstance(default, (int, float)):
        return [declared.flag, str(default + 1)]
    return [declared.flag, "7"]  # a str, or an int whose default is None


def test_every_option_reaches_the_component_that_uses_it():
    """Each option declared in mptok.supervise.options is on the command line and arrives,
    with its value, in what a frontend receives and in the keyword arguments of
    the component it is declared for, so that none is wired halfway."""
    defaults = ServeOptions()
    argv = ["serve"]
    for field, declared in declared_options():
        argv += _non_default_words(declared, getattr(defaults, field.name))
    options = parse_serve_options(argv)
    received = pickle.loads(pickle.dumps(FrontendSettings(0, "/ipc", None, options))).options  # as spawn sends it
    # The supervisor's options are read by it and by what it runs each slot with (serve/launch.py).
    sources = {
        Use.SUPERVISOR: inspect.getsource(supervisor) + inspect.getsource(launch),
        Use.FRONTEND: inspect.getsource(frontend),
    }
    parameters = {
        Use.ROUTING: inspect.signature(TokenizationOwners).parameters,
        Use.SERVICE: inspect.signature(TokenizeService).parameters,
        Use.CACHE: inspect.signature(CacheConfig).parameters,
    }
    for field, declared in declared_options():
        assert getattr(options, field.name) != getattr(defaults, field.name), declared.flag
        assert getattr(received, field.name) == getattr(options, field.name), declared.flag
        if declared.use in sources:
            assert f"options.{field.name}" in sources[declared.use], f"{declared.flag} is not read by the {declared.use.value}"
        else:
            argument = declared.argument or field.name
            assert argument in parameters[declared.use], f"{declared.flag}: no {argument} parameter in the {declared.use.value}"
            assert options.arguments_for(declared.use)[argument] == getattr(options, field.name)
    assert "max_model_len" not in defaults.arguments_for(Use.SERVICE)  # None: the component's own default


# -- another tokenizer, special tokens, chat templates -----------------------------------


def test_another_tokenizer_with_special_tokens_and_a_template_file(tmp_path):
    path = _tokenizer_file("metaspace_first")  # its post-processor adds "<s>" before the text
    template = tmp_path / "chatml.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    local = mptok.load_tokenizer(path)
    with Server(tmp_path / "serve.log", "--frontends", "1", "--tokenizer", str(path), "--chat-template", str(template)) as s:
        prompts = conversation(5, 3)
        for prompt in prompts:
            for special in (True, False):
                answer = tokenize(s.port, {"prompt": prompt, "add_special_tokens": special}, {"X-Session-Id": "c"})
                assert answer["tokens"] == expected(local, prompt, special)
        assert expected(local, "x", True)[0] != expected(local, "x", False)[0]
        messages = [{"role": "user", "content": "Bonjour, ça va?"}]
        text = local.apply_chat_template(messages, chat_template=template.read_text(), add_generation_prompt=True, tokenize=False)
        answer = tokenize(s.port, {"messages": messages})
        assert answer["tokens"] == expected(local, text, False)
        assert f"event=special_tokens mode=cache prefix=[{local.convert_tokens_to_ids('<s>')}] suffix=[]" in s.log()


@pytest.mark.parametrize("family", ["deepseek", "metaspace_first", "metaspace_always", "metaspace_always_nosplit", "legacy_sp"])
def test_special_tokens_around_cached_ids_are_exact(family):
    hf = load_family_hf(family)
    frame = SpecialTokenFrame.derive(hf)
    assert frame is not None
    prompt_ids = PromptIds(hf, mptok.PrefixTokenCache())
    for key in ("conversation", None):
        for prompt in conversation(11, 4):
            for special in (True, False):
                ids = prompt_ids.ids_array(prompt, special, named(key, None)).tolist()
                assert ids == expected(hf, prompt, special), (family, special)
    assert prompt_ids.ids_array("", True, named(None, None)).tolist() == expected(hf, "", True)


def test_the_built_in_template_matches_deepseek_v3(tokenizer):
    template = ChatTemplate.for_tokenizer(tokenizer)
    assert template.origin == "built-in deepseek-v3"
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "<think>hmm</think>A"},
        {"role": "user", "content": "U2"},
    ]
    assert template.render(tokenizer, messages, True) == (
        "<｜begin▁of▁sentence｜>S<｜User｜>U<｜Assistant｜>A<｜end▁of▁sentence｜><｜User｜>U2<｜Assistant｜>"
    )
    assert template.render(tokenizer, messages, False).endswith("<｜User｜>U2")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTemplate.for_tokenizer(load_family_hf("metaspace_first")).render(tokenizer, messages, True)


# -- the supervisor's own lifecycle ---------------------------------------------------


def test_a_late_restart_is_killed_and_a_given_up_frontend_is_tried_again(tmp_path):
    # Frontend 1 is killed; its replacement is stopped before it is ready
    # (it never will be): the startup deadline kills it, which is its
    # second exit, one more than --max-restarts: given up. After the
    # cool-down it is tried again, and serves.
    startup_timeout = startup_timeout_s(tmp_path, 2)  # the stopped one waits all of it; the retry must start within it
    # Both exits must fall in one restart window, and the stopped one's comes a whole start-up timeout after the first.
    window = 2 * startup_timeout
    args = (
        "--frontends", "2", "--max-restarts", "1", "--startup-timeout", f"{startup_timeout:.0f}",
        "--restart-window", f"{window:.0f}", "--given-up-retry", "1",
    )  # fmt: skip
    with Server(tmp_path / "serve.log", *args) as server:
        offset = len(server.log())
        os.kill(server.frontend_pids()[1], signal.SIGKILL)
        started = server.wait_for_log(r"role=supervisor .*event=frontend_started frontend=1 pid=(\d+) restarts=1", after=offset)
        late = int(started.group(1))
        os.kill(late, signal.SIGSTOP)
        server.wait_for_log(rf"level=ERROR role=supervisor .*event=frontend_start_timeout frontend=1 pid={late}", after=offset)
        server.wait_for_log(rf"level=CRITICAL role=supervisor .*event=frontend_given_up frontend=1 pid={late} .*retry_in_s=1", after=offset)
        server.wait_for_log(r"role=supervisor .*event=frontend_retry frontend=1 times_given_up=1", after=offset)
        server.wait_for_log(r"role=supervisor .*event=frontend_ready frontend=1 pid=\d+ restarts=2", after=offset)
        assert server.process.poll() is None


def test_frontends_stop_when_the_supervisor_dies_and_its_dir_is_swept_at_the_next_start(tmp_path, short_tmp_dir):
    from mptok.supervise.run_dir import LOCK_NAME

    tmp = short_tmp_dir  # TMPDIR of the servers: their socket paths must fit
    env = {"TMPDIR": str(tmp)}
    first = Server(tmp_path / "first.log", "--frontends", "2", env=env)
    holder = None
    try:
        ipc_dir = first.ipc_dir()
        frontends = [psutil.Process(pid) for pid in first.frontend_pids().values()]
        # Publishing a frontend's metrics now fails (a directory sits where
        # its snapshot goes): nothing that rides on that must be needed to
        # notice the supervisor's death.
        for frontend_id in first.frontend_pids():
            snapshot = os.path.join(ipc_dir, f"metrics-{frontend_id}.json")
            while not os.path.isdir(snapshot):  # the frontend may replace its file meanwhile
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(snapshot)
                # NotADirectoryError: the frontend wrote its file again in between.
                with contextlib.suppress(FileExistsError, NotADirectoryError):
                    os.makedirs(os.path.join(snapshot, "blocker"))
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(HANG_GUARD_S)
        _, alive = psutil.wait_procs(frontends, timeout=60)
        assert alive == []
        assert os.path.isdir(ipc_dir)  # left behind
        assert "event=supervisor_gone" in first.log()
        # Next to it, what a sweep must leave: a dir whose lock is held, one
        # with no lock file, and a link to a stale dir.
        held = tmp / "mptok-serve-held"
        held.mkdir(mode=0o700)
        (held / LOCK_NAME).write_text("1")
        holder = os.open(held / LOCK_NAME, os.O_RDONLY)
        assert try_lock(holder)
        unlocked = tmp / "mptok-serve-nolock"
        unlocked.mkdir(mode=0o700)
        target = tmp_path / "elsewhere"
        target.mkdir(mode=0o700)
        (target / LOCK_NAME).write_text("1")
        (tmp / "mptok-serve-link").symlink_to(target)
        with Server(tmp_path / "second.log", "--frontends", "1", env=env) as second:
            assert f"event=swept_stale_ipc_dir path={ipc_dir}" in second.log()
            assert not os.path.exists(ipc_dir)
            assert held.is_dir() and unlocked.is_dir() and (target / LOCK_NAME).exists()
            assert os.path.islink(tmp / "mptok-serve-link")
            assert os.path.isdir(second.ipc_dir())
    finally:
        if holder is not None:
            os.close(holder)
        first.kill()


def test_a_frontends_stop_spends_the_graceful_timeout_once(tmp_path):
    # A tokenization longer than --graceful-timeout is in flight at SIGTERM.
    # uvicorn spends the budget waiting for its request; the pool must get
    # what is left of it (nothing), not a second --graceful-timeout. On
    # `tokenizers`: a fast engine tokenizes the prompt in milliseconds.
    args = ("--frontends", "1", "--graceful-timeout", "1", "--tokenizer-backend", "tokenizers")
    with Server(tmp_path / "serve.log", *args) as server:
        text = "".join(conversation(7, 1, first_chars=3_900_000))
        body = json.dumps({"prompt": text}).encode()
        client = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        try:
            client.sendall(
                b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            time.sleep(0.5)  # the body is read and its tokenization (seconds) has begun
            server.process.send_signal(signal.SIGTERM)
            assert server.wait(60) == 0
        finally:
            client.close()
        abandoned = re.search(r"event=abandoned_tokenizations count=1 after_s=(\S+)", server.log())
        assert abandoned is not None, server.log()[-3000:]
        assert float(abandoned.group(1)) < 1.0

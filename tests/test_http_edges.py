"""The edges of ``mptok serve``'s HTTP side that used to answer wrongly (issue 11, item 8).

A real server, raw sockets where a well-behaved client cannot send the
request: a client gone mid-body, headers too large or too slow, too many
connections, unknown paths and methods, a chat template that raises, too
many messages; and the command line's own edges.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys

import pytest
from mptok_harness.raw_http import RawClient, error_of, post_head, statuses
from mptok_harness.serve import Server, request, scrape, total, wait_for_snapshots

READ_TIMEOUT_S = 2
MAX_CONNECTIONS = 8
MAX_MESSAGES = 3
# Renders like a plain chat template, but its own code fails (TypeError:
# str + int) on a message with the role "boom".
TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n"
    "{% if m.role == 'boom' %}{{ m.content + 1 }}{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("edges")
    (tmp / "template.jinja").write_text(TEMPLATE)
    args = [
        "--frontends", "1", "--chat-template", str(tmp / "template.jinja"), "--read-timeout", str(READ_TIMEOUT_S),
        "--max-connections", str(MAX_CONNECTIONS), "--max-messages", str(MAX_MESSAGES),
    ]  # fmt: skip
    with Server(tmp / "serve.log", *args) as s:
        yield s


def assert_error_shape(payload: bytes | dict, status: int) -> dict:
    error = payload if isinstance(payload, dict) else json.loads(payload)
    assert error["object"] == "error" and error["code"] == status and error["message"] and error["type"], error
    # Current vLLM nests the same fields under "error"; both are there.
    assert error["error"] == {k: error[k] for k in ("message", "type", "param", "code")}, error
    return error


def assert_no_error_logged(server: Server) -> None:
    log = server.log()
    assert "Traceback" not in log and "traceback=" not in log, log[-3000:]
    assert "level=ERROR" not in log and "level=CRITICAL" not in log, log[-3000:]


def test_a_client_gone_mid_body_is_counted_not_an_error(server):
    before = scrape(server.port)
    with RawClient(server.port) as client:
        client.send(post_head("/tokenize", 1000) + b'{"prompt": "cut')
    wait_for_snapshots()
    after = scrape(server.port)
    gone = total(after, "mptok_http_requests_total", path="/tokenize", code="499")
    assert gone - total(before, "mptok_http_requests_total", path="/tokenize", code="499") == 1
    assert total(after, "mptok_http_requests_total", code="500") == 0
    assert_no_error_logged(server)
    assert request(server.port, "GET", "/health")[0] == 200


def test_a_chat_template_that_raises_typeerror_is_a_400_naming_it(server):
    status, payload, _ = request(server.port, "POST", "/tokenize", {"messages": [{"role": "boom", "content": "x"}]})
    error = assert_error_shape(payload, 400)
    assert status == 400 and "TypeError" in error["message"] and "chat template" in error["message"], error
    assert "event=chat_template_failed" in server.log()
    status, payload, _ = request(server.port, "POST", "/tokenize", {"messages": [{"role": "user", "content": "x"}]})
    assert status == 200, payload


@pytest.mark.parametrize(
    ("method", "path", "status"), [("GET", "/nope", 404), ("POST", "/", 404), ("GET", "/tokenize", 405), ("PUT", "/health", 405)]
)
def test_unknown_paths_and_methods_answer_in_the_error_shape(server, method, path, status):
    got, payload, headers = request(server.port, method, path, b"{}")
    assert got == status
    assert_error_shape(payload, status)
    if status == 405:
        assert headers["allow"] in ("POST", "GET")


def test_a_1_mib_header_is_answered_431_not_reset(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.putrequest("POST", "/tokenize")
        connection.putheader("X-Session-Id", "s" * 2**20)
        connection.putheader("Content-Length", "2")
        connection.endheaders(b"{}")
        response = connection.getresponse()
        assert response.status == 431
        assert_error_shape(response.read(), 431)
    finally:
        connection.close()


def test_malformed_http_is_a_400_in_the_error_shape(server):
    with RawClient(server.port) as client:
        received = client.send(b"NOT HTTP AT ALL\r\n\r\n").read_all()
    assert statuses(received) == [400]
    assert_error_shape(error_of(received), 400)


def test_headers_trickling_in_get_408_after_the_read_timeout(server):
    with RawClient(server.port) as client:
        received = client.send(b"POST /tokenize HTTP/1.1\r\nHost: slow\r\nX-Slow").read_all()
    assert statuses(received) == [408]
    assert "--read-timeout" in assert_error_shape(error_of(received), 408)["message"]


def test_a_body_trickling_in_gets_408_and_frees_its_place(server):
    with RawClient(server.port) as client:
        received = client.send(post_head("/tokenize", 100) + b'{"prompt": ').read_all()
    assert statuses(received) == [408]
    status, payload, _ = request(server.port, "POST", "/tokenize", {"prompt": "still served"})
    assert status == 200, payload


def test_connections_beyond_the_cap_get_503_at_once(server):
    held = [RawClient(server.port) for _ in range(MAX_CONNECTIONS)]
    try:
        # The kernel queues connections in order and the frontend accepts them in order.
        with RawClient(server.port) as extra:
            received = extra.read_all()
        assert statuses(received) == [503]
        assert "--max-connections" in assert_error_shape(error_of(received), 503)["message"]
    finally:
        for client in held:
            client.close()


def test_empty_messages_say_so(server):
    status, payload, _ = request(server.port, "POST", "/tokenize", {"messages": []})
    assert status == 400
    assert assert_error_shape(payload, 400)["message"] == '"messages" must be a non-empty list; it is empty'


def test_more_messages_than_the_cap_get_413(server):
    messages = [{"role": "system", "content": "x"}] * (MAX_MESSAGES + 1)
    status, payload, _ = request(server.port, "POST", "/tokenize", {"messages": messages})
    assert status == 413
    assert "--max-messages=3" in assert_error_shape(payload, 413)["message"]
    status, _, _ = request(server.port, "POST", "/tokenize", {"messages": messages[:MAX_MESSAGES]})
    assert status == 200


def test_the_guards_left_no_error_in_the_log(server):
    assert_no_error_logged(server)


# -- the command line ------------------------------------------------------------


def mptok_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mptok.cli", *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )


def test_help_names_the_admission_and_guard_options():
    result = mptok_cli("serve", "--help")
    assert result.returncode == 0
    for option in ("--max-in-flight", "--queue-timeout", "--read-timeout", "--max-connections", "--max-messages"):
        assert option in result.stdout


def test_version():
    result = mptok_cli("--version")
    assert result.returncode == 0 and result.stdout.startswith("mptok "), result


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--route-timeout", "inf", "at most 86,400 seconds"),
        ("--route-patience", "nan", "0 (off) to 1000"),
        ("--graceful-timeout", "inf", "at most 86,400 seconds"),
        ("--queue-timeout", "nan", "at most 86,400 seconds"),
        ("--read-timeout", "0", "more than 0"),
        ("--max-restarts", "-1", "must be 0 or more"),
        ("--max-in-flight", "0", "must be at least 1"),
        ("--route-timeout", "abc", "invalid float value: 'abc'"),
        ("--route-patience", "x", "invalid float value: 'x'"),
        ("--max-in-flight", "many", "invalid int value: 'many'"),
    ],
)
def test_impossible_settings_are_refused_with_a_clear_error(option, value, says):
    result = mptok_cli("serve", option, value)
    assert result.returncode == 2
    assert f"argument {option}: " in result.stderr and says in result.stderr, result.stderr

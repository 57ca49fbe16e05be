"""Fuzzing ``mptok serve`` with malformed HTTP requests (issue 11's proof of items 1 and 8).

Hypothesis generates requests no client should send: odd methods and paths,
broken or oversized headers, wrong or missing lengths, chunked framing with
garbage, bodies that are not JSON, JSON of the wrong shape (deep nesting,
huge numbers, huge ids, surrogates), bodies cut off. Each goes over its own
connection to a real 2-frontend server. Every answer must be a client error
or a 200/503, never another 5xx; the server must keep serving and log no
error; afterwards a good request still gets exact ids.
"""

from __future__ import annotations

import json
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mptok
from mptok_harness.raw_http import RawClient, statuses
from mptok_harness.serve import request, scrape, serving, total, wait_for_snapshots

EXAMPLES = 1000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serving(tmp_path_factory, "fuzz", "--frontends", "2", "--read-timeout", "2", "--max-prompt-chars", "100000")


_json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(max_size=40),
)
_json_values = st.recursive(_json_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
_fields = st.sampled_from(["prompt", "messages", "add_special_tokens", "add_generation_prompt", "conversation_id", "role", "content"])
_message = st.dictionaries(st.sampled_from(["role", "content", "name"]), st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]), _json_values), max_size=3)


def _shaped_body() -> st.SearchStrategy[bytes]:
    """JSON that looks like a /tokenize body, with wrong types and odd values."""
    body = st.fixed_dictionaries(
        {},
        optional={
            "prompt": st.one_of(st.text(max_size=200), _json_values),
            "messages": st.one_of(st.lists(_message, max_size=5), _json_values),
            "add_special_tokens": _json_values,
            "add_generation_prompt": _json_values,
            "conversation_id": st.one_of(st.text(max_size=20), st.just("i" * 100_000), _json_values),
        },
    )
    extra = st.dictionaries(_fields, _json_values, max_size=2)
    return st.builds(lambda b, e: json.dumps({**e, **b}).encode(), body, extra)


_raw_bodies = st.one_of(
    _shaped_body(),
    _json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=200),
    st.integers(min_value=1, max_value=5000).map(lambda n: b"[" * n + b"]" * n),  # deep nesting
    st.sampled_from([b'{"prompt": "\\ud800"}', b'{"prompt": 1e99999}', b'{"prompt": ' + b"9" * 5000 + b"}", b"\xff\xfe{}"]),
    st.builds(lambda b, cut: b[:cut], _shaped_body(), st.integers(min_value=0, max_value=30)),  # truncated JSON
)

_header_names = st.one_of(
    st.sampled_from(["Content-Type", "X-Session-Id", "X-Correlation-Id", "Expect", "Transfer-Encoding", "Host", "Accept"]),
    st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=12),
    st.sampled_from(["Bad Name", "", "X:Y", "\x00"]),
)
_header_values = st.one_of(
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
    st.sampled_from(["100-continue", "chunked", "gzip", "\x00", "a\rb", "x" * 20_000]),
)


@st.composite
def malformed_requests(draw) -> tuple[bytes, bool]:
    """(the bytes sent, whether they end mid-request: then no answer is owed)."""
    method = draw(st.one_of(st.sampled_from(["POST", "GET", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"]), st.text(alphabet="ABCXYZ /", min_size=0, max_size=8)))
    path = draw(st.one_of(st.sampled_from(["/tokenize", "/health", "/metrics", "/", "/tokenize/", "//tokenize", "/tokenize?x=1", "/%ff", "*", "/detokenize", "/tokenizer_info"]), st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=30)))
    version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.1", "HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTP/1.1", ""]))
    body = draw(_raw_bodies)
    framing = draw(st.sampled_from(["length", "length", "length", "short", "long", "none", "chunked", "bad_chunked", "bad_length"]))
    headers = [(draw(_header_names), draw(_header_values)) for _ in range(draw(st.integers(0, 4)))]
    cut_off = False
    if framing in ("length", "short", "long"):
        declared = len(body) + {"length": 0, "short": -min(len(body), 5), "long": 50}[framing]
        headers.append(("Content-Length", str(declared)))
        cut_off = framing == "long"
    elif framing == "bad_length":
        headers.append(("Content-Length", draw(st.sampled_from(["-1", "abc", "99999999999999999999", "1, 2", ""]))))
    elif framing == "chunked":
        headers.append(("Transfer-Encoding", "chunked"))
        body = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    elif framing == "bad_chunked":
        headers.append(("Transfer-Encoding", "chunked"))
        body = b"zz\r\n" + body + b"\r\n"
        cut_off = True
    head = f"{method} {path} {version}\r\n" + "".join(f"{n}: {v}\r\n" for n, v in headers) + "Connection: close\r\n\r\n"
    return head.encode("utf-8", "surrogateescape") + body, cut_off


def exchange(port: int, data: bytes, cut_off: bool) -> list[int]:
    """Send ``data`` on a new connection and return the statuses answered before the server closed."""
    with RawClient(port, timeout_s=30) as client:
        try:
            client.send(data)
            if cut_off:
                client.sock.shutdown(socket.SHUT_WR)  # the rest never comes
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed while we were still sending
        return statuses(client.read_all())


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(case=malformed_requests())
def test_malformed_requests_get_client_errors_never_a_5xx(server, case):
    data, cut_off = case
    answered = exchange(server.port, data, cut_off)
    assert all(status < 500 or status == 503 for status in answered), (answered, data[:300])
    if not cut_off:
        assert answered, ("no answer", data[:300])


def test_after_the_fuzz_the_server_serves_exactly_and_logged_no_error(server):
    tokenizer = mptok.load_tokenizer()
    status, payload, _ = request(server.port, "POST", "/tokenize", {"prompt": "after the fuzz", "add_special_tokens": False})
    assert status == 200 and json.loads(payload)["tokens"] == tokenizer("after the fuzz", add_special_tokens=False)["input_ids"]
    wait_for_snapshots()
    samples = scrape(server.port)
    assert total(samples, "mptok_http_requests_total") >= EXAMPLES // 2  # the fuzz reached the app, not only the parser
    server_errors = {ls["code"]: v for n, ls, v in samples if n == "mptok_http_requests_total" and ls["code"].startswith("5")}
    assert set(server_errors) <= {"503"}, server_errors
    assert total(samples, "mptok_frontend_restarts_total") == 0
    log = server.log()
    assert "traceback=" not in log and "level=ERROR" not in log and "level=CRITICAL" not in log, log[-3000:]

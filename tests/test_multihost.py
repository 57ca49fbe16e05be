"""Several hosts behind nginx: deploy/nginx-multihost.conf with two real `mptok serve`.

Two supervisors play the two hosts, one on 127.0.0.1 and one on 127.0.0.2
(each `--frontends 2`, so routing inside a host is exercised too), behind a
real nginx started here from the template on a free port (its own prefix dir
in tmp_path, `nginx -p ... -c ... -g 'daemon off;'`, always killed on
teardown). Conversations go through nginx with a new connection per turn and
an X-Session-Id header; every id list must equal local full tokenization,
every turn of a conversation must be answered by one host (nginx's
X-Mptok-Upstream header, and each host's own /metrics), and the turns that
can hit must hit (>= 95%).

nginx is required: without it this test FAILS (`make test` installs nginx-light: scripts/ensure_nginx.sh).
"""

from __future__ import annotations

from pathlib import Path

import orjson

import mptok
from mptok.api.chat_template import ChatTemplate
from mptok_harness.nginx import Nginx, nginx_binary, render_nginx
from mptok_harness.serve import Server, free_port, request, scrape, total, wait_for_snapshots

REPO = Path(__file__).resolve().parents[1]

TEMPLATE = REPO / "deploy" / "nginx-multihost.conf"
HOSTS = ("127.0.0.1", "127.0.0.2")
CONVERSATIONS, TURNS = 10, 8


def _conversations(tokenizer, template: ChatTemplate) -> list[tuple[str, list[tuple[bytes, list[int]]]]]:
    """Message lists growing by a tool output or an answer of real text (README, docs,
    stdlib sources); some turns add a second tool output, replacing the generation prompt."""
    docs = (REPO / "README.md").read_text() + (REPO / "docs" / "SERVE.md").read_text()
    code = (Path(__import__("sysconfig").get_paths()["stdlib"]) / "http" / "client.py").read_text()
    out = []
    for c in range(CONVERSATIONS):
        messages = [{"role": "system", "content": docs[c * 500 : c * 500 + 3000]}, {"role": "user", "content": f"task {c}: read the client."}]
        turns = []
        for t in range(TURNS):
            if t:
                if t % 3 == 1:
                    messages.append({"role": "assistant", "content": docs[4000 + 700 * t + 31 * c :][:700]})
                else:  # a tool output; t % 3 == 0 follows another: the generation prompt is replaced
                    messages.append({"role": "user", "content": "<tool_output>\n" + code[1000 * t + 97 * c :][:1000] + "\n</tool_output>"})
            text = template.render(tokenizer, messages, True)
            turns.append((orjson.dumps({"messages": messages, "add_generation_prompt": True}), tokenizer(text, add_special_tokens=False)["input_ids"]))
        out.append((f"multihost-{c}", turns))
    return out


def test_nginx_spreads_conversations_over_hosts_and_each_sticks_to_one(tmp_path: Path) -> None:
    assert nginx_binary() is not None, (
        "nginx is not installed, and this test needs a real nginx: install it with "
        "`apt-get install -y nginx-light` (Debian; or `nginx`); `make test` does (scripts/ensure_nginx.sh)."
    )
    tokenizer = mptok.load_tokenizer()
    conversations = _conversations(tokenizer, ChatTemplate.for_tokenizer(tokenizer))
    servers = []
    nginx = None
    try:
        for i, host in enumerate(HOSTS):
            # Every turn to its owner's cache (the policy under test here; the
            # default also keeps copies where turns land: docs/ROUTING.md).
            args = ("--host", host, "--frontends", "2", "--routing", "always")
            servers.append(Server(tmp_path / f"host-{i}.log", *args, wait_ready=False))
        for server in servers:
            server.wait_for_log(r"event=ready ")
        port = free_port()
        upstreams = [f"{host}:{server.port}" for host, server in zip(HOSTS, servers)]
        config = render_nginx(TEMPLATE, f"127.0.0.1:{port}", [f"{u} max_fails=1 fail_timeout=10s" for u in upstreams])
        assert "hash $http_x_session_id consistent;" in config
        (tmp_path / "nginx").mkdir()
        nginx = Nginx(tmp_path / "nginx", config, port)

        hosts_of: dict[str, set[str]] = {}
        wrong = []
        for turn in range(TURNS):  # interleaved, as concurrent agents would be
            for session, turns in conversations:
                body, expected = turns[turn]
                status, payload, headers = request(port, "POST", "/tokenize", body, {"X-Session-Id": session}, timeout_s=120.0)
                assert status == 200, (status, payload[:300], nginx.log()[-2000:])
                if orjson.loads(payload)["tokens"] != expected:
                    wrong.append((session, turn))
                hosts_of.setdefault(session, set()).add(headers.get("x-mptok-upstream"))
        assert not wrong, f"wrong ids: {wrong}"
        assert all(len(h) == 1 and None not in h for h in hosts_of.values()), f"a conversation on several hosts: {hosts_of}"
        used = {next(iter(h)) for h in hosts_of.values()}
        assert used == set(upstreams), f"consistent hashing used {used} of {upstreams} for {CONVERSATIONS} conversations"

        # Each host's own counters: the turns it tokenized are exactly those of its conversations.
        wait_for_snapshots()
        hits = misses = 0.0
        for upstream, (host, server) in zip(upstreams, zip(HOSTS, servers)):
            samples = scrape(server.port, host=host)
            mine = sum(1 for h in hosts_of.values() if upstream in h)
            h, m, u = (total(samples, f"mptok_cache_{k}_total") for k in ("hits", "misses", "uncached"))
            assert h + m + u == mine * TURNS, (upstream, h, m, u, mine)
            assert total(samples, "mptok_route_failures_total") == 0
            hits, misses = hits + h, misses + m
        can_hit = CONVERSATIONS * (TURNS - 1)
        assert hits >= 0.95 * can_hit, f"{hits} hits of {can_hit} turns that can hit ({misses} misses)"
    finally:
        if nginx is not None:
            nginx.stop()
        for server in servers:
            server.kill()

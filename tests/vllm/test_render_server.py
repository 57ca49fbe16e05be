"""vLLM's render server (``vllm launch render``) with ``--tokenizer-mode mptok``: vLLM's ids, the cache alone.

The render server is vLLM's GPU-less front (what a router such as llm-d's
calls to turn requests into ids): one process, no engine, so it runs where
vLLM's engine cannot (the CUDA builds of 0.33 and 0.34 on a machine without
a GPU, ``make test-vllm-render``), and on vLLM 0.32's CPU build as well.
One render server without the switch answers every request of
``test_plugin.CASES`` (agentic chats with tool turns, ``add_special_tokens``
both ways, ``continue_final_message``, ``chat_template_kwargs``, completion
and ``/tokenize`` renders), and agentic chats with tool turns in the other
two formats the render server takes (Anthropic's ``/v1/messages/render``,
OpenAI's ``/v1/responses/render``), and is stopped; then one with the switch
on the same model directory must give every request the same ids, with its cache
alone (one process: nothing routed) hitting on the agents' later turns, as
its ``/metrics`` shows. vLLM's own fastokens backend (``VLLM_USE_FASTOKENS=1``)
must agree too. Expected ids always come from vLLM without the switch.
A vLLM that reports a release the plugin was not tested with starts with a
warning and the same ids; one whose renderer no longer matches the plugin's
override refuses to start, naming it.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mptok.vllm.compat import TESTED_RELEASES
from mptok_harness.vllm import VllmServer

from render_cases import API_CASES, LATER_TURNS, WITHOUT_OFFSETS, answer_every_format, render_server
from test_plugin import CASES, _scraped

FAILED_START_TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def plain_ids(render_plain_ids: dict[str, list[int]]) -> dict[str, list[int]]:
    return render_plain_ids


@dataclass(frozen=True)
class Switched:
    """What the render server with the switch answered, logged and counted; it is stopped by then."""

    ids: dict[str, list[int]]
    log: str
    series: dict[str, dict[str, float]]


@pytest.fixture(scope="module")
def switched(model_dir: Path, logs_dir: Path, plain_ids: dict[str, list[int]]) -> Switched:
    with render_server(model_dir, logs_dir / "render-mptok.log", mptok=True) as server:
        ids = answer_every_format(server)
        # The counters are copied to /metrics one series after another every
        # 0.5 s; mptok_direct_prompts_total after the cache's (the catalogue's order).
        _scraped(server, "mptok_cache_hits_total", LATER_TURNS)
        series = _scraped(server, "mptok_direct_prompts_total", len(CASES) - len(WITHOUT_OFFSETS))
        return Switched(ids, server.log(), series)


def _fastokens_installed() -> bool:
    return importlib.util.find_spec("fastokens") is not None and importlib.util.find_spec("vllm.tokenizers.fastokens") is not None


@pytest.fixture(scope="module")
def fastokens_ids(model_dir: Path, logs_dir: Path) -> dict[str, list[int]]:
    if not _fastokens_installed():
        pytest.skip("needs fastokens and a vLLM with VLLM_USE_FASTOKENS")
    log_path = logs_dir / "render-fastokens.log"
    with render_server(model_dir, log_path, mptok=False, env={"VLLM_USE_FASTOKENS": "1"}) as server:
        return answer_every_format(server, WITHOUT_OFFSETS)


@pytest.mark.parametrize("name", [*CASES, *API_CASES])
def test_every_request_gets_the_ids_of_the_render_server_without_the_switch(plain_ids, switched, name):
    assert switched.ids[name] == plain_ids[name]


def test_the_start_log_says_mptok_is_on_with_the_cache_alone(switched):
    assert switched.log.count("mptok is on (--tokenizer-mode mptok)") == 1, switched.log[-3000:]
    assert "routing off: one API server" in switched.log
    assert "cache max_bytes=" in switched.log


def test_its_metrics_show_the_cache_hitting_on_later_turns_with_nothing_routed(switched):
    series = switched.series
    assert set(series["mptok_prompts_total"]) == {"0"}, series["mptok_prompts_total"]
    assert sum(series["mptok_cache_hits_total"].values()) >= LATER_TURNS, series
    assert sum(series["mptok_cache_tokens_reused_total"].values()) > 0, series
    assert sum(series.get("mptok_routed_total", {}).values()) == 0, series
    # The requests for token offsets go down vLLM's own path.
    assert sum(series["mptok_direct_prompts_total"].values()) >= len(CASES) - len(WITHOUT_OFFSETS), series


def test_vllm_with_fastokens_gives_the_ids_mptok_gives(switched, fastokens_ids):
    assert {name: switched.ids[name] for name in fastokens_ids} == fastokens_ids
    assert set(fastokens_ids) == {*WITHOUT_OFFSETS, *API_CASES}


# Runs vLLM's CLI in a process whose vLLM reports another version
# (argv: the CLI, the version, then its arguments), and with
# MPTOK_TEST_RESIGN set, whose renderer calls _tokenize_prompt with one
# more parameter, as a later vLLM might.
_AS_VERSION = (
    "import os, runpy, sys, vllm.version\n"
    "sys.argv = sys.argv[1:]\n"
    "vllm.version.__version__ = sys.argv.pop(1)\n"
    "if os.environ.get('MPTOK_TEST_RESIGN'):\n"
    "    import vllm.renderers.base as base\n"
    "    base.BaseRenderer._tokenize_prompt = lambda self, prompt, params, lora_request=None: None\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def _as_version(server: VllmServer, version: str) -> VllmServer:
    server.args = [sys.executable, "-c", _AS_VERSION, server.args[1], version, *server.args[2:]]
    return server


def test_an_untested_release_with_every_hook_starts_with_a_warning_and_vllms_ids(model_dir, logs_dir, plain_ids):
    """The render server is one process, so the version it reports is the one the plugin checks."""
    with _as_version(render_server(model_dir, logs_dir / "render-untested.log", mptok=True), "0.99.0") as server:
        ids = answer_every_format(server, {name: CASES[name] for name in list(CASES)[:4]})
        log = server.log()
    assert f"--tokenizer-mode mptok was tested with vLLM {TESTED_RELEASES}, not 0.99.0" in log, log[-3000:]
    assert log.count("mptok is on (--tokenizer-mode mptok)") == 1
    assert ids == {name: plain_ids[name] for name in ids}


def test_a_vllm_lacking_a_hook_refuses_to_start_naming_it(model_dir, logs_dir):
    server = _as_version(render_server(model_dir, logs_dir / "render-resigned.log", mptok=True, env={"MPTOK_TEST_RESIGN": "1"}), "0.99.0")
    server.launch()
    assert server.process is not None
    try:
        code = server.process.wait(FAILED_START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        server.stop()
    assert code not in (None, 0), server.log_tail()
    log = server.log()
    assert "--tokenizer-mode mptok cannot run on vLLM 0.99.0" in log, server.log_tail()
    assert "HfRenderer._tokenize_prompt(prompt, params): takes (prompt, params, lora_request)" in log, server.log_tail()

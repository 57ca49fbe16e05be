"""Every command the README names runs to its end, in a short form: ``make smoke``.

Why it exists: CI ran the tests but not the scripts the README points at, so
a benchmark could break (an import, a renamed helper) and nothing noticed.
Each test runs one README command as a real subprocess from the repository's
root, with real tokenizers and real servers:

- ``make run``: the server answers the README's chat turns with the ids of
  full tokenization, then stops cleanly on Ctrl-C (SIGINT);
- ``make bench``, ``bench-turn``, ``bench-memory``, ``replay``, ``replay-long``, ``replay-capacity``,
  ``drill``: the script each target runs, with ``--smoke`` (scripts/smoke.py:
  a small workload, one run, no report written; a non-zero exit on an error
  or a wrong id); ``replay-capacity`` runs three commands that differ only in
  their options, and its smoke form is the first;
- ``examples/owners.py``, as the README runs it.

The commands are read from the Makefile (``make -n``), so a target and its
short form cannot drift apart. ``make test`` leaves this directory out
(``addopts`` in pyproject.toml); ``make smoke`` runs it, after installing
nginx for the replays. ``make test-vllm`` and ``make test-vllm-render`` run
whole in CI.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
from pathlib import Path

import pytest

import mptok
from mptok.api.chat_template import ChatTemplate
from mptok_harness.checks import HANG_GUARD_S, expected_ids
from mptok_harness.serve import Server, tokenize

ROOT = Path(__file__).resolve().parents[2]
BIN = ".venv/bin/"  # the Makefile's
RESULTS = ROOT / "docs" / "results"
SMOKE_TIMEOUT_S = 300.0  # a guard: the longest smoke form, the replay, takes about 2 minutes on busy cores
# The README's first conversation: a system prompt long enough to be cached, then two turns.
SYSTEM = "You are a careful assistant who answers in short sentences. " * 6
README_TURNS = (
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "What is a token?"},
    ],
)


def make_commands(target: str) -> list[list[str]]:
    """The commands of .venv/bin (pip aside) that ``make <target>`` runs, printed
    by ``make -n`` (not run), with no ARGS and none of the flags of a make that
    runs this test (``make smoke ARGS=...`` exports both); the program's path
    made absolute."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    printed = subprocess.run(
        ["make", "--no-print-directory", "-n", target, "ARGS="], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    commands = [shlex.split(line) for line in printed.splitlines() if line.startswith(BIN) and not line.startswith(BIN + "pip")]
    return [[str(ROOT / program), *args] for program, *args in commands]


def results_written() -> dict[str, int]:
    """Each report under docs/results and when it was last written."""
    return {path.name: path.stat().st_mtime_ns for path in RESULTS.iterdir()}


def run_to_the_end(command: list[str]) -> None:
    """Run ``command`` from the repository's root; fail with its output's tail unless it exits 0."""
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S, check=False)
    assert done.returncode == 0, f"{shlex.join(command)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def test_make_run_answers_the_readme_turns_exactly_and_stops_on_ctrl_c(tmp_path: Path):
    [serve] = make_commands("run")
    tokenizer = mptok.load_tokenizer()
    template = ChatTemplate.for_tokenizer(tokenizer)
    with Server(tmp_path / "serve.log", "--frontends", "2", command=serve) as server:
        for messages in README_TURNS:
            answer = tokenize(server.port, {"messages": messages})
            rendered = template.render(tokenizer, messages, add_generation_prompt=True)
            assert answer["tokens"] == expected_ids(tokenizer, rendered)
        server.process.send_signal(signal.SIGINT)
        assert server.wait(HANG_GUARD_S) == 0, server.log()[-3000:]
        assert "event=stopped" in server.log()


@pytest.mark.parametrize("target", ["bench", "bench-turn", "bench-memory", "replay", "replay-long", "replay-capacity", "drill"])
def test_benchmark_runs_to_its_end_in_its_smoke_form_and_writes_no_report(target: str):
    command = make_commands(target)[0]
    before = results_written()
    run_to_the_end([*command, "--smoke"])
    assert results_written() == before


def test_owners_example_routes_a_first_landing_and_extends_the_copy_it_kept():
    """examples/owners.py as the README runs it: two frontend processes, six
    turns of one conversation alternating between them; the other frontend
    routes its first turn to the owner, keeps the answer, and extends that
    copy for its next two turns."""
    done = subprocess.run(
        [str(ROOT / BIN / "python"), "examples/owners.py"], cwd=ROOT,
        capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    owner = mptok.owner_of("conversation-1", 2)
    lines = done.stdout.splitlines()
    assert lines[0] == f"conversation-1 is owned by frontend {owner}"
    assert f"frontend {owner}: routed 0, kept here 0, owned here 3, cache hits 3, misses 1" in lines
    assert f"frontend {1 - owner}: routed 1, kept here 2, owned here 0, cache hits 2, misses 0" in lines

"""The engine memo: a start's verdict on the fast engines, read by the next start on the machine.

Real processes and real tokenizers: ``mptok serve`` for what a server's
starts decide and say, a process that loads a tokenizer as a library user
does for what a memo that cannot be used does. Each test has a memo
directory of its own (the session's, in conftest.py, is shared by every
other test and not touched here).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time

import pytest

from mptok.engines.memo import LOCK_WAIT_S, MAX_AGE_S, RETRY_S
from mptok.engines.timing import MARGIN, ROUNDS, choose
from mptok_harness.checks import HANG_GUARD_S, expected_ids
from mptok_harness.serve import REPO, Server, scrape, tokenize, wait_for_snapshots

# A process that loads a tokenizer (the embedded one, or the file given) as
# the library does, tokenizes a short text and, with --long, a text past the
# long-text threshold twice (the second time by the long texts' engine once
# it is loaded), compares every id list with the tokenizer's own, and prints
# what it chose as JSON on its last line.
_LIBRARY_START = r"""
import json, logging, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
import mptok
from mptok.cache.backend import backend_for
from mptok.engines.choice import LONG_TEXT_CHARS
from mptok_harness.vllm_requests import text_source
args = sys.argv[1:]
tokenizer = mptok.load_tokenizer(None if args[0] == "-" else args[0])
backend = backend_for(tokenizer, "auto")
texts = [text_source(3)(2_000)]
if "--long" in args:
    texts += [text_source(4)(LONG_TEXT_CHARS + 50_000)] * 2
for i, text in enumerate(texts):
    if i == 2:
        deadline = time.monotonic() + 120
        while backend.engines.names != backend.engines.chosen_names and time.monotonic() < deadline:
            time.sleep(0.05)
    assert backend.encode_ids(text) == tokenizer(text, add_special_tokens=False)["input_ids"], i
print(json.dumps({"engines": backend.engines.names, "chosen": backend.engines.chosen_names}))
"""


def _library_start(memo: object, *args: str, tokenizer: str = "-") -> tuple[dict, str]:
    """Run ``_LIBRARY_START`` with ``MPTOK_ENGINE_MEMO=memo``: (what it chose, its log)."""
    [(chosen, log, _)] = _library_starts(1, memo, *args, tokenizer=tokenizer)
    return chosen, log


def _library_starts(count: int, memo: object, *args: str, tokenizer: str = "-") -> list[tuple[dict, str, int]]:
    """``count`` runs of ``_LIBRARY_START`` started at once: (what each chose, its log, its pid)."""
    starts = [
        subprocess.Popen(
            [sys.executable, "-c", _LIBRARY_START, tokenizer, *args],
            cwd=REPO,
            env=dict(os.environ, MPTOK_ENGINE_MEMO=str(memo)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]
    ran = []
    for start in starts:
        try:
            out, log = start.communicate(timeout=HANG_GUARD_S)
        finally:
            start.kill()
        assert start.returncode == 0, log[-3000:]
        ran.append((json.loads(out.splitlines()[-1]), log, start.pid))
    return ran


def _backend_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "tokenizer backend for " in line]


def _memo_files(directory) -> list:
    return sorted(directory.glob("engines-*.json"))


@pytest.fixture(scope="module")
def decided(tmp_path_factory):
    """A memo directory in which one start decided the embedded tokenizer's engines (read-only: copy it)."""
    memo = tmp_path_factory.mktemp("decided") / "memo"
    _, log = _library_start(memo)
    assert "decided at this start, kept in the engine memo" in log, log[-3000:]
    return memo


@pytest.fixture
def memo(decided, tmp_path):
    """A copy of ``decided`` for one test to change."""
    return shutil.copytree(decided, tmp_path / "memo")


def test_a_second_start_reads_the_verdict_the_first_kept(tmp_path, tokenizer):
    memo = tmp_path / "memo"
    env = {"MPTOK_ENGINE_MEMO": str(memo)}
    first_engines, first_log = _serve(tmp_path / "first.log", 2, env, tokenizer)
    [path] = _memo_files(memo)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(memo.stat().st_mode) == 0o700
    verdict = json.loads(path.read_bytes())["verdict"]
    lines = _backend_lines(first_log)
    assert len(lines) == 2, first_log[-3000:]
    decided = [line for line in lines if f"decided at this start, kept in the engine memo {path}" in line]
    read = [line for line in lines if f"from the engine memo {path}, decided by pid " in line]
    # Two frontends start at once: one decides while the other waits for its
    # verdict, unless it waited longer than the lock allows.
    if f"held for more than {LOCK_WAIT_S:g} s" not in first_log:
        assert len(decided) == 1 and len(read) == 1, lines
        assert {engines["short"] for engines in first_engines.values()} == {verdict["short"]}, first_engines

    written = path.stat().st_mtime_ns
    engines, second_log = _serve(tmp_path / "second.log", 1, env, tokenizer)
    [line] = _backend_lines(second_log)
    assert f"from the engine memo {path}, decided by pid " in line, line
    chosen = verdict["short"] if verdict["long"] == verdict["short"] else f"{verdict['short']}, {verdict['long']} for texts"
    assert re.search(rf"tokenizer backend for \S+: {chosen}", line), line
    assert path.stat().st_mtime_ns == written  # read, not decided again
    # The metric says what tokenizes now: a frontend loads the long texts'
    # engine before it listens, not on the first long text.
    assert engines == {"0": {"short": verdict["short"], "long": verdict["long"]}}, engines


def test_the_long_texts_engine_a_memo_names_is_loaded_on_the_first_long_text_and_exact(memo):
    chosen, log = _library_start(memo, "--long")
    [line] = _backend_lines(log)
    assert "from the engine memo" in line, line
    verdict = json.loads(_memo_files(memo)[0].read_bytes())["verdict"]
    assert chosen["chosen"] == {"short": verdict["short"], "long": verdict["long"]}
    assert chosen["engines"] == chosen["chosen"], log[-3000:]


def _plant(memo, **fields) -> tuple:
    """Change the kept verdict's ``fields``: (its path, the verdict as changed)."""
    [path] = _memo_files(memo)
    kept = json.loads(path.read_bytes())
    kept["verdict"].update(fields)
    path.write_text(json.dumps(kept))
    return path, kept["verdict"]


def test_a_memo_older_than_its_age_is_decided_again_by_one_of_two_starts_at_once(memo):
    """Two starts find a stale verdict at once: one decides it again (timing
    the engines that passed, with the load it was decided under), the other
    waits and reads that verdict."""
    path, planted = _plant(memo, decided_at=time.time() - MAX_AGE_S - 3600, report="planted")
    assert len(planted["passed"]) == 2, planted  # else there is nothing to decide again
    starts = _library_starts(2, memo)
    if any(f"held for more than {LOCK_WAIT_S:g} s" in log for _, log, _ in starts):
        pytest.skip("a start waited longer than the lock allows")
    lines = [_backend_lines(log) for _, log, _ in starts]
    assert all(len(found) == 1 for found in lines), lines
    again = [pid for (_, _, pid), [line] in zip(starts, lines) if "decided again (it was decided 7.0 days ago" in line]
    assert len(again) == 1, lines
    read = [line for [line] in lines if f"from the engine memo {path}, decided by pid {again[0]} " in line]
    assert len(read) == 1, lines
    verdict = json.loads(path.read_bytes())["verdict"]
    assert verdict["decided_by"] == again[0] and verdict["report"] != "planted"
    assert verdict["passed"] == planted["passed"]  # timed again, not checked again
    assert verdict["load"] >= 0 and verdict["spread"] >= 0
    assert f"load average {verdict['load']:.2f} per CPU" in verdict["report"]
    assert {chosen["chosen"]["short"] for chosen, _, _ in starts} == {verdict["short"]}


def test_a_memo_decided_under_load_is_decided_again_once_quieter_and_not_sooner(memo):
    """A verdict decided at a load no machine here has now: read as it is
    while it is younger than RETRY_S, decided again after."""
    path, _ = _plant(memo, load=1000.0, decided_at=time.time() - 60, report="planted")
    written = path.stat().st_mtime_ns
    _, log = _library_start(memo)
    [line] = _backend_lines(log)
    assert f"from the engine memo {path}" in line and "planted" in line, line
    assert path.stat().st_mtime_ns == written

    _plant(memo, decided_at=time.time() - RETRY_S - 60)
    _, log = _library_start(memo)
    [line] = _backend_lines(log)
    assert "decided again (it was decided at a load average of 1000.00 per CPU" in line, line
    verdict = json.loads(path.read_bytes())["verdict"]
    assert verdict["report"] != "planted" and verdict["load"] < 1000


@pytest.mark.parametrize("incumbent", ["fastokens", "gigatoken"])
def test_the_incumbent_stays_unless_beaten_by_the_margin(incumbent):
    """The choice from given per-round CPU times: a challenger within the
    margin, or cheaper in fewer than half the rounds, does not replace the
    incumbent; one cheaper by more than the margin in most rounds does."""
    challenger = "gigatoken" if incumbent == "fastokens" else "fastokens"
    base = [0.003 + 0.0001 * i for i in range(ROUNDS)]
    close = [t * (1 - MARGIN / 2) for t in base]
    assert choose({incumbent: base, challenger: close}, incumbent).chosen == incumbent
    spikes = [t * 0.3 if i < ROUNDS // 2 else t * 1.1 for i, t in enumerate(base)]  # a busy moment in a few rounds
    assert choose({incumbent: base, challenger: spikes}, incumbent).chosen == incumbent
    cheaper = [t * (1 - 2 * MARGIN) for t in base]
    comparison = choose({incumbent: base, challenger: cheaper}, incumbent)
    assert comparison.chosen == challenger and comparison.ratios[challenger] < 1 - MARGIN and comparison.spread < 0.01


def test_a_corrupt_memo_is_ignored_and_decided_again(memo):
    [path] = _memo_files(memo)
    path.write_bytes(path.read_bytes()[:100])
    _, log = _library_start(memo)
    assert re.search(rf"WARNING mptok.engines.memo engine memo {path} is not used: ", log), log[-3000:]
    [line] = _backend_lines(log)
    assert f"decided at this start, kept in the engine memo {path}" in line, line
    assert json.loads(path.read_bytes())["verdict"]["short"]  # whole again


def test_a_memo_written_for_another_key_is_not_used(memo):
    [path] = _memo_files(memo)
    kept = json.loads(path.read_bytes())
    kept["key"]["packages"]["tokenizers"]["version"] = "0.0.0"  # as if written by another tokenizers
    kept["verdict"]["report"] = "planted"
    path.write_text(json.dumps(kept))
    _, log = _library_start(memo)
    assert f"engine memo {path} is not used: it was written for another key" in log, log[-3000:]
    [line] = _backend_lines(log)
    assert "planted" not in line and f"decided at this start, kept in the engine memo {path}" in line, line


def test_a_memo_directory_others_may_write_in_is_not_used(memo):
    memo.chmod(0o777)
    _, log = _library_start(memo)
    assert f"engine memo off: directory {memo} has mode 0777: group and others must not write in it" in log, log[-3000:]
    [line] = _backend_lines(log)
    assert "decided at this start, engine memo off" in line, line


def test_the_memo_turned_off_is_neither_read_nor_written():
    _, log = _library_start("off")
    [line] = _backend_lines(log)
    assert "decided at this start, engine memo off" in line, line
    assert "WARNING" not in log, log[-3000:]
    assert not (REPO / "off").exists()


def _serve(log, frontends: int, env: dict[str, str], tokenizer) -> tuple[dict[str, dict[str, str]], str]:
    """Start ``mptok serve``, check one prompt's ids, and stop it: (each
    frontend's engines on /metrics, its log)."""
    text = "Grüße aus Köln, 12345 \u6211\u4eec\u4eca\u5929 " * 40
    with Server(log, "--frontends", str(frontends), env=env) as server:
        answer = tokenize(server.port, {"prompt": text, "add_special_tokens": False})
        assert answer["tokens"] == expected_ids(tokenizer, text)
        wait_for_snapshots(server)
        return _engines_on_metrics(server.port), server.log()


def _engines_on_metrics(port: int) -> dict[str, dict[str, str]]:
    """Each frontend's engine of short and of long texts, as ``mptok_tokenizer_engine`` says."""
    engines: dict[str, dict[str, str]] = {}
    for name, labels, value in scrape(port):
        if name == "mptok_tokenizer_engine" and value == 1:
            engines.setdefault(labels["frontend"], {})[labels["texts"]] = labels["engine"]
    return engines

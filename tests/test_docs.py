"""What the README and docs/*.md name exists in the code, and what the code declares is documented.

A doc that names a metric no process exports, a variable nothing reads, a
``make`` target the Makefile lacks or an option no command takes sends an
operator after something that is not there. Each such name is read from the
docs and looked up where it is declared: the metric catalogue, the code that
reads the variables, the Makefile, the parsers of ``mptok`` and of the
scripts. The other way round, every series the catalogue declares is in
docs/SERVE.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from mptok.cache.config import ENV_PREFIX, CacheConfig
from mptok.cli import build_parser
from mptok.front.catalogue import FRONTEND_METRICS, SUPERVISOR_METRICS
from mptok.render.hits import ANSWERS_METRIC

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# Series the README says were renamed (old name: new name).
RENAMED_METRICS = {
    "mptok_held_reply_bytes": "mptok_held_fingerprint_bytes",
    "mptok_held_reply_entries": "mptok_held_fingerprint_entries",
    "mptok_held_reply_max_bytes": "mptok_held_fingerprint_max_bytes",
}
# Metrics the README says are gone (with the routing policy's cost model).
REMOVED_METRICS = {"mptok_crossing_choices_total"}
# vLLM's own options, which the docs name beside mptok's; mptok declares none of them.
VLLM_OPTIONS = {
    "--api-server-count", "--headless", "--middleware", "--model", "--shutdown-timeout", "--tokenizer-mode",
    "--trust-request-chat-template", "--uds",
}  # fmt: skip
# SGLang's own options, which the docs name beside mptok's (mptok sglang passes every one on).
SGLANG_OPTIONS = {"--enable-dynamic-batch-tokenizer", "--enable-metrics", "--model-path", "--tokenizer-worker-num"}


def _named(pattern: str, *, flags: int = 0) -> list[tuple[str, str]]:
    """(doc, name) for every match of ``pattern``'s first group in the docs."""
    return sorted({(path.name, name) for path in DOCS for name in re.findall(pattern, path.read_text(), flags)})


def _metric_names() -> set[str]:
    names = {f"{ANSWERS_METRIC}_total"}  # mptok render's own counter, beside the catalogue's
    for metric in FRONTEND_METRICS + SUPERVISOR_METRICS:
        names.add(metric.name)
        if metric.kind == "histogram":
            names.update(f"{metric.name}_{part}" for part in ("bucket", "sum", "count"))
    return names


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """Every long option of ``parser`` and of its subcommands."""
    found = set()
    for action in parser._actions:
        found.update(flag for flag in action.option_strings if flag.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                found |= _options(command)
    return found


def test_every_declared_series_is_in_the_serve_docs():
    docs = (REPO / "docs" / "SERVE.md").read_text()
    missing = [metric.name for metric in FRONTEND_METRICS + SUPERVISOR_METRICS if f"`{metric.name}" not in docs]
    assert missing == []


def test_every_metric_the_docs_name_is_exported():
    exported = _metric_names()
    for old, new in RENAMED_METRICS.items():
        assert old not in exported and new in exported, (old, new)
    assert not REMOVED_METRICS & exported
    named = _named(r"\b(mptok_[a-z0-9_]+)")
    unknown = [
        (doc, name) for doc, name in named
        if name != "mptok_harness" and not name.endswith("_") and name not in exported | set(RENAMED_METRICS) | REMOVED_METRICS
    ]  # fmt: skip
    assert unknown == []


def test_every_variable_the_docs_name_is_read():
    read = set()
    for path in [*(REPO / "mptok").rglob("*.py"), *(REPO / "scripts").glob("*.sh")]:
        read.update(re.findall(r"\bMPTOK_[A-Z0-9_]+\b", path.read_text()))
    read |= {ENV_PREFIX + field.name.upper() for field in dataclasses.fields(CacheConfig)}
    unknown = [(doc, name) for doc, name in _named(r"\b(MPTOK_[A-Z0-9_]+)") if not name.endswith("_") and name not in read]
    assert unknown == []


def test_every_make_target_the_docs_name_is_in_the_makefile():
    targets = set(re.findall(r"^([\w.-]+):", (REPO / "Makefile").read_text(), re.M))
    named = _named(r"`make ([\w.-]+)") + _named(r"^\s*make ([\w.-]+)", flags=re.M)
    assert named, "the docs name no make target: the pattern is wrong"
    assert [(doc, target) for doc, target in named if target not in targets] == []


@pytest.mark.parametrize("doc", [path.name for path in DOCS])
def test_every_option_a_doc_names_is_taken_by_a_command(doc):
    options = _options(build_parser()) | VLLM_OPTIONS | SGLANG_OPTIONS
    for path in [*(REPO / "scripts").glob("*.py"), *(REPO / "examples").glob("*.py")]:
        options.update(re.findall(r'add_argument\(\s*"(--[\w-]+)"', path.read_text()))
    named = [name for where, name in _named(r"(?<![\w-])(--[a-z][a-z0-9-]*[a-z0-9])") if where == doc]
    assert [name for name in named if name not in options] == []

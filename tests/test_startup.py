"""What ``mptok serve`` loads and refuses before it starts a frontend.

The supervisor only spawns and watches processes, so importing it loads
none of the tokenizer stack; and a bad ``MPTOK_*`` variable stops a real
``mptok serve`` before any frontend starts, with one line naming the
variable and its value, exit status 2, and no traceback or restarts.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import subprocess
import sys

import pytest

from mptok.cache.config import ENV_PREFIX, CacheConfig
from mptok_harness.checks import HANG_GUARD_S
from mptok_harness.serve import REPO, Server

# What a process that tokenizes loads and the supervisor must not.
_STACK = ("tokenizers", "numpy", "mptok.cache", "mptok.transport")


def _loaded_after(code: str) -> list[str]:
    probe = f"{code}; import sys; print(sorted(m for m in sys.modules if m.startswith({_STACK!r})))"
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S, check=True
    )
    return ast.literal_eval(result.stdout)


def test_importing_the_supervisor_loads_no_tokenizer_stack():
    assert _loaded_after("import mptok.supervise.supervisor") == []


def test_the_render_supervisor_spawns_its_processes_without_loading_the_stack():
    # What ``mptok render``'s supervisor does for each slot: ask its kind for
    # the spawn target and settings, and pickle them (spawn sends them by reference).
    loaded = _loaded_after(
        "import pickle, tempfile; from mptok.cli import build_parser; "
        "from mptok.render.frontends import RenderFrontends; "
        "from mptok.render.options import render_options; "
        "options = render_options(*build_parser().parse_known_args(['render', 'MODEL', '--frontends', '2'])); "
        "target, settings = RenderFrontends(options).target(0, tempfile.mkdtemp(), options.serve); "
        "pickle.dumps((target, settings))"
    )
    assert loaded == ["mptok.cache", "mptok.cache.config"]


def test_the_mptok_command_reads_the_cache_configuration_and_nothing_else_of_the_stack():
    # What ``mptok serve`` runs in its own process before it spawns: parse
    # the options, check the environment (the supervisor's preflight).
    loaded = _loaded_after(
        "from mptok.cli import parse_serve_options; "
        "from mptok.supervise import supervisor; "
        "supervisor._check_environment(parse_serve_options(['serve', '--frontends', '2']))"
    )
    assert loaded == ["mptok.cache", "mptok.cache.config"]


# Every variable mptok reads, a value it cannot take, and what the one line says of it.
BAD_VARIABLES = [
    ("MPTOK_CACHE_MAX_BYTES", "lots", "is not a size in bytes"),
    ("MPTOK_CACHE_MAX_HELD_BYTES", "0", "must be at least 1"),
    ("MPTOK_CACHE_MAX_ENTRIES", "many", "is not a whole number"),
    ("MPTOK_CACHE_MIN_CHARS", "-1", "must be at least 0"),
    ("MPTOK_CACHE_MAX_SEAM_ATTEMPTS", "1.5", "is not a whole number"),
    ("MPTOK_CACHE_TOKENIZER_BACKEND", "fastest", "must be one of auto, tokenizers, fastokens, gigatoken"),
    ("MPTOK_ROUTING", "sometimes", "must be one of always, kept, never"),
    ("MPTOK_LOG_LEVEL", "loud", "is not a log level"),
    ("MPTOK_ENGINE_MEMO", "relative/memo", "must be an absolute directory path, or 'off'"),
]


# Not mptok serve's: the SGLang plugin's switch, which `mptok sglang` sets for
# SGLang's processes (any value but "1" is off; test-sglang runs it both ways).
PLUGIN_SWITCHES = {"MPTOK_SGLANG"}


@pytest.mark.parametrize("variable, value, says", BAD_VARIABLES)
def test_a_bad_variable_stops_mptok_serve_with_one_line(tmp_path, variable, value, says):
    with Server(tmp_path / "serve.log", "--frontends", "2", wait_ready=False, env={variable: value}) as server:
        status = server.wait()
        log = server.log()
    assert status == 2, log
    assert "Traceback" not in log
    assert "frontend_started" not in log, "nothing starts on a configuration that cannot serve"
    lines = [line for line in log.splitlines() if line.startswith("mptok serve: cannot start:")]
    assert len(lines) == 1 and lines[0].startswith(f"mptok serve: cannot start: {variable}={value!r} {says}"), log


def test_every_variable_mptok_reads_is_among_the_bad_ones_above():
    read = set()
    for path in (REPO / "mptok").rglob("*.py"):
        read.update(name for name in re.findall(r"\bMPTOK_[A-Z_]+\b", path.read_text()) if not name.endswith("_"))
    read |= {ENV_PREFIX + field.name.upper() for field in dataclasses.fields(CacheConfig)}
    assert read - PLUGIN_SWITCHES == {variable for variable, _, _ in BAD_VARIABLES}


def test_a_bad_variable_is_read_when_the_cache_is_configured_not_at_import():
    # The library and the vLLM plugin import routing before they build a cache:
    # an import must not fail on the environment (it would be a traceback
    # from wherever the import happened).
    env = dict(os.environ, MPTOK_CACHE_TOKENIZER_BACKEND="fastest", MPTOK_CACHE_MAX_BYTES="lots")
    code = "import mptok, mptok.routing.owners, mptok.routing.router, mptok.serve.frontend"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, timeout=HANG_GUARD_S, check=True)

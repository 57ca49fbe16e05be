#!/bin/sh
# The SGLang tests' and benchmark's venv (`make test-sglang`, `make
# bench-sglang`): SGLang 0.5.23 (SGLANG overrides) and fastokens (its
# `--tokenizer-backend fastokens`), kept once per machine by
# scripts/engine_venv.sh (about 5 minutes and 11 GB the first time), and
# this checkout's mptok in VENV (default .venv-sglang).
set -eu
exec "$(dirname "$0")/engine_venv.sh" "${1:-.venv-sglang}" sglang "${SGLANG:-sglang==0.5.23}" fastokens==0.3.5

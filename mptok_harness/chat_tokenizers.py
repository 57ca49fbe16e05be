"""Tokenizer directories with chat templates that use tools, for the vLLM-contract tests.

No packaged tokenizer here carries a chat template, and vLLM's contract is
about what a template does with ``tools``, ``continue_final_message`` and
``chat_template_kwargs``. So each directory here is what a model repository
holds: a ``tokenizer.json`` built by ``families`` and a
``tokenizer_config.json`` with the special tokens, a context length and a
realistic chat template of our own:

- ``chatml_tools``: the ``qwen`` family (adds no special tokens) with a
  ChatML template in the style of Qwen's: tools as JSON lines inside
  ``<tools>`` in the system turn, assistant tool calls as ``<tool_call>``
  JSON, tool results inside ``<tool_response>``, and an ``enable_thinking``
  switch read from ``chat_template_kwargs``. ``model_max_length`` 32768.
- ``bos_tools``: the ``metaspace_always_nosplit`` family, whose
  post-processor wraps every sequence in ``<s> ... </s>`` (so
  ``add_special_tokens`` changes the ids), with a template that starts with
  ``bos_token``, prints the tools as one JSON list, and closes assistant
  turns with ``eos_token``. No ``model_max_length`` (transformers then
  reports int(1e30)).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mptok_harness.families import _recipe, _tokenizer_file

CHATML_TOOLS_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- '\\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role in ('user', 'system') or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for call in message.tool_calls %}
            {{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
            {{- call.function.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- else %}
        {{- raise_exception('unknown role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and not enable_thinking %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

BOS_TOOLS_TEMPLATE = """\
{{ bos_token }}
{%- if tools %}[AVAILABLE_TOOLS] {{ tools | tojson }} [/AVAILABLE_TOOLS]{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|im_start|>assistant {{ message.content }}
{%- for call in message.tool_calls or [] %}[TOOL_CALLS] {{ call.function | tojson }}{% endfor %}{{ eos_token }}
{%- else %}<|im_start|>{{ message.role }} {{ message.content }}<|im_end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant {% endif %}
"""

CHAT_TOKENIZERS = {
    "chatml_tools": ("qwen", CHATML_TOOLS_TEMPLATE, 32768),
    "bos_tools": ("metaspace_always_nosplit", BOS_TOOLS_TEMPLATE, None),
}


def write_chat_tokenizer(name: str, directory: Path, *, small: bool = False) -> Path:
    """Write tokenizer directory ``name`` (see the module docstring) into
    ``directory``; returns it. ``small``: ``chatml_tools`` on the pieces of
    ``bytelevel_prefix`` without its prefix space (qwen has none), the same
    special tokens, a few thousand pieces where qwen has 248k (which take
    seconds to load in every process)."""
    family, template, model_max_length = CHAT_TOKENIZERS[name]
    directory.mkdir(parents=True, exist_ok=True)
    if small:
        assert name == "chatml_tools", name
        spec = json.loads(_tokenizer_file("bytelevel_prefix").read_text(encoding="utf-8"))
        for part in ("pre_tokenizer", "post_processor", "decoder"):
            spec[part]["add_prefix_space"] = False
        (directory / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    else:
        shutil.copyfile(_tokenizer_file(family), directory / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, **_recipe(family).hf_special}
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")
    return directory

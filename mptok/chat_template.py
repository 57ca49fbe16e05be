"""Turn a chat (``messages``) into the prompt text the model sees.

``POST /tokenize`` accepts ``messages`` the way vLLM's does, so the frontend
needs a chat template: ``--chat-template FILE``, else the tokenizer's own
(``tokenizer_config.json``), else, for the embedded DeepSeek V3-family
tokenizer whose config carries none, ``DEEPSEEK_V3_TEMPLATE`` below, written
for its added tokens. A tokenizer with none of these answers ``messages``
with a clear 400, never with a guessed format.

Rendering goes through transformers' ``apply_chat_template(...,
tokenize=False)``, the same sandboxed Jinja environment vLLM uses, so a
template renders here as it does there. It never touches the Rust
tokenizer, so threads may render concurrently.
"""

from __future__ import annotations

from typing import Any

import jinja2
import jinja2.sandbox

# DeepSeek V3's template without its tool-call branches: the begin-of-sentence
# token, system prompts joined by blank lines, "<｜User｜>" before each user
# message, "<｜Assistant｜>" ... "<｜end▁of▁sentence｜>" around each answer
# (text before "</think>" dropped, as V3 does), and "<｜Assistant｜>" as the
# generation prompt.
DEEPSEEK_V3_TEMPLATE = (
    "{%- set ns = namespace(system_prompt='', is_first_sp=true) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- if ns.is_first_sp -%}{%- set ns.system_prompt = message['content'] -%}{%- set ns.is_first_sp = false -%}"
    "{%- else -%}{%- set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] -%}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "<｜begin▁of▁sentence｜>{{ ns.system_prompt }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{ '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{%- set content = message['content'] -%}"
    "{%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1] -%}{%- endif -%}"
    "{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}"
    "{%- elif message['role'] != 'system' -%}"
    "{{ raise_exception('unsupported role ' + message['role'] + ': use system, user or assistant') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<｜Assistant｜>' }}{%- endif -%}"
)

# The added tokens DEEPSEEK_V3_TEMPLATE writes; a tokenizer without them gets no default.
_DEEPSEEK_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered: the template refused them, or there is no template."""


def check_template_source(source: str) -> None:
    """Raise ``ChatTemplateError`` naming the line if ``source`` is not valid Jinja."""
    try:
        jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template line {e.lineno}: {e.message}") from None


class ChatTemplate:
    """Renders ``messages`` to prompt text with one fixed template (or refuses: no template)."""

    def __init__(self, source: str | None, origin: str):
        if source is not None:
            check_template_source(source)
        self.source = source
        self.origin = origin

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, override: str | None = None) -> ChatTemplate:
        """``override``, else the tokenizer's template, else the DeepSeek V3 default
        if the tokenizer has its added tokens, else no template."""
        if override is not None:
            return cls(override, "--chat-template")
        own = getattr(tokenizer, "chat_template", None)
        if isinstance(own, str) and own:
            return cls(own, "tokenizer")
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        if all(token in vocab for token in _DEEPSEEK_TOKENS):
            return cls(DEEPSEEK_V3_TEMPLATE, "built-in deepseek-v3")
        return cls(None, "none")

    def render(self, tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """The prompt text; ``ChatTemplateError`` if the template refuses the messages."""
        if self.source is None:
            raise ChatTemplateError(
                "this tokenizer has no chat template: send a prompt, or start the server with --chat-template FILE"
            )
        try:
            text = tokenizer.apply_chat_template(
                messages, chat_template=self.source, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template refused the messages: {e}") from None
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, not str")
        return text

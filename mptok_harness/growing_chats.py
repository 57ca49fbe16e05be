"""Conversations of real text that grow by about TOKENS_PER_TURN tokens a turn.

Why a module of its own: the fault drill (scripts.fault_drill) sends them to
``mptok serve`` under faults, and the conversations scripts and tests build
live in ``mptok_harness`` (``conversations``, ``prompts``, this one).

Each turn adds a user message and an answer, both cut from the text, between
the family's chat markers; every prompt ends with a generation prompt
(``assistant\\n<think>\\n``) that the next turn replaces, as chat templates do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

TOKENS_PER_TURN = 300
_SAMPLE_CHARS = 100_000  # enough text to measure characters per token on


@dataclass(frozen=True)
class GrowingChat:
    """The last prompts of one chat, and unrelated text as long as the last prompt
    (cut from after the chat's own text: other work of the same size)."""

    prompts: list[str]
    unrelated: str


def growing_chat(
    text: str,
    count_tokens: Callable[[str], int],
    markers: tuple[str, str],
    target_tokens: int,
    turns: int,
) -> GrowingChat:
    """The last ``turns`` prompts of a chat cut from the start of ``text``, growing
    by about TOKENS_PER_TURN tokens a turn up to about ``target_tokens``.

    ``count_tokens`` gives the token count of a text (without special tokens);
    ``markers`` are the chat's (start, end) markers, as in
    ``mptok_harness.families.CHAT_MARKERS``."""
    start, end = markers
    sample = text[:_SAMPLE_CHARS]
    chars_per_token = len(sample) / count_tokens(sample)
    step = int(TOKENS_PER_TURN * chars_per_token) // 2  # a user message and an answer per turn
    total = int(target_tokens * chars_per_token)
    history, cursor, prompts = f"{start}system\nYou are a helpful assistant.{end}\n", 0, []
    while len(history) < total:
        user, answer = text[cursor : cursor + step], text[cursor + step : cursor + 2 * step]
        cursor += 2 * step
        history += f"{start}user\n{user}{end}\n"
        prompts.append(history + f"{start}assistant\n<think>\n")
        history += f"{start}assistant\n{answer}{end}\n"
    return GrowingChat(prompts[-turns:], text[cursor : cursor + len(prompts[-1])])

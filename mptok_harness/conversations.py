"""Conversations that put seams where tokenizers are hardest to splice.

Shared by the exactness tests and the cache benchmark: each turn's prompt is
the previous one plus a delta, sometimes with the tail rewritten the way chat
templates rewrite their generation prompt.
"""

from __future__ import annotations

import random

# Pieces that make hard seams: inside words and digit runs, whitespace runs,
# CRLF, runs of combining marks (NFC composes them across a seam), emoji ZWJ
# sequences (byte-level BPE splits a character over tokens), CJK, Hangul
# jamo that compose, fullwidth and compatibility characters.
ADVERSARIAL_PIECES = (
    "hello", " world", "ing", "tokenization", " the", "  ", "    ", "\n", "\n\n", "\r\n",
    "\t", " \t ", "123", "4567", "3.14159", "e", "\u0301", "\u0323\u0301", "e\u0301",
    "\u00e9", "a\u0308\u0304", "😀", "👨\u200d👩\u200d👧", "🏳️\u200d🌈", "中文", "字",
    "日本語のテキスト", "ﾃｽﾄ", "\u1100\u1161\u11a8", "가", "ß", "İ", "\u00a0", "ﬁ",
    "'s", "'ll", "!!", "...", "-->", "{", "}", "(x)", "def f():", "    return 1",
    "Ω", "ǅ", "\u2028",
)  # fmt: skip

PLAIN_WORDS = (
    "the", "model", "reads", "each", "prompt", "and", "answers", "with", "tokens",
    "cache", "turn", "history", "server", "frontend", "process", "request",
)  # fmt: skip


def adversarial_delta(rng: random.Random, extra: tuple[str, ...] = (), pieces: int = 20) -> str:
    """A random run of hard pieces (plus ``extra``, e.g. special tokens)."""
    alphabet = ADVERSARIAL_PIECES + extra
    return "".join(rng.choice(alphabet) for _ in range(pieces))


def plain_delta(rng: random.Random, words: int) -> str:
    sentence = " ".join(rng.choice(PLAIN_WORDS) for _ in range(words))
    return sentence[0].upper() + sentence[1:] + ". "


def chat_turns(
    rng: random.Random, start: str, end: str, turns: int, words_per_message: int = 40
) -> list[str]:
    """Prompts of a chat whose template ends each prompt with a generation
    prompt that the next turn replaces (``<think>\\n`` becomes the answer)."""
    history = f"{start}system\nYou are a helpful assistant.{end}\n"
    prompts = []
    for _ in range(turns):
        history += f"{start}user\n{plain_delta(rng, words_per_message)}{end}\n"
        prompts.append(history + f"{start}assistant\n<think>\n")
        history += f"{start}assistant\n{plain_delta(rng, words_per_message)}{end}\n"
    return prompts

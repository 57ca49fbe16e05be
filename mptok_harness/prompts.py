"""Prompts of a conversation that grows turn after turn, as the routing tests and
scripts/bench_routing.py tokenize them: mixed-script prose, no tokenizer needed."""

from __future__ import annotations

import random

_WORDS = (
    "the of and to in is that for it as with was on be by this are from or have an at not "
    "model token cache prefix frontend process socket owner conversation turn prompt tokenizer "
    "request latency throughput server thread kernel memory queue answer question result value "
    "however therefore because although function return class import error timeout retry "
    "naïve café Zürich 東京 数据 🙂 🚀 — “quoted” e\u0301 x²"
).split()


# The DeepSeek V3 template's markers, which its tokenizer (the embedded
# default) holds as added tokens, and look-alikes in ASCII that it does not:
# prompts with the look-alikes are plain text to the tokenizer.
TEMPLATE_MARKERS = ("<｜begin▁of▁sentence｜>", "<｜Assistant｜>", "<｜User｜>")
PLAIN_MARKERS = ("<|begin▁of▁sentence|>", "<|Assistant|>", "<|User|>")


def conversation(
    seed: int, turns: int, *, first_chars: int = 2000, turn_chars: int = 1200, markers: tuple[str, str, str] = PLAIN_MARKERS
) -> list[str]:
    """Prompts of one conversation: each is the last plus about 300 tokens.

    Like a chat template, each prompt ends with a generation prompt that the
    next turn rewrites, so prompts do not extend each other literally. The
    ``markers`` (begin, assistant, user) are plain text by default; with
    ``TEMPLATE_MARKERS`` they are the default tokenizer's added tokens, as its
    chat template writes them.
    """
    rng = random.Random(seed)
    begin, assistant, user = markers

    def prose(chars: int) -> str:
        out: list[str] = []
        size = 0
        while size < chars:
            word = rng.choice(_WORDS)
            sep = rng.choice((" ", " ", " ", " ", ", ", ". ", "\n", "  "))
            out.append(word + sep)
            size += len(word) + len(sep)
        return "".join(out)

    history = begin + "You are a helpful assistant.\n" + prose(first_chars)
    prompts = []
    for _ in range(turns):
        prompts.append(history + assistant + "<think>\n")
        history += assistant + prose(turn_chars // 2) + user + prose(turn_chars // 2)
    return prompts

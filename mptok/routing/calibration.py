"""What tokenizing a character costs in this process, learned once at start.

Routing bounds its patience with an owner by what a prompt would cost here
at worst (``mptok.routing.deadline``: made-up words, which no engine has
cached), and weighs a prompt's cost here against a call to its owner by
what a prompt typically costs (``mptok.routing.crossing``: real text, whose
words repeat as a prompt's do). The two differ most for the fast engines,
which cache words: made-up words cost them tens of times what text does.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

from mptok.cache.backend import SlowTokenizerError, TokenizerBackend, backend_for

# Characters of made-up words that the backend tokenizes at start, to learn
# what a character costs here; new random words, because BPE caches the
# words it has seen and a sample seen before would look cheaper than a prompt.
CALIBRATION_CHARS = 20_000
_LETTERS = "etaoinshrdlucmfwypvbgkjqxz"


def build_backend(tokenizer: Any, choice: str) -> TokenizerBackend | None:
    """Build (and run once) the tokenizer backend an owner answers its peers
    with (the cache's ``choice`` of engine); None for a slow tokenizer, which
    the cache does not serve."""
    try:
        backend = backend_for(tokenizer, choice)
    except SlowTokenizerError:
        return None
    backend.engines.warm()
    return backend


def seconds_per_char(backend: TokenizerBackend, sample: str | None = None) -> float:
    """What tokenizing one character of ``sample`` (default: made-up words)
    in full costs ``backend`` here, with the engine its full tokenizations
    use (a fast one, if trusted)."""
    if sample is None:
        sample = made_up_words()
    started = time.perf_counter()
    backend.encode_ids(sample)
    return (time.perf_counter() - started) / len(sample)


def made_up_words() -> str:
    """About ``CALIBRATION_CHARS`` characters of new random words."""
    rng = random.Random(os.urandom(8))  # words the backend has not cached yet
    words, chars = [], 0
    while chars < CALIBRATION_CHARS:
        word = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(1, 9)))
        words.append(word)
        chars += len(word) + 1
    return " ".join(words)


def typical_text() -> str:
    """About ``CALIBRATION_CHARS`` characters of real text, prose and code:
    mptok's own sources, which every installation has."""
    parts, chars = [], 0
    for path in sorted(Path(__file__).resolve().parent.parent.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        parts.append(text)
        chars += len(text)
        if chars >= CALIBRATION_CHARS:
            break
    return "".join(parts)[:CALIBRATION_CHARS]

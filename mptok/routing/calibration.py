"""What tokenizing a character costs in this process at worst, learned once at start; and the text threads warm on.

Routing bounds its patience with an owner by what a prompt would cost here
at worst: made-up words, which no engine has cached (the fast engines cache
words, so made-up words cost them tens of times what text does). The
threads that answer peers warm on real text instead (``typical_text``).
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


def seconds_per_char(backend: TokenizerBackend) -> float:
    """What tokenizing one character of made-up words in full costs
    ``backend`` here, with the engine its full tokenizations use (a fast
    one, if trusted)."""
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

"""What tokenizing a character costs in this process, learned once at start.

Routing weighs a prompt's cost here against a call to its owner
(``mptok.routing.crossing``) and bounds its patience with an owner by it
(``mptok.routing.deadline``); both need seconds per character of this
frontend's tokenizer backend, on words it has not seen.
"""

from __future__ import annotations

import os
import random
import time
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
    backend.encode("warm up")
    return backend


def seconds_per_char(backend: TokenizerBackend) -> float:
    """What tokenizing one character of made-up words in full costs ``backend``
    here, with the engine its full tokenizations use (a fast one, if trusted)."""
    rng = random.Random(os.urandom(8))  # words the backend has not cached yet
    words, chars = [], 0
    while chars < CALIBRATION_CHARS:
        word = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(1, 9)))
        words.append(word)
        chars += len(word) + 1
    sample = " ".join(words)
    started = time.perf_counter()
    backend.encode_ids(sample)
    return (time.perf_counter() - started) / len(sample)

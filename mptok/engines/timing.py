"""Which fast engine costs less CPU on a tokenizer, measured so that a busy moment does not decide it.

fastokens and gigatoken cost within a few tens of percent of each other,
and one measurement of each is at the mercy of whatever else the machine
runs while it is taken, which then decides for every later start that reads
the engine memo. So the engines are timed in rounds: each round, every
engine tokenizes the same text, in an order rotated from round to round,
and each engine's cost is compared with the incumbent's in the same round.
A burst of load that falls on one round moves one paired ratio, not the
median of them, which decides.

CPU time is the process's (``time.process_time``): it counts fastokens'
worker threads, and not the time the engine waited for a core. Each engine
first tokenizes every timing text once, untimed: fastokens builds
per-thread state on its threads' first calls, and both engines cache the
words they tokenized, which is where a serving engine spends its time (it
has seen most words of what it tokenizes). Text an engine sees for the
first time costs fastokens more than gigatoken, and text whose words it has
seen costs it less, so timing first sights would choose the engine that is
cheaper only at a start. What is timed is ``encode_id_array``, the call the
cache makes for every prompt it keeps.

**The incumbent stays unless beaten by ``MARGIN``.** Two engines within a
margin of each other are a tie that noise would break either way, and
flipping costs a start (a process that reads the memo loads the engine it
names). The incumbent is the engine the memo named before, when its verdict
is decided again; else, for short texts, the first of ``ENGINES`` that
passed, fastokens: it takes calls from many threads at once (gigatoken
takes one call at a time, ``mptok.engines.fast``) and spreads a long text
over threads; for long texts, the short texts' engine, since a second
engine costs its loading.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class IdsEngine(Protocol):
    """Full tokenization without added special tokens: ids only, as a list or an int array."""

    name: str

    def encode_ids(self, text: str) -> list[int]: ...

    def encode_id_array(self, text: str) -> np.ndarray: ...

# Rounds per length of text; a round is one text tokenized by every engine.
ROUNDS = 7
LONG_ROUNDS = 5
# A challenger replaces the incumbent only if its median paired ratio is
# below 1 - MARGIN.
MARGIN = 0.10


@dataclass(frozen=True)
class Comparison:
    """The engines timed over ``rounds`` rounds on texts of ``chars``
    characters: each engine's median CPU seconds per round, its median ratio
    to the incumbent's cost in the same round, the spread of those ratios
    (their median absolute deviation over their median, the largest of the
    challengers'), and the engine chosen."""

    chars: int
    rounds: int
    incumbent: str
    costs: dict[str, float]
    ratios: dict[str, float]
    spread: float
    chosen: str

    def describe(self) -> str:
        engines = "; ".join(
            f"{name}: {cost * 1e3:.2f} ms CPU" + ("" if name == self.incumbent else f" ({self.ratios[name]:.2f}x)")
            for name, cost in self.costs.items()
        )
        return f"{self.chars} characters, medians of {self.rounds} rounds against the incumbent {self.incumbent}: {engines}"


def compare(engines: Sequence[IdsEngine], texts: Sequence[str], rounds: int, incumbent: str) -> Comparison:
    """Time ``engines`` on ``texts`` (one a round, in turn) over ``rounds``
    rounds after each tokenized them all once, and choose (``choose``)."""
    for engine in engines:
        for text in texts:
            engine.encode_id_array(text)
    costs: dict[str, list[float]] = {engine.name: [] for engine in engines}
    for round_ in range(rounds):
        text = texts[round_ % len(texts)]
        shift = round_ % len(engines)
        for engine in (*engines[shift:], *engines[:shift]):
            began = time.process_time()
            engine.encode_id_array(text)
            costs[engine.name].append(time.process_time() - began)
    return choose(costs, incumbent, len(texts[0]))


def choose(costs: dict[str, list[float]], incumbent: str, chars: int = 0) -> Comparison:
    """The choice among engines whose CPU seconds in each round are ``costs``
    (rounds paired by position): the incumbent, unless another's median ratio
    to it is below ``1 - MARGIN`` (then the lowest)."""
    paired = {
        name: [cost / max(base, 1e-9) for cost, base in zip(series, costs[incumbent], strict=True)]
        for name, series in costs.items()
    }
    ratios = {name: statistics.median(values) for name, values in paired.items()}
    spread = max(
        (statistics.median(abs(v - ratios[name]) for v in values) / ratios[name] for name, values in paired.items() if name != incumbent),
        default=0.0,
    )
    best = min(ratios, key=ratios.__getitem__)
    chosen = best if ratios[best] < 1 - MARGIN else incumbent
    medians = {name: statistics.median(series) for name, series in costs.items()}
    return Comparison(chars, len(costs[incumbent]), incumbent, medians, ratios, spread, chosen)

"""Which fast engine costs less CPU on a tokenizer, measured so that a busy moment does not decide it.

Engines are timed in rounds, after one untimed pass over the texts (both
cache the words they have seen, as a serving engine has): each round every
engine tokenizes the same text, in an order rotated from round to round,
and the median of each engine's paired ratios to the incumbent's process
CPU time decides, so a burst of load moves one ratio, not the choice. The
incumbent stays unless beaten by ``MARGIN``: flipping between engines within
noise of each other costs a start a load. docs/CACHE.md, "Which one", says
which engine is the incumbent, and why.
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
    """Each engine's median CPU seconds per round and median ratio to the
    incumbent's; ``spread``: the largest challenger's median absolute
    deviation of its ratios over their median."""

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
    """Time ``engines`` over ``rounds`` rounds of ``texts`` (one a round), after one untimed pass, and ``choose``."""
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
    """The incumbent, unless another engine's median ratio to it over the
    rounds of ``costs`` is below ``1 - MARGIN`` (then the lowest)."""
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

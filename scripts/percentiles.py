"""The one percentile convention of mptok's benchmark and drill reports.

Nearest rank: the p50 and p99 in a report are values that were measured,
never interpolated between two requests, and the replay and the drill read
alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """The smallest measured value with at least ``q`` (a fraction in (0, 1])
    of the values at or below it; NaN values (not measured) are left out.
    Returns NaN when nothing is left."""
    if not 0 < q <= 1:
        raise ValueError(f"q must be in (0, 1], not {q}")
    ordered = sorted(v for v in values if not math.isnan(v))
    if not ordered:
        return math.nan
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

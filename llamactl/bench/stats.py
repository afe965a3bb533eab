"""Small statistics for benchmark results (no numpy needed)."""

from __future__ import annotations

import math
from typing import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks."""
    if not values:
        return float("nan")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0..100")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def spread(values: Sequence[float]) -> dict[str, float]:
    """min, max and the relative half-range around the median."""
    if not values:
        return {"min": float("nan"), "max": float("nan"), "rel": float("nan")}
    m = median(values)
    return {"min": min(values), "max": max(values), "rel": (max(values) - min(values)) / 2 / m if m else float("nan")}

"""Step-time statistics of a mode: the job's T, its spread, per-round medians, paired ratios."""

from __future__ import annotations

import math
import statistics
from typing import Any


def stats(per_rank: list[list[float]]) -> dict[str, float]:
    """The job's step time: the slowest rank's median; spread: that rank's IQR / median."""
    best = None
    for rank, times in enumerate(per_rank):
        s = sorted(times)
        med = statistics.median(s)
        q1, q3 = _quantile(s, 0.25), _quantile(s, 0.75)
        if best is None or med > best["t"]:
            best = {"t": med, "p25": q1, "p75": q3, "min": s[0], "max": s[-1], "rank": rank}
    best["iqr"] = (best["p75"] - best["p25"]) / best["t"] if best["t"] else 0.0
    return best


def round_medians(per_rank: list[list[float]], per_round: int) -> list[float]:
    """Per round (``per_round`` timed steps each): the slowest rank's median step time in that
    round. Modes interleave by round, so two modes' values of the same round were measured
    minutes apart at most and their ratio is free of the host's slower drifts (see
    ``paired_ratio``)."""
    return [
        max(statistics.median(times[start : start + per_round]) for times in per_rank)
        for start in range(0, len(per_rank[0]), per_round)
    ]


def paired_ratio(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """T_a / T_b − 1 as the median over rounds of the ratio within each round (None when the
    two modes were not timed in the same rounds)."""
    ra, rb = a.get("round_t") or [], b.get("round_t") or []
    if not ra or len(ra) != len(rb):
        return None
    return statistics.median(x / y for x, y in zip(ra, rb)) - 1


def _quantile(s: list[float], q: float) -> float:
    if len(s) == 1:
        return s[0]
    pos = q * (len(s) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)

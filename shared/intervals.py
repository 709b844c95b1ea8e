"""The mean of per-prompt numbers and its 95% interval, as every acceptance table reports them (the project's own
speculative decoding and SGLang's counters alike)."""

import math
import statistics
from collections.abc import Sequence


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def mean_ci95(values: Sequence[float]) -> tuple[float, float]:
    """A 95% interval of the mean (normal approximation: mean +- 1.96 standard errors); NaN below two values."""
    if len(values) < 2:
        return (math.nan, math.nan)
    half = statistics.NormalDist().inv_cdf(0.975) * statistics.stdev(values) / math.sqrt(len(values))
    centre = mean(values)
    return (centre - half, centre + half)

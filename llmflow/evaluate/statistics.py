"""lm-evaluation-harness's standard errors: of a metric's mean over samples, and pooled over
the tasks of a group weighted by their sizes."""

from __future__ import annotations

import math


def stderr_of_mean(values: list[float]) -> float | None:
    """The harness's mean_stderr: sample standard deviation (n - 1) over sqrt(n); None below two samples."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    return math.sqrt(sum((x - mean) ** 2 for x in values) / (n - 1)) / math.sqrt(n)


def pooled_stderr(stderrs: list[float | None], sizes: list[int]) -> float | None:
    """The harness's pooled_sample_stderr of a group weighted by task size."""
    if any(s is None for s in stderrs) or sum(sizes) <= len(sizes):
        return None
    variance = sum((n - 1) * s**2 * n for n, s in zip(sizes, stderrs)) / (sum(sizes) - len(sizes))
    return math.sqrt(variance / sum(sizes))

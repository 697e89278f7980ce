"""Two-sample tests (no scipy in the project): pure functions, one implementation for the chaos soak's
length-bias check and the experiment reports' "whom the window drops" (``tools.reports.dropbias``).

* ``mann_whitney`` — Mann-Whitney U, two-sided, normal approximation with tie correction and
  continuity correction (what ``scipy.stats.mannwhitneyu(method="asymptotic")`` computes). Token
  counts are discrete with many ties, where the rank test is the right tool.
* ``ks_statistic`` — the two-sample Kolmogorov-Smirnov distance D (largest gap between the two
  empirical CDFs), reported next to it as an effect size.
* ``cluster_means`` — one value per cluster (a GRPO group): both tests assume independent
  observations, and the samples of one group share their prompt (and so, largely, their length).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TwoSampleResult:
    statistic: float
    p_value: float


def _ranks(values: Sequence[float]) -> tuple[list[float], list[int]]:
    """Average ranks (1-based) of ``values`` and the sizes of their tie groups."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    ties: list[int] = []
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        ties.append(j - i + 1)
        i = j + 1
    return ranks, ties


def mann_whitney(a: Sequence[float], b: Sequence[float]) -> TwoSampleResult:
    """Two-sided Mann-Whitney U test of ``a`` vs ``b``: U of ``a`` and its p-value."""
    n1, n2 = len(a), len(b)
    if n1 == 0 or n2 == 0:
        raise ValueError("mann_whitney needs two non-empty samples")
    ranks, ties = _ranks([*a, *b])
    u1 = sum(ranks[:n1]) - n1 * (n1 + 1) / 2
    n = n1 + n2
    mu = n1 * n2 / 2
    tie_term = sum(t ** 3 - t for t in ties) / (n * (n - 1)) if n > 1 else 0.0
    var = n1 * n2 / 12 * ((n + 1) - tie_term)
    if var <= 0:  # every value equal: no evidence of a shift
        return TwoSampleResult(u1, 1.0)
    z = max(0.0, abs(u1 - mu) - 0.5) / math.sqrt(var)
    return TwoSampleResult(u1, min(1.0, math.erfc(z / math.sqrt(2))))


def ks_statistic(a: Sequence[float], b: Sequence[float]) -> float:
    """Kolmogorov-Smirnov D: the largest distance between the empirical CDFs of ``a`` and ``b``."""
    if not a or not b:
        raise ValueError("ks_statistic needs two non-empty samples")
    ca, cb = Counter(a), Counter(b)
    fa = fb = 0.0
    d = 0.0
    for v in sorted(set(ca) | set(cb)):
        fa += ca[v] / len(a)
        fb += cb[v] / len(b)
        d = max(d, abs(fa - fb))
    return d


def cluster_means(clusters: Iterable[str], values: Mapping[str, Sequence[float]]) -> list[float]:
    """The mean of ``values[c]`` for each cluster ``c`` that has values (empty clusters are skipped)."""
    return [sum(v) / len(v) for c in clusters if (v := values.get(c))]

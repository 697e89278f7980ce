"""Confidence intervals for experiment results across seeds (pure arithmetic, no SciPy).

* ``mean_interval``: the Student-t interval of a mean, ``x̄ ± t(1-α/2, n-1) · s/√n``
  (``s`` the sample standard deviation, n-1 in the denominator). One seed has no spread: the
  bounds are ``None``, never a made-up width.
* ``ratio_interval``: the ratio of two means from independent runs (``mean(a) / mean(b)``, e.g.
  sync wall-clock over async wall-clock = the speed-up), with the **delta method on the log
  scale**: ``Var(log R) ≈ s_a²/(n_a·ā²) + s_b²/(n_b·b̄²)``, Student-t with the Welch–Satterthwaite
  degrees of freedom of those two terms, bounds ``R · exp(± t · √Var)``. Chosen over Fieller's
  theorem because it never returns an unbounded or empty interval when a mean is noisy, and
  over a bootstrap because with 3 seeds a bootstrap has only 10 distinct resamples.
  Both samples need ≥ 2 values for an interval (the ratio itself needs one each).
* ``t_quantile``: the Student-t quantile for any real ``df > 0``, by bisection on the CDF,
  which is the regularized incomplete beta function (continued fraction, Lentz's method).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


class NoData(ValueError):
    """An interval of an empty sample, or a ratio whose denominator mean is not positive."""


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float | None  # None: no spread (fewer than two values)
    high: float | None
    n: int  # values behind the estimate (for a ratio: the smaller of the two samples)

    def text(self, digits: int = 2, unit: str = "") -> str:
        est = f"{self.estimate:.{digits}f}{unit}"
        if self.low is None or self.high is None:
            return f"{est} (n={self.n}, no interval)"
        return f"{est} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (Numerical Recipes §6.4, Lentz)."""
    tiny, eps = 1e-300, 3e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t such that P(T <= t) = p, for 0 < p < 1 and df > 0."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p} df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return (lo + hi) / 2.0


def mean_sd(xs: Sequence[float]) -> tuple[float, float | None]:
    if not xs:
        raise NoData("no values")
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def mean_interval(xs: Sequence[float], level: float = 0.95) -> Interval:
    m, sd = mean_sd(xs)
    if sd is None:
        return Interval(m, None, None, len(xs))
    half = t_quantile(1.0 - (1.0 - level) / 2.0, len(xs) - 1) * sd / math.sqrt(len(xs))
    return Interval(m, m - half, m + half, len(xs))


def ratio_interval(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Interval:
    """``mean(a) / mean(b)`` with the log-scale delta-method interval (both means must be > 0)."""
    ma, sa = mean_sd(a)
    mb, sb = mean_sd(b)
    if ma <= 0 or mb <= 0:
        raise NoData(f"ratio of means needs positive means, got {ma} / {mb}")
    ratio = ma / mb
    n = min(len(a), len(b))
    if sa is None or sb is None:
        return Interval(ratio, None, None, n)
    va, vb = sa * sa / (len(a) * ma * ma), sb * sb / (len(b) * mb * mb)
    if va + vb == 0.0:
        return Interval(ratio, ratio, ratio, n)
    df = (va + vb) ** 2 / (va * va / (len(a) - 1) + vb * vb / (len(b) - 1))
    half = t_quantile(1.0 - (1.0 - level) / 2.0, df) * math.sqrt(va + vb)
    return Interval(ratio, ratio * math.exp(-half), ratio * math.exp(half), n)

"""Statistics over seeds: Student-t confidence intervals for a mean and for paired differences.

No scipy (the core dependencies are torch and numpy, and ``torch.distributions.StudentT.icdf`` is not
implemented): the t quantile is found by bisection on the t CDF, written through the regularised incomplete beta
function ``I_x(a, b)`` evaluated by its continued fraction (modified Lentz), accurate to ~1e-12.

``±`` in every table of this project is the half-width of the 95% t-interval of the mean over seeds,
``t_{0.975, n-1} · sd / √n`` with the sample standard deviation (ddof = 1); with one seed there is no interval.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

CONFIDENCE = 0.95


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of ``I_x(a, b)`` (converges fast for ``x < (a + 1) / (a + b + 2)``)."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def regularized_beta(x: float, a: float, b: float) -> float:
    """``I_x(a, b) = B(x; a, b) / B(a, b)`` for ``0 <= x <= 1``, ``a, b > 0``."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"regularized_beta: x must be in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"t_cdf: degrees of freedom must be > 0, got {df}")
    tail = 0.5 * regularized_beta(df / (df + t * t), df / 2.0, 0.5)
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on :func:`t_cdf`)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


@dataclass
class Interval:
    """Mean of ``n`` values with the half-width of its t-interval (``None`` when ``n = 1``)."""

    mean: float
    half_width: float | None
    n: int
    sd: float | None
    confidence: float = CONFIDENCE

    @property
    def low(self) -> float | None:
        return None if self.half_width is None else self.mean - self.half_width

    @property
    def high(self) -> float | None:
        return None if self.half_width is None else self.mean + self.half_width

    def excludes_zero(self) -> bool:
        return self.half_width is not None and (self.low > 0 or self.high < 0)

    def to_dict(self) -> dict:
        return {**asdict(self), "low": self.low, "high": self.high}

    def format(self, digits: int = 4) -> str:
        """``"0.8125 ± 0.0310"``, or ``"0.8125 (n = 1, no interval)"``."""
        if self.half_width is None:
            return f"{self.mean:.{digits}f} (n = 1, no interval)"
        return f"{self.mean:.{digits}f} ± {self.half_width:.{digits}f}"


def mean_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """Mean and two-sided ``confidence`` t-interval of ``values`` (sample sd, ddof = 1)."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_interval: no values")
    mean = math.fsum(values) / n
    if n == 1:
        return Interval(mean, None, 1, None, confidence)
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    return Interval(mean, t_quantile(0.5 + confidence / 2.0, n - 1) * sd / math.sqrt(n), n, sd, confidence)


def paired_interval(values: Sequence[float], reference: Sequence[float],
                    confidence: float = CONFIDENCE) -> tuple[list[float], Interval]:
    """Per-pair differences ``values[i] - reference[i]`` (the same seed) and their paired t-interval."""
    if len(values) != len(reference):
        raise ValueError(f"paired_interval: {len(values)} values against {len(reference)} reference values")
    diffs = [v - r for v, r in zip(values, reference)]
    return diffs, mean_interval(diffs, confidence)


def verdict(diff: Interval, higher_is_better: bool) -> str:
    """``"better"``/``"worse"`` than the reference where the interval of the difference excludes 0, else
    ``"undecided"`` (always with one pair)."""
    if not diff.excludes_zero():
        return "undecided"
    return "better" if (diff.mean > 0) == higher_is_better else "worse"

"""Statistics over seeds: Student-t intervals, and paired comparisons that stay valid when a method sometimes
collapses (heavy tails): the median, wins and losses, the Wilcoxon signed-rank test and a paired bootstrap.

No scipy (the core dependencies are torch and numpy, and ``torch.distributions.StudentT.icdf`` is not
implemented): the t quantile is found by bisection on the t CDF, written through the regularised incomplete beta
function ``I_x(a, b)`` evaluated by its continued fraction (modified Lentz), accurate to ~1e-12; the signed-rank
null distribution is counted exactly (:func:`signed_rank_null`).

``±`` in every table of this project is the half-width of the 95% t-interval of the mean over seeds,
``t_{0.975, n-1} · sd / √n`` with the sample standard deviation (ddof = 1); with one seed there is no interval.

The verdict of a paired comparison (:func:`rank_verdict`) is the two-sided Wilcoxon signed-rank test at level
``ALPHA``: it assumes only that, were the two methods equivalent, each seed's difference would be as likely
positive as negative (symmetric about 0), not that differences are normal. With ``n`` non-zero differences its
smallest two-sided p-value is ``2 / 2ⁿ``, so at least 6 seeds are needed for ``p < 0.05``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

CONFIDENCE = 0.95
ALPHA = 0.05  # level of the two-sided signed-rank test behind a verdict
EXACT_MAX_N = 100  # the signed-rank p-value is exact up to this many non-zero differences, normal beyond
BOOTSTRAP_RESAMPLES = 10_000
TIE_DIGITS = 12  # |differences| equal to this many significant digits share a rank (floating-point noise)


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

    def format(self, digits: int = 4, signed: bool = False) -> str:
        """``"0.8125 ± 0.0310"``, or ``"0.8125 (n = 1, no interval)"``; ``signed`` (a difference): ``"+0.0125 ±
        0.0310"``, its sign written as in every other column of differences."""
        mean = f"{self.mean:+.{digits}f}" if signed else f"{self.mean:.{digits}f}"
        if self.half_width is None:
            return f"{mean} (n = 1, no interval)"
        return f"{mean} ± {self.half_width:.{digits}f}"


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
    """``"better"``/``"worse"`` than the reference where the t-interval of the difference excludes 0, else
    ``"undecided"`` (always with one pair). Valid when the differences are near normal; see :func:`rank_verdict`."""
    if not diff.excludes_zero():
        return "undecided"
    return "better" if (diff.mean > 0) == higher_is_better else "worse"


def median(values: Sequence[float]) -> float:
    """The middle value (the mean of the two middle ones for an even count)."""
    if not values:
        raise ValueError("median: no values")
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0


def midranks(magnitudes: Sequence[float]) -> list[float]:
    """Ranks 1..n of ``magnitudes`` in increasing order; equal values share the mean of their ranks."""
    order = sorted(range(len(magnitudes)), key=lambda i: magnitudes[i])
    ranks = [0.0] * len(magnitudes)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and magnitudes[order[end + 1]] == magnitudes[order[start]]:
            end += 1
        for i in order[start:end + 1]:
            ranks[i] = (start + end) / 2.0 + 1.0
        start = end + 1
    return ranks


def signed_rank_null(ranks: Sequence[float]) -> np.ndarray:
    """The exact null distribution of ``2·W⁺`` for these (mid)ranks: ``dist[k] = P(2·W⁺ = k)`` when each rank's
    sign is + or − with probability ½ independently (``[Σ 2·rank + 1]``, float64). Midranks are multiples of
    ½, so doubled ranks are integers and the count is exact with or without ties (the permutation distribution
    conditional on the tie pattern)."""
    doubled = [int(round(2 * r)) for r in ranks]
    dist = np.zeros(sum(doubled) + 1)
    dist[0] = 1.0
    reach = 0
    for d in doubled:
        nxt = 0.5 * dist
        nxt[d:reach + d + 1] += 0.5 * dist[:reach + 1]
        dist, reach = nxt, reach + d
    return dist


@dataclass
class SignedRank:
    """The Wilcoxon signed-rank test of paired differences against 0 (two-sided).

    ``n``: non-zero differences ranked; ``zeros``: differences exactly 0, dropped before ranking (Wilcoxon's
    rule); ``w_plus``/``w_minus``: the sums of the (mid)ranks of |d| over the positive/negative differences
    (``w_plus + w_minus = n(n+1)/2``); ``p``: the two-sided p-value, ``min(1, 2·min(P(W⁺ ≤ w⁺), P(W⁺ ≥ w⁺)))``
    under the null; ``exact``: counted exactly (``n ≤ EXACT_MAX_N``), else the normal approximation with the tie
    correction of the variance and a continuity correction of ½."""

    n: int
    zeros: int
    w_plus: float
    w_minus: float
    p: float
    exact: bool

    def to_dict(self) -> dict:
        return asdict(self)


def wilcoxon_signed_rank(differences: Sequence[float], exact_max_n: int = EXACT_MAX_N) -> SignedRank:
    """The signed-rank test of ``differences`` (see :class:`SignedRank`). Magnitudes equal to ``TIE_DIGITS``
    significant digits are ties and share their mean rank; with no non-zero difference ``p = 1``."""
    nonzero = [d for d in differences if d != 0]
    magnitudes = [float(f"{abs(d):.{TIE_DIGITS}g}") for d in nonzero]
    ranks = midranks(magnitudes)
    n = len(nonzero)
    w_plus = math.fsum(r for r, d in zip(ranks, nonzero) if d > 0)
    w_minus = n * (n + 1) / 2.0 - w_plus
    if n == 0:
        p, exact = 1.0, True
    elif n <= exact_max_n:
        dist = signed_rank_null(ranks)
        k = int(round(2 * w_plus))
        p, exact = min(1.0, 2.0 * min(float(dist[:k + 1].sum()), float(dist[k:].sum()))), True
    else:
        counts: dict[float, int] = {}
        for m in magnitudes:
            counts[m] = counts.get(m, 0) + 1
        var = n * (n + 1) * (2 * n + 1) / 24.0 - sum(t ** 3 - t for t in counts.values()) / 48.0
        z = max(abs(w_plus - n * (n + 1) / 4.0) - 0.5, 0.0) / math.sqrt(var) if var > 0 else 0.0
        p, exact = min(1.0, math.erfc(z / math.sqrt(2.0))), False
    return SignedRank(n, len(differences) - n, w_plus, w_minus, p, exact)


def rank_verdict(test: SignedRank, higher_is_better: bool, alpha: float = ALPHA) -> str:
    """``"better"``/``"worse"`` than the reference where the signed-rank test rejects "no difference" at level
    ``alpha`` (two-sided ``p < alpha``), in the direction of the larger rank sum; else ``"undecided"``."""
    if not test.p < alpha:
        return "undecided"
    return "better" if (test.w_plus > test.w_minus) == higher_is_better else "worse"


def bootstrap_interval(differences: Sequence[float], seed: int = 0, resamples: int = BOOTSTRAP_RESAMPLES,
                       confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """The paired bootstrap percentile interval of the mean difference: ``resamples`` means of ``n`` differences
    drawn with replacement (whole seeds, so each keeps its pairing), from ``numpy.random.default_rng(seed)``;
    the ``(1 − confidence)/2`` and ``(1 + confidence)/2`` quantiles of those means (linear interpolation).
    ``None`` with fewer than two differences. With few seeds it is narrower than the t-interval (it cannot see
    beyond the values observed)."""
    d = np.asarray(differences, dtype=np.float64)
    if d.size < 2:
        return None
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(resamples, d.size))].mean(axis=1)
    low, high = np.quantile(means, [(1.0 - confidence) / 2.0, (1.0 + confidence) / 2.0])
    return float(low), float(high)


def wins_losses(differences: Sequence[float], higher_is_better: bool) -> dict[str, int]:
    """Seeds where the method did better than the reference (``wins``), worse (``losses``) or the same
    (``ties``: difference exactly 0)."""
    ahead = sum(1 for d in differences if d > 0)
    behind = sum(1 for d in differences if d < 0)
    wins, losses = (ahead, behind) if higher_is_better else (behind, ahead)
    return {"wins": wins, "losses": losses, "ties": len(differences) - ahead - behind}

"""Rényi-DP accountant of the Poisson-subsampled Gaussian mechanism, and the inverse map target ε → σ.

One step releases ``Σ clipped contributions + N(0, σ²C²)`` where each participant is included independently
with probability ``q`` (Poisson sampling). Its RDP at integer order α (Mironov, Talwar & Zhang 2019, "Rényi
Differential Privacy of the Sampled Gaussian Mechanism", §3.3)::

    ε_α = log( Σ_{k=0}^{α} C(α,k) (1−q)^{α−k} q^k exp((k²−k)/(2σ²)) ) / (α−1)          (q = 1: α/(2σ²))

RDP composes additively over steps; (ε, δ) is the best order of Balle et al. 2020's conversion (the one
Opacus 1.6 ``privacy_analysis.get_privacy_spent`` uses)::

    ε = min_α  T·ε_α − (log δ + log α)/(α−1) + log((α−1)/α)

Orders: the integers 2..256 (:data:`ORDERS`).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

ORDERS = np.arange(2, 257)


@lru_cache(maxsize=None)
def _log_binomials(alpha: int) -> np.ndarray:
    """log C(α, k) for k = 0..α."""
    return np.array([math.lgamma(alpha + 1) - math.lgamma(k + 1) - math.lgamma(alpha - k + 1) for k in range(alpha + 1)])


def _log_a(q: float, sigma: float, alpha: int) -> float:
    """log of the sum above for one integer order, in log space (float64)."""
    k = np.arange(alpha + 1, dtype=np.float64)
    terms = _log_binomials(alpha) + k * math.log(q) + (alpha - k) * math.log1p(-q) + (k * k - k) / (2 * sigma**2)
    top = terms.max()
    return float(top + math.log(np.exp(terms - top).sum()))


@lru_cache(maxsize=4096)
def rdp(q: float, sigma: float) -> tuple[float, ...]:
    """RDP ε_α of one step at each of :data:`ORDERS` (``inf`` when σ = 0)."""
    if not 0 <= q <= 1:
        raise ValueError(f"sampling rate must be in [0, 1], got {q}")
    if sigma <= 0:
        return tuple(math.inf for _ in ORDERS)
    if q == 0:
        return tuple(0.0 for _ in ORDERS)
    if q == 1:
        return tuple(float(a) / (2 * sigma**2) for a in ORDERS)
    return tuple(_log_a(q, sigma, int(a)) / (int(a) - 1) for a in ORDERS)


def epsilon(q: float, sigma: float, steps: int, delta: float) -> float:
    """ε of ``steps`` compositions of the subsampled Gaussian (rate ``q``, noise multiplier ``sigma``) at ``delta``."""
    if steps <= 0:
        return 0.0
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    total = steps * np.asarray(rdp(float(q), float(sigma)))
    a = ORDERS.astype(np.float64)
    eps = total - (math.log(delta) + np.log(a)) / (a - 1) + np.log((a - 1) / a)
    return float(max(np.nanmin(eps), 0.0))


def noise_for_epsilon(target: float, q: float, steps: int, delta: float, tol: float = 1e-4) -> float:
    """The smallest noise multiplier σ (to ``tol``, relative) with ``epsilon(q, σ, steps, delta) <= target``,
    by bisection (ε decreases in σ)."""
    if target <= 0:
        raise ValueError(f"target epsilon must be > 0, got {target}")
    lo, hi = 1e-3, 1.0
    while epsilon(q, hi, steps, delta) > target:
        lo, hi = hi, 2 * hi
        if hi > 1e6:
            raise ValueError(f"no noise multiplier up to 1e6 reaches epsilon = {target} (q = {q}, {steps} steps)")
    while hi - lo > tol * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if epsilon(q, mid, steps, delta) <= target else (mid, hi)
    return hi

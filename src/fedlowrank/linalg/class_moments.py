"""Class-conditional feature statistics and their exact pooling (CCVR: Luo et al., "No fear of heterogeneity:
classifier calibration for federated learning with non-IID data", arXiv:2106.05001, §4).

A client ``k`` holding ``n_{c,k}`` examples of class ``c`` sends their mean ``μ_{c,k}`` and unbiased covariance
``Σ_{c,k}`` (eq. 2); the server pools them into the moments of all ``N_c = Σ_k n_{c,k}`` examples (eqs. 3–4):

    μ_c = Σ_k (n_{c,k} / N_c) μ_{c,k}
    Σ_c = Σ_k (n_{c,k} − 1)/(N_c − 1) Σ_{c,k} + Σ_k n_{c,k}/(N_c − 1) μ_{c,k} μ_{c,k}ᵀ − N_c/(N_c − 1) μ_c μ_cᵀ

which equal the mean and unbiased covariance of the pooled features. A covariance of fewer than two examples is
zero (the unbiased estimate is undefined there).
"""

from __future__ import annotations

import torch
from torch import Tensor


def class_moments(features: Tensor, labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(counts [C] int64, means [C, d], covariances [C, d, d])`` of ``features`` ``[n, d]`` by ``labels`` ``[n]``,
    in float64 (eq. 2; zero for a class with no example, a zero covariance with fewer than two)."""
    x = features.to(torch.float64)
    d = x.shape[1]
    counts = torch.bincount(labels, minlength=num_classes)
    onehot = torch.nn.functional.one_hot(labels, num_classes).to(torch.float64)  # [n, C]
    n = counts.to(torch.float64)
    means = (onehot.T @ x) / n.clamp(min=1)[:, None]
    centred = x - means[labels]
    scatter = torch.einsum("nc,ni,nj->cij", onehot, centred, centred)
    covs = scatter / (n - 1).clamp(min=1)[:, None, None]
    covs[counts < 2] = torch.zeros(d, d, dtype=torch.float64)
    return counts, means, covs


def pooled_class_moments(counts: Tensor, means: Tensor, covs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The pooled ``(N [C], μ [C, d], Σ [C, d, d])`` (eqs. 3–4, float64) of ``K`` clients' ``counts`` ``[K, C]``,
    ``means`` ``[K, C, d]`` and ``covs`` ``[K, C, d, d]`` (:func:`class_moments`'s, stacked)."""
    n = counts.to(torch.float64)  # [K, C]
    mu_k, cov_k = means.to(torch.float64), covs.to(torch.float64)
    total = n.sum(0)  # [C]
    mu = torch.einsum("kc,kcd->cd", n, mu_k) / total.clamp(min=1)[:, None]
    outer = torch.einsum("kc,kci,kcj->cij", n, mu_k, mu_k)
    within = torch.einsum("kc,kcij->cij", (n - 1).clamp(min=0), cov_k)
    scatter = within + outer - total[:, None, None] * mu[:, :, None] * mu[:, None, :]
    cov = scatter / (total - 1).clamp(min=1)[:, None, None]
    cov[total < 2] = 0.0
    return total.to(torch.int64), mu, cov


def gaussian_samples(mean: Tensor, cov: Tensor, count: int, generator: torch.Generator) -> Tensor:
    """``count`` draws ``[count, d]`` (float64) from ``N(mean, cov)`` for a positive semi-definite ``cov`` ``[d, d]``
    (singular allowed): ``mean + z · (V √Λ)ᵀ`` with ``cov = V Λ Vᵀ`` (eigenvalues below zero, rounding, taken as
    zero) and ``z`` standard normal from ``generator``."""
    values, vectors = torch.linalg.eigh(cov.to(torch.float64))
    root = vectors * values.clamp(min=0).sqrt()[None, :]
    z = torch.randn(count, mean.shape[0], generator=generator, dtype=torch.float64)
    return mean.to(torch.float64)[None, :] + z @ root.T


__all__ = ["class_moments", "gaussian_samples", "pooled_class_moments"]

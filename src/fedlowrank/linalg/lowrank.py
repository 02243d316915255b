"""Factored linear algebra of sums of low-rank products ``ΔW = Σₖ Bₖ Aₖ`` (never forming ``ΔW`` densely).

Shapes: ``Bₖ: [out, rₖ]``, ``Aₖ: [rₖ, in]``, ranks may differ. Stack ``B_c = [B₁ … B_K]: [out, R]`` and
``A_c = [A₁; …; A_K]: [R, in]`` with ``R = Σ rₖ``, so ``ΔW = B_c A_c``. Costs are O((out + in)·R²), not
O(out·in·min(out, in)). Computed in float64; results are float64.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..schema import check_choice


def stack_factors(Bs: Sequence[torch.Tensor], As: Sequence[torch.Tensor],
                  weights: Sequence[float] | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B_c: [out, R], A_c: [R, in])`` with ``B_c A_c = Σₖ wₖ Bₖ Aₖ`` (weights folded into the A blocks)."""
    if len(Bs) != len(As) or not Bs:
        raise ValueError(f"need as many B as A factors (>0), got {len(Bs)} and {len(As)}")
    w = [1.0] * len(Bs) if weights is None else [float(x) for x in weights]
    B_c = torch.cat([B.to(torch.float64) for B in Bs], dim=1)
    A_c = torch.cat([wk * A.to(torch.float64) for wk, A in zip(w, As)], dim=0)
    return B_c, A_c


def factored_svd(B_c: torch.Tensor, A_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD of ``B_c A_c`` through QR of both factors and an SVD of the small ``R×R`` core.

    Returns ``U: [out, R]``, ``S: [R]`` (descending), ``Vh: [R, in]`` with ``U diag(S) Vh = B_c A_c``
    (for R ≤ min(out, in); otherwise the first min(out, in) components).
    """
    B_c, A_c = B_c.to(torch.float64), A_c.to(torch.float64)
    Q1, R1 = torch.linalg.qr(B_c)            # [out, R'], [R', R]
    Q2, R2 = torch.linalg.qr(A_c.T)          # [in, R''], [R'', R]
    U, S, Vh = torch.linalg.svd(R1 @ R2.T, full_matrices=False)
    return Q1 @ U, S, Vh @ Q2.T


def truncated_svd(B_c: torch.Tensor, A_c: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Best rank-``rank`` approximation of ``B_c A_c``: ``(U_r: [out, r], S_r: [r], Vh_r: [r, in])``."""
    U, S, Vh = factored_svd(B_c, A_c)
    r = min(rank, S.shape[0])
    return U[:, :r], S[:r], Vh[:r]


def sketched_svd(B_c: torch.Tensor, A_c: torch.Tensor, omega: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
    """FedASK's two-stage sketch of ``ΔW = B_c A_c`` (arXiv:2507.09990), never forming ``ΔW``: stage 1
    ``Y = B_c (A_c Ω): [out, s]`` and ``Q = qr(Y)``; stage 2 ``Pᵀ = (Qᵀ B_c) A_c = Qᵀ ΔW: [s, in]`` and its SVD
    ``Pᵀ = Ũ S Vh``. Returns ``(U = Q Ũ, S, Vh)``, the SVD of ``Q Qᵀ ΔW``: of ``ΔW`` itself when ``rank ΔW ≤ s`` and
    ``Ω: [in, s]`` is generic. Both stages are linear in ``(B_c, A_c)`` blocks, so ``Y`` and ``Pᵀ`` are the sums
    of the clients' own sketches. Float64 (QR included)."""
    B_c, A_c, omega = B_c.to(torch.float64), A_c.to(torch.float64), omega.to(torch.float64)
    Q = torch.linalg.qr(B_c @ (A_c @ omega)).Q                       # [out, min(out, s)]
    U, S, Vh = torch.linalg.svd((Q.T @ B_c) @ A_c, full_matrices=False)
    return Q @ U, S, Vh


def energy_rank(S: torch.Tensor, tau: float) -> int:
    """The smallest ``j`` with ``Σ_{l≤j} σ_l² ≥ τ Σ_l σ_l²`` for singular values ``S: [R]`` (descending),
    ``τ ∈ (0, 1]``; 0 when every ``σ`` is 0. With ``τ = 1`` it is the number of non-zero ``σ`` (the trailing energy below round-off
    excluded)."""
    cumulative = torch.cumsum(S.to(torch.float64).pow(2), 0)
    if cumulative.numel() == 0 or float(cumulative[-1]) == 0:
        return 0
    return int(torch.nonzero(cumulative >= tau * cumulative[-1]).flatten()[0]) + 1


def normalize_qr_signs(Q: torch.Tensor, R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q D, D R)`` with ``D = sign(diag R)`` (0 → +1): the product is unchanged and ``diag R ≥ 0``.

    ``Q: [out, m]``, ``R: [m, in]``; makes an unpivoted QR unique where it is unique up to signs.
    """
    d = torch.sign(torch.diagonal(R))
    d = torch.where(d == 0, torch.ones_like(d), d)
    return Q * d, d[:, None] * R


def factored_qr(B_c: torch.Tensor, A_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpivoted QR of ``B_c A_c`` without forming it: ``B_c = Q₁R₁``, ``R₁A_c = Q₂R₂``, so ``B_c A_c = (Q₁Q₂) R₂``.

    Returns ``Q: [out, m]`` orthonormal columns and ``R: [m, in]`` upper trapezoidal with ``diag R ≥ 0``
    (:func:`normalize_qr_signs`), ``m = min(out, R, in)``. Where the QR of ``B_c A_c`` is unique (its leading
    ``m`` columns independent) this is the dense QR with the same sign convention.
    """
    B_c, A_c = B_c.to(torch.float64), A_c.to(torch.float64)
    Q1, R1 = torch.linalg.qr(B_c)
    Q2, R2 = torch.linalg.qr(R1 @ A_c)
    return normalize_qr_signs(Q1 @ Q2, R2)


def normalize_svd_signs(U: torch.Tensor, Vh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U D, D Vh)`` with ``D`` making the largest-magnitude entry of each column of ``U`` positive."""
    idx = U.abs().argmax(dim=0)
    d = torch.sign(U.gather(0, idx[None, :])[0])
    d = torch.where(d == 0, torch.ones_like(d), d)
    return U * d, d[:, None] * Vh


def pad_basis(Q: torch.Tensor, R: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``Q: [out, m]``, ``R: [m, in]`` → ``[out, rank]``, ``[rank, in]`` with the same product ``Q R``.

    Truncates when ``rank ≤ m``; otherwise completes Q with orthonormal columns (deterministically, from the
    complete QR of Q) and R with zero rows. Needs ``rank ≤ out``.
    """
    m = Q.shape[1]
    if rank <= m:
        return Q[:, :rank], R[:rank]
    if rank > Q.shape[0]:
        raise ValueError(f"cannot complete a basis of {Q.shape[0]}-vectors to rank {rank}")
    full = torch.linalg.qr(Q, mode="complete").Q              # [out, out], first m columns = ±Q
    Q = torch.cat([Q, full[:, m:rank]], dim=1)
    R = torch.cat([R, R.new_zeros(rank - m, R.shape[1])], dim=0)
    return Q, R


DECOMPOSITIONS = ("qr", "svd")


def factored_basis(B_c: torch.Tensor, A_c: torch.Tensor, method: str = "qr") -> tuple[torch.Tensor, torch.Tensor]:
    """``B_c A_c = Q R`` with orthonormal ``Q: [out, m]`` and ``R: [m, in]``, in factored form (float64).

    ``"qr"``: the unpivoted QR (:func:`factored_qr`), so ``Q[:, :r] R[:r]`` projects onto the span of the first
    ``r`` columns of ``B_c A_c``. ``"svd"``: ``Q = U``, ``R = diag(S) Vh`` (:func:`factored_svd`, signs by
    :func:`normalize_svd_signs`), the Eckart–Young optimal truncations. Either way the truncation error is
    ``‖B_c A_c − Q[:, :r] R[:r]‖_F = ‖R[r:]‖_F``.
    """
    check_choice("decomposition", method, DECOMPOSITIONS)
    if method == "qr":
        return factored_qr(B_c, A_c)
    U, S, Vh = factored_svd(B_c, A_c)
    U, Vh = normalize_svd_signs(U, Vh)
    return U, S[:, None] * Vh


def orthonormal_refactor(B: torch.Tensor, A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-factorise ``B A`` as ``B⁺ A⁺`` with orthonormal rows in ``A⁺``, in O((out + in)·r²) (float64).

    ``B: [out, r]``, ``A: [r, in]`` with ``r ≤ in``. The QR ``Aᵀ = Q Rₐ`` (``Q: [in, r]``) and the SVD of the small
    ``B Rₐᵀ = U Σ Wᵀ`` (``[out, r]``) give ``B A = U Σ (Q W)ᵀ``: ``B⁺ = U Σ: [out, r]``, ``A⁺ = Wᵀ Qᵀ: [r, in]``,
    the thin SVD of ``B A`` (signs by :func:`normalize_svd_signs`) without forming the ``[out, in]`` product.
    ``A⁺ A⁺ᵀ = I`` holds even when ``B A`` has rank below r (its trailing singular values are then 0).
    """
    B, A = B.to(torch.float64), A.to(torch.float64)
    if A.shape[0] != B.shape[1] or A.shape[0] > A.shape[1]:
        raise ValueError(f"need B [out, r] and A [r, in] with r <= in, got B{tuple(B.shape)} and A{tuple(A.shape)}")
    Q, R_a = torch.linalg.qr(A.T)                          # [in, r], [r, r]
    U, S, Wh = torch.linalg.svd(B @ R_a.T, full_matrices=False)
    U, Vh = normalize_svd_signs(U, Wh @ Q.T)              # Vh = Wᵀ Qᵀ: [r, in], orthonormal rows
    return U * S, Vh

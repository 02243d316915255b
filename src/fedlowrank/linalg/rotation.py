"""Orthogonal Procrustes on r×r matrices and the soft rotation of FedRot-LoRA (Zhang et al., arXiv:2602.23638).

For a LoRA pair ``B: [out, r]``, ``A: [r, in]`` and any orthogonal ``R: [r, r]``, ``(B R)(Rᵀ A) = B A``: the factors
can be rotated into a reference frame without changing the product. Computed in float64; results are float64.
"""

from __future__ import annotations

import torch


def procrustes_rotation(M: torch.Tensor, special: bool = True) -> torch.Tensor:
    """``R* = argmax_R tr(Rᵀ M)`` over orthogonal ``R: [r, r]`` (``special``: over SO(r), det R = +1).

    ``M = U Σ Vᵀ`` gives ``R* = U Vᵀ``; with ``special`` and ``det(U Vᵀ) < 0`` the sign of the direction of the
    smallest singular value flips (``R* = U diag(1, …, 1, −1) Vᵀ``), the optimum over SO(r). With
    ``M = A Arefᵀ`` it minimises ``‖Rᵀ A − Aref‖_F``; with ``M = Bᵀ Bref`` it minimises ``‖B R − Bref‖_F``.
    """
    U, _, Vh = torch.linalg.svd(M.to(torch.float64))
    if special and torch.linalg.det(U @ Vh) < 0:
        U = U.clone()
        U[:, -1] = -U[:, -1]
    return U @ Vh


def soft_rotation(R_star: torch.Tensor, lam: float) -> torch.Tensor:
    """The rotation nearest to ``(1 − λ) I + λ R*`` in SO(r) (``R_star: [r, r]`` in SO(r), ``λ ∈ [0, 1]``).

    λ = 0 gives ``I`` (no alignment), λ = 1 gives ``R*``; between, :func:`procrustes_rotation` of the blend
    projects it back onto SO(r) (the nearest orthogonal matrix in Frobenius norm, its determinant kept at +1).
    """
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"the soft rotation's λ must be in [0, 1], got {lam}")
    R_star = R_star.to(torch.float64)
    if lam == 1.0:
        return R_star
    eye = torch.eye(R_star.shape[0], dtype=torch.float64)
    return procrustes_rotation((1.0 - lam) * eye + lam * R_star, special=True)


def align_factors(B: torch.Tensor, A: torch.Tensor, B_ref: torch.Tensor, A_ref: torch.Tensor, factor: str,
                  lam: float, hard: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotate ``(B: [out, r], A: [r, in])`` towards the reference ``(B_ref, A_ref)`` matching one factor.

    ``factor = "A"``: ``M = A A_refᵀ``; ``"B"``: ``M = Bᵀ B_ref`` (``[r, r]``). ``hard``: ``R = R*`` over O(r)
    (reflections allowed, λ unused); else ``R = soft_rotation(R* over SO(r), λ)``. Returns
    ``(B R, Rᵀ A, R)`` in float64, with ``(B R)(Rᵀ A) = B A``. A non-finite ``M`` (a diverged client) gives
    ``R = I``: the factors go up as they are, for the server's reply check to reject.
    """
    B, A = B.to(torch.float64), A.to(torch.float64)
    if factor == "A":
        M = A @ A_ref.to(torch.float64).T
    elif factor == "B":
        M = B.T @ B_ref.to(torch.float64)
    else:
        raise ValueError(f"factor must be 'A' or 'B', got {factor!r}")
    if not bool(torch.isfinite(M).all()):
        R = torch.eye(M.shape[0], dtype=torch.float64)
    elif hard:
        R = procrustes_rotation(M, special=False)
    else:
        R = soft_rotation(procrustes_rotation(M), lam)
    return B @ R, R.T @ A, R


__all__ = ["procrustes_rotation", "soft_rotation", "align_factors"]

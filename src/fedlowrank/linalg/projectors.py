"""GaLore projector bases: data-driven (exact or randomized SVD of a gradient) and seeded random orthonormal.

A block ``W: [m, n]`` is projected on one side (GaLore ``proj_type="std"``): ``right`` when ``m ≥ n`` (the
basis spans the input side, ``d_p = n``), ``left`` when ``m < n`` (``d_p = m``). In *canonical form* the
gradient is ``G_c = G`` (right) or ``Gᵀ`` (left), of shape ``[d_u, d_p]``, and a basis is ``Q: [d_p, r]`` with
orthonormal columns; the projected gradient is ``G_c Q: [d_u, r]`` and the project-back of ``X: [d_u, r]`` is
``X Qᵀ``. All functions are pure; randomness comes only from the generator passed in.
"""

from __future__ import annotations

import torch

from ..schema import check_choice

SIDES = ("right", "left")


def projection_side(m: int, n: int) -> str:
    """GaLore's ``std`` rule for ``W: [m, n]``: ``"right"`` if ``m ≥ n`` (square included), else ``"left"``."""
    return "right" if m >= n else "left"


def canonical(X: torch.Tensor, side: str) -> torch.Tensor:
    """``X`` for a right block, ``Xᵀ`` for a left block (so that the projected axis is the last one)."""
    check_choice("side", side, SIDES)
    return X if side == "right" else X.T


def svd_basis(G: torch.Tensor, rank: int, side: str) -> torch.Tensor:
    """Top-``rank`` right singular vectors of ``canonical(G, side)``: ``Q: [d_p, rank]`` (G's dtype).

    For a right block this is ``V[:, :r]`` of ``G = U Σ Vᵀ``; for a left block ``U[:, :r]`` (GaLore's ``std`` rule, FedGaLore
    paper App. A.1).
    """
    Gc = canonical(G, side).float()
    _, _, Vh = torch.linalg.svd(Gc, full_matrices=False)
    return Vh[:rank].T.contiguous().to(G.dtype)


def randomized_range(X: torch.Tensor, k: int, niter: int, generator: torch.Generator) -> torch.Tensor:
    """Orthonormal basis ``[rows, k]`` of the approximate top-k range of ``X: [rows, cols]`` (Halko et al.).

    Gaussian test matrix from ``generator``, ``niter`` power iterations with QR re-orthonormalisation.
    """
    Z = torch.randn(X.shape[1], k, generator=generator, dtype=X.dtype).to(X.device)  # drawn on the generator's CPU
    Y, _ = torch.linalg.qr(X @ Z)
    for _ in range(niter):
        Y, _ = torch.linalg.qr(X.T @ Y)
        Y, _ = torch.linalg.qr(X @ Y)
    return Y


def rsvd_basis(G: torch.Tensor, rank: int, side: str, generator: torch.Generator, oversample: int = 10,
               niter: int = 2) -> torch.Tensor:
    """Randomized-SVD version of :func:`svd_basis`: ``q = min(rank + oversample, d_u, d_p)``, ``niter`` power steps."""
    Gc = canonical(G, side).float()
    q = min(rank + oversample, *Gc.shape)
    Y = randomized_range(Gc.T, q, niter, generator)          # [d_p, q] ≈ range of Gcᵀ (right singular space)
    _, _, Vh = torch.linalg.svd(Gc @ Y, full_matrices=False)  # Gc Y = U Σ (Yᵀ V)ᵀ ⇒ right vectors Y Vhᵀ
    return (Y @ Vh[:rank].T).contiguous().to(G.dtype)


def random_basis(dim: int, rank: int, generator: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Seeded random orthonormal ``Q: [dim, rank]``: QR of a float64 Gaussian, signs fixed by ``diag(R) > 0``.

    Identical on every machine given the same generator seed (build it with
    :func:`fedlowrank.seeding.torch_generator`), so a server can rebuild a client's basis from its seed.
    """
    if not 1 <= rank <= dim:
        raise ValueError(f"rank must be in [1, {dim}], got {rank}")
    Z = torch.randn(dim, rank, generator=generator, dtype=torch.float64)
    Q, R = torch.linalg.qr(Z)
    Q *= torch.where(torch.diagonal(R) < 0, -1.0, 1.0)
    return Q.to(dtype).contiguous()


__all__ = ["SIDES", "projection_side", "canonical", "svd_basis", "rsvd_basis", "randomized_range", "random_basis"]

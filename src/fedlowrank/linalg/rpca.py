"""Robust PCA by Principal Component Pursuit, solved with ADMM (FedRPCA's Algorithm 2; Candès et al. 2011).

``min ‖L‖_* + λ‖S‖_1  s.t.  L + S = M`` for ``M: [d1, d2]``, with the paper's defaults
``λ = 1/√max(d1, d2)``, ``μ = d1·d2 / (4‖M‖_1)`` (entrywise ℓ1), ``ρ = 1/μ``, ``S₀ = Y₀ = 0``, stop when
``‖M − L − S‖_F ≤ tol·‖M‖_F`` or after ``max_iter`` iterations. One iteration::

    L ← svt(M − S + ρY, ρ)        # singular-value soft-threshold
    S ← shrink(M − L + ρY, ρλ)    # entrywise soft-threshold
    Y ← Y + μ(M − L − S)

:func:`robust_pca_reference` is that loop verbatim (one thin SVD per iteration). :func:`robust_pca` computes
the same iterates, faster, on a batch ``[B, d1, d2]``:

* ``W = ρY`` is exactly ``clamp(T, −ρλ, ρλ)`` with ``T = M − L + ρY`` (because ``ρμ = 1``), so the dual update
  is a clamp and ``S = T − W``; the residual ``M − L − S`` is ``W_new − W_old``.
* For ``X: [p, q]`` with ``p ≤ q`` (the clients' side), ``svt(X, τ) = K X`` with ``K = V diag(g) Vᵀ``,
  ``X Xᵀ = V diag(σ²) Vᵀ`` and ``g = max(1 − τ/σ, 0)``: one ``p × p`` Gram matrix and a ``p × p`` eigh per
  iteration instead of a ``q × p`` SVD. Components with ``σ ≤ τ`` are dropped whatever their accuracy, and
  the error of the kept ones is ~ε·σ_max/τ relative, far below the ADMM tolerance in float64.
* ``RPCA(cM) = c·RPCA(M)`` for ``c > 0``, so each matrix is scaled by its own μ: then ``ρ = 1`` and the
  thresholds are the scalars 1 and λ for the whole batch.
* Same-shape matrices iterate together (batched matmul and eigh) in chunks of bounded memory, each with its
  own stopping test; a converged matrix leaves the batch, so every matrix gets exactly its own iterates.
* Working buffers are reused across iterations (reallocated only when a matrix leaves the batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class RPCAResult:
    """Output of :func:`robust_pca` (batch dimension ``B`` present iff the input had one).

    Attributes:
        L: low-rank part ``[B, d1, d2]`` (float64).
        S: sparse part ``[B, d1, d2]`` (float64).
        iterations: ADMM iterations run ``[B]`` (0 for an all-zero matrix; ``max_iter`` if not converged).
        residual: ``‖M − L − S‖_F / ‖M‖_F`` at return ``[B]`` (0 for an all-zero matrix).
        rank: rank of ``L``: singular values of the last SVT input above ``1/μ`` ``[B]``.
        converged: whether the tolerance was met within ``max_iter`` ``[B]`` (bool).
    """

    L: torch.Tensor
    S: torch.Tensor
    iterations: torch.Tensor
    residual: torch.Tensor
    rank: torch.Tensor
    converged: torch.Tensor


def pcp_parameters(M: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The paper's defaults for ``M: [..., d1, d2]``: ``λ = 1/√max(d1, d2)`` and ``μ = d1·d2/(4‖M‖_1)`` ``[...]``."""
    d1, d2 = M.shape[-2:]
    lam = 1.0 / math.sqrt(max(d1, d2))
    mu = d1 * d2 / (4.0 * M.abs().sum((-2, -1)))
    return lam, mu


def _check(M: torch.Tensor, tol: float, max_iter: int) -> None:
    if M.dim() not in (2, 3) or M.shape[-1] == 0 or M.shape[-2] == 0:
        raise ValueError(f"robust_pca expects a non-empty [d1, d2] or [B, d1, d2] matrix, got {tuple(M.shape)}")
    if not tol > 0 or max_iter < 1:
        raise ValueError(f"robust_pca needs tol > 0 and max_iter >= 1, got tol={tol}, max_iter={max_iter}")


def robust_pca_reference(M: torch.Tensor, tol: float = 1e-7, max_iter: int = 1000) -> RPCAResult:
    """Algorithm 2 of the paper as written: one thin SVD per iteration, ``M: [d1, d2]``, in float64.

    The plain reference :func:`robust_pca` is tested against; results carry no batch dimension.
    """
    _check(M, tol, max_iter)
    if M.dim() != 2:
        raise ValueError(f"robust_pca_reference takes one [d1, d2] matrix, got {tuple(M.shape)}")
    M = M.to(torch.float64)
    norm_M = torch.linalg.matrix_norm(M)
    L, S = torch.zeros_like(M), torch.zeros_like(M)
    if norm_M == 0:
        zero = torch.tensor(0)
        return RPCAResult(L, S, zero, torch.tensor(0.0, dtype=torch.float64), zero, torch.tensor(True))
    lam, mu = pcp_parameters(M)
    rho = 1.0 / mu
    Y = torch.zeros_like(M)

    def shrink(X: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.sign(X) * torch.clamp(X.abs() - t, min=0.0)

    res = norm_M
    for it in range(1, max_iter + 1):
        U, s, Vh = torch.linalg.svd(M - S + rho * Y, full_matrices=False)
        L = (U * shrink(s, rho)) @ Vh
        rank = (s > rho).sum()
        S = shrink(M - L + rho * Y, rho * lam)
        Y = Y + mu * (M - L - S)
        res = torch.linalg.matrix_norm(M - L - S)
        if res <= tol * norm_M:
            break
    return RPCAResult(L, S, torch.tensor(it), res / norm_M, rank, res <= tol * norm_M)


def _admm_normalised(M: torch.Tensor, lam: float, stop: torch.Tensor, max_iter: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ADMM on a batch ``M: [b, p, q]`` (``p ≤ q``) scaled so that ``μ = 1``; stop when ``‖M−L−S‖ ≤ stop [b]``.

    State: ``T = M − L + ρY`` (``W = ρY = clamp(T, ±λ)``, ``S = T − W``), so the SVT input ``M − S + ρY`` is
    ``M + 2W − T``. Returns ``(L, S, iterations, ‖M − L − S‖_F, rank L, converged)``.
    """
    b = M.shape[0]
    L_out, S_out = torch.empty_like(M), torch.empty_like(M)
    iters, rank = torch.full((b,), max_iter, dtype=torch.int64), torch.zeros(b, dtype=torch.int64)
    res_out = torch.zeros(b, dtype=torch.float64)
    converged = torch.zeros(b, dtype=torch.bool)
    idx = torch.arange(b)                                # rows of the output still iterating
    T, W = torch.zeros_like(M), torch.zeros_like(M)
    X, W_new = torch.empty_like(M), torch.empty_like(M)
    for it in range(1, max_iter + 1):
        torch.add(M, W, alpha=2.0, out=X).sub_(T)        # SVT input M − S + ρY
        evals, V = torch.linalg.eigh(X @ X.mT)           # X Xᵀ = V diag(σ²) Vᵀ   [b, p, p]
        keep = evals > 1.0                               # σ > ρ = 1
        g = torch.where(keep, 1.0 - evals.clamp(min=1.0).rsqrt(), 0.0)
        K = (V * g.unsqueeze(1)) @ V.mT                  # svt(X, 1) = K X
        torch.add(M, W, out=T).baddbmm_(K, X, alpha=-1.0)   # T = M − L + ρY
        torch.clamp(T, min=-lam, max=lam, out=W_new)     # ρY_new; S = T − W_new
        res = torch.linalg.vector_norm(torch.sub(W_new, W, out=X), dim=(1, 2))   # ‖M − L − S‖_F
        ok = res <= stop
        done = ok if it < max_iter else torch.ones_like(ok)
        if done.any():
            d = idx[done]
            L_out[d] = (M + W - T)[done]
            S_out[d] = (T - W_new)[done]
            iters[d] = it
            res_out[d] = res[done]
            rank[d] = keep[done].sum(1)
            converged[d] = ok[done]
            live = ~done
            if not live.any():
                break
            idx, M, T, stop = idx[live], M[live], T[live], stop[live]
            W, W_new, X = W_new[live], torch.empty_like(M), torch.empty_like(M)
        else:
            W, W_new = W_new, W
    return L_out, S_out, iters, res_out, rank, converged


def robust_pca(M: torch.Tensor, tol: float = 1e-7, max_iter: int = 1000, chunk_bytes: int = 1 << 20) -> RPCAResult:
    """Robust PCA of ``M: [d1, d2]`` or a batch ``[B, d1, d2]`` (float64 inside and out).

    Same iterates as :func:`robust_pca_reference`, computed through a ``min(d1, d2)``-sized Gram matrix per
    matrix and batched over ``B`` (see the module docstring), in chunks of about ``chunk_bytes`` per working
    array so that the working set stays in cache. An all-zero matrix gives ``L = S = 0`` in 0 iterations.
    """
    _check(M, tol, max_iter)
    single = M.dim() == 2
    Mb = (M.unsqueeze(0) if single else M).to(torch.float64)
    B, d1, d2 = Mb.shape
    transpose = d1 > d2                      # work on [B, p, q] with p = min(d1, d2) contiguous rows
    A = (Mb.mT if transpose else Mb).contiguous()
    lam, mu = pcp_parameters(A)
    norm_M = torch.linalg.vector_norm(A, dim=(1, 2))

    L, S = torch.zeros_like(A), torch.zeros_like(A)
    iters, rank = torch.zeros(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64)
    residual = torch.zeros(B, dtype=torch.float64)
    converged = torch.ones(B, dtype=torch.bool)
    # RPCA(cM) = c·RPCA(M) for c > 0: scaling each matrix by its μ makes μ = ρ = 1 for all of them, so the
    # thresholds are the scalars 1 (singular values) and λ (entries), shared by the whole batch.
    nonzero = torch.nonzero(norm_M > 0).flatten()
    per_chunk = max(1, chunk_bytes // (A[0].numel() * 8))
    for idx in nonzero.split(per_chunk):
        scale = mu[idx].view(-1, 1, 1)
        stop = tol * norm_M[idx] * mu[idx]
        Lc, Sc, iters[idx], res, rank[idx], converged[idx] = _admm_normalised(A[idx] * scale, lam, stop, max_iter)
        L[idx], S[idx] = Lc / scale, Sc / scale
        residual[idx] = res / (norm_M[idx] * mu[idx])

    if transpose:
        L, S = L.mT, S.mT
    if single:
        L, S, iters, residual, rank, converged = L[0], S[0], iters[0], residual[0], rank[0], converged[0]
    return RPCAResult(L, S, iters, residual, rank, converged)


__all__ = ["RPCAResult", "pcp_parameters", "robust_pca", "robust_pca_reference"]

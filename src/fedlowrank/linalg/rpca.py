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
* Everything runs on ``M``'s device (CUDA tensors in, CUDA tensors out), in float64.

``robust_pca(..., solver="adaptive")`` solves the same PCP problem (same λ, starting from the same μ) by a faster
ADMM that shares this loop (:func:`_admm_normalised`):

* over-relaxation ``α = 1.8`` (Eckstein & Bertsekas 1992; Boyd et al. 2011 §3.4.3);
* a penalty adapted by residual balancing (Boyd et al. 2011 §3.4.1: ``μ ← 2μ`` when the primal residual
  ``‖M − L − S‖`` exceeds twice the dual residual ``μ‖S_k − S_{k−1}‖``, ``μ ← μ/2`` in the opposite case),
  changed at most 10 times per matrix, after which it is fixed-penalty over-relaxed ADMM and converges to the PCP
  optimum by the classical theory. (IALM's unbounded geometric μ has ``Σ 1/μ_k < ∞`` and may stop at a feasible,
  non-optimal point: 5–12% off here. Measured on these inputs: the best fixed μ is about half the paper's, larger
  ones are slower, and Anderson acceleration or restarted momentum gain little over α = 1.8 with balancing.)
* the first iterations in float32, until both residuals are ``≤ 1e-5·‖M‖`` (or for at most 200 iterations),
  then float64 from that state: a finite number of inexact iterations only moves the starting point of the
  float64 ADMM, whose limit, stopping test and returned L, S are float64's;
* residuals (stopping test, balancing) every 2nd iteration; it stops when both are ``≤ tol·‖M‖_F``.

Its iterates are not the paper's; its limit is the same: at ``tol = 1e-12`` its L and S agree with the paper's
ADMM run to the same tolerance to ~1e-9 relative (tests/test_rpca.py). At the default ``tol = 1e-7`` it stops
nearer the optimum than the paper's primal-only rule (on LoRA-like updates ~4e-6 relative against ~1e-4) in
about 0.45× the iterations, each cheaper on average (float32 warm-up). Its float32 phase makes it deterministic
but not bit-for-bit equivariant: a permuted, scaled or differently batched input moves the result by ~1e-8.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..schema import check_choice


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


SOLVERS = ("admm", "adaptive")
# The adaptive solver's constants, measured on LoRA-like, Gaussian and planted low-rank + sparse inputs of shapes
# 1536 × {10, 20, 50}, 20 × 1536 and 384 × 4 (docs/methods/fedrpca.md, "Solvers and device").
RELAXATION = 1.8        # over-relaxation α (Eckstein & Bertsekas 1992: any α ∈ (0, 2) converges)
BALANCE = 2.0           # change μ when one residual exceeds the other by this factor (Boyd et al. 2011 §3.4.1)
PENALTY_FACTOR = 2.0    # ... by this factor (a power of 2: rescaling by it is exact)
PENALTY_CHANGES = 10    # ... at most this many times per matrix: fixed-penalty ADMM from then on
CHECK_EVERY = 2         # residuals (stopping test, balancing) every this many iterations
WARMUP_TOL = 1e-5       # float32 iterations until both residuals are ≤ this·‖M‖ (float32 stalls near 1e-6) ...
WARMUP_MAX_ITER = 200   # ... or for at most this many iterations; float64 from there


def _check_solver(solver: str) -> None:
    check_choice("robust_pca solver", solver, SOLVERS)


State = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]                     # (T, W, c, changes)
Solved = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
# (L, S, iterations, ‖M − L − S‖_F, rank L, converged)


def _admm_normalised(M: torch.Tensor, lam: float, stop: torch.Tensor, limit: torch.Tensor, adaptive: bool = False,
                     start: State | None = None) -> tuple[*Solved, State]:
    """ADMM on a batch ``M: [b, p, q]`` (``p ≤ q``; overwritten) scaled so that the paper's ``μ = 1``; each matrix
    stops when ``‖M−L−S‖ ≤ stop [b]`` (and, if ``adaptive``, ``μ‖S − S_prev‖ ≤ stop``) or after ``limit [b]``
    iterations. On ``M``'s device, in ``M``'s dtype.

    Scaled form with penalty ``μ`` (the paper: ``μ = 1`` throughout) and relaxation ``α`` (the paper: 1)::

        L ← svt(M − S + W, 1/μ);   L̂ = αL + (1 − α)(M − S);   S ← shrink(M − L̂ + W, λ/μ);   W ← W + M − L̂ − S

    A penalty μ on ``M`` gives ``1/μ`` times the iterates of penalty 1 on ``μM`` (with the same dual ``Y``), so the
    loop always runs at penalty 1 on ``cM``, ``c`` the matrix's current μ, and the thresholds stay the scalars 1
    and λ. State: ``T = M − L̂ + W_prev`` with ``W = Y = clamp(T, ±λ)`` and ``S = T − W``; the SVT input is
    ``M + 2W − T`` and the update ``T ← α(M + W − L) + (1 − α)T``. With ``ΔT, ΔW`` the changes of one iteration,
    the primal residual is ``M − L − S = ΔW + ((1 − α)/α)ΔT`` (``ΔW`` for α = 1) and the dual one ``ΔT − ΔW``
    (``μ(S − S_prev)`` in the unscaled problem).

    ``adaptive``: α = :data:`RELAXATION`, residuals every :data:`CHECK_EVERY` iterations, and residual balancing:
    μ is multiplied (divided) by :data:`PENALTY_FACTOR` when the primal (dual) residual exceeds :data:`BALANCE`
    times the other, at most :data:`PENALTY_CHANGES` times per matrix (``M``, ``S`` rescale with μ, ``Y`` does not).
    ``start = (T, W, c, changes)`` continues from such a state (then ``M`` is the matrices times ``c``).

    Returns ``(L, S, iterations, ‖M − L − S‖_F, rank L, converged, (T, W, c, changes))`` of the problem at ``c = 1``,
    the last the state at return.
    """
    b, dev = M.shape[0], M.device
    alpha = RELAXATION if adaptive else 1.0
    L_out, S_out, T_out, W_out = (torch.empty_like(M) for _ in range(4))
    iters = limit.clone()
    rank = torch.zeros(b, dtype=torch.int64, device=dev)
    res_out = torch.zeros(b, dtype=torch.float64, device=dev)
    converged = torch.zeros(b, dtype=torch.bool, device=dev)
    idx = torch.arange(b, device=dev)                    # rows of the output still iterating
    if start is None:                                    # c: current μ of each matrix (the loop runs on cM)
        T, W = torch.zeros_like(M), torch.zeros_like(M)
        c, changes = torch.ones(b, dtype=M.dtype, device=dev), torch.zeros(b, dtype=torch.int64, device=dev)
    else:
        T, W, c, changes = start
    c_out, changes_out = c.clone(), changes.clone()

    def buffers(M: torch.Tensor, T: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """X, W_new, T_new, ΔW, ΔT; the paper's iteration updates T in place and puts ΔW in X (fewer arrays)."""
        X, W_new = torch.empty_like(M), torch.empty_like(M)
        if not adaptive:
            return X, W_new, T, X, None
        return X, W_new, torch.empty_like(M), torch.empty_like(M), torch.empty_like(M)

    X, W_new, T_new, dW, dT = buffers(M, T)
    soonest, last = int(limit.min()), int(limit.max())     # host copies: no device sync to skip a check (b ≥ 1)
    for it in range(1, last + 1):
        torch.add(M, W, alpha=2.0, out=X).sub_(T)        # SVT input M − S + W
        evals, V = torch.linalg.eigh(X @ X.mT)           # X Xᵀ = V diag(σ²) Vᵀ   [b, p, p]
        keep = evals > 1.0                               # σ > 1
        g = torch.where(keep, 1.0 - evals.clamp(min=1.0).rsqrt(), 0.0)
        K = (V * g.unsqueeze(1)) @ V.mT                  # svt(X, 1) = K X
        torch.add(M, W, out=T_new).baddbmm_(K, X, beta=alpha, alpha=-alpha)     # α(M + W − L)
        if adaptive:
            T_new.add_(T, alpha=1.0 - alpha)                                     # ... + (1 − α)T
        torch.clamp(T_new, min=-lam, max=lam, out=W_new)                          # W = Y; S = T − W
        if adaptive and it % CHECK_EVERY and it < soonest:
            T, T_new, W, W_new = T_new, T, W_new, W
            continue
        torch.sub(W_new, W, out=dW)
        if adaptive:
            torch.sub(T_new, T, out=dT)
            res = torch.linalg.vector_norm(torch.add(dW, dT, alpha=(1.0 - alpha) / alpha), dim=(1, 2)) / c
            dual = torch.linalg.vector_norm(dT.sub_(dW), dim=(1, 2))
            ok = (res <= stop) & (dual <= stop)
        else:
            res = torch.linalg.vector_norm(dW, dim=(1, 2))                   # ‖M − L − S‖_F
            ok = res <= stop
        done = ok | (limit <= it)
        if done.any():
            d, cd = idx[done], c[done].view(-1, 1, 1)
            L_out[d] = (K[done] @ X[done] if adaptive else (M + W - T_new)[done]) / cd
            S_out[d] = (T_new - W_new)[done] / cd
            T_out[d], W_out[d], c_out[d], changes_out[d] = T_new[done], W_new[done], c[done], changes[done]
            iters[d] = it
            res_out[d] = res[done].to(torch.float64)
            rank[d] = keep[done].sum(1)
            converged[d] = ok[done]
            live = ~done
            if not live.any():
                break
            idx, M, stop, limit, c, changes = idx[live], M[live], stop[live], limit[live], c[live], changes[live]
            soonest = int(limit.min())
            T, W = T_new[live], W_new[live]
            X, W_new, T_new, dW, dT = buffers(M, T)
            if adaptive:
                res, dual = res[live], dual[live]
        elif adaptive:
            T, T_new, W, W_new = T_new, T, W_new, W
        else:
            W, W_new = W_new, W
        if adaptive:
            free = changes < PENALTY_CHANGES
            up, down = free & (res > BALANCE * dual), free & (dual > BALANCE * res)
            if (up | down).any():                        # μ ← fμ: M, S ← fM, fS; W = Y unchanged; T = S + W
                f = torch.where(up, PENALTY_FACTOR, torch.where(down, 1.0 / PENALTY_FACTOR, 1.0)).to(M.dtype)
                fv = f.view(-1, 1, 1)
                M.mul_(fv)
                T.sub_(W).mul_(fv).add_(W)
                c = c * f
                changes = changes + (up | down).long()
    return L_out, S_out, iters, res_out, rank, converged, (T_out, W_out, c_out, changes_out)


def _adaptive(M: torch.Tensor, lam: float, stop: torch.Tensor, max_iter: int) -> Solved:
    """The adaptive solver on a normalised float64 batch (as :func:`_admm_normalised`): its first iterations in
    float32, until both residuals are ``≤ WARMUP_TOL·‖M‖`` or for ``WARMUP_MAX_ITER`` iterations,
    then float64 from that state on the float64 ``M`` (the float32 phase only chooses the starting point: the
    limit, the stopping test and the returned L, S are float64's). ``iterations`` counts both phases."""
    b = M.shape[0]
    warm = min(WARMUP_MAX_ITER, max_iter - 1)
    if warm < 1:
        return _admm_normalised(M, lam, stop, torch.full((b,), max_iter, device=M.device), adaptive=True)[:6]
    *_, it32, _, _, _, (T, W, c, changes) = _admm_normalised(
        M.float(), lam, (WARMUP_TOL * torch.linalg.vector_norm(M, dim=(1, 2))).float(),
        torch.full((b,), warm, device=M.device), adaptive=True)
    c = c.double()
    L, S, it64, res, rank, converged, _ = _admm_normalised(M * c.view(-1, 1, 1), lam, stop, max_iter - it32,
                                                           adaptive=True, start=(T.double(), W.double(), c, changes))
    return L, S, it32 + it64, res, rank, converged


def robust_pca(M: torch.Tensor, tol: float = 1e-7, max_iter: int = 1000, chunk_bytes: int | None = None,
               solver: str = "admm") -> RPCAResult:
    """Robust PCA of ``M: [d1, d2]`` or a batch ``[B, d1, d2]`` (float64 inside and out, on ``M``'s device).

    ``solver = "admm"``: the same iterates as :func:`robust_pca_reference` (the paper's Algorithm 2 and stopping
    rule), computed through a ``min(d1, d2)``-sized Gram matrix per matrix and batched over ``B`` (see the module
    docstring). ``solver = "adaptive"``: the same problem (PCP, the paper's λ, starting from the paper's μ) by
    over-relaxed ADMM with a residual-balanced penalty and a float32 warm-up (module docstring, :func:`_adaptive`),
    stopping when both the primal residual ``‖M − L − S‖_F`` and the dual residual ``μ‖S_k − S_{k−1}‖_F`` are
    ``≤ tol·‖M‖_F``; its iterates differ from the paper's, its limit is the same PCP optimum. ``iterations``
    counts ADMM iterations (both phases for ``"adaptive"``), at most ``max_iter``.

    Batches are cut into chunks of about ``chunk_bytes`` per working array (default: 1 MiB on the CPU, so that the
    working set stays in cache; the whole batch on an accelerator). An all-zero matrix gives ``L = S = 0`` in 0
    iterations.
    """
    _check(M, tol, max_iter)
    _check_solver(solver)
    single = M.dim() == 2
    Mb = (M.unsqueeze(0) if single else M).to(torch.float64)
    B, d1, d2 = Mb.shape
    dev = Mb.device
    transpose = d1 > d2                      # work on [B, p, q] with p = min(d1, d2) contiguous rows
    A = (Mb.mT if transpose else Mb).contiguous()
    lam, mu = pcp_parameters(A)
    norm_M = torch.linalg.vector_norm(A, dim=(1, 2))

    L, S = torch.zeros_like(A), torch.zeros_like(A)
    iters, rank = (torch.zeros(B, dtype=torch.int64, device=dev) for _ in range(2))
    residual = torch.zeros(B, dtype=torch.float64, device=dev)
    converged = torch.ones(B, dtype=torch.bool, device=dev)
    # RPCA(cM) = c·RPCA(M) for c > 0: scaling each matrix by its μ makes μ = ρ = 1 for all of them, so the
    # thresholds are the scalars 1 (singular values) and λ (entries), shared by the whole batch.
    nonzero = torch.nonzero(norm_M > 0).flatten()
    if chunk_bytes is None:
        chunk_bytes = 1 << 20 if dev.type == "cpu" else 1 << 62
    per_chunk = max(1, chunk_bytes // (A[0].numel() * 8))
    for idx in nonzero.split(per_chunk) if len(nonzero) else ():
        scale = mu[idx].view(-1, 1, 1)
        stop = tol * norm_M[idx] * mu[idx]
        if solver == "adaptive":
            out = _adaptive(A[idx] * scale, lam, stop, max_iter)
        else:
            out = _admm_normalised(A[idx] * scale, lam, stop, torch.full_like(idx, max_iter))[:6]
        Lc, Sc, iters[idx], res, rank[idx], converged[idx] = out
        L[idx], S[idx] = Lc / scale, Sc / scale
        residual[idx] = res / (norm_M[idx] * mu[idx])

    if transpose:
        L, S = L.mT, S.mT
    if single:
        L, S, iters, residual, rank, converged = L[0], S[0], iters[0], residual[0], rank[0], converged[0]
    return RPCAResult(L, S, iters, residual, rank, converged)


__all__ = ["SOLVERS", "RPCAResult", "pcp_parameters", "robust_pca", "robust_pca_reference"]

"""LoRA-FAIR (Bian et al., "LoRA-FAIR: Federated LoRA Fine-Tuning with Aggregation and Initialization
Refinement", ICCV 2025): a server-side residual correction of the averaged B, and "Avg-Initial" clients.

Server, per target module: ``Ā = Σ pₖ Aₖ``, ``B̄ = Σ pₖ Bₖ``, ideal update ``ΔW = Σ pₖ Bₖ Aₖ``, and

    ΔB* = argmin_ΔB  [1 − cos(ΔW, (B̄ + ΔB) Ā)] + λ ‖ΔB‖_F,        B̄' = B̄ + ΔB*

(the paper's similarity-based objective; cosine similarity of the flattened matrices, our reading of "Sim").
Clients start the next round from ``(B̄', Ā)`` (Avg-Initial); nothing extra travels. The objective is solved
with ``steps`` Adam steps on its analytic gradient from ``ΔB = 0``, step size ``step_size·RMS(B̄)`` (the cosine
is scale-free, so the step follows B̄'s scale), entirely in factored form: with ``C = B_s (A_s Āᵀ): [out, r]`` and
``Gₐ = Ā Āᵀ: [r, r]``, ``⟨ΔW, XĀ⟩ = ⟨X, C⟩`` and ``‖XĀ‖²_F = ⟨XᵀX, Gₐ⟩`` — no ``[out, in]`` matrix is formed.
The correction is kept only if it raises the cosine. Reports ``cos_before``/``cos_after`` (mean over modules).

Heterogeneous ranks (not in the paper): zero-padded averaging at the server's scale as in
:mod:`~fedlowrank.methods.hetlora`, ``ΔW = Σ pₖ (sₖ/s) Bₖ Aₖ``, leading slices back to the clients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..adapters.lora import lora_scale
from ..linalg.lowrank import stack_factors
from ..message import Reply, State
from ..schema import setting
from . import SGD_LR_GRID, register
from .ranks import (HeteroRankLoRA, module_names, padded_average, rank_weights)


def fair_loss_grad(X: torch.Tensor, B0: torch.Tensor, C: torch.Tensor, Ga: torch.Tensor, t_norm: float,
                   lam: float) -> tuple[float, float, torch.Tensor]:
    """Objective at ``B̄' = X`` and its gradient: ``(loss, cos, ∇loss)``, all factored.

    ``cos = ⟨X, C⟩ / (‖ΔW‖ n)`` with ``n² = ⟨XᵀX, Gₐ⟩``; ``∇cos = C/(‖ΔW‖ n) − ⟨X, C⟩ X Gₐ / (‖ΔW‖ n³)``;
    ``∇ λ‖X − B0‖_F = λ (X − B0)/‖X − B0‖_F`` (0 at ``X = B0``).
    """
    f = float((X * C).sum())
    XG = X @ Ga
    n = math.sqrt(max(float((X * XG).sum()), 1e-300))
    cos = f / (t_norm * n)
    D = X - B0
    d = float(D.norm())
    grad = -C / (t_norm * n) + (f / (t_norm * n ** 3)) * XG
    if d > 0:
        grad = grad + (lam / d) * D
    return 1.0 - cos + lam * d, cos, grad


def fair_correction(B_bar: torch.Tensor, A_bar: torch.Tensor, B_s: torch.Tensor, A_s: torch.Tensor, lam: float,
                    steps: int, step_size: float) -> tuple[torch.Tensor, float, float]:
    """``B̄ + ΔB*`` for the target ``ΔW = B_s A_s`` (see the module docstring), and the cosines before/after.

    Shapes: ``B̄: [out, r]``, ``Ā: [r, in]``, ``B_s: [out, R]``, ``A_s: [R, in]``. Returns ``B̄'`` in B̄'s dtype.
    Adam (``torch.optim.Adam``) on the analytic gradient of :func:`fair_loss_grad`.
    """
    B0, A = B_bar.to(torch.float64), A_bar.to(torch.float64)
    B_s, A_s = B_s.to(torch.float64), A_s.to(torch.float64)
    C = B_s @ (A_s @ A.T)
    Ga = A @ A.T
    t_norm = math.sqrt(max(float(((B_s.T @ B_s) * (A_s @ A_s.T)).sum()), 0.0))
    if t_norm == 0.0 or float((B0 * (B0 @ Ga)).sum()) <= 0.0:
        return B_bar, 1.0, 1.0
    _, before, _ = fair_loss_grad(B0, B0, C, Ga, t_norm, lam)
    X = B0.clone()
    opt = torch.optim.Adam([X], lr=step_size * float(B0.pow(2).mean().sqrt()), foreach=False)
    for _ in range(steps):
        X.grad = fair_loss_grad(X, B0, C, Ga, t_norm, lam)[2]
        opt.step()
    _, after, _ = fair_loss_grad(X, B0, C, Ga, t_norm, lam)
    if after <= before:
        return B_bar, before, before
    return X.to(B_bar.dtype), before, after


@register
@dataclass
class LoRAFAIR(HeteroRankLoRA):
    """LoRA-FAIR's server: FedIT averaging, then the residual correction ΔB fitted by Adam."""

    name = "lora-fair"
    description = "FedIT averaging plus a server-side residual correction ΔB so that (B̄+ΔB)Ā ≈ Σpₖ BₖAₖ"
    paper = ("Bian et al., LoRA-FAIR: Federated LoRA Fine-Tuning with Aggregation and Initialization Refinement "
             "(ICCV 2025)")
    uplink = "A_k [r_k,in] and B_k [out,r_k] per target module, head"
    downlink = "Ā[:r_k], (B̄+ΔB)[:, :r_k] per target module, head"
    needs_individual_replies = True
    preset = {"train.optimizer": "sgd"}  # as run in FedGaLore's study (Table 1)
    lr_grid = SGD_LR_GRID

    lam: float = setting(0.01, "λ, the weight of ‖ΔB‖_F in the server's fit of the residual correction", ge=0)
    steps: int = setting(200, "server Adam steps per module (0 = plain FedIT averaging)", ge=0)
    step_size: float = setting(0.01, "the server Adam's step size, in units of RMS(B̄)", gt=0)

    def aggregate(self, server: State, replies: list[Reply], rnd: int) -> State:
        server = State(server)
        p = self.client_weights(replies)
        wr = rank_weights(replies, self.info, p)
        s = lora_scale(self.info.alpha, self.info.rank, self.info.scaling)
        wt = [float(pk) * lora_scale(self.info.alpha, self.info.client_ranks[r.client], self.info.scaling) / s
              for pk, r in zip(p, replies)]
        cosines = []
        for name in module_names(server):
            ka, kb = f"{name}.lora_A", f"{name}.lora_B"
            A_bar = padded_average(replies, ka, server[ka].shape, wr)
            B_bar = padded_average(replies, kb, server[kb].shape, wr)
            B_s, A_s = stack_factors([r.message[kb] for r in replies], [r.message[ka] for r in replies], wt)
            B_fair, before, after = fair_correction(B_bar, A_bar, B_s, A_s, self.lam, self.steps, self.step_size)
            cosines.append((before, after))
            server[ka] = self.server_step(server[ka], A_bar)
            server[kb] = self.server_step(server[kb], B_fair)
        self.average_into(server, replies, self.head_keys(server), p)
        self.aggregate_corrections(server, replies)
        self.report(cos_before=sum(c[0] for c in cosines) / len(cosines),
                    cos_after=sum(c[1] for c in cosines) / len(cosines))
        return server

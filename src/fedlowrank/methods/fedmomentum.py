"""FedMomentum (Yan, Hua, Wang, Zhang, Wu, Song, Guan, arXiv:2603.08014): the "loss of training momentum" when a
noise-free aggregate is re-initialised or frozen, avoided by keeping the aggregate's dominant directions.

Clients are FedIT's: they start from the global LoRA ``(B, A)`` over the base ``W0 + D`` and train both factors.
The server aggregates the products exactly, keeps the dominant directions as the next LoRA (so training continues
along them) and merges the residual directions into the base instead of dropping them. Per module, with the LoRA
scale ``s`` (and ``sₖ`` of client k's rank):

    (1)  ΔW = Σₖ pₖ sₖ Bₖ Aₖ = U Σ Vᵀ          factored thin SVD, never formed densely (linalg.lowrank)
    (2)  r_eff = min{j : Σ_{l≤j} σ_l² ≥ τ Σ_l σ_l²},  r' = min(r, r_eff)       τ = method.tau
    (3)  B⁺ = U_{:r'} (Σ_{:r'}/s)^{1/2},  A⁺ = (Σ_{:r'}/s)^{1/2} V_{:r'}ᵀ       balanced split, s B⁺A⁺ = [ΔW]_{r'}
    (4)  D⁺ = D + c · U_{r':r_eff} Σ_{r':r_eff} V_{r':r_eff}ᵀ                   c = 1 (residual_scale = lora) or 1/s

so with ``τ = 1`` and ``c = 1`` the global model is exactly ``W0 + D⁺ + s B⁺A⁺ = W0 + D + ΔW``. Components beyond
``r_eff`` are dropped. Server step β: the old adapter joins (1) as one more block, ``ΔW = (1 − β) s B A +
β Σₖ pₖ sₖ Bₖ Aₖ``. The accumulated base delta ``D: [out, in]`` goes down with every message once it is non-zero
(``<module>.base_delta``, as FedEx-LoRA's), so the ledger counts it. Heterogeneous ranks: client k receives the
leading ``r_k`` directions of ``(B⁺, A⁺)`` at its scale (as FlexLoRA's even split) and the same ``D⁺``.
Reports ``residual_rank`` (``r_eff − r'``, mean over modules) and ``dropped_energy`` (the share of ``‖ΔW‖²_F``
beyond ``r_eff``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..adapters.lora import lora_scale
from ..linalg.lowrank import energy_rank
from ..message import Message, Reply, State
from ..schema import setting
from . import register
from .ranks import HeteroRankLoRA, module_names, product_svd, set_balanced

RESIDUAL_SCALES = ("lora", "none")


@register
@dataclass
class FedMomentum(HeteroRankLoRA):
    name = "fedmomentum"
    description = ("exact Σpₖ sₖBₖAₖ, SVD: the top directions (energy τ) are the next LoRA, the residual directions "
                   "are merged into the base (dense download)")
    paper = "Yan, Hua, Wang, Zhang, Wu, Song, Guan, FedMomentum (arXiv:2603.08014)"
    uplink = "A_k [r_k,in] and B_k [out,r_k] per target module, head"
    downlink = ("balanced SVD factors A [r_k,in], B [out,r_k] and the accumulated base delta [out,in] (once "
                "non-zero) per target module, head")
    needs_individual_replies = True
    server_entries = ("{module}.base_delta",)  # the merged residual directions, once non-zero

    tau: float = setting(0.9999, "energy kept: r_eff is the fewest singular directions holding this share of "
                         "‖ΔW‖²; directions r..r_eff are merged into the base, those beyond r_eff dropped "
                         "(the reference's residual_threshold)", gt=0, le=1)
    merge_residual: bool = setting(True, "merge the directions r..r_eff into the base (false: drop them, i.e. "
                                   "FlexLoRA's balanced split truncated at min(r, r_eff))")
    residual_scale: str = setting("lora", "the merged residual's scale: lora (the model change s·UΣVᵀ, so the global "
                                  "model is conserved) or none (the reference code: the residual of ΣBₖAₖ without s)",
                                  choices=RESIDUAL_SCALES)

    def broadcast(self, server: State, client: int, rnd: int) -> Message:
        """FlexLoRA's even split at the client's rank, plus the accumulated base delta once there is one."""
        msg = super().broadcast(server, client, rnd)
        msg.update({k: server[k] for k in server.tensors() if k.endswith(".base_delta")})
        return msg

    def aggregate(self, server: State, replies: list[Reply], rnd: int) -> State:
        server = State(server)
        p = self.client_weights(replies)
        r = self.info.rank
        s = lora_scale(self.info.alpha, r, self.info.scaling)
        residual_ranks, dropped = [], []
        for name in module_names(server):
            kb, kd = f"{name}.lora_B", f"{name}.base_delta"
            U, S, Vh = product_svd(server, replies, name, p, self.info)
            kept = energy_rank(S, self.tau)
            k = min(r, kept)
            set_balanced(server, name, U, S, Vh, k, s)
            if self.merge_residual and kept > k:
                c = 1.0 if self.residual_scale == "lora" else 1.0 / s
                residual = (U[:, k:kept] * (c * S[k:kept])) @ Vh[k:kept]
                old = server.get(kd, torch.zeros(residual.shape, dtype=server[kb].dtype))
                server[kd] = (old.to(torch.float64) + residual).to(old.dtype)
            total = float(S.pow(2).sum())
            residual_ranks.append(float(kept - k))
            dropped.append(float(S[kept:].pow(2).sum()) / total if total > 0 else 0.0)
        self.average_into(server, replies, self.head_keys(server), p)
        self.aggregate_corrections(server, replies)
        self.report(residual_rank=sum(residual_ranks) / len(residual_ranks),
                    dropped_energy=math.fsum(dropped) / len(dropped))
        return server


__all__ = ["FedMomentum", "RESIDUAL_SCALES"]

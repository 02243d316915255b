"""HetLoRA-style zero padding for heterogeneous ranks (Cho et al., EMNLP 2024), and the rank helpers that the
other heterogeneous-rank LoRA methods share (FFA-LoRA, FedEx-LoRA, FlexLoRA, LoRA-FAIR).

Client k trains LoRA at its own rank ``r_k`` with scale ``s_k = lora_scale(α, r_k)``; the server keeps factors
``Ā: [r, in]``, ``B̄: [out, r]`` at the server rank ``r = max r_k`` with scale ``s``. Every exchange is expressed
at the server's scale, so a factor pair stands for the same weight update on both sides (this avoids the
α mismatch of FLoRA's zero-padding baseline, ``ziyaow1010/FederatedLLM#16``). With ``ρ_k = s_k / s``:

* download (both factors trained): ``A_k = ρ_k^{-1/2} Ā[:r_k]``, ``B_k = ρ_k^{-1/2} B̄[:, :r_k]``, so that
  ``s_k B_k A_k = s B̄[:, :r_k] Ā[:r_k]`` (the server's leading ``r_k`` directions);
* upload: ``Ā = Σ pₖ ρ_k^{1/2} pad(A_k)``, ``B̄ = Σ pₖ ρ_k^{1/2} pad(B_k)`` — zero rows/columns ``r_k..r``, so
  direction ``j`` gets total weight ``Σ_{k: r_k > j} pₖ`` (HetLoRA's zero-padding aggregation).

With equal ranks ``ρ_k = 1`` exactly and nothing is padded or sliced: the result is FedIT's, bit for bit.

HetLoRA's "sparsity-weighted" aggregation (``aggregation = "sparsity"``) replaces ``pₖ`` by
``‖s_k B_k A_k‖_F / Σ_j ‖s_j B_j A_j‖_F`` per target module (norms in factored form). HetLoRA's rank
self-pruning regulariser is not implemented. The head is averaged with ``pₖ``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..adapters.lora import lora_scale
from ..message import Reply, State
from ..schema import setting
from . import register
from .ranks import HeteroRankLoRA, module_names, padded_average, rank_weights

AGGREGATIONS = ("weighted", "sparsity")


def product_norm(B: torch.Tensor, A: torch.Tensor) -> float:
    """``‖B A‖_F`` without forming ``B A``: ``√Σ (BᵀB) ⊙ (A Aᵀ)`` (float64)."""
    B, A = B.to(torch.float64), A.to(torch.float64)
    return float(((B.T @ B) * (A @ A.T)).sum().clamp_min(0).sqrt())


@register
@dataclass
class HetLoRA(HeteroRankLoRA):
    """HetLoRA: LoRA at each client's own rank, zero-padded factor averaging, truncation for redistribution.

    ``aggregation = "sparsity"`` weighs client k by ``pₖ ∝ ‖s_k B_k A_k‖_F`` per module.
    """

    name = "hetlora"
    description = "LoRA at per-client ranks; zero-padded averaging of A and B, clients take the leading r_k slices"
    paper = "Cho et al., Heterogeneous LoRA for Federated Fine-tuning of On-Device Foundation Models (EMNLP 2024)"
    uplink = "A_k [r_k,in] and B_k [out,r_k] per target module, head"
    downlink = "Ā[:r_k] [r_k,in], B̄[:, :r_k] [out,r_k] per target module, head"
    needs_individual_replies = False
    privacy_modes = ("local",)
    privacy_refusal = ("its server step weighs each reply by its rank and, with method.aggregation = 'sparsity', "
                       "by its norm, so one client's weight is not bounded by 1/K")

    aggregation: str = setting("weighted", "client weights of the padded average: weighted (by server.weighting) or "
                               "sparsity (HetLoRA's, ∝ the norm of each client's update per module)",
                               choices=AGGREGATIONS)

    def module_weights(self, replies: Sequence[Reply], name: str, p: torch.Tensor) -> torch.Tensor:
        if self.aggregation == "weighted":
            return p
        norms = torch.tensor([lora_scale(self.info.alpha, self.info.client_ranks[r.client], self.info.scaling)
                              * product_norm(r.message[f"{name}.lora_B"], r.message[f"{name}.lora_A"])
                              for r in replies], dtype=torch.float64)
        return norms / norms.sum() if float(norms.sum()) > 0 else p

    def aggregate(self, server: State, replies: list[Reply], rnd: int) -> State:
        server = State(server)
        p = self.client_weights(replies)
        for name in module_names(server):
            w = rank_weights(replies, self.info, self.module_weights(replies, name, p))
            for key in (f"{name}.lora_A", f"{name}.lora_B"):
                server[key] = self.server_step(server[key], padded_average(replies, key, server[key].shape, w))
        self.average_into(server, replies, self.head_keys(server), p)
        self.aggregate_corrections(server, replies)
        return server

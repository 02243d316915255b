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
from typing import Iterable, Sequence

import torch

from ..adapters.lora import lora_scale
from ..message import Message, Reply, State
from . import register
from .base import LoRAMethod, SetupInfo, weighted_sum
from .fedit import FedIT
from .ilora import leading, zero_pad

AGGREGATIONS = ("weighted", "sparsity")


def scale_ratio(info: SetupInfo, rank: int) -> float:
    """``ρ = s_rank / s_server``: a client's LoRA scale over the server's (exactly 1.0 at the server rank)."""
    if rank == info.rank:
        return 1.0
    return lora_scale(info.alpha, rank, info.scaling) / lora_scale(info.alpha, info.rank, info.scaling)


def module_names(keys: Iterable[str]) -> list[str]:
    """Target module names, from the ``"<module>.lora_A"`` keys among ``keys`` (in order; ``"ns/…"`` keys of
    corrections and the head excluded)."""
    return [k[: -len(".lora_A")] for k in keys if k.endswith(".lora_A") and "/" not in k]


def download_factors(server: State, keys: Iterable[str], info: SetupInfo, client: int,
                     exponent: float = 0.5) -> Message:
    """Client ``client``'s leading-``r_k`` slices of the server factors ``keys``, times ``ρ_k^{-exponent}``.

    ``exponent = 0.5`` when both factors carry the rescaling, ``1.0`` when only B does (A frozen, FFA-LoRA).
    Slices are contiguous copies: the message holds, and the ledger counts, only ``r_k`` directions.
    """
    r = info.client_ranks[client]
    c = scale_ratio(info, r) ** -exponent
    return Message({k: leading(k, server[k], r) * c for k in keys})          # c = 1.0 (equal ranks) is exact


def rank_weights(replies: Sequence[Reply], info: SetupInfo, weights: torch.Tensor,
                 exponent: float = 0.5) -> torch.Tensor:
    """``pₖ ρ_k^{exponent}``: the weights of the zero-padded average at the server's scale. ``[K]`` float64."""
    rho = torch.tensor([scale_ratio(info, info.client_ranks[r.client]) for r in replies], dtype=torch.float64)
    return weights * rho ** exponent                                          # exact when every ρ is 1.0


def padded_average(replies: Sequence[Reply], key: str, shape: Sequence[int], weights: torch.Tensor) -> torch.Tensor:
    """``Σₖ wₖ pad(reply_k[key])`` with each factor zero-padded to the server ``shape``."""
    return weighted_sum((zero_pad(r.message[key], shape) for r in replies), weights)


def refuse_scaffold_with_hetero_ranks(method: LoRAMethod, info: SetupInfo) -> None:
    """SCAFFOLD's control variates live at the server rank; with per-client ranks their shapes would not match."""
    if info.heterogeneous_ranks and "scaffold" in method.correction:
        raise ValueError(f"method.correction: {method.name!r} with heterogeneous ranks (lora.ranks) allows "
                         f"'none' or 'fedprox', got {method.correction!r}")


def product_norm(B: torch.Tensor, A: torch.Tensor) -> float:
    """``‖B A‖_F`` without forming ``B A``: ``√Σ (BᵀB) ⊙ (A Aᵀ)`` (float64)."""
    B, A = B.to(torch.float64), A.to(torch.float64)
    return float(((B.T @ B) * (A @ A.T)).sum().clamp_min(0).sqrt())


@register
@dataclass
class HetLoRA(LoRAMethod):
    """HetLoRA: LoRA at each client's own rank, zero-padded factor averaging, truncation for redistribution.

    Options:
        aggregation: ``"weighted"`` (``pₖ`` by ``server.weighting``) or ``"sparsity"`` (``pₖ ∝ ‖s_k B_k A_k‖_F``
            per module, HetLoRA's sparsity-weighted aggregation).
    """

    name = "hetlora"
    description = "LoRA at per-client ranks; zero-padded averaging of A and B, clients take the leading r_k slices"
    paper = "Cho et al., Heterogeneous LoRA for Federated Fine-tuning of On-Device Foundation Models (EMNLP 2024)"
    uplink = "A_k [r_k,in] and B_k [out,r_k] per target module, head"
    downlink = "Ā[:r_k] [r_k,in], B̄[:, :r_k] [out,r_k] per target module, head"
    needs_individual_replies = False
    supports_heterogeneous_ranks = True
    reply_keys = FedIT.reply_keys          # the trained factors named in the download, head, corrections

    aggregation: str = "weighted"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"method.aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")

    def setup(self, model, info):
        refuse_scaffold_with_hetero_ranks(self, info)
        return super().setup(model, info)

    def broadcast(self, server: State, client: int, rnd: int) -> Message:
        msg = download_factors(server, self.lora_keys(server), self.info, client)
        msg.update(self.global_tensors(server, self.head_keys(server)))
        return self.correction_broadcast(server, msg)

    def train(self, model, msg, state, trainer):
        params, extra, state, loss = self.local_train(model, msg, state, trainer, ("A", "B"))
        return self.reply(params, params, extra, trainer, loss), state

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

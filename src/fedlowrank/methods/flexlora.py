"""FlexLoRA (Bai et al., "Federated Fine-tuning of Large Language Models under Heterogeneous Tasks and Client
Resources", NeurIPS 2024): average the full-size updates, SVD-truncate back to each client's rank.

Clients train A and B at their own rank from the factors they received. The server forms
``ΔW = Σ pₖ sₖ Bₖ Aₖ`` in factored form (stacked factors, QR of both, SVD of the small core —
:func:`~fedlowrank.linalg.lowrank.factored_svd`; ``ΔW`` is never formed) and keeps its best rank-``r`` approximation
``U_r S_r V_rᵀ`` (``r`` = server rank = max client rank) as the global adapter, split between the factors by
``split``:

    official (default, the public code):  B̄ = U_r S_r / s,            Ā = V_rᵀ
    even (FeDeRA's default):               B̄ = U_r S_r^{1/2} / √s,     Ā = S_r^{1/2} V_rᵀ / √s

Both give ``s B̄ Ā = U_r S_r V_rᵀ`` exactly; they differ in what the clients' optimiser starts from (the official A
has orthonormal rows). Client k, at rank ``r_k`` and scale ``s_k``, receives the leading ``r_k`` directions, i.e.
exactly the rank-``r_k`` truncated SVD of ``ΔW``, split the same way at its own scale:

    official:  B_k = U_{r_k} S_{r_k} / s_k,   A_k = V_{r_k}ᵀ      (the public code's ``distribute_weight_fast``)
    even:      B_k = U_{r_k} (S_{r_k}/s_k)^{1/2},   A_k = (S_{r_k}/s_k)^{1/2} V_{r_k}ᵀ

that is B̄'s and Ā's leading slices with the rescaling ``s / s_k`` all on B (official), or its square root on each
(even, :func:`~fedlowrank.methods.ranks.download_factors`). The FedLLM-Factory variant (``√S`` on one side only) is
not offered. Equal-rank rule: the public
code averages A and B factor-wise (FedAvg, as FedIT) when every client has the same rank; ``equal_ranks =
"fedavg"`` does that, the default ``"svd"`` keeps the paper's SVD redistribution at every rank mix. Server step β:
``ΔW = (1 − β) s B̄_old Ā_old + β Σ pₖ sₖ Bₖ Aₖ`` (the old adapter is one more stacked block).
Reports ``truncation_err``: ``‖ΔW − U_r S_r V_rᵀ‖_F / ‖ΔW‖_F``, averaged over modules (0 at full rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..adapters.lora import lora_scale
from ..message import Message, Reply, State
from ..schema import setting
from . import register
from .ranks import HeteroRankLoRA, download_factors, module_names, product_svd, set_balanced, zero_pad

SPLITS = ("official", "even")
EQUAL_RANKS = ("svd", "fedavg")


@register
@dataclass
class FlexLoRA(HeteroRankLoRA):
    """FlexLoRA's server: the weighted average of the products, truncated back to each client's rank."""

    name = "flexlora"
    description = "average Σpₖ sₖBₖAₖ (factored), truncated SVD back to each client's rank"
    paper = ("Bai et al., Federated Fine-tuning of Large Language Models under Heterogeneous Tasks and Client "
             "Resources (NeurIPS 2024)")
    uplink = "A_k [r_k,in] and B_k [out,r_k] per target module, head"
    downlink = "rank-r_k truncated SVD factors A [r_k,in], B [out,r_k] per target module, head"
    needs_individual_replies = True

    split: str = setting("official", "how the truncated SVD is split between B and A: official (B = U S/s, A = Vᵀ) "
                         "or even (√S on each side)", choices=SPLITS)
    equal_ranks: str = setting("svd", "with equal client ranks: svd (the paper's SVD at any rank mix) or fedavg (the "
                               "public code: factor-wise FedAvg)", choices=EQUAL_RANKS)

    def broadcast(self, server: State, client: int, rnd: int) -> Message:
        """Client ``client``'s leading-``r_k`` slices of B̄ and Ā at its scale (see the module docstring)."""
        if self.split != "official":
            return super().broadcast(server, client, rnd)
        sliced = {**download_factors(server, self.lora_keys(server, ("B",)), self.info, client, exponent=1.0),
                  **download_factors(server, self.lora_keys(server, ("A",)), self.info, client, exponent=0.0)}
        msg = Message({k: sliced[k] for k in self.lora_keys(server)})
        msg.update(self.global_tensors(server, self.head_keys(server)))
        return self.correction_broadcast(server, msg)

    def aggregate(self, server: State, replies: list[Reply], rnd: int) -> State:
        server = State(server)
        p = self.client_weights(replies)
        if self.equal_ranks == "fedavg" and not self.info.heterogeneous_ranks:
            self.average_into(server, replies, self.lora_keys(server) + self.head_keys(server), p)
            self.aggregate_corrections(server, replies)
            return server
        r = self.info.rank
        s = lora_scale(self.info.alpha, r, self.info.scaling)
        errors = []
        for name in module_names(server):
            ka, kb = f"{name}.lora_A", f"{name}.lora_B"
            U, S, Vh = product_svd(server, replies, name, p, self.info)
            k = min(r, S.shape[0])
            if self.split == "official":
                server[kb] = zero_pad((U[:, :k] * (S[:k] / s)).to(server[kb].dtype), server[kb].shape)
                server[ka] = zero_pad(Vh[:k].to(server[ka].dtype), server[ka].shape)
            else:
                set_balanced(server, name, U, S, Vh, k, s)
            total = float(S.pow(2).sum())
            errors.append(math.sqrt(float(S[k:].pow(2).sum()) / total) if total > 0 else 0.0)
        self.average_into(server, replies, self.head_keys(server), p)
        self.aggregate_corrections(server, replies)
        self.report(truncation_err=sum(errors) / len(errors))
        return server

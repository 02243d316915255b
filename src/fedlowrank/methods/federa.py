"""FeDeRA as the FLoRG paper describes it (Meng, Tang, Wong, "FLoRG: Federated Fine-tuning with Low-rank Gram
Matrices and Procrustes Alignment", arXiv:2602.17095, §4.1; Yan et al. 2024 is cited for it).

Clients train LoRA (both factors) at one common rank r. The server forms ``ΔW̄ = Σ pₖ s Bₖ Aₖ``, takes its rank-r
truncated SVD ``U_r Σ_r V_rᵀ`` and re-factorises ``B = U_r Σ_r^{1/2} / √s``, ``A = Σ_r^{1/2} V_rᵀ / √s`` (an even
split: the paper says only "performs SVD"), broadcast to every client. This is FlexLoRA with a homogeneous rank, and
shares its code; the SVD is factored (QR of the stacked factors, SVD of the small core), never of a dense ``d × k``
matrix.

Not implemented: the original FeDeRA paper's variant (adapters initialised from the SVD of the pretrained
weights, then FedAvg of A and B), which differs from the description above.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schema import setting
from . import register
from .flexlora import SPLITS, FlexLoRA


@register
@dataclass
class FeDeRA(FlexLoRA):
    name = "federa"
    description = "average Σpₖ sBₖAₖ and re-factorise by truncated SVD (homogeneous rank; as in FLoRG's paper)"
    paper = ("Yan et al., FeDeRA: Efficient Fine-tuning of Language Models in Federated Learning Leveraging "
             "Weight Decomposition (2024), as described by FLoRG")
    uplink = "A_k [r,in] and B_k [out,r] per target module, head"
    downlink = "rank-r truncated SVD factors A [r,in], B [out,r] per target module, head"
    supports_heterogeneous_ranks = False

    split: str = setting("even", "how the truncated SVD is split between B and A: even (√S on each side, FeDeRA's) "
                         "or official (B = U S/s, A = Vᵀ)", choices=SPLITS)

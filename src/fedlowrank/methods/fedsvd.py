"""FedSVD (Lee et al., "FedSVD: Adaptive Orthogonalization for Private Federated Learning with LoRA",
arXiv:2505.12805, NeurIPS 2025).

Clients train only ``B: [out, r]`` (and the head) with ``A: [r, in]`` frozen at the value they received, as in
FFA-LoRA, and upload ``B_k``. The server averages ``B̄ = Σ pₖ Bₖ`` (optional server step β) and re-factorises
the product with the previous ``A`` (:func:`~fedlowrank.linalg.lowrank.orthonormal_refactor`, O((out+in)·r²)):
``B̄ A = U Σ Vᵀ`` (thin SVD, no α/r factor), ``A⁺ = Vᵀ`` (orthonormal rows), ``B⁺ = U Σ``, so ``B⁺ A⁺ = B̄ A``
exactly and the global model is unchanged by the re-factorisation. Both factors go down each round, since A
changes. The first A is LoRA's Kaiming-uniform init from the run seed, as in the official code.

Under record-level DP-SGD (``privacy.dpsgd``) only B and the head are clipped and noised; the SVD is
post-processing of what the clients uploaded and costs no privacy. Under client-level DP (``privacy.mode``) the
noise is added to the mean of the B uploads, before the SVD. SCAFFOLD is refused: A changes every round, so
control variates on B would be in stale coordinates. Client ranks must be equal (``heterogeneous_ranks_refusal``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..linalg.lowrank import orthonormal_refactor
from ..message import State
from ..schema import setting
from . import register
from .base import correction_option
from .fedit import FedIT
from .ranks import module_names


@register
@dataclass
class FedSVD(FedIT):
    name = "fedsvd"
    description = "B-only training (A frozen per round); the server re-factorises B̄A by SVD: A⁺ orthonormal rows"
    paper = ("Lee et al., FedSVD: Adaptive Orthogonalization for Private Federated Learning with LoRA "
             "(arXiv:2505.12805, NeurIPS 2025)")
    uplink = "B_k [out,r] per target module, head (A is not trained and not sent)"
    downlink = "A [r,in] (orthonormal rows after the first re-factorisation) and B [out,r] per target module, head"
    needs_individual_replies = False
    heterogeneous_ranks_refusal = ("the re-factorisation keeps the product of one rank-r pair; a client of another "
                                   "rank would need a truncated SVD, which loses exactness")

    trains = ("B",)
    preset = {"train.optimizer": "sgd"}     # official scripts: SGD, constant lr 0.5 on RoBERTa-large (α = r = 8)
    lr_grid = (1e-2, 3e-2, 1e-1, 5e-1)

    correction: str = correction_option("none", ("none", "fedprox"),
                                        "A changes every round, so SCAFFOLD's control variates on B go stale")
    svd_every: int = setting(1, "re-factorise after every round whose number (from 1) is a multiple of this (the "
                             "official recalculate_svd_period)", ge=1)
    svd_warmup: int = setting(0, "no re-factorisation after rounds 1..svd_warmup, plain B averaging (the official "
                              "svd_warmup_steps)", ge=0)

    def refactor_due(self, rnd: int) -> bool:
        """Whether round ``rnd`` (from 1) ends with a re-factorisation: the official rule, ``(curr_rnd + 1) %
        recalculate_svd_period == 0 and curr_rnd + 1 > svd_warmup_steps`` with ``curr_rnd = rnd − 1``; the period
        counts rounds from the run's start, not from the end of the warm-up."""
        return rnd > self.svd_warmup and rnd % self.svd_every == 0

    def aggregate(self, server, replies, rnd):
        server = State(server)
        self.average_into(server, replies, self.lora_keys(server, ("B",)) + self.head_keys(server),
                          self.client_weights(replies))
        if self.refactor_due(rnd):
            for name in module_names(server):
                ka, kb = f"{name}.lora_A", f"{name}.lora_B"
                B, A = orthonormal_refactor(server[kb], server[ka])
                server[ka], server[kb] = A.to(server[ka].dtype), B.to(server[kb].dtype)
        self.aggregate_corrections(server, replies)
        return server


__all__ = ["FedSVD"]

"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020) on LoRA.

FedIT with the proximal term of FedProx's Eq. (2) added to each client's local objective::

    min_θ  F_k(θ) + μ/2 · ‖θ − θ^t‖²          θ = every trainable tensor (A, B of each module, head)

where ``θ^t`` is the global model the client received this round. The server step is FedIT's (weighted
mean of A and B separately). The term itself is :class:`fedlowrank.training.corrections.FedProx`, which any
LoRA method composes with its ``correction`` option; this method is FedIT with that option set.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import register
from .base import correction_option
from .fedit import FedIT


@register
@dataclass
class FedProx(FedIT):
    """FedIT with the proximal term (``mu`` = 0 gives FedIT)."""

    name = "fedprox"
    description = "FedIT with FedProx's proximal term μ/2·‖θ − θ_global‖² on A, B and the head"
    paper = "Li et al., Federated Optimization in Heterogeneous Networks (MLSys 2020)"
    uplink = "A [r,in] and B [out,r] per target module, head"
    downlink = "Ā, B̄ per target module, head"

    correction: str = correction_option("fedprox", ("fedprox", "fedprox+scaffold"), "the proximal term is the method")

"""Task Arithmetic (Ilharco et al., "Editing Models with Task Arithmetic", ICLR 2023) as a federated server
step, as FedRPCA (Eq. 5) runs it: the clients' task vectors are their updates of the trainable tensors,
``ΔAᵢ = Aᵢ − A^t``, ``ΔBᵢ = Bᵢ − B^t`` per module (and ``Δheadᵢ``), and the server adds their scaled mean::

    A^{t+1} = A^t + β·Σᵢ pᵢ ΔAᵢ,     B^{t+1} = B^t + β·Σᵢ pᵢ ΔBᵢ,     head likewise

with pᵢ from ``server.weighting`` (FedRPCA uses uniform 1/M). β = 1 is FedIT/FedAvg (Eq. 4); FedRPCA tunes
β ∈ {2, 3, 4} and selects 2. This is FedIT with server learning rate β, so ``server.lr`` must stay 1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..message import State
from ..schema import setting
from . import register
from .base import SetupInfo
from .fedit import FedIT


@register
@dataclass
class TaskArithmetic(FedIT):
    """FedIT whose server scales the mean update by β."""

    name = "task-arithmetic"
    description = "scaled averaging: θ ← θ + β·mean of the clients' updates of A, B and the head"
    paper = "Ilharco et al., Editing Models with Task Arithmetic (ICLR 2023); FedRPCA Eq. 5"
    uplink = "A [r,in] and B [out,r] per target module, head"
    downlink = "A, B per target module, head"

    beta: float = setting(2.0, "β, the scale of the mean task vector (1 = FedIT)", gt=0)

    def setup(self, model, info: SetupInfo) -> State:
        if info.server_lr != 1.0:
            raise ValueError(f"method.beta is task-arithmetic's server step; server.lr must be 1, got {info.server_lr}")
        return super().setup(model, dataclasses.replace(info, server_lr=self.beta))

"""SCAFFOLD (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning",
ICML 2020) on LoRA, with partial participation as in the paper's Algorithm 1.

Control variates live on every trainable tensor θ (A ``[r,in]`` and B ``[out,r]`` of each module, head),
server ``c`` and client ``cᵢ``, all zero at the start. Client i in the sampled set S, K local steps of
learning rate η (Alg. 1 lines 9–12; Eq. 4)::

    yᵢ ← yᵢ − η·(gᵢ(yᵢ) − cᵢ + c)              (the corrected gradient is what the optimizer sees)
    cᵢ⁺ = mean of the round's raw gradients gᵢ,   Δcᵢ = cᵢ⁺ − cᵢ   (uploaded with yᵢ)

The refresh equals option II, ``cᵢ − c + (x − yᵢ)/(K η)``, under plain SGD and stays on the gradient scale under
AdamW, where option II diverges; ``cv_grad = "option2"`` gives the literal rule (see
:class:`~fedlowrank.training.corrections.Scaffold`).

Server (Alg. 1 lines 16–17): ``x ← FedIT average of yᵢ`` (server step β = ``server.lr``) and
``c ← c + (|S|/N)·mean_{i∈S} Δcᵢ``, which keeps ``c = (1/N) Σᵢ cᵢ`` over all N clients. The correction
itself is :class:`fedlowrank.training.corrections.Scaffold`, composable with any LoRA method through its
``correction`` option; this method is FedIT with that option set.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import SGD_LR_GRID, register
from .base import correction_option
from .fedit import FedIT


@register
@dataclass
class Scaffold(FedIT):
    """FedIT with SCAFFOLD's control variates (combined with FedProx by ``correction = "fedprox+scaffold"``)."""

    name = "scaffold"
    description = "FedIT with SCAFFOLD control variates on A, B and the head"
    paper = "Karimireddy et al., SCAFFOLD: Stochastic Controlled Averaging for Federated Learning (ICML 2020)"
    uplink = "A [r,in], B [out,r] per target module, head; and Δcᵢ of the same shapes"
    downlink = "Ā, B̄ per target module, head; and the server control variate c of the same shapes"
    preset = {"server.weighting": "uniform", "train.optimizer": "sgd"}  # Alg. 1: x ← x + η_g·mean Δy, local SGD
    lr_grid = SGD_LR_GRID

    correction: str = correction_option("scaffold", ("scaffold", "fedprox+scaffold"), "the control variates are "
                                        "the method")

"""MOON (Li, He, Song, "Model-Contrastive Federated Learning", CVPR 2021) on LoRA.

FedIT plus MOON's model-contrastive term on the representation ``z = task.features(net, batch)``
``[B, d]`` (the vector the head sees). Local objective of client i in round t (Eqs. 3–4)::

    ℓ = ℓ_task + μ·ℓ_con,
    ℓ_con = −log( exp(sim(z, z_glob)/τ) / (exp(sim(z, z_glob)/τ) + exp(sim(z, z_prev)/τ)) )

averaged over the batch, with ``sim`` the cosine similarity, ``z_glob`` the representation under the global
model received this round (frozen) and ``z_prev`` under the client's own local model at the end of its previous
round (frozen; the global model when the client has not trained before, which makes ``ℓ_con = log 2``
and its gradient zero). Both reference models are evaluated in eval mode (no dropout), as MOON's code does.
The previous local model is the client's trained tensors, kept in its state as ``moon.prev/<key>``.
The server step is FedIT's. Payload: that of FedIT (MOON adds client compute and state, no communication).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..message import Message, State
from ..training.corrections import ClientCorrection
from ..schema import setting
from . import register
from .fedit import FedIT


class _Features(nn.Module):
    """``task.features(net, batch)`` as a module, so that ``functional_call`` can swap ``net``'s tensors."""

    def __init__(self, net: nn.Module, task):
        super().__init__()
        self.net = net
        self.task = task

    def forward(self, batch):
        return self.task.features(self.net, batch)


class ModelContrastive(ClientCorrection):
    """MOON's ``μ·ℓ_con`` as a client correction (composable with any method that trains named tensors).

    Client state: ``moon.prev/<key>`` — the trained tensors at the end of the client's last round.
    """

    name = "moon"
    client_state = "the trained tensors of the client's last round, moon.prev/<key>"
    reads_batch = True
    prefix_prev = "moon.prev/"
    client_entries = ("moon.prev/{key}",)

    def __init__(self, mu: float, temperature: float):
        self.mu, self.temperature = mu, temperature
        self._global: dict[str, torch.Tensor] = {}
        self._prev: dict[str, torch.Tensor] = {}

    def start(self, msg: Message, state: State, params: dict[str, nn.Parameter]) -> None:
        self._global = {k: p.detach().clone() for k, p in params.items()}
        self._prev = {k: state.get(self.prefix_prev + k, self._global[k]).to(p.device) for k, p in params.items()}

    def _reference(self, tensors: dict[str, torch.Tensor], params: dict[str, nn.Parameter], net: nn.Module,
                   batch, task) -> torch.Tensor:
        """Representation ``[B, d]`` with the trained tensors replaced by ``tensors`` (eval mode, no grad)."""
        names = {id(p): n for n, p in net.named_parameters()}
        swap = {f"net.{names[id(p)]}": tensors[k] for k, p in params.items()}
        training = net.training
        net.eval()
        try:
            with torch.no_grad():
                return torch.func.functional_call(_Features(net, task), swap, (batch,))
        finally:
            net.train(training)

    def loss(self, params: dict[str, nn.Parameter], net: nn.Module, batch, task) -> torch.Tensor | None:
        if self.mu == 0:
            return None
        z = task.features(net, batch)
        z_glob = self._reference(self._global, params, net, batch, task)
        z_prev = self._reference(self._prev, params, net, batch, task)
        logits = torch.stack([F.cosine_similarity(z, z_glob, dim=-1), F.cosine_similarity(z, z_prev, dim=-1)], 1)
        target = torch.zeros(z.shape[0], dtype=torch.long, device=z.device)
        return self.mu * F.cross_entropy(logits / self.temperature, target)

    def finish(self, params: dict[str, nn.Parameter], state: State, result) -> dict[str, torch.Tensor]:
        for k, p in params.items():
            state[self.prefix_prev + k] = p.detach().clone()
        return {}


@register
@dataclass
class Moon(FedIT):
    """FedIT plus μ·ℓ_con (``moon_mu`` = 0 gives FedIT); FedProx/SCAFFOLD compose on top (``correction``)."""

    name = "moon"
    description = "FedIT with MOON's model-contrastive loss on the representation (global vs previous local model)"
    paper = "Li, He, Song, Model-Contrastive Federated Learning (CVPR 2021)"
    uplink = "A [r,in] and B [out,r] per target module, head"
    downlink = "Ā, B̄ per target module, head"
    reads_features = True

    moon_mu: float = setting(0.01, "μ, the weight of the model-contrastive loss ℓ_con (0 gives FedIT)", ge=0)
    temperature: float = setting(0.5, "τ, the temperature of ℓ_con", gt=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._corrections.append(ModelContrastive(self.moon_mu, self.temperature))

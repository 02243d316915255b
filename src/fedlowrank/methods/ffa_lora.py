"""FFA-LoRA (Sun et al., "Improving LoRA in Privacy-preserving Federated Learning", ICLR 2024).

``A: [r, in]`` is frozen at a random initialisation that every party derives from the run seed (PEFT's
Kaiming-uniform, stream ``"ffa-lora-A"``); it never travels and never changes. Only ``B: [out, r]`` (zero at
init) and the head are trained, uploaded and averaged: ``B̄ = Σ pₖ Bₖ``. The aggregate is exact,
``s B̄ A = Σ pₖ s Bₖ A``, because A is shared. (FedGaLore's Table 1 runs it with SGD: ``train.optimizer``.)

Heterogeneous ranks (not in the paper): one ``A_full: [r_max, in]`` from the shared seed; client k uses
``A_full[:r_k]`` with scale ``s_k``. Upload ``B̄ = Σ pₖ (s_k/s) pad(B_k)``, download ``B_k = (s/s_k) B̄[:, :r_k]``,
so ``s B̄ A_full = Σ pₖ s_k B_k A_full[:r_k]`` exactly and client k starts from the leading r_k directions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..adapters.lora import init_lora_factors, lora_modules
from ..adapters.model import AdaptedModel
from ..message import Message, State
from ..seeding import torch_generator
from . import SGD_LR_GRID, register
from .base import SetupInfo
from .ranks import HeteroRankLoRA, download_factors, module_names, padded_average, rank_weights


def frozen_A(model: AdaptedModel, info: SetupInfo) -> dict[str, torch.Tensor]:
    """The shared frozen ``A: [r_server, in]`` of every target module, a pure function of ``info.seed``."""
    gen = torch_generator(info.seed, "ffa-lora-A")
    return {name: init_lora_factors(mod.out_features, mod.in_features, info.rank, gen, mod.base.weight.dtype)[0]
            for name, mod in lora_modules(model).items()}


@register
@dataclass
class FFALoRA(HeteroRankLoRA):
    name = "ffa-lora"
    description = "A frozen at a shared seeded init; only B (and the head) trained and averaged; exact"
    paper = "Sun et al., Improving LoRA in Privacy-preserving Federated Learning (ICLR 2024)"
    uplink = "B_k [out,r_k] per target module, head"
    downlink = "B̄[:, :r_k] [out,r_k] per target module, head (A is regenerated from the seed)"
    needs_individual_replies = False

    trains = ("B",)
    preset = {"train.optimizer": "sgd"}  # as run in FedGaLore's study (Table 1)
    lr_grid = SGD_LR_GRID

    def setup(self, model: AdaptedModel, info: SetupInfo) -> State:
        server = super().setup(model, info)
        server.update({f"{n}.lora_A": A for n, A in frozen_A(model, info).items()})
        return server

    def broadcast(self, server: State, client: int, rnd: int) -> Message:
        msg = download_factors(server, self.lora_keys(server, ("B",)), self.info, client, exponent=1.0)
        msg.update(self.global_tensors(server, self.head_keys(server)))
        return self.correction_broadcast(server, msg)

    def prepare_fit(self, model, msg, state, trainer):
        local = Message(msg)
        for name, A in frozen_A(model, self.info).items():
            local[f"{name}.lora_A"] = A[: msg[f"{name}.lora_B"].shape[1]]
        return self.local_fit(model, local, state, ("B",))

    def aggregate(self, server, replies, rnd):
        server = State(server)
        p = self.client_weights(replies)
        w = rank_weights(replies, self.info, p, exponent=1.0)
        for key in (f"{n}.lora_B" for n in module_names(server)):
            server[key] = self.server_step(server[key], padded_average(replies, key, server[key].shape, w))
        self.average_into(server, replies, self.head_keys(server), p)
        self.aggregate_corrections(server, replies)
        return server

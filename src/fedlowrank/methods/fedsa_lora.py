"""FedSA-LoRA (Guo et al., "Selective Aggregation for Low-Rank Adaptation in Federated Learning", ICLR 2025).

Clients train both factors. Only ``A_k: [r, in]`` (and the head) is uploaded and averaged, ``Ā = Σ pₖ A_k``;
``B_k: [out, r]`` stays private to client k, in the client state the runtime stores (key
``"<module>.lora_B"``), and persists across rounds (zero, LoRA's init, before the client's first round).
No message ever carries a B, and the server never sees one.

Choices: the head is shared and averaged like A (FLoRG's experiments, arXiv:2602.17095 §4.1, do not say; the original
code keeps the classifier local too). There is no single global model: :meth:`load_global` loads the shared part only
(``Ā``, the head, ``B = 0``, i.e. the pretrained target weights) and :meth:`load_personal` loads client k's
personalised model ``(Ā, B_k)`` for per-client evaluation (the metric is the mean over clients of that). SCAFFOLD is
refused: its upload ``Δc`` of B would leak the private factor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..adapters.lora import lora_modules
from ..adapters.model import AdaptedModel
from ..message import Message, State
from . import register
from .base import LoRAMethod, correction_option


@register
@dataclass
class FedSALoRA(LoRAMethod):
    name = "fedsa-lora"
    description = "A shared and averaged; B private to each client (kept in its client state)"
    paper = "Guo et al., Selective Aggregation for Low-Rank Adaptation in Federated Learning (ICLR 2025)"
    uplink = "A_k [r,in] per target module, head"
    downlink = "Ā [r,in] per target module, head"
    needs_individual_replies = False
    supports_heterogeneous_ranks = False
    personalized = True
    client_state = "private B_k [out,r] per target module"
    client_entries = ("{module}.lora_B",)

    correction: str = correction_option("none", ("none", "fedprox"), "SCAFFOLD would upload B's control variate")

    def setup(self, model: AdaptedModel, info) -> State:
        server = super().setup(model, info)
        for key in self.lora_keys(server, ("B",)):
            del server[key]                     # B is the clients' business: the server holds none
        return server

    def broadcast(self, server: State, client: int, rnd: int) -> Message:
        msg = self.global_tensors(server, self.lora_keys(server, ("A",)) + self.head_keys(server))
        return self.correction_broadcast(server, msg)

    def with_private_B(self, model: AdaptedModel, msg: Message, state: State) -> Message:
        """``msg`` plus the client's own ``B`` of every module (zeros before its first round)."""
        full = Message(msg)
        for name, mod in lora_modules(model).items():
            key = f"{name}.lora_B"
            full[key] = state[key] if key in state else torch.zeros(mod.out_features, self.info.rank)
        return full

    def prepare_fit(self, model, msg, state, trainer):
        return self.local_fit(model, self.with_private_B(model, msg, state), state, ("A", "B"))

    def finish_fit(self, fit, result, trainer):
        params, extra, new_state, loss = self.local_result(fit, result)
        new_state.update({k: p.detach().clone() for k, p in params.items() if k.endswith(".lora_B")})
        keys = [k for k in params if not k.endswith(".lora_B")]
        return self.reply(params, keys, extra, trainer, loss), new_state

    def aggregate(self, server, replies, rnd):
        server = State(server)
        self.average_into(server, replies, self.lora_keys(server, ("A",)) + self.head_keys(server),
                          self.client_weights(replies))
        self.aggregate_corrections(server, replies)
        return server

    def load_global(self, model: AdaptedModel, server: State) -> None:
        """The shared part only: ``Ā``, the head and ``B = 0`` (see the module docstring)."""
        self.load_personal(model, server, State())

    def load_personal(self, model: AdaptedModel, server: State, state: State) -> None:
        """Client's personalised model: shared ``Ā`` and head, its private ``B_k`` from ``state``."""
        self.load_message(model, self.with_private_B(model, Message(server), state))

"""FedIT (Zhang et al., "Towards Building the Federated GPT: Federated Instruction Tuning", ICASSP 2024).

Clients train LoRA factors A and B; the server averages them separately, weighted by pₖ:
``Ā = Σ pₖ Aₖ``, ``B̄ = Σ pₖ Bₖ`` (the product of averages, not the average of products). The head is
averaged the same way. Optional server step β: ``new = old + β·(avg − old)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..message import Message, State
from . import register
from .base import LoRAMethod


@register
@dataclass
class FedIT(LoRAMethod):
    name = "fedit"
    description = "LoRA on the target modules; the server averages A and B separately"
    paper = "Zhang et al., Towards Building the Federated GPT: Federated Instruction Tuning (ICASSP 2024)"
    uplink = "A [r,in] and B [out,r] per target module, head"
    downlink = "Ā, B̄ per target module, head"

    def broadcast(self, server: State, client: int, rnd: int) -> Message:
        msg = self.global_tensors(server, self.lora_keys(server) + self.head_keys(server))
        return self.correction_broadcast(server, msg)


    def aggregate(self, server, replies, rnd):
        server = State(server)
        self.average_into(server, replies, self.lora_keys(server) + self.head_keys(server), self.client_weights(replies))
        self.aggregate_corrections(server, replies)
        return server

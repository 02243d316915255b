"""RoLoRA (Chen et al., "Robust Federated Finetuning of LLMs via Alternating Optimization of LoRA", 2024).

Alternating optimisation: in odd rounds (1, 3, …) clients train only ``B: [out, r]`` with ``A`` frozen, in even
rounds only ``A: [r, in]`` with ``B`` frozen; the server averages only the factor that was trained. Since the other
factor is the same on every client, the aggregate is exact: ``s B̄ A = Σ pₖ s Bₖ A`` (odd rounds) and
``s B Ā = Σ pₖ s B Aₖ`` (even rounds). B goes first because with ``B = 0`` (LoRA's init) A has no gradient.

Payload choice: the download carries both factors (a client that skipped rounds needs both; with full
participation the paper sends only the updated one) and ``rolora.factor`` (``"A"``/``"B"``); the upload carries
only the trained factor and the head. SCAFFOLD is refused (its control variates assume every factor trains).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..message import Message, State
from . import register
from .base import LoRAMethod, correction_option


@register
@dataclass
class RoLoRA(LoRAMethod):
    name = "rolora"
    description = "alternating LoRA: odd rounds train and average B (A frozen), even rounds A (B frozen); exact"
    paper = "Chen et al., Robust Federated Finetuning of LLMs via Alternating Optimization of LoRA (2024)"
    uplink = "the round's trained factor (B [out,r] in odd rounds, A [r,in] in even rounds) per target module, head"
    downlink = "Ā and B̄ per target module, which factor to train, head"
    needs_individual_replies = False
    supports_heterogeneous_ranks = False

    correction: str = correction_option("none", ("none", "fedprox"), "one factor is trained per round")

    def factors_to_train(self, rnd: int) -> tuple[str, ...]:
        return ("B",) if rnd % 2 == 1 else ("A",)

    def broadcast(self, server: State, client: int, rnd: int) -> Message:
        msg = self.global_tensors(server, self.lora_keys(server) + self.head_keys(server))
        msg["rolora.factor"] = self.factors_to_train(rnd)[0]
        return self.correction_broadcast(server, msg)

    def prepare_fit(self, model, msg, state, trainer):
        return self.local_fit(model, msg, state, (msg["rolora.factor"],))

    def aggregate(self, server, replies, rnd):
        server = State(server)
        keys = self.lora_keys(server, self.factors_to_train(rnd)) + self.head_keys(server)
        self.average_into(server, replies, keys, self.client_weights(replies))
        self.aggregate_corrections(server, replies)
        return server

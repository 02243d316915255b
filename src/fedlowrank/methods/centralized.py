"""Centralized: the reference of centralised training on the same budget (not a federated method).

Each round one model, LoRA on the target modules and the head as in FedIT, trains on the pooled data of the round's
sampled clients for the sum of their local steps (``pooled``: the runtime hands it that data as one client,
:func:`fedlowrank.runtime.engine.pool`), so it sees as many examples with as many optimizer steps as the clients
together; the global model is what it trained. Over the run that is plain training on the participants' pooled data
with the federated runs' total examples and steps and learning-rate schedule; the optimizer state starts afresh
each round, as a client's does. Nothing crosses a network: the ledger counts zero bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..message import Message, State
from . import register
from .base import LoRAMethod, correction_option


@register
@dataclass
class Centralized(LoRAMethod):
    name = "centralized"
    description = ("reference: one LoRA model trained on the pooled data of each round's clients for their total "
                   "local steps")
    paper = "a reference row, not a federated method (docs/comparison.md, \"Reference rows\")"
    uplink = "nothing (the data is pooled where the model trains)"
    downlink = "nothing"
    reference = "centralised training on the pooled data, same examples and steps"
    communicates = False
    pooled = True
    privacy_modes = ()
    privacy_refusal = "a reference trains on pooled data: no client sends an update to protect"

    correction: str = correction_option("none", ("none",), "a reference trains one model, with no drift to correct")

    def broadcast(self, server: State, client: int, rnd: int) -> Message:
        return self.global_tensors(server, self.lora_keys(server) + self.head_keys(server))

    def aggregate(self, server: State, replies, rnd: int) -> State:
        """The global model is the one reply's trained factors and head (a pooled round has one client)."""
        new = State(server)
        for key in self.lora_keys(server) + self.head_keys(server):
            new[key] = replies[0].message[key]
        return new

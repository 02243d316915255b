"""Local-only: the reference of each client training alone (not a federated method).

Every client keeps its own model, LoRA on the target modules and the head as in FedIT, starting from the same
initial model and training it on its own data whenever it is sampled, with the federated runs' local steps; nothing
is averaged and nothing crosses a network (the ledger counts zero bytes). It is personalised: a round's metric is the
mean over the clients of their own models' test metrics, each client's in its ``per_client`` entry.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..adapters.model import AdaptedModel
from ..message import Message, State
from . import register
from .base import LoRAMethod, SetupInfo, Upload, correction_option


@register
@dataclass
class LocalOnly(LoRAMethod):
    name = "local-only"
    description = "reference: each client trains its own LoRA model on its own data; nothing is shared"
    paper = "a reference row, not a federated method (docs/comparison.md, \"Reference rows\")"
    uplink = "nothing (num_examples and train_loss stay local bookkeeping)"
    downlink = "nothing"
    reference = "each client alone, its own model on the test set"
    communicates = False
    personalized = True
    client_state = "own A_k [r,in], B_k [out,r] per target module and head (nothing else exists)"
    privacy_modes = ()
    privacy_refusal = "a client that trains alone sends no update to protect"

    correction: str = correction_option("none", ("none",), "clients train alone, with no drift to correct")

    def setup(self, model: AdaptedModel, info: SetupInfo) -> State:
        """The initial model (factors ``[r, in]``/``[out, r]`` per target, head), every client's start."""
        server = super().setup(model, info)
        self._initial = State(server)
        return server

    def init_client(self, client: int) -> State:
        return State({k: v.clone() for k, v in self._initial.tensors().items()})

    def broadcast(self, server: State, client: int, rnd: int) -> Message:
        return Message()

    def upload_spec(self, down: Message, rnd: int) -> Upload:
        """No tensor: the reply carries only ``num_examples`` and ``train_loss``."""
        return {}

    def prepare_fit(self, model: AdaptedModel, msg: Message, state: State, trainer):
        """Train the client's own factors and head from its state."""
        return self.local_fit(model, Message(state), State(), self.trains)

    def finish_fit(self, fit, result, trainer):
        """Reply with the example count and loss only; the trained tensors are the client's new state."""
        reply = Message({"num_examples": int(trainer.num_examples), "train_loss": float(result.loss)})
        return reply, State({k: p.detach().clone() for k, p in fit.params.items()})

    def aggregate(self, server: State, replies, rnd: int) -> State:
        return State(server)

    def load_personal(self, model: AdaptedModel, server: State, state: State) -> None:
        self.load_message(model, Message(state))

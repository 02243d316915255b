"""FedALT (Bian, Wang, Zhang, Xu, "FedALT: Federated Fine-Tuning through Adaptive Local Training with Rest-of-World
LoRA", arXiv:2503.11880, AAAI 2026). Personalised.

Per target linear (:class:`~fedlowrank.adapters.routed.RoutedLoRALinear`, two experts, two slots, no top-k cut):
client k keeps its own LoRA ``(A¹_k: [r, in], B¹_k: [out, r])``, its router ``W_k: [2, in]`` and its head in its
client state across rounds; it receives a frozen Rest-of-World LoRA ``(A⁰_k, B⁰_k)``, and a token ``x`` gives
``y = W0 x + s·[g_own(x) B¹_kA¹_k x + g_RoW(x) B⁰_kA⁰_k x]`` with ``[g_own, g_RoW] = softmax(W_k x)``: row 0 of the
router gates the client's own LoRA and row 1 the Rest-of-World (the routed adapter's expert 0 is always the trainable
one). The official code orders the rows the other way (its row 0, ``g_0``, gates the Rest-of-World); swapping the two
rows maps one layout to the other, with the same model. It trains ``A¹_k, B¹_k, W_k`` and its head, and uploads
``A¹_k, B¹_k`` only. Message keys, both ways: ``"<module>.lora_A"`` ``[r, in]``,
``"<module>.lora_B"`` ``[out, r]`` (down: the Rest-of-World; up: the own factors, shaped as what came down).

Server: it keeps the latest upload of every client (``upload.<k>/<module>.lora_A|B``) and sends client k the uniform
leave-one-out mean of the others' latest uploads (the official server's rule, for factors):
``A⁰_k = (1/|U∖{k}|) Σ_{i∈U∖{k}} A¹_i``, ``B⁰_k`` alike, U = the clients that have uploaded at least once. With full
participation this is the paper's ``(1/(N−1)) Σ_{i≠k}``; with partial participation a round uses the latest upload
of every other client, not only the sampled ones (the official code samples every client every round, so both
readings agree there; the latest uploads keep the Rest-of-World the same size from round to round). Before any other
client has uploaded, the Rest-of-World is zero and contributes nothing (as the official round 0, where ``B⁰ = 0``).

Own factors start as LoRA's (``A¹`` uniform in ``±1/√in``, ``B¹ = 0``) and the router as a linear layer's default,
each from the seeded stream ``"fedalt-client"`` of the client. The head is the client's own (it starts from the
model's and never travels). :meth:`load_global` is the uniform mean of every latest upload with an even router: what a
client that never trained would get.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..adapters.model import AdaptedModel
from ..adapters.routed import RoutedLoRALinear, routed_modules
from ..message import Message, State
from ..seeding import torch_generator
from ..training.local import Fit
from . import register
from .base import Method, SetupInfo, Upload, head_tensors, load_head, on_host, specs_of


def upload_key(client: int, key: str) -> str:
    """The server-state key of client ``client``'s latest upload of ``key`` (``"<module>.lora_A"``)."""
    return f"upload.{client}/{key}"


@register
@dataclass
class FedALT(Method):
    name = "fedalt"
    description = ("personalised: each client keeps its own LoRA and a per-token router mixing it with a "
                   "leave-one-out Rest-of-World LoRA the server sends it")
    paper = ("Bian, Wang, Zhang, Xu, FedALT: Federated Fine-Tuning through Adaptive Local Training with "
             "Rest-of-World LoRA (arXiv:2503.11880, AAAI 2026)")
    uplink = "own A¹_k [r,in], B¹_k [out,r] per target module (router and head stay on the client)"
    downlink = ("client k's Rest-of-World A⁰_k [r,in], B⁰_k [out,r] per target module: the mean of every other "
                "client's latest upload")
    needs_individual_replies = True          # the server keeps each client's latest upload for the leave-one-out
    personalized = True
    per_client_downlink = True               # the leave-one-out Rest-of-World of each client
    server_entries = ("upload.{client}/{module}.lora_A", "upload.{client}/{module}.lora_B")  # latest uploads
    upload_entries = ("{module}.lora_A", "{module}.lora_B")  # the shared adapter (the server keeps them per client)
    client_state = ("own A¹_k [r,in], B¹_k [out,r] and router W_k [2,in] per target module, the head, and the "
                    "client's index k")
    heterogeneous_ranks_refusal = ("the Rest-of-World is a mean of factors, which needs every client at the same "
                                   "rank")
    # official main.py/config.py: AdamW, weight decay 0.05, lr 3e-4, 5 local epochs, batch 8, every client each round
    preset = {"train.optimizer": "adamw", "train.weight_decay": 0.05, "train.local_epochs": 5.0,
              "train.batch_size": 8}
    lr_grid = (1e-4, 3e-4, 1e-3)

    def setup(self, model: AdaptedModel, info: SetupInfo) -> State:
        """Attach a two-expert :class:`RoutedLoRALinear` to every target; the server starts with no uploads."""
        self.info = info
        model.attach(lambda name, lin: RoutedLoRALinear(lin, info.rank, info.alpha, info.scaling, info.dropout,
                                                        slot_expert=[0, 1], top_k=2))
        self._shapes = {name: (m.out_features, m.in_features) for name, m in routed_modules(model).items()}
        self._head = head_tensors(model)
        return State({"uploaded": torch.zeros(info.num_clients)})

    def init_client(self, client: int) -> State:
        """Own ``A¹`` (LoRA's init), ``B¹ = 0``, the router (``U(±1/√in)``, a linear layer's init; row 0 gates the own
        LoRA, row 1 the Rest-of-World), the model's
        head and the client's index, from the stream ``"fedalt-client"`` of ``client``."""
        gen = torch_generator(self.info.seed, "fedalt-client", client)
        state = State({"client": int(client)})
        for name, (out_f, in_f) in self._shapes.items():
            bound = 1.0 / math.sqrt(in_f)
            state[f"{name}.lora_A"] = (torch.rand(self.info.rank, in_f, generator=gen) * 2 - 1) * bound
            state[f"{name}.lora_B"] = torch.zeros(out_f, self.info.rank)
            state[f"{name}.router"] = (torch.rand(2, in_f, generator=gen) * 2 - 1) * bound
        state.update({k: v.clone() for k, v in self._head.items()})
        return state

    # -- server side -----------------------------------------------------------------------------------
    def rest_of_world(self, server: State, client: int) -> dict[str, torch.Tensor]:
        """``{"<module>.lora_A": A⁰_k, "<module>.lora_B": B⁰_k}``: the uniform mean of the latest uploads of the
        clients other than ``client`` that have uploaded (zeros when none has), accumulated in float64."""
        others = [i for i in range(self.info.num_clients) if i != client and float(server["uploaded"][i]) > 0]
        row = {}
        for name, (out_f, in_f) in self._shapes.items():
            for key, shape in ((f"{name}.lora_A", (self.info.rank, in_f)), (f"{name}.lora_B", (out_f, self.info.rank))):
                acc = torch.zeros(shape, dtype=torch.float64)
                for i in others:
                    acc += server[upload_key(i, key)].double()
                row[key] = (acc / max(len(others), 1)).float()
        return row

    def broadcast(self, server: State, client: int, rnd: int) -> Message:
        return Message(self.rest_of_world(server, client))

    def upload_spec(self, down: Message, rnd: int) -> Upload:
        """The own factors, named, shaped and typed as the Rest-of-World factors of the download."""
        return specs_of(down, down.tensors())

    def aggregate(self, server: State, replies, rnd: int) -> State:
        """Store each reply as its client's latest upload."""
        new = State(server)
        uploaded = server["uploaded"].clone()
        for r in replies:
            for key in self.reply_keys_of(r.message):
                new[upload_key(r.client, key)] = r.message[key].clone()
            uploaded[r.client] = 1.0
        new["uploaded"] = uploaded
        self.report(clients_known=float(uploaded.sum()))
        return new

    @staticmethod
    def reply_keys_of(msg: Message) -> list[str]:
        return sorted(k for k in msg.tensors() if k.endswith((".lora_A", ".lora_B")))

    # -- client side -----------------------------------------------------------------------------------
    def load(self, model: AdaptedModel, row: Message, state: State) -> None:
        """Own factors, router and head from ``state``, the Rest-of-World from ``row``."""
        for name, mod in routed_modules(model).items():
            mod.set_base_delta(None)
            mod.set_experts(state[f"{name}.lora_A"], state[f"{name}.lora_B"], row[f"{name}.lora_A"][None],
                            row[f"{name}.lora_B"][None], state[f"{name}.router"])
        load_head(model, state)

    def trainable(self, model: AdaptedModel) -> dict[str, nn.Parameter]:
        params: dict[str, nn.Parameter] = {}
        for name, mod in routed_modules(model).items():
            params[f"{name}.lora_A"], params[f"{name}.lora_B"] = mod.lora_A, mod.lora_B
            params[f"{name}.router"] = mod.router
        params.update({f"head/{n}": p for n, p in model.head_parameters().items()})
        return params

    def prepare_fit(self, model, msg, state, trainer):
        """One fit of the own factors, router and head (routed per member in a cohort)."""
        self.load(model, msg, state)
        params = self.trainable(model)
        model.set_trainable(params)
        return Fit(model, params, msg=msg, state=state)

    def finish_fit(self, fit, result, trainer):
        params = fit.params
        new_state = State({k: on_host(p) for k, p in params.items()})
        new_state["client"] = int(fit.state["client"])
        up = Message({k: on_host(p) for k, p in params.items() if k.endswith((".lora_A", ".lora_B"))})
        up["num_examples"] = int(trainer.num_examples)
        up["train_loss"] = float(result.loss)
        return up, new_state

    def load_personal(self, model: AdaptedModel, server: State, state: State) -> None:
        """Client k's model: its own factors, router and head, and the Rest-of-World it would receive now."""
        self.load(model, self.broadcast(server, int(state["client"]), 0), state)

    def load_global(self, model: AdaptedModel, server: State) -> None:
        """The uniform mean of every latest upload as both experts, an even router, the model's head."""
        mean = self.rest_of_world(server, -1)
        state = State(mean)
        for name, (_, in_f) in self._shapes.items():
            state[f"{name}.router"] = torch.zeros(2, in_f)
        state.update(self._head)
        self.load(model, Message(mean), state)


__all__ = ["FedALT", "upload_key"]

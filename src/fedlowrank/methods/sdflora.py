"""SDFLoRA ("Selective Dual-Module LoRA for Federated Fine-tuning with Heterogeneous Clients", arXiv:2601.11219).
Personalised.

Per target linear (:class:`~fedlowrank.adapters.dual.DualLoRALinear`) client k holds a global module
``(A_g: [r_g, in], B_g: [out, r_g])``, aggregated across clients, and a local module ``(A_l: [r_l, in],
B_l: [out, r_l])`` that never leaves it, fused with learnable scalar gates:

    (1)  y = W0 x + σ(γ_g) s_g B_g A_g x + σ(γ_l) s_l B_l A_l x          s_g = α/r_g, s_l = α/r_l (lora.scaling)

Client: loads the global module it receives and its own local module, gates (γ_g, γ_l initialised to 0.7 and 0.3,
as in the code) and head from its state; trains all of them; uploads the global module only. Server:

* ``sdflora``: ``A_g ← Σₖ pₖ A_g,k``, ``B_g ← Σₖ pₖ B_g,k`` (normalised weights ``pₖ``, ``server.weighting``; or the
  code's unnormalised ``pₖ = method.fixed_weight``), with the server step β; equal ranks.
* ``sdflora-svd`` (heterogeneous ``r_g,k``): the rank-r_g truncated SVD of ``Σₖ pₖ s_k B_g,k A_g,k``, split evenly
  (:func:`~fedlowrank.methods.ranks.product_svd`); client k receives its leading ``r_g,k`` directions at its scale.

The head is private by default (the code's ``personalization.local_param``); ``method.shared_head`` averages it as
FedIT does. :meth:`load_global` is the global module with no local module, gates at 1 and the model's (or the
shared) head: what the server holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..adapters.dual import DualLoRALinear, dual_modules
from ..adapters.lora import init_lora_factors, lora_scale
from ..adapters.model import AdaptedModel
from ..message import Message, Reply, State
from ..schema import setting
from ..seeding import torch_generator
from ..training.local import Fit
from . import register
from .base import LoRAMethod, SetupInfo, correction_option, head_tensors, load_head, on_host
from .ranks import download_factors, module_names, product_svd, set_balanced

GATE_INIT = (0.7, 0.3)   # γ_g, γ_l (the code's fusion weights before the sigmoid)


def gate_keys(name: str) -> tuple[str, str]:
    """Client-state keys of target ``name``'s gate logits ``γ_g``, ``γ_l`` (scalars)."""
    return f"{name}.gate_g", f"{name}.gate_l"


def local_keys(name: str) -> tuple[str, str]:
    """Client-state keys of target ``name``'s local module ``A_l: [r_l, in]``, ``B_l: [out, r_l]``."""
    return f"{name}.local_A", f"{name}.local_B"


@dataclass
class DualModule(LoRAMethod):
    """SDFLoRA's client, model and state, shared by both server steps (see the module docstring)."""

    paper = ("SDFLoRA: Selective Dual-Module LoRA for Federated Fine-tuning with Heterogeneous Clients "
             "(arXiv:2601.11219)")
    personalized = True
    client_state = ("local A_l [r_l,in], B_l [out,r_l] and gate logits γ_g, γ_l per target module, the head "
                    "(unless method.shared_head), and the client's index")
    preset = {"train.optimizer": "adamw"}
    lr_grid = (1e-4, 3e-4, 1e-3, 3e-3)

    correction: str = correction_option("none", ("none",), "the local module and gates are trained with the global "
                                        "one, and no correction anchors them")
    local_rank: int = setting(4, "rank r_l of the private local module (0 = none: the global module alone; the "
                              "code's default 4 with a global rank of 8)", ge=0)
    learned_gates: bool = setting(True, "learn the fusion gates σ(γ_g), σ(γ_l) (γ from 0.7 and 0.3, as the code); "
                                  "false: both gates 1")
    shared_head: bool = setting(False, "average the head across clients like the global module (false: each "
                                "client keeps its own, as the code)")

    # -- set-up ----------------------------------------------------------------------------------------
    def setup(self, model: AdaptedModel, info: SetupInfo) -> State:
        """The global module's initial factors as FedIT's (LoRA's init from the run seed), then a
        :class:`DualLoRALinear` on every target; the server holds the head only with ``shared_head``."""
        server = super().setup(model, info)
        model.attach(lambda name, lin: DualLoRALinear(lin, info.rank, self.local_rank, info.alpha, info.scaling,
                                                      info.dropout, self.learned_gates))
        self.record_factors(model)
        self._head = head_tensors(model)
        if not self.shared_head:
            for key in self.head_keys(server):
                del server[key]
        return server

    def init_client(self, client: int) -> State:
        """The local module (``A_l`` LoRA's uniform init, ``B_l = 0``, from the stream ``"sdflora-local"`` of
        ``client``), the gate logits (0.7, 0.3), the model's head and the client's index."""
        gen = torch_generator(self.info.seed, "sdflora-local", client)
        state = State({"client": int(client)})
        for name, (out_f, in_f, dtype) in self._factors.items():
            if self.local_rank:
                A, B = init_lora_factors(out_f, in_f, self.local_rank, gen, dtype)
                state[local_keys(name)[0]], state[local_keys(name)[1]] = A, B
            if self.learned_gates:
                kg, kl = gate_keys(name)
                state[kg] = torch.tensor(GATE_INIT[0])
                if self.local_rank:
                    state[kl] = torch.tensor(GATE_INIT[1])
        if not self.shared_head:
            state.update({k: v.clone() for k, v in self._head.items()})
        return state

    # -- messages --------------------------------------------------------------------------------------
    def broadcast(self, server: State, client: int, rnd: int) -> Message:
        """The global module (at the client's rank for ``sdflora-svd``) and, with ``shared_head``, the head."""
        msg = download_factors(server, self.lora_keys(server), self.info, client)
        msg.update(self.global_tensors(server, self.head_keys(server)))
        return msg

    # -- client side -----------------------------------------------------------------------------------
    def load(self, model: AdaptedModel, msg: Message, state: State) -> None:
        """The global module (and the shared head) from ``msg``, the local module, gates and own head from
        ``state`` (what :meth:`init_client` makes)."""
        for name, mod in dual_modules(model).items():
            mod.set_factors(msg[f"{name}.lora_A"], msg[f"{name}.lora_B"])
            mod.set_base_delta(None)
            (ka, kb), (kg, kl) = local_keys(name), gate_keys(name)
            mod.set_local(state.get(ka), state.get(kb), state.get(kg), state.get(kl))
        load_head(model, msg if self.shared_head else state)

    def trainable_all(self, model: AdaptedModel) -> dict[str, torch.nn.Parameter]:
        """Everything a client trains: the global and local modules, the gates and the head."""
        params = self.trainable(model, ("A", "B"))
        for name, mod in dual_modules(model).items():
            parts = (mod.local_A, mod.local_B, mod.gate_g, mod.gate_l)
            for key, p in zip((*local_keys(name), *gate_keys(name)), parts):
                if p is not None:
                    params[key] = p
        return params

    def prepare_fit(self, model, msg, state, trainer):
        """One fit of the global and local modules, the gates and the head (routed per member in a cohort)."""
        self.load(model, msg, state)
        params = self.trainable_all(model)
        model.set_trainable(params)
        return Fit(model, params, msg=msg, state=state)

    def finish_fit(self, fit, result, trainer):
        """The tensors the upload declares go up; the others are the client's new state."""
        params, sent = fit.params, self.upload_spec(fit.msg, 0)
        up = Message({k: on_host(p) for k, p in params.items() if k in sent})
        up["num_examples"], up["train_loss"] = int(trainer.num_examples), float(result.loss)
        new_state = State({k: on_host(p) for k, p in params.items() if k not in sent})
        new_state["client"] = int(fit.state["client"])
        return up, new_state

    def load_global(self, model: AdaptedModel, server: State) -> None:
        """The global module at the server rank with what a client that never trained holds (its local module's
        ``B_l = 0`` adds nothing, the initial gates, the model's head unless the head is shared)."""
        self.load(model, Message(server), self.init_client(0))

    def load_personal(self, model: AdaptedModel, server: State, state: State) -> None:
        """Client k's model: the global module it would receive now, its local module, gates and head."""
        self.load(model, self.broadcast(server, int(state["client"]), 0), state)


@register
@dataclass
class SDFLoRA(DualModule):
    name = "sdflora"
    description = ("personalised: a shared global LoRA (averaged) plus a private local LoRA, fused by learned "
                   "sigmoid gates")
    uplink = "global A_g,k [r,in], B_g,k [out,r] per target module (local module, gates and head stay)"
    downlink = "global Ā_g [r,in], B̄_g [out,r] per target module"
    needs_individual_replies = False
    heterogeneous_ranks_refusal = ("the factor-wise mean needs one global rank; sdflora-svd aggregates global modules "
                                   "of different ranks")

    fixed_weight: float = setting(0.0, "> 0: the code's unnormalised client weight pₖ = fixed_weight (8 clients at "
                                  "0.1 shrink the global module by 0.8 each round); 0: normalised weights "
                                  "(server.weighting)", ge=0)

    # -- server side -----------------------------------------------------------------------------------
    def aggregate(self, server: State, replies: list[Reply], rnd: int) -> State:
        """Weighted mean of the global factors (normalised, or the code's fixed unnormalised weights), with β."""
        server = State(server)
        p = self.client_weights(replies)
        w = p if not self.fixed_weight else torch.full((len(replies),), self.fixed_weight, dtype=torch.float64)
        self.average_into(server, replies, self.lora_keys(server), w)
        self.average_into(server, replies, self.head_keys(server), p)
        return server


@register
@dataclass
class SDFLoRASVD(DualModule):
    name = "sdflora-svd"
    description = ("SDFLoRA with heterogeneous global ranks: the truncated SVD of Σpₖ sₖB_g,kA_g,k, each client "
                   "receiving its leading r_k directions")
    uplink = "global A_g,k [r_k,in], B_g,k [out,r_k] per target module (local module, gates and head stay)"
    downlink = "rank-r_k truncated SVD factors A_g [r_k,in], B_g [out,r_k] per target module"
    needs_individual_replies = True
    supports_heterogeneous_ranks = True

    def aggregate(self, server: State, replies: list[Reply], rnd: int) -> State:
        """Per module, the rank-r truncated SVD of ``(1 − β) s B A + β Σₖ pₖ sₖ B_g,k A_g,k``, split evenly.
        Reports ``truncation_err`` (‖ΔW − [ΔW]_r‖_F / ‖ΔW‖_F, mean over modules)."""
        server = State(server)
        p = self.client_weights(replies)
        s = lora_scale(self.info.alpha, self.info.rank, self.info.scaling)
        errors = []
        for name in module_names(server):
            U, S, Vh = product_svd(server, replies, name, p, self.info)
            k = min(self.info.rank, S.shape[0])
            set_balanced(server, name, U, S, Vh, k, s)
            total = float(S.pow(2).sum())
            errors.append(math.sqrt(float(S[k:].pow(2).sum()) / total) if total > 0 else 0.0)
        self.average_into(server, replies, self.head_keys(server), p)
        self.report(truncation_err=sum(errors) / len(errors))
        return server


__all__ = ["DualModule", "SDFLoRA", "SDFLoRASVD", "gate_keys", "local_keys"]

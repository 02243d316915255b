"""RAVAN (Raje, Askin, Jhunjhunwala, Joshi, "Ravan: Multi-Head Low-Rank Adaptation for Federated Fine-Tuning",
arXiv:2506.05568, NeurIPS 2025).

Per target linear, ``ΔW = Σᵢ sᵢ Bᵢ Hᵢ Aᵢ`` over h heads (:mod:`fedlowrank.adapters.ravan`): the bases
``Bᵢ: [out, r]``, ``Aᵢ: [r, in]`` are frozen and identical on every client (seeded from the run seed and the target's
index, never sent), the cores ``Hᵢ: [r, r]`` and scales ``sᵢ`` are trained. Round t:

* down: every core ``Hᵢ`` per target, the head, and the heads this client trains (``ravan.heads``);
* client: loads the cores, sets every ``sᵢ = 1``, trains its heads' ``Hᵢ``, ``sᵢ`` and the head, uploads
  ``Gᵢ = sᵢ Hᵢ`` for those heads (the scale folded in) and the head;
* server, per head i and target: ``Hᵢ ← Σ_{k∈Sᵢ} pₖ Gᵢ,ₖ / Σ_{k∈Sᵢ} pₖ`` over the clients Sᵢ that trained head i
  (optional server step β; a head nobody trained keeps its value), ``sᵢ = 1``. Since the bases are shared,
  ``Σₖ pₖ Σᵢ sᵢ,ₖ Bᵢ Hᵢ,ₖ Aᵢ = Σᵢ Bᵢ Hᵢ⁺ Aᵢ``: the aggregate is exact (per head, when clients train subsets).

Compute heterogeneity: ``client_heads`` gives the number of heads each client trains (dealt round-robin over the
clients, as ``lora.ranks``); which heads is drawn each round from the seeded stream ``"ravan-heads"`` (the paper's
head-selection rule was not available to us; a uniform draw keeps every head trained in expectation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..adapters.model import AdaptedModel, matrix_shape
from ..adapters.ravan import BASES_INITS, RavanLinear, ravan_bases, ravan_modules
from ..message import Message, State
from ..schema import setting
from ..seeding import torch_generator
from ..training.corrections import finish_corrections
from . import register
from .base import (Corrected, SetupInfo, Upload, correction_option, head_tensors, load_head, on_host, specs_of,
                   weighted_sum)


def core_key(name: str, head: int) -> str:
    """The message key of target ``name``'s core ``Hᵢ`` (``i = head``)."""
    return f"{name}.ravan_H.{head}"


@register
@dataclass
class Ravan(Corrected):
    name = "ravan"
    description = "h heads Σ sᵢBᵢHᵢAᵢ with frozen seeded bases; only the r×r cores Hᵢ (and sᵢ) train; exact"
    paper = ("Raje, Askin, Jhunjhunwala, Joshi, Ravan: Multi-Head Low-Rank Adaptation for Federated Fine-Tuning "
             "(arXiv:2506.05568, NeurIPS 2025)")
    uplink = "sᵢHᵢ [r,r] for each head i the client trained, per target module, head"
    downlink = "Hᵢ [r,r] for every head per target module, the heads to train, head (bases come from the seed)"
    needs_individual_replies = False
    per_client_downlink = True  # the heads this client trains (method.client_heads)
    heterogeneous_ranks_refusal = ("every head has rank lora.rank; RAVAN's compute heterogeneity is how many heads "
                                   "a client trains (method.client_heads)")

    heads: int = setting(4, "number of heads h (the reference code's default: 4); each head has rank lora.rank",
                         ge=1, le=64)
    bases_init: str = setting("orthonormal", "the frozen bases: orthonormal columns of Bᵢ and rows of Aᵢ (so "
                              "‖BᵢHᵢAᵢ‖ = ‖Hᵢ‖), or unscaled N(0, 1) entries as in the reference code",
                              choices=BASES_INITS)
    client_heads: list[int] = setting([], "heads each client trains, dealt round-robin over the clients (compute "
                                      "heterogeneity; each entry in [1, method.heads]); [] = every head")
    correction: str = correction_option("none", ("none", "fedprox"),
                                        "a client may train a subset of the heads, SCAFFOLD's variates assume all")

    def __post_init__(self) -> None:
        super().__post_init__()
        bad = [k for k in self.client_heads if not 1 <= k <= self.heads]
        if bad:
            raise ValueError(f"method.client_heads: each entry must be in [1, method.heads = {self.heads}], "
                             f"got {bad[0]}")

    def unequal_replies(self) -> str:
        if not self.client_heads:
            return ""
        return "with method.client_heads each client sends only the cores of the heads it trained"

    # -- set-up ----------------------------------------------------------------------------------------
    def setup(self, model: AdaptedModel, info: SetupInfo) -> State:
        """Attach a :class:`RavanLinear` to every target (bases from ``"ravan-bases"``, keyed by target index)."""
        self.info = info
        index = {name: i for i, name in enumerate(model.target_names)}

        def make(name: str, lin: nn.Module) -> RavanLinear:
            out_f, in_f = matrix_shape(lin)
            B, A = ravan_bases(out_f, in_f, self.heads, info.rank, self.bases_init,
                               torch_generator(info.seed, "ravan-bases", index[name]), lin.weight.dtype)
            return RavanLinear(lin, B, A, info.dropout)

        model.attach(make)
        server = State({core_key(name, i): torch.zeros(info.rank, info.rank)
                        for name in model.target_names for i in range(self.heads)})
        server.update(head_tensors(model))
        return server

    def trained_heads(self, client: int, rnd: int) -> list[int]:
        """The heads client ``client`` trains in round ``rnd`` (sorted): all, or a seeded draw of its share."""
        if not self.client_heads:
            return list(range(self.heads))
        k = self.client_heads[client % len(self.client_heads)]
        if k == self.heads:
            return list(range(self.heads))
        draw = torch.randperm(self.heads, generator=torch_generator(self.info.seed, "ravan-heads", client, rnd))
        return sorted(int(i) for i in draw[:k])

    def model_keys(self, server: State) -> list[str]:
        return [k for k in server if (".ravan_H." in k and "/" not in k) or k.startswith("head/")]

    # -- client side -----------------------------------------------------------------------------------
    def load_global(self, model: AdaptedModel, server) -> None:
        for name, mod in ravan_modules(model).items():
            mod.set_heads([server[core_key(name, i)] for i in range(mod.heads)])
        load_head(model, server)

    def broadcast(self, server: State, client: int, rnd: int) -> Message:
        msg = Message({k: server[k] for k in self.model_keys(server)})
        msg["ravan.heads"] = self.trained_heads(client, rnd)
        return self.correction_broadcast(server, msg)

    def upload_spec(self, down: Message, rnd: int) -> Upload:
        """The cores ``<module>.ravan_H.<i>`` [r, r] of the heads this client trains (``ravan.heads``, with their scales
        folded in) and the head, as sent, plus the corrections' uploads."""
        names = {k.split(".ravan_H.")[0] for k in down.tensors() if ".ravan_H." in k and "/" not in k}
        trained = [core_key(n, i) for n in names for i in down["ravan.heads"]]
        trained += [k for k in down.tensors() if k.startswith("head/")]
        return self.with_corrections(down, specs_of(down, trained))

    def prepare_fit(self, model, msg, state, trainer):
        """One fit of the trained heads' cores and scales and the head (routed per client in a cohort, like
        LoRA's factors)."""
        self.load_global(model, msg)
        heads = list(msg["ravan.heads"])
        mods = ravan_modules(model)
        params: dict[str, nn.Parameter] = {}
        for name, mod in mods.items():
            for i in heads:
                params[core_key(name, i)] = mod.cores[i]
                params[f"{name}.ravan_s.{i}"] = mod.scales[i]
        params.update({f"head/{n}": p for n, p in model.head_parameters().items()})
        return self.corrected_fit(model, msg, state, params)

    def finish_fit(self, fit, result, trainer):
        extra = finish_corrections(fit, result)
        heads, mods = list(fit.msg["ravan.heads"]), ravan_modules(fit.model)
        up = Message({core_key(name, i): on_host(mod.cores[i] * mod.scales[i]) for name, mod in mods.items()
                      for i in heads})
        up.update({k: on_host(p) for k, p in fit.params.items() if k.startswith("head/")})
        up.update(extra)
        up["num_examples"] = int(trainer.num_examples)
        up["train_loss"] = float(result.loss)
        return up, fit.state

    # -- server side -----------------------------------------------------------------------------------
    def aggregate(self, server, replies, rnd):
        """Per core: the weighted mean over the replies that carry it (weights renormalised); head: over all."""
        new = State(server)
        p = self.client_weights(replies)
        for key in self.model_keys(server):
            have = [j for j, r in enumerate(replies) if key in r.message]
            if not have:
                continue
            w = p[have] / p[have].sum()
            avg = weighted_sum((replies[j].message[key] for j in have), w)
            new[key] = self.server_step(server[key], avg)
        for c in self._corrections:
            c.aggregate(new, replies, self.info.num_clients)
        return new


__all__ = ["Ravan", "core_key"]

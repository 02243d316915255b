"""FR-LoRA as the FedGaLore paper's Table 1 and §6 run it (Yan et al., "Federated Residual Low-Rank Adaptation of
Large Language Models", ICLR 2025): local AdamW (``train.optimizer``), lifted ΔW aggregation.

Every round each client re-initialises its LoRA PiSSA-style from the pretrained weight ``W₀ = U Σ Vᵀ``:
``B₀ = U_r √Σ_r: [out, r]``, ``A₀ = √Σ_r V_rᵀ: [r, in]``, with the frozen base ``W₀ + (R_g − s B₀A₀)`` so that
the model starts at the global weight ``W_g = W₀ + R_g`` (``R_g: [out, in]`` = the global residual). The server
adds the p̃-weighted lifted updates to the residual:

    R_g ← R_g + β · Σᵢ p̃ᵢ s (Bᵢ Aᵢ − B₀ A₀)        (s = the LoRA scale, β = server.lr)

which has rank up to K·r (FedGaLore paper, arXiv:2602.01746, §4.1: "lifted" aggregation). ``B₀, A₀`` are a pure
function of ``W₀``, which every party holds, so they are recomputed rather than sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..adapters.lora import attach_lora, lora_modules, lora_scale
from ..adapters.model import AdaptedModel
from ..message import Message, State
from . import register
from .base import LoRAMethod, SetupInfo, Upload, head_tensors, load_head, on_host, specs_of


def pissa_factors(W0: torch.Tensor, rank: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A₀: [r, in], B₀: [out, r])`` with ``s·B₀A₀`` = the best rank-r approximation of ``W₀`` (SVD in float64).

    The singular values are divided by ``s`` before the split, so that ``s·B₀A₀ = U_r Σ_r V_rᵀ`` (PiSSA).
    """
    U, S, Vh = torch.linalg.svd(W0.to(torch.float64), full_matrices=False)
    root = torch.sqrt(S[:rank] / scale)
    return (root[:, None] * Vh[:rank]).to(W0.dtype), (U[:, :rank] * root).to(W0.dtype)


@register
@dataclass
class FRLoRA(LoRAMethod):
    name = "fr-lora"
    description = "LoRA re-initialised each round from W0's principal components; lifted ΔW added to a global residual"
    paper = "Yan et al., Federated Residual Low-Rank Adaptation of Large Language Models (ICLR 2025)"
    uplink = "A [r,in] and B [out,r] per target module, head"
    downlink = "dense global residual R_g [out,in] per target module, head"
    needs_individual_replies = False
    privacy_modes = ("local",)
    privacy_refusal = "its server step averages the products B_k A_k, which is not a weighted sum of the replies"

    def setup(self, model: AdaptedModel, info: SetupInfo) -> State:
        self.info = info
        attach_lora(model, info.rank, info.alpha, info.scaling, info.dropout)
        self.record_factors(model)
        mods = lora_modules(model)
        self._pissa = {n: pissa_factors(m.base.weight, info.rank, m.scale) for n, m in mods.items()}
        server = State({f"{n}.residual": torch.zeros_like(m.base.weight) for n, m in mods.items()})
        server.update(head_tensors(model))
        for c in self._corrections:
            c.init_server(server, self.trainable_keys(model))
        return server

    def residual_keys(self, server: State) -> list[str]:
        return [k for k in server if k.endswith(".residual")]

    def broadcast(self, server: State, client: int, rnd: int) -> Message:
        msg = self.global_tensors(server, self.residual_keys(server) + self.head_keys(server))
        return self.correction_broadcast(server, msg)

    def upload_spec(self, down: Message, rnd: int) -> Upload:
        """The PiSSA-initialised factors at the server rank (never sent), the head, the corrections' uploads."""
        trained = {**self.factor_specs(self.info.rank), **specs_of(down, self.head_keys(down))}
        return self.with_corrections(down, trained)

    def load_message(self, model: AdaptedModel, msg: Message) -> None:
        """PiSSA factors of ``W₀`` (computed once in :meth:`setup`) and base delta ``R_g − s B₀A₀``; the head."""
        for name, mod in lora_modules(model).items():
            mod.set_factors(*self._pissa[name])
            mod.set_base_delta(msg[f"{name}.residual"] - on_host(mod.adapter_delta()))
        load_head(model, msg)

    def load_global(self, model: AdaptedModel, server: State) -> None:
        self.load_message(model, Message(server))

    def aggregate(self, server, replies, rnd):
        new = State(server)
        weights = self.client_weights(replies).tolist()
        s = lora_scale(self.info.alpha, self.info.rank, self.info.scaling)
        for key in self.residual_keys(server):
            name = key[: -len(".residual")]
            A0, B0 = self._pissa[name]
            delta = torch.zeros(server[key].shape, dtype=torch.float64)
            for w, rep in zip(weights, replies):
                B, A = rep.message[f"{name}.lora_B"].to(torch.float64), rep.message[f"{name}.lora_A"].to(torch.float64)
                delta += w * (B @ A)
            delta = s * (delta - B0.to(torch.float64) @ A0.to(torch.float64))
            new[key] = (server[key].to(torch.float64) + self.info.server_lr * delta).to(server[key].dtype)
        self.average_into(new, replies, self.head_keys(server), self.client_weights(replies))
        self.aggregate_corrections(new, replies)
        return new

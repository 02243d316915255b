"""FedASK (Wen, Zhu, Xu, Zhou, Han, "Differentially Private Federated Low Rank Adaptation Beyond Fixed-Matrix",
arXiv:2507.09990).

Clients train both LoRA factors (under DP-SGD: both noised, no frozen factor as in FFA-LoRA), and the server rebuilds
the global adapter from the product ``ΔW = Σᵢ pᵢ sᵢ Bᵢ Aᵢ`` through two sketching stages modelled on randomized SVD.
Per module, with a Gaussian ``Ω: [in, s]`` drawn once from the run seed (or each round):

    (1)  stage 1: client i sends Yᵢ = Bᵢ (Aᵢ Ω) [out, s];  server: Y = Σ pᵢ sᵢ Yᵢ,  Q = qr(Y) [out, s]  (float64)
    (2)  stage 2: client i gets Q, sends Pᵢ = Aᵢᵀ (Bᵢᵀ Q) [in, s];  server: Pᵀ = Σ pᵢ sᵢ Pᵢᵀ = Qᵀ ΔW
    (3)  Pᵀ = Ũ S Vᵀ,  B = Q Ũ_{:r} (S_{:r}/s_r)^{1/2},  A = (S_{:r}/s_r)^{1/2} V_{:r}ᵀ   so  s_r B A = [QQᵀΔW]_r

(:func:`~fedlowrank.linalg.lowrank.sketched_svd`; ``s_r`` the LoRA scale at the global rank). When
``s ≥ rank ΔW`` (at most ``Σᵢ rᵢ``) ``QQᵀΔW = ΔW``, and (3) is the optimal rank-r truncation (FlexLoRA's product);
with ``r ≥ rank ΔW`` it is ``ΔW`` exactly. ``s = method.sketch_dim``, or ``K·r`` (K = ``run.clients_per_round``)
capped at ``min(in, out)``. Server step β: the old adapter joins ΔW as one more block.

Protocol mapping: the runtime runs one exchange per round, so each client uploads its trained ``(Aᵢ, Bᵢ)`` and the
server computes both stages from them, as the official code's simulation does. The ledger counts the true
protocol (:meth:`protocol_messages`): down the global factors and head, then ``Q``; up ``Yᵢ``, then ``Pᵢ`` and the
head. Heterogeneous ranks: client i receives the leading ``rᵢ`` directions of (3) at its scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..adapters.lora import lora_scale
from ..linalg.lowrank import sketched_svd
from ..message import Message, Reply, State
from ..schema import setting
from ..seeding import torch_generator
from . import register
from .ranks import HeteroRankLoRA, module_names, product_factors, set_balanced


@register
@dataclass
class FedASK(HeteroRankLoRA):
    name = "fedask"
    description = ("both factors trained (DP-friendly); the server rebuilds (B, A) from a two-stage sketch of "
                   "Σpᵢ sᵢBᵢAᵢ (randomized SVD); the ledger counts both uploads")
    paper = ("Wen, Zhu, Xu, Zhou, Han, Differentially Private Federated Low Rank Adaptation Beyond Fixed-Matrix "
             "(arXiv:2507.09990)")
    uplink = ("protocol: Y_i [out,s], then P_i [in,s] and the head, per target module (the simulation uploads A_i "
              "[r_i,in], B_i [out,r_i] and computes both on the server)")
    downlink = "A [r_i,in], B [out,r_i] per target module and the head, then Q [out,s] per target module"
    needs_individual_replies = True     # the server computes the clients' sketches from their factors

    sketch_dim: int = setting(0, "sketch width s of Ω [in, s] (0 = run.clients_per_round × lora.rank, enough for "
                              "an exact reconstruction; the code's default is 16)", ge=0)
    omega_fresh_each_round: bool = setting(False, "draw a new Ω every round (false: once, as in the code)")

    def sketch_size(self, in_features: int, out_features: int) -> int:
        """``s``: ``method.sketch_dim``, or ``K·r``; at most ``min(in, out)`` (beyond it a sketch adds nothing)."""
        s = self.sketch_dim or self.info.clients_per_round * self.info.rank
        return min(s, in_features, out_features)

    def omega(self, index: int, in_features: int, out_features: int, rnd: int) -> torch.Tensor:
        """``Ω: [in, s]`` of the target with index ``index``, N(0, 1), from ``"fedask-omega"`` (float64)."""
        keys = (index, rnd) if self.omega_fresh_each_round else (index,)
        return torch.randn(in_features, self.sketch_size(in_features, out_features), dtype=torch.float64,
                           generator=torch_generator(self.info.seed, "fedask-omega", *keys))

    def aggregate(self, server: State, replies: list[Reply], rnd: int) -> State:
        server = State(server)
        p = self.client_weights(replies)
        s = lora_scale(self.info.alpha, self.info.rank, self.info.scaling)
        for index, name in enumerate(module_names(server)):
            out_f, in_f, _ = self._factors[name]
            U, S, Vh = sketched_svd(*product_factors(server, replies, name, p, self.info),
                                    self.omega(index, in_f, out_f, rnd))
            set_balanced(server, name, U, S, Vh, min(self.info.rank, S.shape[0]), s)
        self.average_into(server, replies, self.head_keys(server), p)
        self.aggregate_corrections(server, replies)
        self.report(sketch_dim=float(min(self.sketch_size(i, o) for o, i, _ in self._factors.values())))
        return server

    def protocol_messages(self, down: Message, reply: Message) -> tuple[list[Message], list[Message]]:
        """Down: ``down``, then ``<module>.fedask_Q [out, s]``; up: ``<module>.fedask_Y [out, s]`` with
        ``num_examples`` and ``train_loss``, then ``<module>.fedask_P [in, s]``, the head and what composed corrections
        add (float32)."""
        Q, Y, P = Message(), Message(), Message()
        for name, (out_f, in_f, dtype) in self._factors.items():
            s = self.sketch_size(in_f, out_f)
            Q[f"{name}.fedask_Q"] = torch.zeros(out_f, s, dtype=dtype)
            Y[f"{name}.fedask_Y"] = torch.zeros(out_f, s, dtype=dtype)
            P[f"{name}.fedask_P"] = torch.zeros(in_f, s, dtype=dtype)
        Y["num_examples"], Y["train_loss"] = reply["num_examples"], reply["train_loss"]
        P.update({k: t for k, t in reply.tensors().items() if "/" in k or not k.endswith((".lora_A", ".lora_B"))})
        return [down, Q], [Y, P]


__all__ = ["FedASK"]

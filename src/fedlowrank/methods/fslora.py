"""FSLoRA (Fang, Han, Yuan, Hosseinalipour, Brinton, "Federated Sketching LoRA: A Flexible Framework for Heterogeneous
Collaborative Fine-Tuning of LLMs", arXiv:2501.19389).

The server keeps one global LoRA of rank r (``info.rank``: ``lora.server_rank``, else the largest client rank).
In round t client i gets a sketch of size ``k_i`` (its ``lora.ranks`` entry, ``info.client_ranks[i]``): a subset
``J_i ⊂ {0..r−1}``, ``|J_i| = k_i``, drawn uniformly without replacement by the server, fresh each round, one per
target module (stream ``"fslora-sketch"`` of client, round and module index), and the sketched model

    (1)  y = W0 x + s B S_i A x,   S_i = (r/k_i)·diag(1[j ∈ J_i])      so  E_J[B S_i A] = B A

Only ``B_{:,J}`` and ``A_{J,:}`` enter (1), so those blocks are what goes down and what the client trains: a LoRA of
rank ``k_i`` at scale ``s·r/k_i``, whose gradients are exactly ``∇_B = G Aᵀ S_i`` and ``∇_A = S_i Bᵀ G`` on the
blocks. It uploads the trained blocks. The server forms the pseudo-gradient with the clients' masks

    (2)  g = Σ_{i∈S_t} pᵢ Mᵢ ⊙ (θ − θᵢ)       θ = (A, B), Mᵢ the mask of J_i (pᵢ: server.weighting, Σ pᵢ = 1)

(weights are not renormalised by coverage, which would bias the estimator) and steps ``θ ← θ − η_s g`` with
``η_s = server.lr`` (``method.server_opt = "sgd"``; 1 = plain averaging of the masked deltas) or Adam with
``method.server_adam_lr`` and persistent moments in the server state (the code's default optimizer, without weight
decay). With every ``k_i = r`` and SGD at 1 this is FedIT. The head is averaged as FedIT's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..adapters.lora import lora_modules, lora_scale
from ..message import Message, Reply, State
from ..schema import setting
from ..seeding import torch_generator
from . import register
from .base import correction_option
from .ranks import HeteroRankLoRA, copy, module_names

SERVER_OPTIMIZERS = ("sgd", "adam")
ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8


def sketch_indices(seed: int, client: int, rnd: int, module: int, rank: int, k: int) -> torch.Tensor:
    """``J``: ``k`` of ``0..rank−1`` uniformly without replacement, sorted, for client ``client``'s module
    ``module`` in round ``rnd`` (int64 ``[k]``)."""
    draw = torch.randperm(rank, generator=torch_generator(seed, "fslora-sketch", client, rnd, module))
    return draw[:k].sort().values


@register
@dataclass
class FSLoRA(HeteroRankLoRA):
    name = "fslora"
    description = ("each client trains a random sketch of k_i of the global LoRA's r directions, scaled by r/k_i "
                   "(unbiased); the server steps on the masked pseudo-gradient")
    paper = ("Fang, Han, Yuan, Hosseinalipour, Brinton, Federated Sketching LoRA: A Flexible Framework for "
             "Heterogeneous Collaborative Fine-Tuning of LLMs (arXiv:2501.19389)")
    uplink = "the trained sketch blocks A_J [k_i,in], B_J [out,k_i] per target module, head"
    downlink = "the global LoRA's sketch blocks A[J_i] [k_i,in], B[:, J_i] [out,k_i] per target module, head"
    needs_individual_replies = False
    per_client_downlink = True        # each client's own sketch J_i
    privacy_modes = ("local",)
    privacy_refusal = ("each reply holds the blocks of its client's own random sketch, at other coordinates than "
                       "the others', so noise on their mean is not defined")

    correction: str = correction_option("none", ("none", "fedprox"), "a client trains sketch blocks at other "
                                        "coordinates each round, where SCAFFOLD's variates have no meaning")
    server_opt: str = setting("sgd", "the server's step on the masked pseudo-gradient: sgd (θ − server.lr·g; 1 = "
                              "plain averaging of the masked deltas) or adam (method.server_adam_lr, moments kept "
                              "in the server state; the code's default)", choices=SERVER_OPTIMIZERS)
    server_adam_lr: float = setting(3e-4, "the server Adam's learning rate (method.server_opt = adam; the code's "
                                    "3e-4)", gt=0)

    def unequal_replies(self) -> str:
        return "each client uploads the blocks of its own random sketch J_i"

    def setup(self, model, info) -> State:
        bad = [k for k in info.client_ranks if k > info.rank]
        if bad:
            raise ValueError(f"lora.ranks: a client's sketch size must be at most the global rank r = {info.rank} "
                             f"(lora.server_rank), got {bad[0]}")
        server = super().setup(model, info)
        if self.server_opt == "adam":
            for key in self.lora_keys(server):
                server[f"fslora.m/{key}"] = torch.zeros_like(server[key])
                server[f"fslora.v/{key}"] = torch.zeros_like(server[key])
            server["fslora.step"] = 0
        return server

    def sketch(self, client: int, rnd: int) -> dict[str, torch.Tensor]:
        """``{module: J}``: client ``client``'s sketch of each target module in round ``rnd``."""
        k = self.info.client_ranks[client]
        return {name: sketch_indices(self.info.seed, client, rnd, i, self.info.rank, k)
                for i, name in enumerate(self._factors)}

    def broadcast(self, server: State, client: int, rnd: int) -> Message:
        """The blocks ``A[J]``, ``B[:, J]`` of client ``client``'s sketch, and the head."""
        msg = Message()
        for name, J in self.sketch(client, rnd).items():
            msg[f"{name}.lora_A"] = copy(server[f"{name}.lora_A"][J])
            msg[f"{name}.lora_B"] = copy(server[f"{name}.lora_B"][:, J])
        msg.update(self.global_tensors(server, self.head_keys(server)))
        return self.correction_broadcast(server, msg)

    def load_message(self, model, msg: Message) -> None:
        """The blocks as a rank-k LoRA at the sketched model's scale ``s·r/k`` (1); the global LoRA (k = r) at s."""
        super().load_message(model, msg)
        s = lora_scale(self.info.alpha, self.info.rank, self.info.scaling)
        for mod in lora_modules(model).values():
            mod.scale = s * self.info.rank / mod.rank

    def aggregate(self, server: State, replies: list[Reply], rnd: int) -> State:
        server = State(server)
        p = self.client_weights(replies)
        sketches = {r.client: self.sketch(r.client, rnd) for r in replies}
        step = int(server.get("fslora.step", 0)) + 1
        for name in module_names(server):
            for key, rows in ((f"{name}.lora_A", True), (f"{name}.lora_B", False)):
                theta = server[key].to(torch.float64)
                g = torch.zeros_like(theta)
                for pk, rep in zip(p.tolist(), replies):
                    J = sketches[rep.client][name]
                    block = rep.message[key].to(torch.float64)
                    if rows:
                        g[J] += pk * (theta[J] - block)
                    else:
                        g[:, J] += pk * (theta[:, J] - block)
                server[key] = self.server_update(server, key, theta, g, step).to(server[key].dtype)
        if self.server_opt == "adam":
            server["fslora.step"] = step
        self.average_into(server, replies, self.head_keys(server), p)
        self.aggregate_corrections(server, replies)
        return server

    def server_update(self, server: State, key: str, theta: torch.Tensor, g: torch.Tensor, step: int) -> torch.Tensor:
        """``θ − η_s g`` (sgd, η_s = server.lr), or Adam's step ``θ − lr m̂/(√v̂ + ε)`` updating the moments of
        ``key`` in ``server`` (float64 in, float64 out)."""
        if self.server_opt == "sgd":
            return theta - self.info.server_lr * g
        (b1, b2), mk, vk = ADAM_BETAS, f"fslora.m/{key}", f"fslora.v/{key}"
        m = b1 * server[mk].to(torch.float64) + (1 - b1) * g
        v = b2 * server[vk].to(torch.float64) + (1 - b2) * g * g
        server[mk], server[vk] = m.to(server[mk].dtype), v.to(server[vk].dtype)
        m_hat, v_hat = m / (1 - b1 ** step), v / (1 - b2 ** step)
        return theta - self.server_adam_lr * m_hat / (v_hat.sqrt() + ADAM_EPS)


__all__ = ["FSLoRA", "sketch_indices", "SERVER_OPTIMIZERS"]

"""FedLEASE (Wang, Bian, Zhang, Xu, "FedLEASE: Adaptive LoRA Experts Allocation and Selection in Federated
Fine-Tuning", arXiv:2509.15087, NeurIPS 2025). Clustered LoRA experts with an adaptive top-M router.

Warm-up: every client trains a LoRA ``(A_k: [r, in], B_k: [out, r])`` and its head from the common initialisation
and uploads them; the server keeps each client's latest. The warm-up lasts ``warmup_rounds`` rounds and, beyond, until
every client has uploaded once. At the end of it the server clusters the clients once
(:func:`~fedlowrank.linalg.clustering.cluster_by_silhouette` on the mean over targets of the cosine distance of the
trained ``B_k``, average linkage, K ∈ 2 … min(N − 1, ``max_experts``) by the silhouette, one cluster when N ≤ 2);
expert e's ``(A_e, B_e)`` and head start as the uniform mean of its members' warm-up uploads.

Then per target (:class:`~fedlowrank.adapters.routed.RoutedLoRALinear`): client k of cluster c receives every expert
(its own, c, trainable; the M − 1 others frozen) and its cluster's router ``R_c: [2M − 1, in]`` with bias
``b_c: [2M − 1]``; for a token, ``p = softmax(R_c x + b_c)`` keeps its top M slots; slots ``0 … M − 1`` belong to the
own expert and ``M … 2M − 2`` to the others (one each), so the own expert is always used and a token uses 1 to M
experts. The client trains its own expert, its cluster's router and head, and uploads them. Server: per cluster, the
weighted mean over the cluster's **sampled** members (FedIT within the cluster; a cluster without a reply keeps its
state). Routers start as a linear layer's default (``U(±1/√in)``, zero bias) from the stream ``"fedlease-router"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..adapters.lora import init_lora_factors
from ..adapters.model import AdaptedModel
from ..adapters.routed import RoutedLoRALinear, routed_modules
from ..linalg.clustering import cluster_by_silhouette, layer_cosine_distance
from ..message import Message, State
from ..schema import setting
from ..seeding import torch_generator
from ..training.local import Fit
from . import register
from .base import Method, SetupInfo, Upload, head_tensors, load_head, on_host, specs_of, weighted_sum


def slots_of(experts: int) -> list[int]:
    """The expert of each of the ``2M − 1`` slots: ``M`` slots of the own expert (0), then one per other expert."""
    return [0] * experts + list(range(1, experts))


@register
@dataclass
class FedLEASE(Method):
    name = "fedlease"
    description = ("clients clustered once by their trained B after a warm-up; one LoRA expert per cluster; a "
                   "(2M−1)-slot top-M router that always keeps the client's own expert")
    paper = ("Wang, Bian, Zhang, Xu, FedLEASE: Adaptive LoRA Experts Allocation and Selection in Federated "
             "Fine-Tuning (arXiv:2509.15087, NeurIPS 2025)")
    uplink = ("warm-up: A_k [r,in], B_k [out,r] per target module, head; then: own expert A_c, B_c, router R_c "
              "[2M−1,in], b_c [2M−1] per target module, head")
    downlink = ("warm-up: the initial A [r,in], B [out,r] per target module, head; then: own expert, the M−1 other "
                "experts [M−1,r,in], [M−1,out,r], the cluster's router and bias per target module, head")
    needs_individual_replies = True          # the clustering needs each client's B
    personalized = True
    per_client_downlink = True  # the client's cluster's expert, router and head, and the other experts
    client_state = "the client's index k (its cluster, in the server state, picks its personal model)"
    server_entries = ("upload.{client}/{module}.lora_A", "upload.{client}/{module}.lora_B",  # before clustering:
                      "upload.{client}/head/{head}",                                         # each client's upload
                      "expert.{n}/{module}.lora_A", "expert.{n}/{module}.lora_B", "expert.{n}/head/{head}",
                      "expert.{n}/{module}.router", "expert.{n}/{module}.router_bias")       # after: each cluster's
    upload_entries = ("{module}.lora_A", "{module}.lora_B", "{module}.router", "{module}.router_bias", "head/{head}")
    heterogeneous_ranks_refusal = "an expert is a mean of its members' factors, which needs one rank"
    preset = {"train.optimizer": "adamw"}

    warmup_rounds: int = setting(1, "rounds of warm-up before the clustering (it also waits until every client has "
                                 "uploaded once)", ge=1)
    max_experts: int = setting(8, "the most clusters (experts) the silhouette may choose (the reference code's 8)",
                               ge=1, le=64)

    def setup(self, model: AdaptedModel, info: SetupInfo) -> State:
        self.info = info
        model.attach(lambda name, lin: RoutedLoRALinear(lin, info.rank, info.alpha, info.scaling, info.dropout,
                                                        slot_expert=[0], top_k=1, bias=True))
        self._shapes = {name: (m.out_features, m.in_features) for name, m in routed_modules(model).items()}
        server = State({"cluster": -torch.ones(info.num_clients), "uploaded": torch.zeros(info.num_clients)})
        gen = torch_generator(info.seed, "lora-init")
        for name, (out_f, in_f) in self._shapes.items():
            server[f"init/{name}.lora_A"], server[f"init/{name}.lora_B"] = init_lora_factors(out_f, in_f, info.rank,
                                                                                           gen)
        server.update({f"init/{k}": v for k, v in head_tensors(model).items()})
        return server

    def init_client(self, client: int) -> State:
        return State({"client": int(client)})

    # -- helpers -----------------------------------------------------------------------------------------
    def experts(self, server: State) -> int:
        """M, the number of experts (0 during the warm-up)."""
        return int(server["cluster"].max()) + 1

    def lora_names(self) -> list[str]:
        return [f"{n}.lora_{f}" for n in self._shapes for f in "AB"]

    # -- server side -----------------------------------------------------------------------------------
    def broadcast(self, server: State, client: int, rnd: int) -> Message:
        M = self.experts(server)
        if M == 0:
            return Message({k[len("init/"):]: v for k, v in server.items() if k.startswith("init/")})
        c = int(server["cluster"][client])
        others = [e for e in range(M) if e != c]
        msg = Message({k[len(f"expert.{c}/"):]: v for k, v in server.items() if k.startswith(f"expert.{c}/")})
        for name in self._shapes if others else ():
            for f in "AB":
                msg[f"{name}.others_{f}"] = torch.stack([server[f"expert.{e}/{name}.lora_{f}"] for e in others])
        return msg

    def upload_spec(self, down: Message, rnd: int) -> Upload:
        """What the client was sent of its own expert (factors, head; after the clustering its router), trained,
        in the download's shapes and dtypes; never the other experts (``.others_``)."""
        return specs_of(down, [k for k in down.tensors() if ".others_" not in k])

    def aggregate(self, server: State, replies, rnd: int) -> State:
        new = State(server)
        M = self.experts(server)
        if M == 0:
            uploaded = server["uploaded"].clone()
            for r in replies:
                for key in r.message.tensors():
                    new[f"upload.{r.client}/{key}"] = r.message[key].clone()
                uploaded[r.client] = 1.0
            new["uploaded"] = uploaded
            if rnd >= self.warmup_rounds and bool((uploaded > 0).all()):
                self.allocate(new)
            return new
        for c in range(M):
            members = [r for r in replies if int(server["cluster"][r.client]) == c]
            if not members:
                continue
            w = self.client_weights(members)
            for key in members[0].message.tensors():
                avg = weighted_sum((r.message[key] for r in members), w)
                new[f"expert.{c}/{key}"] = self.server_step(server[f"expert.{c}/{key}"], avg)
        self.report(experts=float(M))
        return new

    def allocate(self, server: State) -> None:
        """Cluster the clients by their warm-up ``B`` and make the experts, routers and heads (in place)."""
        N = self.info.num_clients
        layers = [torch.stack([server[f"upload.{k}/{name}.lora_B"] for k in range(N)]) for name in self._shapes]
        labels = cluster_by_silhouette(layer_cosine_distance(layers), self.max_experts)
        server["cluster"] = torch.tensor(labels, dtype=torch.float32)
        M = max(labels) + 1
        keys = [k[len("upload.0/"):] for k in server if k.startswith("upload.0/")]
        for c in range(M):
            members = [k for k in range(N) if labels[k] == c]
            for key in keys:
                mean = weighted_sum((server[f"upload.{k}/{key}"] for k in members),
                                    torch.full((len(members),), 1.0 / len(members), dtype=torch.float64))
                server[f"expert.{c}/{key}"] = mean
            gen = torch_generator(self.info.seed, "fedlease-router", c)
            for name, (_, in_f) in self._shapes.items():
                bound = 1.0 / math.sqrt(in_f)
                server[f"expert.{c}/{name}.router"] = (torch.rand(2 * M - 1, in_f, generator=gen) * 2 - 1) * bound
                server[f"expert.{c}/{name}.router_bias"] = torch.zeros(2 * M - 1)
        for key in [k for k in server if k.startswith("upload.")]:
            del server[key]
        self.report(experts=float(M))

    # -- client side -----------------------------------------------------------------------------------
    def load(self, model: AdaptedModel, msg: Message) -> None:
        warm = not any(".router" in k for k in msg.tensors())
        for name, mod in routed_modules(model).items():
            mod.set_base_delta(None)
            if warm:
                mod.set_routing([0], 1)
                mod.set_experts(msg[f"{name}.lora_A"], msg[f"{name}.lora_B"], mod.others_A, mod.others_B, mod.router,
                                mod.router_bias)
                continue
            M = (msg[f"{name}.router"].shape[0] + 1) // 2
            mod.set_routing(slots_of(M), M)
            oa, ob = ((msg[f"{name}.others_A"], msg[f"{name}.others_B"]) if M > 1 else
                      (mod.others_A, mod.others_B))
            mod.set_experts(msg[f"{name}.lora_A"], msg[f"{name}.lora_B"], oa, ob, msg[f"{name}.router"],
                            msg[f"{name}.router_bias"])
        load_head(model, msg)

    def prepare_fit(self, model, msg, state, trainer):
        """One fit of the own expert, router and head (routed per member in a cohort)."""
        self.load(model, msg)
        routed = any(".router" in k for k in msg.tensors())
        params: dict[str, nn.Parameter] = {}
        for name, mod in routed_modules(model).items():
            params[f"{name}.lora_A"], params[f"{name}.lora_B"] = mod.lora_A, mod.lora_B
            if routed:
                params[f"{name}.router"], params[f"{name}.router_bias"] = mod.router, mod.router_bias
        params.update({f"head/{n}": p for n, p in model.head_parameters().items()})
        model.set_trainable(params)
        return Fit(model, params, msg=msg, state=state)

    def finish_fit(self, fit, result, trainer):
        up = Message({k: on_host(p) for k, p in fit.params.items()})
        up["num_examples"] = int(trainer.num_examples)
        up["train_loss"] = float(result.loss)
        return up, State(fit.state)

    def load_personal(self, model: AdaptedModel, server: State, state: State) -> None:
        """Client k's model: during the warm-up its latest warm-up upload (the initial model before it has one);
        then its cluster's expert, router and head with the other experts."""
        k = int(state["client"])
        mine = Message({key[len(f"upload.{k}/"):]: v for key, v in server.items() if key.startswith(f"upload.{k}/")})
        self.load(model, mine if mine else self.broadcast(server, k, 0))

    def load_global(self, model: AdaptedModel, server: State) -> None:
        """Before the clustering the initial model; after it, cluster 0's model."""
        if self.experts(server) == 0:
            self.load(model, self.broadcast(server, 0, 0))
            return
        first = next(k for k in range(self.info.num_clients) if int(server["cluster"][k]) == 0)
        self.load(model, self.broadcast(server, first, 0))


__all__ = ["FedLEASE", "slots_of"]

"""FLoRA (Wang et al., "FLoRA: Federated Fine-Tuning Large Language Models with Heterogeneous Low-Rank
Adaptations", NeurIPS 2024): stacking, merging, fresh adapters every round.

Each round every client trains a fresh LoRA (A Kaiming-uniform from its own seeded stream, B = 0) of its own rank
``r_k`` on top of its merged base. The server stacks the replies (weights and scales folded in)

    B_s = [B_1 … B_K]: [out, Σr_k],   A_s = [β p_1 s_1 A_1; …; β p_K s_K A_K]: [Σr_k, in],   B_s A_s = β Σ pₖ sₖ Bₖ Aₖ

exactly, and every party merges ``W ← W + B_s A_s`` (the explicit ``base_delta``). Each client's own scale
``s_k = lora_scale(α, r_k)`` is folded into its block, so heterogeneous ranks need no α adjustment (the public
code's ``lora_alpha·K`` / zero-padding α mismatch does not arise).

Downlink, per client (what the client needs to rebuild the merged base; a client keeps its merged base in its own
client state, ``"<module>.base_delta"``, as a real FLoRA client keeps its merged model):
* in sync (it has every merge but the latest): the latest stack ``(B_s, A_s)`` — the paper's payload,
  ``Σ_k r_k (in + out)`` per module;
* behind by more than one merge (partial participation): the dense merged ``base_delta [out, in]`` instead;
* before the first merge: nothing but the head.
The server tracks how many merges each client has (``"flora.synced"``, ``[M]``). Client and server merge with the
same function on the same float32 tensors, so their bases are bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..adapters.lora import init_lora_factors, lora_modules, lora_scale
from ..adapters.model import AdaptedModel
from ..linalg.lowrank import stack_factors
from ..message import Message, Reply, State
from ..seeding import torch_generator
from . import register
from .base import LoRAMethod, SetupInfo, Upload, correction_option, load_head, specs_of


def merge(base: torch.Tensor | None, B_s: torch.Tensor, A_s: torch.Tensor) -> torch.Tensor:
    """``base + B_s A_s`` (``base = None`` is zero), in float64, returned in ``B_s``'s dtype. ``[out, in]``."""
    update = B_s.to(torch.float64) @ A_s.to(torch.float64)
    return (update if base is None else base.to(torch.float64) + update).to(B_s.dtype)


@register
@dataclass
class FLoRA(LoRAMethod):
    name = "flora"
    description = "stack the clients' factors, merge Σpₖ sₖBₖAₖ into the base, fresh adapters each round"
    paper = ("Wang et al., FLoRA: Federated Fine-Tuning Large Language Models with Heterogeneous Low-Rank "
             "Adaptations (NeurIPS 2024)")
    uplink = "A_k [r_k,in] and B_k [out,r_k] per target module, head"
    downlink = ("stacked B_s [out,Σr_k] and A_s [Σr_k,in] of the last round per target module, or the dense merged "
                "base delta [out,in] to a client that missed merges; head")
    needs_individual_replies = True
    supports_heterogeneous_ranks = True
    per_client_downlink = True  # the stacked factors, or the merged base delta to a client that missed merges
    server_entries = ("{module}.merge_A", "{module}.merge_B", "{module}.base_delta")  # the last stack, the merges
    client_entries = ("{module}.base_delta",)  # the client's merged model
    exact_entries = ("*.merge_A", "*.merge_B", "*.base_delta")  # merged into the base a client keeps

    correction: str = correction_option("none", ("none", "fedprox"), "the adapters are re-initialised every round, "
                                        "so control variates could not follow them")

    def setup(self, model: AdaptedModel, info: SetupInfo) -> State:
        server = super().setup(model, info)
        self.targets = {n: (m.out_features, m.in_features) for n, m in lora_modules(model).items()}  # shapes only
        for key in self.lora_keys(server):
            del server[key]                     # no global adapter: everything is merged into the base
        server["flora.merges"] = 0
        server["flora.synced"] = torch.zeros(info.num_clients, dtype=torch.int64)
        return server

    def broadcast(self, server: State, client: int, rnd: int) -> Message:
        msg = self.global_tensors(server, self.head_keys(server))
        msg.update(client=client, round=rnd)
        behind = int(server["flora.merges"]) - int(server["flora.synced"][client])
        names = [k[: -len(".merge_A")] for k in server if k.endswith(".merge_A")]
        for name in names:
            if behind == 1:
                msg[f"{name}.merge_B"], msg[f"{name}.merge_A"] = server[f"{name}.merge_B"], server[f"{name}.merge_A"]
            elif behind > 1:
                msg[f"{name}.base_delta"] = server[f"{name}.base_delta"]
        return self.correction_broadcast(server, msg)

    def upload_spec(self, down: Message, rnd: int) -> Upload:
        """Fresh factors at the client's rank (never sent), the head, the corrections' uploads."""
        fresh = self.factor_specs(self.info.client_ranks[int(down["client"])])
        return self.with_corrections(down, {**fresh, **specs_of(down, self.head_keys(down))})

    def max_reply_bytes(self, down: Message) -> int:
        """The fresh factors are not in the download: bound by their size at the client's rank."""
        factors = 4 * self.info.client_ranks[int(down["client"])] * sum(o + i for o, i in self.targets.values())
        return 2 * down.nbytes() + factors + (1 << 20)

    def prepare_fit(self, model, msg, state, trainer):
        client, rnd = int(msg["client"]), int(msg["round"])
        rank = self.info.client_ranks[client]
        gen = torch_generator(self.info.seed, "flora-init", client, rnd)
        local, new_state = Message(msg), State(state)
        for name, mod in lora_modules(model).items():
            base = msg.get(f"{name}.base_delta")                 # dense catch-up, or: own base + latest stack
            if base is None:
                base = state.get(f"{name}.base_delta")
                if f"{name}.merge_B" in msg:
                    base = merge(base, msg[f"{name}.merge_B"], msg[f"{name}.merge_A"])
            if base is not None:
                local[f"{name}.base_delta"] = new_state[f"{name}.base_delta"] = base
            A, B = init_lora_factors(mod.out_features, mod.in_features, rank, gen, mod.base.weight.dtype)
            local[f"{name}.lora_A"], local[f"{name}.lora_B"] = A, B
        return self.local_fit(model, local, new_state, ("A", "B"))

    def aggregate(self, server: State, replies: list[Reply], rnd: int) -> State:
        server = State(server)
        p = self.client_weights(replies)
        w = [self.info.server_lr * float(pk) * lora_scale(self.info.alpha, self.info.client_ranks[r.client],
                                                          self.info.scaling) for pk, r in zip(p, replies)]
        for name in self.targets:
            B_s, A_s = stack_factors([r.message[f"{name}.lora_B"] for r in replies],
                                     [r.message[f"{name}.lora_A"] for r in replies], w)
            dtype = replies[0].message[f"{name}.lora_B"].dtype
            B_s, A_s = B_s.to(dtype), A_s.to(dtype)                  # what travels, and what both sides merge
            server[f"{name}.merge_B"], server[f"{name}.merge_A"] = B_s, A_s
            server[f"{name}.base_delta"] = merge(server.get(f"{name}.base_delta"), B_s, A_s)
        merges = int(server["flora.merges"])
        synced = server["flora.synced"].clone()
        synced[[r.client for r in replies]] = merges        # they had every merge before this one
        server["flora.synced"], server["flora.merges"] = synced, merges + 1
        self.average_into(server, replies, self.head_keys(server), p)
        self.aggregate_corrections(server, replies)
        return server

    def load_global(self, model: AdaptedModel, server: State) -> None:
        """``W0 + base_delta`` with a zero adapter (B = 0) at the server rank."""
        for name, mod in lora_modules(model).items():
            mod.set_factors(torch.zeros(self.info.rank, mod.in_features), torch.zeros(mod.out_features, self.info.rank))
            mod.set_base_delta(server.get(f"{name}.base_delta"))
        load_head(model, server)

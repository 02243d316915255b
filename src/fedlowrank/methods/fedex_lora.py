"""FedEx-LoRA (Singhal et al., "FedEx-LoRA: Exact Aggregation for Federated Parameter-Efficient Fine-Tuning of
Foundation Models", ACL 2025).

Clients train A and B from the global factors. The server averages the factors separately (FedIT) and folds
the exact residual into the frozen weight, so the global model is exactly the average of the clients' models:

    B̄ = Σ pₖ Bₖ,  Ā = Σ pₖ Aₖ,  W0 ← W0 + s (Σ pₖ Bₖ Aₖ − B̄ Ā)

Implemented through the server's exact global update ``G = W_global − W0: [out, in]`` (dense):
``G ← G + β Σ pₖ (s_k Bₖ Aₖ − s_k B⁰ₖ A⁰ₖ)``, where ``(B⁰ₖ, A⁰ₖ)`` is what client k started from, and client k
receives its factors plus ``base_delta = G − s_k B⁰ₖ A⁰ₖ``, so it starts exactly from the global model. With equal
ranks this is the paper's rule (``base_delta`` is ``W0 ← W0 + s·residual`` accumulated over rounds). The residual
is scaled by the LoRA scale, weighted by ``pₖ`` like the factors, and laid out ``[out, in]`` (``nn.Linear``: no
transpose; the public code's transpose is only right for GPT-2 ``Conv1D``).

Payload: the downlink carries the dense ``base_delta [out, in]`` per module from round 2 on (the same size as one
round's residual; it is the accumulated one, so a client that skipped rounds is still exact).
Heterogeneous ranks: factors zero-padded and sliced as in :mod:`~fedlowrank.methods.hetlora`; the per-client
``base_delta`` makes every client start from the exact global model anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..adapters.lora import lora_scale
from ..linalg.lowrank import stack_factors
from ..message import Message, Reply, State
from . import register
from .ranks import (HeteroRankLoRA, download_factors, module_names, padded_average, rank_weights)


@register
@dataclass
class FedExLoRA(HeteroRankLoRA):
    name = "fedex-lora"
    description = "FedIT averaging plus the exact residual Σpₖ sBₖAₖ − sB̄Ā folded into the base (dense download)"
    paper = ("Singhal et al., FedEx-LoRA: Exact Aggregation for Federated Parameter-Efficient Fine-Tuning of "
             "Foundation Models (ACL 2025)")
    uplink = "A_k [r_k,in] and B_k [out,r_k] per target module, head"
    downlink = "Ā[:r_k], B̄[:, :r_k] and the dense base delta [out,in] per target module (from round 2), head"
    needs_individual_replies = True
    server_entries = ("{module}.global_delta",)  # G, the exact aggregate accumulated over rounds

    def scale(self, rank: int) -> float:
        return lora_scale(self.info.alpha, rank, self.info.scaling)

    def message_for_rank(self, server: State, msg: Message) -> Message:
        """Add ``base_delta = G − s_k B_k A_k`` for the factors in ``msg`` (once the server has a ``G``)."""
        for name in module_names(msg):
            if f"{name}.global_delta" in server:
                A, B = msg[f"{name}.lora_A"].to(torch.float64), msg[f"{name}.lora_B"].to(torch.float64)
                G = server[f"{name}.global_delta"]
                msg[f"{name}.base_delta"] = (G.to(torch.float64) - self.scale(A.shape[0]) * (B @ A)).to(G.dtype)
        msg.update(self.global_tensors(server, self.head_keys(server)))
        return msg

    def broadcast(self, server: State, client: int, rnd: int) -> Message:
        msg = self.message_for_rank(server, download_factors(server, self.lora_keys(server), self.info, client))
        return self.correction_broadcast(server, msg)

    def aggregate(self, server: State, replies: list[Reply], rnd: int) -> State:
        server = State(server)
        p = self.client_weights(replies)
        ranks = [self.info.client_ranks[r.client] for r in replies]
        s_g = self.scale(self.info.rank)
        # Σ pₖ s_k B⁰ₖ A⁰ₖ = s B̄ diag(w) Ā with w_j = Σ_{k: r_k > j} pₖ (clients started from leading slices).
        w = torch.stack([(torch.arange(self.info.rank) < r).to(torch.float64) for r in ranks]).T @ p
        wr = rank_weights(replies, self.info, p)
        for name in module_names(server):
            ka, kb = f"{name}.lora_A", f"{name}.lora_B"
            A_g, B_g = server[ka], server[kb]
            B_c, A_c = stack_factors([r.message[kb] for r in replies] + [B_g],
                                     [r.message[ka] for r in replies] + [w[:, None] * A_g.to(torch.float64)],
                                     [float(pk) * self.scale(rk) for pk, rk in zip(p, ranks)] + [-s_g])
            G = server.get(f"{name}.global_delta", torch.zeros(B_g.shape[0], A_g.shape[1], dtype=B_g.dtype))
            server[f"{name}.global_delta"] = (G.to(torch.float64) + self.info.server_lr * (B_c @ A_c)).to(G.dtype)
            server[ka] = self.server_step(A_g, padded_average(replies, ka, A_g.shape, wr))
            server[kb] = self.server_step(B_g, padded_average(replies, kb, B_g.shape, wr))
        self.average_into(server, replies, self.head_keys(server), p)
        self.aggregate_corrections(server, replies)
        return server

    def load_global(self, model, server: State) -> None:
        self.load_message(model, self.message_for_rank(server, self.global_tensors(server, self.lora_keys(server))))

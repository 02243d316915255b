"""FedAvg-Full: full fine-tuning of the target weight matrices with FedAvg (FedGaLore's upper baseline).

Clients train the dense target weights ``W: [out, in]`` (and the head); the server averages them,
``W̄ = Σ pₖ Wₖ`` (with the optional server step β). Everything else stays frozen, so the trainable set is
the same as the LoRA methods'. With ``correction = "scaffold"`` it is Full-SCAFFOLD (SSF's baseline), with
``"fedprox"`` full-parameter FedProx.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..adapters.model import AdaptedModel
from ..message import Message, State
from . import register
from .base import Corrected, SetupInfo, Upload, correction_option, head_tensors, load_head, specs_of


@register
@dataclass
class FedAvgFull(Corrected):
    name = "fedavg-full"
    description = "full fine-tuning of the target weights, FedAvg (optionally with FedProx/SCAFFOLD)"
    paper = "McMahan et al., Communication-Efficient Learning of Deep Networks (AISTATS 2017)"
    uplink = "dense W [out,in] per target module, head"
    downlink = "dense W̄ [out,in] per target module, head"
    server_entries = ("scaffold.ci/{key}",)  # the vectorised runner's control variates of every client, [N, ...]
    batched = True

    def setup(self, model: AdaptedModel, info: SetupInfo) -> State:
        self.info = info
        server = State({f"{n}.weight": model.base_linear(n).weight.detach().clone() for n in model.target_names})
        server.update(head_tensors(model))
        shapes = {k: tuple(v.shape) for k, v in server.items()}
        for c in self._corrections:
            c.init_server(server, shapes)
        return server

    def trainable(self, model: AdaptedModel) -> dict[str, nn.Parameter]:
        params = {f"{n}.weight": model.base_linear(n).weight for n in model.target_names}
        params.update({f"head/{n}": p for n, p in model.head_parameters().items()})
        return params

    def weight_keys(self, server: State) -> list[str]:
        return [k for k in server if (k.endswith(".weight") and "/" not in k) or k.startswith("head/")]

    def load_global(self, model: AdaptedModel, server) -> None:
        for key, p in self.trainable(model).items():
            if not key.startswith("head/"):
                p.data.copy_(server[key])
        load_head(model, server)

    def broadcast(self, server: State, client: int, rnd: int) -> Message:
        return self.correction_broadcast(server, Message({k: server[k] for k in self.weight_keys(server)}))

    def upload_spec(self, down: Message, rnd: int) -> Upload:
        """The trained weights and head as sent, and the corrections' uploads."""
        return self.with_corrections(down, specs_of(down, self.weight_keys(down)))

    def train(self, model, msg, state, trainer):
        self.load_global(model, msg)
        return self.fit_and_reply(model, msg, state, trainer, self.trainable(model))

    def aggregate(self, server, replies, rnd):
        new = State(server)
        self.average_into(new, replies, self.weight_keys(server), self.client_weights(replies))
        for c in self._corrections:
            c.aggregate(new, replies, self.info.num_clients)
        return new

    def batched_round(self, model: AdaptedModel, server: State, clients: np.ndarray, oracle, rnd: int) -> State:
        """Hook of :mod:`fedlowrank.runtime.vectorized`: Full-FedAvg / Full-SCAFFOLD is SSF's round (:mod:`.ssf`)
        with ``P = I``. In this mode every client's control lives in the server state
        (``scaffold.ci/<key> [N, ...]``), as the vectorised runner keeps no per-client store."""
        from .ssf import local_sgd, scaffold_control_step, server_model_step, state_arrays, state_tensors

        if self.correction not in ("none", "scaffold") or model.head_names:
            raise ValueError("method.correction: the vectorised fedavg-full supports 'none' or 'scaffold' on "
                             f"target layers only; got {self.correction!r}")
        keys = {n: f"{n}.weight" for n in model.target_names}
        missing = [k for k in keys.values() if self.correction == "scaffold" and f"scaffold.ci/{k}" not in server]
        if missing:
            server = State(server)
            for k in missing:
                server[f"scaffold.ci/{k}"] = torch.zeros(self.info.num_clients, *server[k].shape, dtype=server[k].dtype)
        arrays = state_arrays(server)
        start = {n: arrays[k] for n, k in keys.items()}
        if self.correction == "scaffold":
            corr = {n: arrays[f"scaffold.c/{k}"] - arrays[f"scaffold.ci/{k}"][clients] for n, k in keys.items()}
        else:
            corr = {n: np.zeros((len(clients), *w.shape), dtype=w.dtype) for n, w in start.items()}
        coef, gbar = local_sgd(start, dict.fromkeys(keys), corr, oracle)
        weights = self.weights_of([self.info.client_sizes[i] for i in clients])
        for n, k in keys.items():
            arrays[k], _ = server_model_step(arrays[k], None, coef[n], weights.astype(coef[n].dtype),
                                             self.info.server_lr)
            if self.correction == "scaffold":
                ci = arrays[f"scaffold.ci/{k}"]
                arrays[f"scaffold.c/{k}"], ci[clients] = scaffold_control_step(
                    arrays[f"scaffold.c/{k}"], ci[clients], None, gbar[n], self.info.num_clients, "scaffold")
        return state_tensors(arrays)


@register
@dataclass
class ScaffoldFull(FedAvgFull):
    """Full-SCAFFOLD, SSF's baseline: ``fedavg-full`` with SCAFFOLD's control variates on every trained weight,
    under its own name so that one comparison can hold FedAvg-Full and Full-SCAFFOLD side by side."""

    name = "scaffold-full"
    description = "full fine-tuning of the target weights with SCAFFOLD control variates (SSF's Full-SCAFFOLD)"
    paper = "Karimireddy et al., SCAFFOLD: Stochastic Controlled Averaging for Federated Learning (ICML 2020)"
    uplink = "dense W [out,in] per target module, head; and Δcᵢ of the same shapes"
    downlink = "dense W̄ [out,in] per target module, head; and the server control variate c of the same shapes"
    # SCAFFOLD's Alg. 1: uniform weights, plain SGD with one step size for every parameter
    preset = {"server.weighting": "uniform", "train.optimizer": "sgd", "train.head_lr": 0.0}
    lr_grid = (1e-4, 1e-3, 1e-2, 1e-1)  # SSF's search grid, for the comparison with it

    correction: str = correction_option("scaffold", ("scaffold", "fedprox+scaffold"))

"""SSF — Subspace SCAFFOLD with residual backfill (Zhu, Huang, Xu, Li, "Subspace Optimization for Efficient
Federated Learning under Heterogeneous Data", arXiv:2604.25467, Algorithm 1) — and FedSub (Zhang, Xu, Yuan, "An
Efficient Subspace Algorithm for Federated Learning on Heterogeneous Data", arXiv:2509.05213, the baseline of SSF's
§5.1, as the authors' public code defines it: orthonormal Haar P, no r/d gradient scaling, duals rotated at a
refresh), on the same footing.

Layout ``[out, in]`` (``nn.Linear``); the paper's ``X [d, m]`` is ``Wᵀ`` with ``d = in``, ``m = out``. Each target
layer ℓ gets a shared Haar-random orthonormal projector ``P [r, in]`` (``P Pᵀ = I_r``) from the run seed, the
projector epoch ``e = rnd // refresh_every`` and ℓ (§3.6: Gaussian orthonormalised by QR; the refresh period is "a
tunable implementation parameter"). Adapter form (ours; the paper gives no layer-level detail): the effective
weight is ``W + Y P`` with ``W`` frozen for the round and trainable coefficients ``Y [out, r]`` starting at 0,
so autograd returns the projected gradient ``∂L/∂Y = G Pᵀ`` and never forms a dense weight gradient.

SSF round (eq. 5–7; Algorithm 1 uses all N clients; with S < N we add (1/N) Σ Δcᵢ to c, so that c = mean_i cᵢ
keeps holding, as the analysis needs), client i of the S sampled, K local SGD steps η::

    corrᵢ = (c − cᵢ) Pᵀ                                     [out, r]  (constant in the round)
    Y ← Y − η (G(W + Y P) Pᵀ + corrᵢ)                      K times; residual W(I − PᵀP) frozen
    ḡᵢ = (1/K) Σ_k G_k Pᵀ,  Δcᵢ = ḡᵢ − cᵢ Pᵀ,  cᵢ ← cᵢ + Δcᵢ P          (eq. 7: refresh only the subspace)
    W ← W + η_g (Σ pᵢ Yᵢ) P                                 (projected FedAvg + backfill, eq. 5)
    c ← c + (1/N) Σ Δcᵢ P   ("scaffold": keeps c = mean_i cᵢ)   or   c ← c(I − PᵀP) + (mean ḡᵢ) P   ("sample_mean")

FedSub round: ``Y ← Y − η G Pᵀ − Λᵢ/K`` (i.e. correction ``Λᵢ/(Kη)``), ``B̄ = Σ pᵢ Yᵢ``, ``W ← W + η_g B̄ P``,
``Λᵢ ← Λᵢ + Yᵢ − B̄`` for the participants; at a projector refresh every dual is re-expressed in the new basis,
``Λ ← Λ P_old P_newᵀ`` (``dual_transfer = "rotate"``). Default refresh every 5 rounds (paper Table 1).

Non-projected trainable tensors (the head) use ``P = I``: full SCAFFOLD (SSF, ``head_update = "scaffold"``) or
FedAvg. Full-SCAFFOLD/Full-FedAvg are the same maths with ``P = I`` (:func:`project`/:func:`lift` accept
``None``); this is how ``fedavg-full`` can share :func:`local_sgd` and the server steps.

State (simulation mode, as in the paper's own simulation, §3.5): the server holds ``w/<key>`` (the global
weight), for SSF ``c/<key>`` and every client's ``ci/<key> [N, ...]`` (full size, host memory), for FedSub
``dual/<layer> [N, out, r]``. A client keeps only its copy of the model (``w/<layer>``, ``synced``), which it
brings up to date from the increments ``η_g B̄ [out, r]`` of the rounds it missed, or from the full weight when
that is no larger (a re-joining client needs what it missed, which the paper's "order r per vector" cost
leaves out); with full participation the download is one increment per round.
Per participant per round and layer, in floats:

    SSF     down: increment (rm) + corrᵢ (rm) + round index;           up: Yᵢ (rm) + ḡᵢ (rm)   = 4rm
    FedSub  down: increment (rm) + Λᵢ (rm);                              up: Yᵢ (rm)             = 3rm

(plus rm per extra missed round, capped at dm, under partial participation). The pure batched functions
below (leading client dimension S) are the whole maths: the methods' per-client contract
(``broadcast``/``train``/``aggregate``) and :meth:`SubspaceMethod.batched_round`, the hook of
:mod:`fedlowrank.runtime.vectorized`, both call them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar, Protocol, Union

import numpy as np
import torch
from torch import nn

from ..adapters.model import AdaptedLinear, AdaptedModel
from ..linalg.projectors import random_basis
from ..message import Message, Reply, State
from ..schema import setting, with_default
from ..seeding import torch_generator
from ..training.corrections import ClientCorrection
from . import register
from .base import Method, SetupInfo, TensorSpec, Upload, head_tensors, load_head, on_host

CONTROL_UPDATES = ("scaffold", "sample_mean")
CONTROLS = ("full", "none")
HEAD_UPDATES = ("scaffold", "fedavg")
DUAL_TRANSFERS = ("rotate", "none", "reset")

Array = Union[torch.Tensor, np.ndarray]


# ---------------------------------------------------------------------------------------------------------
# pure maths (leading client dimension S where a tensor is per client). Except the projector, the functions take
# torch tensors or NumPy arrays (one kind and dtype per call): the message contract runs them on the state's
# tensors, the vectorised round on NumPy views of the same memory (at the toy's sizes a round is a few hundred
# small products, and NumPy's per-call cost is a fraction of torch's).
# ---------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def projector(seed: int, epoch: int, layer: int, dim: int, rank: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Shared projector ``P [rank, dim]`` of layer ``layer`` in projector epoch ``epoch``: Haar-random orthonormal
    rows (QR of a float64 Gaussian, sign-fixed; §3.6), identical on every party. Do not modify in place."""
    return random_basis(dim, rank, torch_generator(seed, "subspace-projector", epoch, layer), dtype).T.contiguous()


def project(x: Array, P: Array | None) -> Array:
    """``[..., out, in] → [..., out, r]``: ``x Pᵀ`` (the paper's ``P x``), one product over the leading dimensions
    folded; identity when ``P`` is None."""
    return x if P is None else (x.reshape(-1, x.shape[-1]) @ P.T).reshape(*x.shape[:-1], P.shape[0])


def lift(y: Array, P: Array | None) -> Array:
    """``[..., out, r] → [..., out, in]``: ``y P`` (the paper's ``Pᵀ y``), one product over the leading dimensions
    folded; identity when ``P`` is None."""
    return y if P is None else (y.reshape(-1, y.shape[-1]) @ P).reshape(*y.shape[:-1], P.shape[1])


class BatchedOracle(Protocol):
    """Minibatch gradients of the round's S clients at once (built by :mod:`fedlowrank.runtime.vectorized`)."""

    steps: int   # K
    lr: float    # η_l

    def grad(self, weights: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
        """``{key: W [S, out, in]}`` → ``{key: ∇f_i(W_i; ξ_i^step) [S, out, in]}`` (NumPy arrays)."""
        ...


def local_sgd(start: dict[str, np.ndarray], proj: dict[str, np.ndarray | None], corr: dict[str, np.ndarray],
              oracle: BatchedOracle) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """K corrected SGD steps of S clients in the subspace (Alg. 1 C2–C3), all clients at once, on NumPy arrays
    (the vectorised runner's gradients are NumPy's; these products are small enough that per-call cost dominates).

    Args:
        start: global weights ``W [out, in]`` per key (frozen during the round: the backfilled residual).
        proj: ``P [r, in]`` per key, or None for a full-dimensional tensor.
        corr: the constant correction per key ``[S, out, r]`` (SSF ``(c − cᵢ)Pᵀ``, FedSub ``Λᵢ/(Kη)``, zeros).
    Returns:
        ``Y_K [S, out, r]`` (the coefficients moved from 0) and ``ḡ = (1/K) Σ_k G_k Pᵀ [S, out, r]``.
    """
    coef = {k: np.zeros_like(c) for k, c in corr.items()}
    acc = {k: np.zeros_like(c) for k, c in corr.items()}
    for step in range(oracle.steps):
        grads = oracle.grad({k: start[k] + lift(coef[k], proj[k]) for k in start}, step)
        for k, g in grads.items():
            gp = project(g, proj[k])
            acc[k] += gp
            gp += corr[k]
            gp *= oracle.lr
            coef[k] -= gp
    return coef, {k: a / oracle.steps for k, a in acc.items()}


def client_sum(weights: Array, stacked: Array) -> Array:
    """``Σᵢ pᵢ xᵢ`` over the leading axis: ``weights [S]`` (``stacked``'s kind and dtype), ``stacked [S, ...]``."""
    return (weights @ stacked.reshape(len(weights), -1)).reshape(stacked.shape[1:])


def state_arrays(server: State) -> State:
    """``server`` with every tensor as a NumPy array sharing its memory (host state)."""
    return State({k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in server.items()})


def state_tensors(arrays: State) -> State:
    """The inverse of :func:`state_arrays`: every NumPy array as a tensor sharing its memory."""
    return State({k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in arrays.items()})


def server_model_step(w: Array, proj: Array | None, coef: Array, weights: Array,
                      server_lr: float) -> tuple[Array, Array]:
    """Projected averaging and backfill (Alg. 1 S4–S5): ``inc = η_g Σ pᵢ Yᵢ [out, r]``, ``W ← W + inc P``.

    Returns ``(W_new [out, in], inc [out, r])``; the residual ``W(I − PᵀP)`` is untouched.
    """
    inc = server_lr * client_sum(weights, coef)
    return w + lift(inc, proj), inc


def scaffold_control_step(c: Array, ci: Array, proj: Array | None, gbar: Array, num_clients: int,
                          rule: str) -> tuple[Array, Array]:
    """Control refresh on the active subspace (eq. 6–7) for the S participants.

    ``c [out, in]``, ``ci [S, out, in]`` (the participants' controls), ``gbar [S, out, r]`` (mean projected
    gradients). Returns ``(c_new, ci_new)``. ``rule = "scaffold"``: ``c += (1/N) Σ Δcᵢ P`` (keeps c = mean cᵢ);
    ``"sample_mean"``: ``c ← c(I − PᵀP) + (mean ḡᵢ) P`` (eq. 6 read literally on the sample).
    """
    dc = gbar - project(ci, proj)
    ci_new = ci + lift(dc, proj)
    if rule == "scaffold":
        return c + lift(dc.sum(0), proj) / num_clients, ci_new
    return c + lift(gbar.mean(0) - project(c, proj), proj), ci_new


def fedsub_correction(dual: Array, steps: int, lr: float) -> Array:
    """FedSub's step ``Y ← Y − η g − Λ/K`` written as a corrected gradient: ``corr = Λ / (K η)``."""
    return dual / (steps * lr)


def fedsub_dual_step(dual: Array, coef: Array, weights: Array) -> Array:
    """``Λᵢ ← Λᵢ + Yᵢ − B̄`` for the participants (``dual, coef [S, out, r]``, ``B̄ = Σ pᵢ Yᵢ``)."""
    return dual + coef - client_sum(weights, coef)


def rotate_duals(dual: Array, p_old: Array, p_new: Array, transfer: str) -> Array:
    """Duals ``[..., out, r]`` at a projector refresh: ``Λ P_old P_newᵀ`` (rotate), unchanged (none) or 0 (reset)."""
    if transfer == "rotate":
        return project(lift(dual, p_old), p_new)
    return dual if transfer == "none" else dual * 0


# ---------------------------------------------------------------------------------------------------------
# adapter and client-side correction
# ---------------------------------------------------------------------------------------------------------
class SubspaceLinear(AdaptedLinear):
    """``y = x (W0 + base_delta)ᵀ + (x Pᵀ) Yᵀ + bias``: frozen projector ``P [r, in]`` (LoRA's A), trainable
    coefficients ``Y [out, r]`` (LoRA's B, zero at the start of each round). The global weight ``W`` is carried
    as ``base_delta = W − W0`` (the backfill is counted, saved and exported like any base delta)."""

    def __init__(self, base: nn.Linear, rank: int):
        super().__init__(base)
        like = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.register_buffer("proj", torch.zeros(rank, self.in_features, **like))
        self.coef = nn.Parameter(torch.zeros(self.out_features, rank, **like))

    def reset(self, proj: torch.Tensor) -> None:
        """Start a round in the subspace of ``proj [r, in]``: ``Y = 0``."""
        self.proj = proj.to(device=self.base.weight.device, dtype=self.base.weight.dtype)
        with torch.no_grad():
            self.coef.zero_()

    def adapter_delta(self) -> torch.Tensor:
        return self.coef @ self.proj

    def adapter_output(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_map(self.input_map(x, self.proj), self.coef)


class _CorrectedGradient(ClientCorrection):
    """Adds the round's constant correction to each gradient and accumulates the raw (projected) gradients."""

    name = "subspace-correction"

    def __init__(self, corr: dict[str, torch.Tensor]):
        self.corr = corr
        self.total: dict[str, torch.Tensor] = {}

    def grad(self, params: dict[str, nn.Parameter]) -> None:
        for k, p in params.items():
            if p.grad is None:
                continue
            if k in self.total:
                self.total[k] += p.grad
            else:
                self.total[k] = p.grad.detach().clone()
            if k in self.corr:
                p.grad.add_(self.corr[k])


# ---------------------------------------------------------------------------------------------------------
# methods
# ---------------------------------------------------------------------------------------------------------
@dataclass
class SubspaceMethod(Method):
    """What SSF and FedSub share: per-layer shared projectors, the subspace adapter, the model catch-up, the
    per-client contract and the vectorised round. Subclasses give the correction and the server update.

    The subspace rank of layer ℓ is ``round(ratio · in_ℓ)`` (at least 1) when ``ratio`` > 0, else
    ``rank``, capped to ``in_ℓ``; the projector epoch of round t is ``t // refresh_every``.
    """

    rank: int = setting(0, "subspace dimension r of every target layer (0 = lora.rank), capped to the layer's in",
                        ge=0)
    ratio: float = setting(0.0, "if > 0, each layer's r = round(ratio · in) instead of method.rank (at least 1)",
                           ge=0, le=1)
    refresh_every: int = setting(1, "new projectors every this many rounds", ge=1)

    needs_individual_replies: ClassVar[bool] = True
    per_client_downlink = True  # the model increments since the client's last sync, its own correction
    client_state = "the client's copy w/<layer> [out,in] of each target weight and the model version it holds (synced)"
    server_entries = ("inc/{n}/{module}",)     # the model increments of the rounds a client may have missed
    client_entries = ("synced", "w/{module}")
    upload_entries = ("dy/{module}", "dy/head/{head}", "g/{module}", "g/head/{head}")  # increments, gradients
    exact_entries = ("sync/*",)  # added to the copy of the model a client keeps
    batched = True
    optimizers = ("sgd",)
    optimizer_refusal = "the local steps are the paper's plain SGD on the projected coefficients"
    uploads_gradients: ClassVar[bool] = False   # whether replies carry ḡᵢ (``g/<key>``)
    preset = {"train.optimizer": "sgd", "train.head_lr": 0.0}  # plain SGD, one η_l for every parameter (Alg. 1)
    lr_grid = (1e-4, 1e-3, 1e-2, 1e-1)  # SSF's search grid (FedSub's too, for the comparison with it)

    # -- set-up ------------------------------------------------------------------------------------------
    def layer_rank(self, dim: int) -> int:
        r = round(self.ratio * dim) if self.ratio > 0 else (self.rank or self.info.rank)
        return min(max(int(r), 1), dim)

    def setup(self, model: AdaptedModel, info: SetupInfo) -> State:
        self.info = info
        self._dims = {n: model.base_matrix(n).shape[1] for n in model.target_names}  # in (conv: in·kh·kw)
        self._ranks = {n: self.layer_rank(d) for n, d in self._dims.items()}
        model.attach(lambda name, lin: SubspaceLinear(lin, self._ranks[name]))
        self._layers = list(model.target_names)
        self._index = {n: i for i, n in enumerate(self._layers)}
        self._dtype = model.base_matrix(self._layers[0]).dtype
        server = State({f"w/{n}": model.base_matrix(n).detach().clone() for n in self._layers})
        server.update({f"w/{k}": v for k, v in head_tensors(model).items()})
        self._keys = [k[2:] for k in server]
        self._dy = {f"dy/{k}": TensorSpec((server[f"w/{k}"].shape[0], self._ranks[k]) if k in self._ranks
                                          else tuple(server[f"w/{k}"].shape), server[f"w/{k}"].dtype)
                    for k in self._keys}  # Yᵢ [out, r] per layer; the head's change
        # catch-up bookkeeping: model version, the version each client holds, retained increments
        server.update({"version": 0, "sync.last": [0] * info.num_clients, "sync.hist": []})
        longest = max(-(-self._dims[n] // self._ranks[n]) for n in self._layers)
        self._history = longest * self.refresh_every
        self.init_server(server)
        return server

    def init_server(self, server: State) -> None:
        """Add the method's own server state."""
        raise NotImplementedError

    def epoch(self, rnd: int) -> int:
        return rnd // self.refresh_every

    def projectors(self, epoch: int, arrays: bool = False) -> dict[str, Array | None]:
        """``P [r, in]`` per layer key (model dtype), None for the head keys; NumPy views with ``arrays``."""
        out: dict[str, Array | None] = {k: None for k in self._keys}
        for n in self._layers:
            P = projector(self.info.seed, epoch, self._index[n], self._dims[n], self._ranks[n], self._dtype)
            out[n] = P.numpy() if arrays else P
        return out

    # -- the method's maths, per batch of clients ---------------------------------------------------------
    def sent_corrections(self, server: State, clients: Array, proj: dict, rnd: int) -> dict[str, Array]:
        """What the server sends each client to correct its steps, ``{key: [S, out, r]}`` (may omit keys).
        ``server``, ``clients`` and ``proj`` are all tensors or all NumPy arrays (:func:`state_arrays`)."""
        raise NotImplementedError

    def corrections(self, sent: dict[str, torch.Tensor], steps: int, lr: float) -> dict[str, torch.Tensor]:
        """The constant gradient correction the client adds, from what it received."""
        return sent

    def apply(self, server: State, clients: Array, weights: Array, coef: dict[str, Array], gbar: dict[str, Array],
              proj: dict, rnd: int) -> dict[str, Array]:
        """Server update from the participants' ``Yᵢ`` and ``ḡᵢ`` (``[S, ...]``) with weights ``pᵢ`` (in the state's
        dtype); returns the layers' increments. Tensors or NumPy arrays, as :meth:`sent_corrections`."""
        raise NotImplementedError

    # -- vectorised round (hook of runtime/vectorized.py) ------------------------------------------------
    def batched_round(self, model: AdaptedModel, server: State, clients: np.ndarray, oracle: BatchedOracle,
                      rnd: int) -> State:
        """One round for the S sampled ``clients`` at once with closed-form minibatch gradients.

        Same maths as broadcast/train/aggregate (plain SGD local steps), on NumPy views of the state, without
        messages: the result is the server state the contract would produce, except the catch-up bookkeeping (not
        advanced).
        """
        if any(k not in self._layers for k in self._keys):
            raise ValueError(f"method {self.name!r}: the vectorised round supports target layers only, not a head")
        arrays = state_arrays(server)
        proj = self.projectors(self.epoch(rnd), arrays=True)
        sent = self.corrections(self.sent_corrections(arrays, clients, proj, rnd), oracle.steps, oracle.lr)
        start = {k: arrays[f"w/{k}"] for k in self._keys}
        corr = {k: sent[k] if k in sent else np.zeros((len(clients), *project(start[k], proj[k]).shape), start[k].dtype)
                for k in self._keys}
        coef, gbar = local_sgd(start, proj, corr, oracle)
        dtype = start[self._keys[0]].dtype
        weights = self.weights_of([self.info.client_sizes[k] for k in clients]).astype(dtype)
        self.apply(arrays, clients, weights, coef, gbar, proj, rnd)
        return state_tensors(arrays)

    # -- contract: server side ---------------------------------------------------------------------------
    def broadcast(self, server: State, client: int, rnd: int) -> Message:
        proj = self.projectors(self.epoch(rnd))
        msg = self.sync_message(server, client)
        msg["round"] = rnd
        msg.update({f"w/{k}": server[f"w/{k}"] for k in self._keys if k not in self._layers})
        sent = self.sent_corrections(server, torch.tensor([client]), proj, rnd)
        msg.update({f"corr/{k}": v[0] for k, v in sent.items()})
        return msg

    def sync_message(self, server: State, client: int) -> Message:
        """Catch-up of the client's model copy: per layer, the increments ``[out, r]`` of the versions it missed
        (``sync/<layer>/<version>``, with their projector epochs in ``sync.epochs``), or the full weight
        (``sync/<layer>/full``) when that is no larger or the history no longer holds them."""
        version, last = int(server["version"]), int(server["sync.last"][client])
        msg = Message({"sync.from": last, "sync.to": version})
        if version == last:
            return msg
        hist = {int(v): int(e) for v, e in server["sync.hist"]}
        kept = all(v in hist for v in range(last, version))
        if kept:
            msg["sync.epochs"] = [hist[v] for v in range(last, version)]
        for n in self._layers:
            if kept and (version - last) * self._ranks[n] < self._dims[n]:
                msg.update({f"sync/{n}/{v}": server[f"inc/{v}/{n}"] for v in range(last, version)})
            else:
                msg[f"sync/{n}/full"] = server[f"w/{n}"]
        return msg

    def upload_spec(self, down: Message, rnd: int) -> Upload:
        """``dy/<layer>``: ``Yᵢ [out, r]``, ``dy/head/<p>``: the head's change; with ``uploads_gradients`` also
        ``g/<key>``: ``ḡᵢ`` of each correction received, of its shape."""
        specs = dict(self._dy)
        if self.uploads_gradients:
            specs.update({f"g/{k[5:]}": TensorSpec.of(v) for k, v in down.tensors().items() if k.startswith("corr/")})
        return specs

    def aggregate(self, server: State, replies: list[Reply], rnd: int) -> State:
        server = State(server)
        clients = torch.tensor([r.client for r in replies])
        coef = {k: torch.stack([r.message[f"dy/{k}"] for r in replies]) for k in self._keys}
        gbar = {k: torch.stack([r.message[f"g/{k}"] for r in replies]) for k in self._keys
                if f"g/{k}" in replies[0].message}
        proj = self.projectors(self.epoch(rnd))
        inc = self.apply(server, clients, self.client_weights(replies).to(self._dtype), coef, gbar, proj, rnd)
        self.record(server, clients.tolist(), inc, rnd)
        return server

    def record(self, server: State, clients: list[int], inc: dict[str, torch.Tensor], rnd: int) -> None:
        """Advance the model version, remember who holds which version and keep the recent increments."""
        version = int(server["version"])
        for n, t in inc.items():
            server[f"inc/{version}/{n}"] = t
        last = list(server["sync.last"])
        for k in clients:
            last[k] = version
        oldest = version + 1 - self._history
        hist = [[v, e] for v, e in server["sync.hist"] if v >= oldest] + [[version, self.epoch(rnd)]]
        for v, _ in server["sync.hist"]:
            if v < oldest:
                for n in self._layers:
                    server.pop(f"inc/{v}/{n}", None)
        server.update({"version": version + 1, "sync.last": last, "sync.hist": hist})

    def load_global(self, model: AdaptedModel, server: State) -> None:
        proj = self.projectors(0)
        for n, mod in model.adapters().items():
            mod.set_frozen_weight(server[f"w/{n}"])
            mod.reset(proj[n])
        if len(self._keys) > len(self._layers):
            load_head(model, Message({k: server[f"w/{k}"] for k in self._keys if k not in self._layers}))

    # -- contract: client side ---------------------------------------------------------------------------
    def train(self, model: AdaptedModel, msg: Message, state: State, trainer) -> tuple[Message, State]:
        rnd = int(msg["round"])
        proj = self.projectors(self.epoch(rnd))
        state = self.catch_up(model, msg, state)
        params: dict[str, nn.Parameter] = {}
        for n, mod in model.adapters().items():
            mod.set_frozen_weight(state[f"w/{n}"])
            mod.reset(proj[n])
            params[n] = mod.coef
        load_head(model, Message({k: msg[f"w/{k}"] for k in self._keys if k not in self._layers}))
        params.update({f"head/{n}": p for n, p in model.head_parameters().items()})
        start = {k: p.detach().clone() for k, p in params.items() if k not in self._layers}
        model.set_trainable(params)
        sent = {k[5:]: v for k, v in msg.items() if k.startswith("corr/")}
        corr = self.corrections(sent, trainer.num_steps, trainer.lr)
        control = _CorrectedGradient({k: c.to(params[k].device) for k, c in corr.items()})
        result = trainer.fit(model, params, corrections=[control])
        reply = Message({f"dy/{k}": (p.detach() - start[k] if k in start else p.detach().clone())
                         for k, p in params.items()})
        if self.uploads_gradients:
            reply.update({f"g/{k}": control.total[k] / result.steps for k in sent})
        reply.update(num_examples=int(trainer.num_examples), train_loss=float(result.loss))
        return reply, state

    def catch_up(self, model: AdaptedModel, msg: Message, state: State) -> State:
        """The client's model copy brought to the broadcast version (see :meth:`sync_message`). A client may be
        ahead of what the server knows (a round whose aggregate was skipped): it skips what it already has."""
        first, to = int(msg["sync.from"]), int(msg["sync.to"])
        synced = int(state.get("synced", 0))
        new = State({"synced": to})
        for n in self._layers:
            if f"sync/{n}/full" in msg:
                new[f"w/{n}"] = msg[f"sync/{n}/full"].clone()
                continue
            if synced < first:
                raise ValueError(f"method {self.name!r}: the client's model copy is at version {synced} but the "
                                 f"increments start at version {first}")
            w = state[f"w/{n}"] if f"w/{n}" in state else on_host(model.base_matrix(n))
            for v in range(synced, to):
                w = w + lift(msg[f"sync/{n}/{v}"], self.projectors(msg["sync.epochs"][v - first])[n])
            new[f"w/{n}"] = w
        return new


@register
@dataclass
class SSF(SubspaceMethod):
    """SSF: subspace steps corrected by full-size controls (module docstring); ``controls = "none"`` is the
    ablation "subspace FedAvg with backfill"."""

    name = "ssf"
    description = "Subspace SCAFFOLD: shared random subspace per round, full-size controls, residual backfill"
    paper = "Zhu et al., Subspace Optimization for Efficient Federated Learning under Heterogeneous Data (arXiv:2604.25467)"
    uplink = "Y [out,r] and mean projected gradient [out,r] per target layer; head and its mean gradient"
    downlink = "model increments [out,r] since last sync (or W), (c − cᵢ)Pᵀ [out,r] per layer; head, c − cᵢ of head"
    uploads_gradients = True

    control_update: str = setting("scaffold", "server control refresh: scaffold (c += (1/N) Σ Δcᵢ P, keeps c = mean "
                                  "cᵢ) or sample_mean (eq. 6 on the sample)", choices=CONTROL_UPDATES)
    controls: str = setting("full", "full (SSF) or none (subspace FedAvg with backfill)", choices=CONTROLS)
    head_update: str = setting("scaffold", "non-projected tensors (the head) with full SCAFFOLD or FedAvg",
                               choices=HEAD_UPDATES)

    def controlled(self) -> list[str]:
        if self.controls == "none":
            return []
        return [k for k in self._keys if k in self._layers or self.head_update == "scaffold"]

    def init_server(self, server: State) -> None:
        for k in self.controlled():
            w = server[f"w/{k}"]
            server[f"c/{k}"] = torch.zeros_like(w)
            server[f"ci/{k}"] = torch.zeros(self.info.num_clients, *w.shape, dtype=w.dtype)

    def sent_corrections(self, server, clients, proj, rnd):
        return {k: project(server[f"c/{k}"] - server[f"ci/{k}"][clients], proj[k]) for k in self.controlled()}

    def apply(self, server, clients, weights, coef, gbar, proj, rnd):
        inc = {}
        for k in self._keys:
            server[f"w/{k}"], step = server_model_step(server[f"w/{k}"], proj[k], coef[k], weights, self.info.server_lr)
            if k in self._layers:
                inc[k] = step
        for k in self.controlled():
            ci = server[f"ci/{k}"]
            server[f"c/{k}"], ci_new = scaffold_control_step(server[f"c/{k}"], ci[clients], proj[k], gbar[k],
                                                             self.info.num_clients, self.control_update)
            ci[clients] = ci_new   # in place: the N × size array is the clients' store (host memory)
        return inc


@register
@dataclass
class FedSub(SubspaceMethod):
    """FedSub: subspace steps with subspace-only duals (refresh_every = 5 as in the paper's Table 1); the head (if
    any) is averaged FedAvg-style."""

    name = "fedsub"
    description = "Subspace FedAvg with subspace-only duals rotated at each projector refresh"
    paper = "Zhang, Xu, Yuan, An Efficient Subspace Algorithm for Federated Learning on Heterogeneous Data (arXiv:2509.05213)"
    uplink = "Y [out,r] per target layer; head"
    downlink = "model increments [out,r] since last sync (or W), dual Λᵢ [out,r] per layer; head"

    refresh_every: int = with_default(SubspaceMethod, "refresh_every", 5)
    dual_transfer: str = setting("rotate", "the duals at a projector refresh: rotate (Λ ← Λ P_old P_newᵀ, FedSub's "
                                 "code), none (keep their coordinates) or reset (Λ ← 0)", choices=DUAL_TRANSFERS)

    def init_server(self, server: State) -> None:
        for n in self._layers:
            w = server[f"w/{n}"]
            server[f"dual/{n}"] = torch.zeros(self.info.num_clients, w.shape[0], self._ranks[n], dtype=w.dtype)
        server["dual.epoch"] = 0

    def duals_at(self, server: State, n: str, epoch: int, clients: Array | None = None) -> Array:
        """Layer ``n``'s duals (of ``clients``, or all) expressed in projector epoch ``epoch``: one rotation per
        refresh since the stored epoch, as if every dual had been rotated at each refresh (a product of successive
        rotations is not one direct rotation)."""
        dual = server[f"dual/{n}"] if clients is None else server[f"dual/{n}"][clients]
        arrays = isinstance(dual, np.ndarray)
        for e in range(int(server["dual.epoch"]), epoch):
            dual = rotate_duals(dual, self.projectors(e, arrays)[n], self.projectors(e + 1, arrays)[n],
                                self.dual_transfer)
        return dual

    def sent_corrections(self, server, clients, proj, rnd):
        return {n: self.duals_at(server, n, self.epoch(rnd), clients) for n in self._layers}

    def corrections(self, sent, steps, lr):
        return {k: fedsub_correction(v, steps, lr) for k, v in sent.items()}

    def apply(self, server, clients, weights, coef, gbar, proj, rnd):
        epoch = self.epoch(rnd)
        if int(server["dual.epoch"]) != epoch:
            for n in self._layers:
                server[f"dual/{n}"] = self.duals_at(server, n, epoch)
            server["dual.epoch"] = epoch
        inc = {}
        for k in self._keys:
            server[f"w/{k}"], step = server_model_step(server[f"w/{k}"], proj[k], coef[k], weights, self.info.server_lr)
            if k in self._layers:
                inc[k] = step
                dual = server[f"dual/{k}"]
                dual[clients] = fedsub_dual_step(dual[clients], coef[k], weights)
        return inc


__all__ = ["SSF", "FedSub", "SubspaceMethod", "SubspaceLinear", "BatchedOracle", "projector", "project", "lift",
           "local_sgd", "server_model_step", "scaffold_control_step", "fedsub_correction", "fedsub_dual_step",
           "rotate_duals"]

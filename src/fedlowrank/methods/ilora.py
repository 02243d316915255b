"""ILoRA and ILoRA-S (Zhou, Liu, Shang, "ILoRA: Federated Learning with Low-Rank Adaptation for Heterogeneous Client
Aggregation", arXiv:2511.16069, §5), and the QR-initialised LoRA machinery that FedIT+QR (``fedit_qr.py``) shares.

Per target module with pretrained ``W0: [out, in]`` and one constant LoRA scale ``s``:

* QR initialisation (Alg. 1 l.1–4, Eqs. 5–7): ``W0 = Q0 R0`` (reduced, unpivoted, ``diag R0 ≥ 0``). Client k
  starts from ``B_k = Q0[:, :r_k]: [out, r_k]``, ``A_k = R0[:r_k]: [r_k, in]`` on the frozen base
  ``W0 − s·Q0[:, :r_k] R0[:r_k]``, so its outputs are those of the pretrained model.
* Concatenated aggregation (Alg. 2, Eqs. 8–11): ``B_c = [B_1 … B_S]: [out, R_t]``,
  ``A_c = [p_1 A_1; …; p_S A_S]: [R_t, in]``, ``B_c A_c = Σ p_k B_k A_k`` exactly for any ranks; ``Q, R`` of
  ``B_c A_c`` computed in factored form (never the dense product); global adapter ``(Q[:, :r_s], R[:r_s])``,
  truncation error ``‖R[r_s:]‖_F``; client k receives ``(Q[:, :r_k], R[:r_k])``.
* ILoRA-S (Alg. 3, Eqs. 12–17): rank-aware control variates on A and B, added to the gradient before the
  optimizer (AdamW by default), refreshed from the client's raw gradients, zero-padded and averaged on the server.

Choices for what the paper leaves open:

* Scale: one constant ``s = lora_scale(lora.alpha, lora.rank = r_s, lora.scaling)`` for every client whatever its rank
  (with α/r_k per client, the paper's raw-factor sum would mix scales), so raw factors are aggregated as the paper
  writes and equal the effective updates up to ``s``.
* QR offset: never sent. It is a deterministic function of ``W0``, which every client holds, so the client
  recomputes ``−s·Q0[:, :n] R0[:n]`` (``n`` = the directions it received) each time it loads a message.
* Alg. 1 l.7 (``θ_k ← θ_k + B_k A_k``): the received factors replace the client's (merging them as well would count
  the adapter twice); the optimizer is fresh every round (the trainer's); the head is trained and FedAvg-ed
  (``Σ p_k head_k``), with no control variates.
* ``hetero_base`` (Alg. 1 gives each client its own base but averages whole factors): ``"residual"`` (default) is one
  base at rank r_s, ``W0 − s·Q0[:, :r_s]R0[:r_s]`` (Lemma 6, Alg. 4 l.2): clients receive the global ``(B_s, A_s)``,
  its leading r_k directions to train and the others as ``<m>.frozen_A/B`` kept frozen in their base; the server
  appends the frozen parts as extra blocks of the concatenation. Every client then starts every round from the global
  model, which is what eq. 7 (``θ_k = θ_0 − B_k A_k``: the local model is the pretrained one plus the adapter) is for;
  with equal ranks it is Alg. 1 exactly. ``"per_client"`` is Alg. 1 read literally at unequal ranks: client k's base
  keeps ``W0 − s·Q0[:, :r_k]R0[:r_k]`` while the server averages whole factors, so after a round W0's j-th QR
  direction in client k's model is scaled by ``1 − s(1 − w_j)`` (negative, i.e. sign-flipped, when
  ``s(1 − w_j) > 1``); it needs no r_k ≤ r_s.
* Global model (the one evaluated; the paper reports one accuracy per method without defining it):
  ``W0 − s·Q0 diag(w) R0 + s·B_s A_s`` with ``w_j = Σ_{k: r_k > j} π_k``, ``π_k`` = data share over all clients
  (``per_client``), or ``w = 1`` on the first r_s directions (``residual``); before the first aggregation it is the
  pretrained model.
* ``server_lr`` η_g (our reading of the paper's unused "global scaling factor", App. A.3): ``ΔW ← η_g ΔW + (1 − η_g)
  B_s^old A_s^old``, done by appending ``B_s^old`` to the concatenation (1 = Alg. 2 exactly).
* ILoRA-S's control refresh (Alg. 3 l.3–7 do not say over which steps ``g_k^raw`` is taken): ``c_k`` ← the mean raw
  gradient over the round's local steps (the epoch mean when the round is one epoch, the paper's E = 1), or the last
  step's (``cv_grad="last"``); the correction uses the server variate of the previous round (zero in round 1, so round
  1 equals ILoRA); variates are averaged unweighted, 1/|S_t| (Eqs. 16–17).

Server state: ``"<m>.lora_B"`` = ``Q[:, :r_max]: [out, r_max]``, ``"<m>.lora_A"`` = ``R[:r_max]: [r_max, in]``
(``r_max = max(r_s, max_k r_k)``), ``"head/<p>"``, ``"qr_init"`` (1 until the first aggregation); ILoRA-S adds
``"ilora_cv.c/<m>.lora_A": [r_max, in]`` and ``"ilora_cv.c/<m>.lora_B": [out, r_max]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..adapters.lora import attach_lora, lora_modules, lora_scale
from ..adapters.model import AdaptedModel
from ..linalg.lowrank import DECOMPOSITIONS, factored_basis, normalize_qr_signs, pad_basis, stack_factors
from ..message import Message, Reply, State
from ..schema import setting
from ..training.corrections import Scaffold
from . import register
from .base import LoRAMethod, SetupInfo, correction_option, head_tensors, load_head
from .ranks import copy, leading, zero_pad

HETERO_BASES = ("per_client", "residual")


@dataclass
class QRInitLoRA(LoRAMethod):
    """LoRA whose clients start from the leading ``r_k`` directions of ``QR(W0)`` (shared by ILoRA, FedIT+QR).

    Subclasses say how many directions a client receives (:meth:`rows_sent`), which rank and base weights make
    the global model (:meth:`global_rank`, :meth:`global_base`), and how the server aggregates.
    """

    supports_heterogeneous_ranks = True

    correction: str = correction_option("none", ("none", "fedprox"), "rank-aware control variates are method "
                                        "ilora-s")

    # -- set-up ----------------------------------------------------------------------------------------
    def setup(self, model: AdaptedModel, info: SetupInfo) -> State:
        self.info = info
        self.r_max = max([info.rank, *info.client_ranks])
        self.scale = lora_scale(info.alpha, info.rank, info.scaling)
        attach_lora(model, info.rank, info.alpha, info.scaling, info.dropout)
        share = torch.tensor([1.0 if info.weighting == "uniform" else float(n) for n in info.client_sizes],
                             dtype=torch.float64)
        share = share / share.sum()
        ranks = torch.tensor(info.client_ranks)
        #: w_j = Σ_{k: r_k > j} π_k, weight of QR direction j in the average of the clients' bases [r_max]
        self.direction_share = torch.stack([share[ranks > j].sum() for j in range(self.r_max)])
        self._qr0: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        server = State()
        for name, mod in lora_modules(model).items():
            if self.r_max > min(mod.out_features, mod.in_features):
                raise ValueError(f"lora.rank / client ranks: max rank {self.r_max} exceeds min(out, in) = "
                                 f"{min(mod.out_features, mod.in_features)} of {name!r}")
            W0 = mod.base.weight.detach()
            Q0, R0 = normalize_qr_signs(*torch.linalg.qr(W0.to(torch.float64)))
            self._qr0[name] = (Q0[:, : self.r_max], R0[: self.r_max])
            server[f"{name}.lora_B"] = Q0[:, : self.r_max].to(W0.dtype)
            server[f"{name}.lora_A"] = R0[: self.r_max].to(W0.dtype)
        server.update(head_tensors(model))
        server["qr_init"] = 1
        for c in self._corrections:
            c.init_server(server, {k: tuple(server[k].shape) for k in self.factor_keys()})
        return server

    def factor_keys(self) -> list[str]:
        return [f"{n}.lora_{f}" for n in self._qr0 for f in ("A", "B")]

    def leading_directions(self, n: int) -> torch.Tensor:
        """Base weights that remove the first ``n`` QR directions: ``[1]*n + [0]*(r_max − n)``. [r_max]"""
        return (torch.arange(self.r_max) < n).to(torch.float64)

    def rows_sent(self, client_rank: int) -> int:
        """How many QR directions client k receives (it trains the first ``r_k``)."""
        return client_rank

    def global_rank(self) -> int:
        raise NotImplementedError

    def global_base(self) -> torch.Tensor:
        """``w: [r_max]``: the global model's frozen base is ``W0 − s·Q0 diag(w) R0``."""
        raise NotImplementedError

    # -- messages and loading ----------------------------------------------------------------------------
    def broadcast(self, server: State, client: int, rnd: int) -> Message:
        """Leading ``r_k`` directions as ``<m>.lora_A/B``; directions ``r_k..n`` (``n`` = :meth:`rows_sent`) as
        ``<m>.frozen_A: [n − r_k, in]``, ``<m>.frozen_B: [out, n − r_k]`` when ``n > r_k``; head; corrections'
        entries sliced to ``r_k``."""
        r_k = self.info.client_ranks[client]
        n = self.rows_sent(r_k)
        msg = Message()
        for name in self._qr0:
            A, B = server[f"{name}.lora_A"], server[f"{name}.lora_B"]
            msg[f"{name}.lora_A"], msg[f"{name}.lora_B"] = copy(A[:r_k]), copy(B[:, :r_k])
            if n > r_k:
                msg[f"{name}.frozen_A"], msg[f"{name}.frozen_B"] = copy(A[r_k:n]), copy(B[:, r_k:n])
        msg.update({k: server[k] for k in self.head_keys(server)})
        for c in self._corrections:
            msg.update({k: leading(k, v, r_k) for k, v in c.broadcast(server).items()})
        return msg

    def load_message(self, model: AdaptedModel, msg: Message, base: torch.Tensor | None = None) -> None:
        """Load ``<m>.lora_A/B`` as the trainable factors and rebuild the frozen base of every module.

        Base delta: ``s·(−Q0 diag(base) R0 + frozen_B frozen_A)``; ``base`` defaults to
        :meth:`leading_directions` of the number of directions received (trainable + frozen), which is the
        client's QR offset, recomputed from W0.
        """
        for name, mod in lora_modules(model).items():
            A, B = msg[f"{name}.lora_A"], msg[f"{name}.lora_B"]
            fA, fB = msg.get(f"{name}.frozen_A"), msg.get(f"{name}.frozen_B")
            mod.set_factors(A, B)
            mod.scale = self.scale
            Q0, R0 = self._qr0[name]
            received = A.shape[0] + (0 if fA is None else fA.shape[0])
            delta = -(Q0 * (self.leading_directions(received) if base is None else base)) @ R0
            if fA is not None:
                delta += fB.to(torch.float64) @ fA.to(torch.float64)
            mod.set_base_delta(self.scale * delta)
        load_head(model, msg)

    def load_global(self, model: AdaptedModel, server: State) -> None:
        r = self.global_rank()
        msg = Message({k: leading(k, server[k], r) for k in self.factor_keys()})
        msg.update({k: server[k] for k in self.head_keys(server)})
        self.load_message(model, msg, self.leading_directions(r) if server["qr_init"] else self.global_base())

    def prepare_fit(self, model: AdaptedModel, msg: Message, state: State, trainer):
        return self.local_fit(model, msg, state, ("A", "B"))


@register
@dataclass
class ILoRA(QRInitLoRA):
    """ILoRA: QR init, concatenated-QR aggregation of heterogeneous ranks, personalised slices (Algs. 1, 2).

    ``decomp = "svd"`` gives the Eckart–Young optimal truncation the paper claims (its QR is unpivoted, so
    ``"qr"`` keeps the span of the first r_s columns); ``hetero_base = "residual"`` is Lemma 6 /
    Alg. 4 (one base at r_s: every client starts from the global model as eq. 7 intends).
    """

    name = "ilora"
    description = "QR-initialised LoRA, heterogeneous ranks merged by a QR of the concatenated factors"
    paper = ("Zhou, Liu, Shang, ILoRA: Federated Learning with Low-Rank Adaptation for Heterogeneous Client "
             "Aggregation")
    uplink = "A_k [r_k,in] and B_k [out,r_k] per target module, head"
    downlink = ("Q[:, :r_k] [out,r_k] and R[:r_k] [r_k,in] per target module, head; with hetero_base=residual "
                "also the frozen directions r_k..r_s of the global adapter")
    needs_individual_replies = True
    lr_grid = (3e-4, 1e-3, 3e-3)  # a CPU-scale grid around the paper's AdamW 1e-4 (App. A.3)

    decomp: str = setting("qr", "decomposition of the concatenated factors: qr (unpivoted, the paper) or svd "
                          "(optimal truncation)", choices=DECOMPOSITIONS)
    hetero_base: str = setting("residual", "frozen base of a client below the server rank: residual (one base at "
                               "lora.rank, every client starts from the global model; needs every client rank <= "
                               "lora.rank) or per_client (Alg. 1 literally)", choices=HETERO_BASES)

    def setup(self, model: AdaptedModel, info: SetupInfo) -> State:
        if self.hetero_base == "residual" and max(info.client_ranks) > info.rank:
            raise ValueError(f"method.hetero_base: 'residual' needs every client rank <= lora.rank = {info.rank}, "
                             f"got {max(info.client_ranks)}; use 'per_client'")
        return super().setup(model, info)

    def rows_sent(self, client_rank: int) -> int:
        return self.info.rank if self.hetero_base == "residual" else client_rank

    def global_rank(self) -> int:
        return self.info.rank

    def global_base(self) -> torch.Tensor:
        if self.hetero_base == "residual":
            return self.leading_directions(self.info.rank)
        return self.direction_share

    def aggregate(self, server: State, replies: list[Reply], rnd: int) -> State:
        """Per module: ``ΔW = Σ p_k B_k A_k`` (+ frozen residuals, + server step) → ``Q, R`` → keep ``r_max``."""
        server = State(server)
        p = self.client_weights(replies)
        r_s, beta = self.info.rank, self.info.server_lr
        err2 = total2 = 0.0
        for name in self._qr0:
            ka, kb = f"{name}.lora_A", f"{name}.lora_B"
            Bs = [r.message[kb] for r in replies]
            As = [r.message[ka] for r in replies]
            weights = p
            B_old, A_old = server[kb][:, :r_s].to(torch.float64), server[ka][:r_s].to(torch.float64)
            if self.hetero_base == "residual":  # each client's frozen directions r_k..r_s of the old adapter
                Bs, As = Bs + [B_old[:, A.shape[0]:] for A in As], As + [A_old[A.shape[0]:] for A in As]
                weights = torch.cat([p, p])
            B_c, A_c = stack_factors(Bs, As, weights)
            if beta != 1.0:
                B_c, A_c = torch.cat([B_c, B_old], 1), torch.cat([beta * A_c, (1.0 - beta) * A_old], 0)
            Q, R = factored_basis(B_c, A_c, self.decomp)
            err2 += float(R[r_s:].pow(2).sum())
            total2 += float(R.pow(2).sum())
            Q, R = pad_basis(Q, R, self.r_max)
            server[kb], server[ka] = Q.to(server[kb].dtype), R.to(server[ka].dtype)
        self.average_into(server, replies, self.head_keys(server), p)
        self.aggregate_corrections(server, replies)
        server["qr_init"] = 0
        self.report(trunc_err=math.sqrt(err2), trunc_err_rel=math.sqrt(err2 / total2) if total2 > 0 else 0.0)
        return server


class RankAwareControlVariates(Scaffold):
    """ILoRA-S's control variates (Alg. 3, Eqs. 12–17) on the LoRA factors, on SCAFFOLD's hooks.

    Server ``c``: ``[r_max, in]`` for A, ``[out, r_max]`` for B; client k receives its leading ``r_k``
    directions and keeps ``c_k`` at its own rank (keys ``ilora_cv.c/``, ``ilora_cv.ci/``, ``ilora_cv.dc/`` + the
    factor's key). Each step ``g̃ = g + (c − c_k)`` before the optimizer (Eqs. 12–13, :meth:`Scaffold.grad`).
    After the round ``c_k ← ĝ`` (the mean raw gradient of the round, or the last one) and the client uploads
    ``Δc_k = ĝ − c_k`` (Eqs. 14–15). Server: ``c ← c + (1/|S_t|) Σ_k zero_pad(Δc_k)`` (Eqs. 16–17, unweighted).
    The head gets no control variates.
    """

    name = "ilora-cv"
    prefix_c, prefix_ci, prefix_dc = "ilora_cv.c/", "ilora_cv.ci/", "ilora_cv.dc/"

    def start(self, msg: Message, state: State, params: dict[str, nn.Parameter]) -> None:
        super().start(msg, state, {k: p for k, p in params.items() if self.prefix_c + k in msg})

    def aggregate(self, server: State, replies: list[Reply], num_clients: int) -> None:
        for key in [k for k in server if k.startswith(self.prefix_c)]:
            dc = [zero_pad(r.message[self.prefix_dc + key[len(self.prefix_c):]].to(torch.float64), server[key].shape)
                  for r in replies]
            server[key] = (server[key].to(torch.float64) + torch.stack(dc).mean(0)).to(server[key].dtype)


@register
@dataclass
class ILoRAS(ILoRA):
    """ILoRA-S: ILoRA plus rank-aware control variates on A and B (:class:`RankAwareControlVariates`).

    ``cv_grad`` (shared with SCAFFOLD) says how ``c_k`` is refreshed.
    """

    name = "ilora-s"
    description = "ILoRA with rank-aware SCAFFOLD-style control variates on A and B (corrected AdamW)"
    uplink = "A_k [r_k,in], B_k [out,r_k], Δc_A [r_k,in], Δc_B [out,r_k] per target module, head"
    downlink = ("Q[:, :r_k] [out,r_k], R[:r_k] [r_k,in], c_A[:r_k] [r_k,in], c_B[:, :r_k] [out,r_k] per target "
                "module, head; with hetero_base=residual also the frozen directions r_k..r_s")

    def __post_init__(self) -> None:
        super().__post_init__()
        self._corrections.append(RankAwareControlVariates(self.cv_grad))


__all__ = ["QRInitLoRA", "ILoRA", "ILoRAS", "RankAwareControlVariates", "leading", "zero_pad"]

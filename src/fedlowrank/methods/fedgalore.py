"""FedGaLore (Peng et al., "Rethinking LoRA for Data Heterogeneous Federated Learning: Subspace and State
Alignment", arXiv:2602.01746, §5 and Algorithm 1) and its ablation FedGaLore- (no state synchronisation, §6).

Clients train the dense target weights ``W_b: [m, n]`` with GaLore (:class:`~fedlowrank.training.galore.GaLore`,
Alg. 1 l.2–10, App. A.1): rank-r projected AdamW, basis refreshed every τ steps, SVD bases for the first S refreshes
and seeded random orthonormal bases after. The head is trained densely by the same operator. The server FedAvgs the
weights (Alg. 1 l.11, reusing :class:`FedAvgFull`) and synchronises the projected second moments
``S_i = can(ṽ_i): [d_u, r]`` (Alg. 1 l.12, eq. 11): when every client ended in the same basis ``Q`` the views
``S_i Qᵀ`` are handled on the compact ``[d_u, r]`` matrices (exact: ``QᵀQ = I``, so centering, the left singular
vectors and the singular values of ``S_i Qᵀ`` are those of ``S_i``); otherwise the dense ``[d_u, d_p]`` views are used
and the result is re-factored to ``S̄ Q_syncᵀ`` with ``Q_sync`` its top-r right singular vectors. ``state_sync``
(App. F): ``ajive`` (``S̄ = Σ p̃_i (U_J U_Jᵀ S_ic + 1μ_iᵀ)``), ``avg`` (``Σ p̃_i S_i``), ``avg_svd`` (the average
truncated to rank ``sync_rank``) or ``none``.

Round k: the server sends the weights, the head, the round seed ``s_k`` and, from round 2 on, ``S̄`` with its
basis (a seed and refresh index, or ``Q_sync`` itself). The client starts its buffers from it (``init_mode``
``carry``: keep the sync basis until t = τ; ``svd``: re-project into the SVD basis of the first gradient).

Scale of the synced ṽ (the paper leaves Adam's bias correction of a warm ṽ open, App. A.1): a warm ṽ is used with
Adam's v factor 1, so it must be on the scale of E[g̃²]. A client that started from ṽ = 0 and ran T steps holds only
``(1 − β₂ᵀ)·E[g̃²]`` ≈ T(1 − β₂)·E[g̃²]; ``v_sync = "bias_corrected"`` (default) uploads ``ṽ/(1 − β₂ᵀ)``
(:meth:`GaLore.second_moment`), so the next round's first steps have a warm AdamW step's size. ``"raw"`` uploads the
raw EMA (the literal reading of Alg. 1 l.9), whose next round's first steps are ≈ 1/√(T(1 − β₂)) too large.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..adapters.model import AdaptedModel
from ..linalg.ajive import IDENTIFIABILITY, ajive_combine
from ..linalg.projectors import canonical, projection_side
from ..message import Message, Reply, State
from ..schema import setting, with_default
from ..seeding import derive_seed
from ..training.corrections import fit_with_corrections
from ..training.galore import LOADED, MOMENTS_AT_REFRESH, PROJECTORS, V_REPROJECT, GaLore, seeded_basis
from . import register
from .base import SetupInfo, TensorSpec, Upload, weighted_sum
from .fedavg_full import FedAvgFull

STATE_SYNC = ("ajive", "avg", "avg_svd", "none")
INIT_MODES = ("carry", "svd")
UPLOADS = ("dense", "segments")
V_SYNC = ("bias_corrected", "raw")
SEED_KEY, INDEX_KEY = "galore_seed", "galore_basis_index"
SYNC_SEED_KEY, SYNC_INDEX_KEY = "galore_sync_seed", "galore_sync_index"
SEGMENTS_KEY, DECAY_KEY = "galore_segments", "galore_decay"
MAX_SEGMENTS = 1024  # basis segments a reply may declare (one per basis refresh of its local steps)


@register
@dataclass
class FedGaLore(FedAvgFull):
    """FedGaLore (module docstring). The paper gives no τ, S, α_g or ε (App. G lists the rest); the defaults here
    and why are in docs/methods/fedgalore.md, "Choices where the paper is silent". ``v_reproject = "linear"`` (the
    paper's, with the clamp) diverges in our runs; ``upload = "segments"`` sends the exact structured form of the
    paper's "rank-r factorized" update (§5: one [d_u, r] coefficient matrix per basis segment and the decay D_T).
    """

    name = "fedgalore"
    description = "GaLore-AdamW on the dense target weights; FedAvg + AJIVE sync of the projected second moments"
    paper = "Peng et al., Rethinking LoRA for Data Heterogeneous Federated Learning: Subspace and State Alignment"
    uplink = ("per target module: dense W [out,in] (upload=segments: a [d_u,r] coefficient matrix per basis segment, "
              "+ the [d_p,r] basis of SVD segments) and the projected ṽ [d_u,r]; head; final basis index")
    downlink = "dense W̄ [out,in] per target module, head, round seed, synced S̄ [d_u,r] per module + its basis id"
    needs_individual_replies = True
    # the synced state, from round 1 on; with the synced basis Q̄ [d_p, r] when the clients ended on different bases
    server_entries = ("{module}.galore_v", "{module}.galore_Q", SYNC_SEED_KEY, SYNC_INDEX_KEY)
    batched = False  # FedAvg-full's vectorised round has no GaLore steps

    rank: int = setting(0, "GaLore rank r (0 = lora.rank, the baselines' rank)", ge=0)
    tau: int = setting(0, "basis refresh period τ in local steps (0 = ⌈T/4⌉: half an epoch at two local epochs, "
                       "so that T > S·τ)", ge=0)
    svd_refreshes: int = setting(2, "S, the data-driven (SVD) refreshes before the seeded random ones (-1 = always "
                                 "SVD, 0 = always random)", ge=-1)
    scale: float = setting(4.0, "α_g, GaLore's scale of the projected update", gt=0)
    projector: str = setting("svd", "how a data-driven basis is computed: exact or randomised SVD", choices=PROJECTORS)
    state_sync: str = setting("ajive", "how the server synchronises the projected second moments: AJIVE's joint "
                              "part, their average, the average truncated to method.sync_rank, or none",
                              choices=STATE_SYNC)
    sync_rank: int = setting(0, "AJIVE's joint rank / the avg_svd rank (0 = r)", ge=0)
    init_mode: str = setting("carry", "a client's start from the synced state: carry (keep the sync basis until "
                             "t = τ) or svd (re-project into the SVD basis of the first gradient)", choices=INIT_MODES)
    identifiability: str = setting("all", "AJIVE's identifiability check", choices=IDENTIFIABILITY)
    restore_means: bool = setting(True, "add the view means back to AJIVE's joint part (false = mvlearn's J alone)")
    v_reproject: str = setting("squared", "re-projection of ṽ into a new basis: squared (variance propagation, "
                               "stays >= 0) or the paper's linear (with the clamp)", choices=V_REPROJECT)
    clamp_v: bool = setting(True, "clamp ṽ >= 0 on load and re-projection")
    warm_bias_correction: bool = setting(False, "keep Adam's v bias correction for a warm-started ṽ (the literal "
                                         "reading)")
    upload: str = setting("dense", "what a client uploads: the trained W (dense, as FedAvg-Full) or segments (D_T "
                          "and, per basis segment, a [d_u, r] coefficient matrix plus the basis when not seeded)",
                          choices=UPLOADS)
    moments_at_refresh: str = setting("reproject", "Adam's moments at a basis refresh: reproject (App. A.1) or keep "
                                      "(unchanged in the new basis, as galore-torch)", choices=MOMENTS_AT_REFRESH)
    v_sync: str = setting("bias_corrected", "the ṽ a client uploads: bias_corrected (ṽ/(1 − β₂ᵀ) after a cold "
                          "start, on the scale of E[g̃²], which a warm ṽ needs) or raw (the EMA, ≈ T(1 − β₂)·E[g̃²])",
                          choices=V_SYNC)

    def setup(self, model: AdaptedModel, info: SetupInfo) -> State:
        server = super().setup(model, info)
        self._shapes = {n: tuple(model.base_linear(n).weight.shape) for n in model.target_names}
        return server

    @property
    def r(self) -> int:
        return self.rank or self.info.rank

    def block_rank(self, name: str) -> int:
        return min(self.r, *self._shapes[name])

    def round_seed(self, rnd: int) -> int:
        """s_k, the integer seed of round ``rnd`` (broadcast; the server recomputes it to rebuild bases)."""
        return derive_seed(self.info.seed, "fedgalore-round", rnd)

    def sync_basis(self, msg, b: int, name: str) -> torch.Tensor:
        """``Q_sync: [d_p, r]`` of block ``b`` from a message/state: sent explicitly or rebuilt from its seed."""
        if f"{name}.galore_Q" in msg:
            return msg[f"{name}.galore_Q"]
        m, n = self._shapes[name]
        d_p = n if projection_side(m, n) == "right" else m
        return seeded_basis(int(msg[SYNC_SEED_KEY]), b, int(msg[SYNC_INDEX_KEY]), d_p, self.block_rank(name))

    # -- server → client -------------------------------------------------------------------------------
    def broadcast(self, server: State, client: int, rnd: int) -> Message:
        msg = super().broadcast(server, client, rnd)
        msg[SEED_KEY] = self.round_seed(rnd)
        if self.state_sync != "none":
            msg.update({k: v for k, v in server.items() if k.startswith("galore_sync") or ".galore_" in k})
        return msg

    def canonical_dims(self, name: str) -> tuple[int, int]:
        """``(d_u, d_p)`` of block ``name``'s canonical form."""
        m, n = self._shapes[name]
        return (m, n) if projection_side(m, n) == "right" else (n, m)

    def upload_spec(self, down: Message, rnd: int) -> Upload:
        """Weights as sent (with ``upload=segments`` only the head: the segments are :meth:`chosen_upload_spec`), the
        corrections' uploads, and with a state sync ``ṽ [d_u, r]`` per block and, when always-SVD, its final basis
        ``Q [d_p, r]`` (in the weight's dtype)."""
        specs = super().upload_spec(down, rnd)
        if self.upload == "segments":
            for n in self._shapes:
                del specs[f"{n}.weight"]
        if self.state_sync != "none":
            for n in self._shapes:
                (d_u, d_p), r, dtype = self.canonical_dims(n), self.block_rank(n), down[f"{n}.weight"].dtype
                specs[f"{n}.galore_v"] = TensorSpec((d_u, r), dtype)
                if self.svd_refreshes < 0:
                    specs[f"{n}.galore_Q"] = TensorSpec((d_p, r), dtype)
        return specs

    def chosen_upload_spec(self, down: Message, reply: Message) -> Upload:
        """With ``upload=segments``, per block and basis segment ``k`` of ``reply["galore_segments"]`` (at most one
        per local step): ``C [d_u, r]`` float32 and, for an SVD basis, ``Q [d_p, r]`` in the weight's dtype. The
        client's SVD refreshes are S capped by its last refresh index, as in :meth:`train`. Also checks the scalars
        the server step reads: ``galore_basis_index`` an integer >= -1 (with a state sync), ``galore_decay`` D_T in
        (0, 1] (with segments)."""
        index = reply.get(INDEX_KEY)
        if self.state_sync != "none" and (type(index) is not int or index < LOADED):
            raise ValueError(f"{INDEX_KEY} must be an integer >= {LOADED}, got {index!r}")
        if self.upload != "segments":
            return {}
        decay = reply.get(DECAY_KEY)
        if type(decay) not in (int, float) or not 0 < decay <= 1:
            raise ValueError(f"{DECAY_KEY} must be a number in (0, 1], got {decay!r}")
        segments = reply.get(SEGMENTS_KEY)
        if not isinstance(segments, list) or not all(type(j) is int and j >= LOADED for j in segments) \
                or len(segments) > MAX_SEGMENTS:
            raise ValueError(f"{SEGMENTS_KEY} must be a list of at most {MAX_SEGMENTS} basis indices >= {LOADED}")
        svd = self.svd_refreshes if self.svd_refreshes < 0 else min(self.svd_refreshes, max([0, *segments]))
        specs: Upload = {}
        for n in self._shapes:
            (d_u, d_p), r, dtype = self.canonical_dims(n), self.block_rank(n), down[f"{n}.weight"].dtype
            for k, j in enumerate(segments):
                specs[f"{n}.galore_seg{k}.C"] = TensorSpec((d_u, r), torch.float32)
                if j != LOADED and (svd < 0 or j < svd):
                    specs[f"{n}.galore_seg{k}.Q"] = TensorSpec((d_p, r), dtype)
        return specs

    def optimizer_requirement(self) -> tuple[tuple[str, ...], str]:
        """Adam or AdamW when ``state_sync`` synchronises Adam's second moment; any optimizer otherwise."""
        if self.state_sync == "none":
            return (), ""
        return ("adam", "adamw"), f"method.state_sync = {self.state_sync!r} synchronises Adam's second moment"

    # -- client ----------------------------------------------------------------------------------------
    def train(self, model, msg, state, trainer):
        self.load_global(model, msg)
        params = self.trainable(model)
        names = list(model.target_names)
        cfg = trainer.cfg
        steps = trainer.num_steps
        tau = self.tau or max(1, math.ceil(steps / 4))
        # at most (T−1)//τ SVD refreshes, so that the round ends in a seeded (rebuildable) basis: T > S·τ
        svd_refreshes = self.svd_refreshes if self.svd_refreshes < 0 else min(self.svd_refreshes, (steps - 1) // tau)
        built: list[GaLore] = []

        def factory(ps, lr):
            head_lr = cfg.lr_at(trainer.rnd, trainer.rounds, cfg.head_lr) if cfg.head_lr else lr
            common = dict(operator=cfg.optimizer, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
                          momentum=cfg.momentum)
            groups = [dict(params=[ps[f"{n}.weight"] for n in names], lr=lr, rank=self.r, tau=tau,
                           svd_refreshes=svd_refreshes, scale=self.scale, projector=self.projector,
                           seed=int(msg[SEED_KEY]), block_ids=list(range(len(names))),
                           v_reproject=self.v_reproject, moments_at_refresh=self.moments_at_refresh,
                           clamp_v=self.clamp_v,
                           warm_bias_correction=self.warm_bias_correction,
                           track_segments=self.upload == "segments")]
            head = [p for k, p in ps.items() if k.startswith("head/")]
            if head:
                groups.append(dict(params=head, lr=head_lr))
            opt = GaLore(groups, lr, **common)
            if self.state_sync != "none" and SYNC_INDEX_KEY in msg:
                for b, n in enumerate(names):
                    opt.load_block(ps[f"{n}.weight"], self.sync_basis(msg, b, n), msg[f"{n}.galore_v"],
                                   refresh_at_start=self.init_mode == "svd")
            built.append(opt)
            return opt

        result, extra, state = fit_with_corrections(self._corrections, model, msg, state, params, trainer, factory)
        opt = built[-1]
        if self.upload == "segments":
            reply = Message({k: p.detach().clone() for k, p in params.items() if k.startswith("head/")})
            reply.update(self.segment_payload(opt, params, names, svd_refreshes))
        else:
            reply = Message({k: p.detach().clone() for k, p in params.items()})
        reply.update(extra)
        if self.state_sync != "none":
            index = LOADED
            for n in names:
                st = opt.block_state(params[f"{n}.weight"])
                index = int(st["basis"])
                v = opt.second_moment(params[f"{n}.weight"]) if self.v_sync == "bias_corrected" else st["exp_avg_sq"]
                reply[f"{n}.galore_v"] = v.detach().clone()
                if self.svd_refreshes < 0:  # always-SVD (FedGaLore-SVD): the final basis must go up
                    reply[f"{n}.galore_Q"] = st["Q"].detach().clone()
            reply[INDEX_KEY] = index
        reply.update(num_examples=trainer.num_examples, train_loss=result.loss)
        return reply, state

    def segment_payload(self, opt: GaLore, params, names: list[str], svd_refreshes: int) -> Message:
        """The structured upload (the exact "rank-r factorized" update of §5): per block and basis segment k the
        coefficients ``<block>.galore_seg<k>.C: [d_u, r]`` and, for an SVD basis only,
        ``<block>.galore_seg<k>.Q: [d_p, r]``; ``galore_segments`` = the segments' refresh indices, ``galore_decay`` =
        D_T (same for every block)."""
        out = Message()
        for n in names:
            decay, segments = opt.block_segments(params[f"{n}.weight"])
            for k, seg in enumerate(segments):
                out[f"{n}.galore_seg{k}.C"] = seg["C"].to(torch.float32)
                if seg["basis"] != LOADED and (svd_refreshes < 0 or seg["basis"] < svd_refreshes):
                    out[f"{n}.galore_seg{k}.Q"] = seg["Q"].detach().clone()
            out[SEGMENTS_KEY], out[DECAY_KEY] = [int(seg["basis"]) for seg in segments], float(decay)
        return out

    def reconstruct(self, server: State, msg: Message, rnd: int) -> Message:
        """A segment reply with ``<block>.weight = D_T W̄ + uncanon(Σ_k C_k Q_kᵀ)`` added (bases rebuilt from
        the round seed, the sync basis, or sent)."""
        out = Message(msg)
        seed = self.round_seed(rnd)
        for b, (name, (m, n)) in enumerate(self._shapes.items()):
            W = float(msg[DECAY_KEY]) * server[f"{name}.weight"].to(torch.float64)
            side = projection_side(m, n)
            for k, index in enumerate(msg[SEGMENTS_KEY]):
                Q = self._basis(msg.get(f"{name}.galore_seg{k}.Q"), server, seed, b, name, index)
                W += canonical(msg[f"{name}.galore_seg{k}.C"].to(torch.float64) @ Q.to(torch.float64).T, side)
            out[f"{name}.weight"] = W.to(server[f"{name}.weight"].dtype)
        return out

    # -- server ----------------------------------------------------------------------------------------
    def aggregate(self, server, replies, rnd):
        if self.upload == "segments":
            replies = [Reply(r.client, r.num_examples, self.reconstruct(server, r.message, rnd)) for r in replies]
        new = super().aggregate(server, replies, rnd)
        if self.state_sync == "none":
            return new
        for key in [k for k in new if k.startswith("galore_sync") or ".galore_" in k]:
            del new[key]
        weights = self.client_weights(replies)
        seed = self.round_seed(rnd)
        indices = [int(r.message[INDEX_KEY]) for r in replies]
        shared = len(set(indices)) == 1 and self.svd_refreshes >= 0  # one seeded (or the loaded sync) basis
        joint_ranks = []
        for b, name in enumerate(self._shapes):
            r = self.block_rank(name)
            views = [rep.message[f"{name}.galore_v"].to(torch.float64) for rep in replies]
            if shared:
                est, jr = self.estimate(views, weights, r)
            else:
                bases = [self._basis(rep.message.get(f"{name}.galore_Q"), server, seed, b, name, idx).to(torch.float64)
                         for rep, idx in zip(replies, indices)]
                dense, jr = self.estimate([S @ Q.T for S, Q in zip(views, bases)], weights, r)
                _, _, Vh = torch.linalg.svd(dense, full_matrices=False)
                Q_sync = Vh[:r].T
                est = dense @ Q_sync
                new[f"{name}.galore_Q"] = Q_sync.to(torch.float32)
            new[f"{name}.galore_v"] = est.to(torch.float32)
            joint_ranks.append(jr)
        if shared and indices[0] == LOADED:
            new[SYNC_SEED_KEY], new[SYNC_INDEX_KEY] = server[SYNC_SEED_KEY], server[SYNC_INDEX_KEY]
            for name in self._shapes:
                if f"{name}.galore_Q" in server:
                    new[f"{name}.galore_Q"] = server[f"{name}.galore_Q"]
        else:
            new[SYNC_SEED_KEY], new[SYNC_INDEX_KEY] = seed, indices[0] if shared else LOADED
        if self.state_sync == "ajive":
            self.report(ajive_joint_rank_mean=sum(joint_ranks) / len(joint_ranks), ajive_joint_rank_min=min(joint_ranks))
        self.report(sync_compact_path=float(shared))
        return new

    def _basis(self, sent, server: State, seed: int, b: int, name: str, index: int) -> torch.Tensor:
        """A client's basis with refresh ``index`` in round seed ``seed``: ``sent`` if it was uploaded, else the
        server's sync basis (``LOADED``) or the seeded one."""
        if sent is not None:
            return sent
        if index == LOADED:
            return self.sync_basis(server, b, name)
        return self.sync_basis({SYNC_SEED_KEY: seed, SYNC_INDEX_KEY: index}, b, name)

    def estimate(self, views: list[torch.Tensor], weights: torch.Tensor, r: int) -> tuple[torch.Tensor, int]:
        """The synchronised state from the clients' views ``[N, d]`` (compact ``d = r`` or dense ``d = d_p``).

        Returns the estimate (float64) and the joint rank used (AJIVE's r_J' after the check; else the rank kept).
        """
        rank = min(self.sync_rank or r, r)
        if self.state_sync == "ajive":
            est, res = ajive_combine(views, weights, r, rank, restore_means=self.restore_means,
                                     identifiability=self.identifiability)
            return est, res.joint_rank
        avg = weighted_sum(views, weights)
        if self.state_sync == "avg":
            return avg, r
        U, S, Vh = torch.linalg.svd(avg, full_matrices=False)
        return (U[:, :rank] * S[:rank]) @ Vh[:rank], rank


@register
@dataclass
class FedGaLoreMinus(FedGaLore):
    """FedGaLore- (the paper's ablation): the same clients, FedAvg only, optimiser state reset every round."""

    name = "fedgalore-minus"
    description = "FedGaLore without state synchronisation (GaLore-AdamW clients, FedAvg of the weights)"
    uplink = "dense W [out,in] per target module (or its basis segments, upload=segments), head"
    downlink = "dense W̄ [out,in] per target module, head, round seed"
    needs_individual_replies = False
    server_entries = ()  # no synced state

    state_sync: str = with_default(FedGaLore, "state_sync", "none")

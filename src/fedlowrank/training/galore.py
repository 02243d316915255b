"""GaLore: local optimisation of dense weight matrices in a rotating rank-r gradient subspace (Peng et al.,
"Rethinking LoRA for Data Heterogeneous Federated Learning: Subspace and State Alignment", arXiv:2602.01746,
App. A).

For a block ``W: [m, n]`` (side by :func:`~fedlowrank.linalg.projectors.projection_side`, canonical gradient
``G_c: [d_u, d_p]``) with basis ``Q: [d_p, r]``, one step at local step t (FedGaLore App. A.1):

1. refresh when ``t mod τ = 0`` (not at t = 0 when the state was carried in): refresh index ``j = t // τ``,
   ``Q_new`` = SVD/rSVD basis of the gradient for ``j < S``, seeded random orthonormal for ``j ≥ S``
   (:func:`seeded_basis`); buffers are re-projected with ``C = Q_oldᵀ Q_new`` (App. A.1): ``m̃ ← m̃ C`` and
   ``ṽ ← ṽ (C⊙C)`` (``squared``, the default) or the paper's ``ṽ ← max(ṽ C, 0)`` (``linear``, clamp optional).
   The linear rule clamps many entries of ṽ to 0 while m̃ C stays finite, so ``|m̃|/√ṽ`` explodes (10⁴ in
   the tests) and training diverges; by Cauchy–Schwarz the squared rule keeps the ratio within √r of before.
   ``moments_at_refresh = "keep"`` leaves m̃ and ṽ as they are in the new basis (galore-torch's behaviour);
2. ``g̃ = G_c Q: [d_u, r]``; the operator (Appendix A) turns it into a direction ``ũ: [d_u, r]``:
   ``sgd`` (Alg. 2) ``ũ = g̃``; ``momentum`` (Alg. 3, heavy ball) ``b ← μ b + g̃, ũ = b``; ``adam``/``adamw``
   (Alg. 4 in its standard form, with the bias correction and weight decay its
   listing omits) ``m̃ ← β₁m̃ + (1−β₁)g̃``, ``ṽ ← β₂ṽ + (1−β₂)g̃²``,
   ``ũ = (m̃/c₁) / (sqrt(ṽ/c₂) + ε)`` with ``c₁ = 1−β₁ᵗ``, ``c₂ = 1−β₂ᵗ`` (``c₂ = 1`` when ṽ was warm-started,
   unless ``warm_bias_correction``: the paper leaves the correction of a warm ṽ open, and ``1−β₂ᵗ`` would make a
   warm buffer's first steps about 30× too small at t = 1);
3. ``W ← W − η α_g · uncanon(ũ Qᵀ)`` (α_g = GaLore ``scale``); weight decay is decoupled for ``adamw``
   (``W ← (1 − ηλ) W`` first, as ``torch.optim.AdamW``) and an L2 term added to the gradient otherwise.

Buffers are kept in canonical form ``[d_u, r]`` (the paper's ``[r, n]`` buffers of a left block, transposed).
A parameter group with ``rank=None`` is updated densely by the same operator (the head), so with ``Q = I``
and full rank every operator equals its ``torch.optim`` counterpart (SGD, SGD+momentum, Adam, AdamW).

The basis, its refresh index, the buffers and the warm flag are first-class state: :meth:`GaLore.load_block`
puts a synchronised ``(Q, ṽ)`` in before training, :meth:`GaLore.block_state` reads it back after and
:meth:`GaLore.second_moment` gives ṽ on the scale of E[g̃²] (``ṽ/(1 − β₂ᵗ)`` for a block that started at 0: the
raw EMA of t steps is only ``(1 − β₂ᵗ)·E[g̃²]``; a warm ṽ used with ``c₂ = 1`` must be on the scale of E[g̃²]).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from ..linalg.projectors import canonical, projection_side, random_basis, rsvd_basis, svd_basis
from ..schema import check_choice
from ..seeding import torch_generator

OPERATORS = ("sgd", "momentum", "adam", "adamw")
PROJECTORS = ("svd", "rsvd")
V_REPROJECT = ("linear", "squared")
MOMENTS_AT_REFRESH = ("reproject", "keep")
LOADED = -1  # refresh index of a basis put in by :meth:`GaLore.load_block` (no refresh since)


def seeded_basis(seed: int, block: int, index: int, dim: int, rank: int, dtype: torch.dtype = torch.float32
                 ) -> torch.Tensor:
    """The random orthonormal basis ``Q: [dim, rank]`` of block ``block`` at refresh ``index`` for round seed
    ``seed``; the server rebuilds a client's basis with the same call (stream ``"galore-basis"``)."""
    return random_basis(dim, rank, torch_generator(seed, "galore-basis", block, index), dtype)


class GaLore(torch.optim.Optimizer):
    """GaLore optimiser with the Appendix A operators. Group options (defaults in brackets):

    lr; operator [``adamw``]; betas [(0.9, 0.999)]; eps [1e-8]; weight_decay [0]; momentum μ [0.9];
    rank r [None = dense group, no projection]; tau τ [200]; svd_refreshes S [2] (data-driven bases for
    refresh indices ``j < S``, then seeded random; a negative S means always data-driven); scale α_g [1];
    projector [``svd``] or ``rsvd``; seed [0] (the round seed s_k); block_ids [0, 1, ...] (one per parameter,
    for the seeds); v_reproject [``squared``]; moments_at_refresh [``reproject``, or ``keep`` as galore-torch];
    clamp_v [True]; correct_bias [True]; warm_bias_correction [False];
    track_segments [False] (keep the per-basis sums of the steps for the structured upload,
    :meth:`block_segments`).
    """

    def __init__(self, params: Iterable, lr: float, **defaults: Any):
        base = dict(lr=lr, operator="adamw", betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, momentum=0.9,
                    rank=None, tau=200, svd_refreshes=2, scale=1.0, projector="svd", seed=0, block_ids=None,
                    v_reproject="squared", moments_at_refresh="reproject", clamp_v=True, correct_bias=True, warm_bias_correction=False,
                    track_segments=False)
        unknown = sorted(set(defaults) - set(base))
        if unknown:
            raise ValueError(f"galore: unknown option {unknown[0]!r}; allowed: {', '.join(sorted(base))}")
        base.update(defaults)
        super().__init__(params, base)
        for group in self.param_groups:
            check_choice("galore.operator", group["operator"], OPERATORS)
            check_choice("galore.projector", group["projector"], PROJECTORS)
            check_choice("galore.v_reproject", group["v_reproject"], V_REPROJECT)
            check_choice("galore.moments_at_refresh", group["moments_at_refresh"], MOMENTS_AT_REFRESH)
            if group["rank"] is not None and (int(group["rank"]) < 1 or int(group["tau"]) < 1):
                raise ValueError(f"galore.rank and galore.tau must be >= 1, got {group['rank']}, {group['tau']}")
            if group["rank"] is not None:
                for p in group["params"]:
                    if p.dim() != 2:
                        raise ValueError(f"galore: a projected parameter must be a matrix, got shape {tuple(p.shape)}")
            if group["block_ids"] is None:
                group["block_ids"] = list(range(len(group["params"])))

    # -- first-class state -------------------------------------------------------------------------------
    def _group_of(self, p: torch.Tensor) -> dict:
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return group
        raise KeyError("parameter not managed by this optimiser")

    def load_block(self, p: torch.Tensor, Q: torch.Tensor, exp_avg_sq: torch.Tensor, refresh_at_start: bool,
                   warm: bool = True) -> None:
        """Start block ``p`` from basis ``Q: [d_p, r]`` and second moment ``ṽ: [d_u, r]`` (canonical), m̃ = 0.

        ``refresh_at_start=False`` (``carry``) keeps ``Q`` until the refresh at t = τ; ``True`` (``svd`` init)
        re-projects ``ṽ`` into the basis built at t = 0 (and clamps after that re-projection).
        Negative entries are clamped when ``clamp_v``.
        """
        group = self._group_of(p)
        v = exp_avg_sq.to(device=p.device, dtype=p.dtype, copy=True)
        if group["clamp_v"] and not refresh_at_start:
            v.clamp_(min=0)
        self.state[p] = {"step": 0, "Q": Q.to(device=p.device, dtype=p.dtype, copy=True), "basis": LOADED, "exp_avg": torch.zeros_like(v),
                         "exp_avg_sq": v, "warm": warm, "skip_first_refresh": not refresh_at_start,
                         "clamped": 0, "reprojected": 0}

    def block_state(self, p: torch.Tensor) -> dict[str, Any]:
        """``{"Q", "basis" (refresh index j of Q; -1 = loaded), "exp_avg", "exp_avg_sq", "warm", "step",
        "clamped", "reprojected"}`` of block ``p`` (empty before its first step)."""
        return dict(self.state.get(p, {}))

    def second_moment(self, p: torch.Tensor) -> torch.Tensor:
        """ṽ of block ``p`` on the scale of E[g̃²]: ``ṽ / (1 − β₂ᵗ)`` after t steps from ṽ = 0 (the EMA's weights
        sum to 1 − β₂ᵗ), ṽ itself for a warm-started block (its loaded ṽ already carries weight 1). ``[d_u, r]``"""
        st = self.state[p]
        v = st["exp_avg_sq"]
        if st.get("warm", False) or st["step"] == 0:
            return v.clone()
        beta2 = self._group_of(p)["betas"][1]
        return v / (1 - beta2 ** st["step"])

    # -- the step ------------------------------------------------------------------------------------------
    def _new_basis(self, group: dict, block: int, G: torch.Tensor, j: int, rank: int, side: str) -> torch.Tensor:
        S = int(group["svd_refreshes"])
        dim = G.shape[1] if side == "right" else G.shape[0]
        if S < 0 or j < S:
            if group["projector"] == "rsvd":
                return rsvd_basis(G, rank, side, torch_generator(group["seed"], "galore-rsvd", block, j))
            return svd_basis(G, rank, side)
        return seeded_basis(group["seed"], block, j, dim, rank, G.dtype).to(G.device)

    def _refresh(self, group: dict, block: int, p: torch.Tensor, G: torch.Tensor, st: dict) -> None:
        t, tau = st["step"], int(group["tau"])
        if t % tau or (t == 0 and st.get("skip_first_refresh", False)):
            return
        side = projection_side(*p.shape)
        rank = min(int(group["rank"]), min(p.shape))
        j = t // tau
        Q_new = self._new_basis(group, block, G, j, rank, side)
        Q_old = st.get("Q")
        if Q_old is not None and group["moments_at_refresh"] == "reproject":
            C = Q_old.T @ Q_new
            for key in ("exp_avg", "momentum_buffer"):
                if key in st:
                    st[key] = st[key] @ C
            if "exp_avg_sq" in st:
                v = st["exp_avg_sq"] @ (C * C if group["v_reproject"] == "squared" else C)
                st["clamped"] = st.get("clamped", 0) + int((v < 0).sum())
                st["reprojected"] = st.get("reprojected", 0) + v.numel()
                st["exp_avg_sq"] = v.clamp_(min=0) if group["clamp_v"] else v
        st["Q"], st["basis"] = Q_new, j

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            op, lr, wd, galore = group["operator"], group["lr"], group["weight_decay"], group["rank"] is not None
            for p, block in zip(group["params"], group["block_ids"]):
                if p.grad is None:
                    continue
                G = p.grad
                st = self.state[p]
                st.setdefault("step", 0)
                if wd and op != "adamw":
                    G = G.add(p, alpha=wd)
                if galore:
                    self._refresh(group, block, p, p.grad, st)
                    side = projection_side(*p.shape)
                    g = canonical(G, side) @ st["Q"]
                else:
                    g = G
                st["step"] += 1
                d = self._direction(group, st, g)
                decay = 1 - lr * wd if op == "adamw" and wd else 1.0
                if galore:
                    if group["track_segments"]:
                        self._track(st, decay, d, -lr * group["scale"])
                    d = canonical(d @ st["Q"].T, side).mul_(group["scale"])
                if decay != 1.0:
                    p.mul_(decay)
                p.add_(d, alpha=-lr)
        return loss

    @staticmethod
    def _track(st: dict, decay: float, d: torch.Tensor, coef: float) -> None:
        """Accumulate the step in its segment: ``W_T = D_T W_0 + uncanon(Σ_seg C_seg Q_segᵀ)`` (the exact form
        of the paper's "rank-r factorized" upload, §5: decoupled decay adds ``D_T W_0``), with ``D_T = Π(1 − ηλ)``;
        ``C'`` is kept divided by the running decay, in float64."""
        st["decay"] = st.get("decay", 1.0) * decay
        segments = st.setdefault("segments", [])
        if not segments or segments[-1]["basis"] != st["basis"] or segments[-1]["Q"] is not st["Q"]:
            segments.append({"basis": st["basis"], "Q": st["Q"], "C": torch.zeros(d.shape, dtype=torch.float64, device=d.device)})
        segments[-1]["C"].add_(d.to(torch.float64), alpha=coef / st["decay"])

    def block_segments(self, p: torch.Tensor) -> tuple[float, list[dict[str, Any]]]:
        """``(D_T, [{"basis": j, "Q": [d_p, r], "C": [d_u, r] float64}, ...])`` with
        ``W_T = D_T W_0 + uncanon(Σ C Qᵀ)`` for a group with ``track_segments`` (W_0 = the weight before step 1)."""
        st = self.state[p]
        D = st.get("decay", 1.0)
        return D, [{"basis": s["basis"], "Q": s["Q"], "C": D * s["C"]} for s in st.get("segments", [])]

    @staticmethod
    def _direction(group: dict, st: dict, g: torch.Tensor) -> torch.Tensor:
        """The operator's direction ``ũ`` for projected (or dense) gradient ``g`` (updates the buffers)."""
        op = group["operator"]
        if op == "sgd":
            return g
        if op == "momentum":
            buf = st.get("momentum_buffer")
            st["momentum_buffer"] = g.clone() if buf is None else buf.mul_(group["momentum"]).add_(g)
            return st["momentum_buffer"]
        beta1, beta2 = group["betas"]
        if "exp_avg" not in st:
            st["exp_avg"], st["exp_avg_sq"], st["warm"] = torch.zeros_like(g), torch.zeros_like(g), False
        m, v, t = st["exp_avg"], st["exp_avg_sq"], st["step"]
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        c1, c2 = 1.0, 1.0
        if group["correct_bias"]:
            c1 = 1 - beta1 ** t
            if not st.get("warm", False) or group["warm_bias_correction"]:
                c2 = 1 - beta2 ** t
        denom = (v.sqrt() / math.sqrt(c2)).add_(group["eps"])
        return (m / c1) / denom


__all__ = ["GaLore", "seeded_basis", "LOADED", "OPERATORS", "PROJECTORS", "V_REPROJECT", "MOMENTS_AT_REFRESH"]

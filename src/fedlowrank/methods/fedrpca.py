"""FedRPCA (Jhunjhunwala et al., "FedRPCA: Enhancing Federated LoRA Aggregation Using Robust PCA",
arXiv:2506.01194).

Clients train LoRA A, B and the head exactly as in FedIT (any ``correction``: FedProx / SCAFFOLD compose on the
client, paper Fig. 5). The server, for each LoRA matrix separately (A and B of every module), stacks the K
participating clients' updates ``Δᵢ = Xᵢ − X^t`` as the columns of ``M_X: [numel, K]`` (Eqs. 7–8), splits
it by Robust PCA into ``L + S`` (Eq. 9; :func:`fedlowrank.linalg.rpca.robust_pca`, paper defaults; ``rpca_solver``
picks the paper's ADMM or a faster one with the same optimum, ``rpca_device`` where it runs) and updates
(Eqs. 10–11)::

    X^{t+1} = X^t + L·p + β·S·p          p = client weights (uniform 1/K in the paper: server.weighting)

With ``M = L + S + R`` (R the ADMM residual) this is ``FedAvg + (β − 1)·S·p − R·p``, which is how it is computed, so
that β = 1 with ``fold_residual`` (``L ← M − S``) is FedAvg bit for bit. β is adaptive by default (§4, App. B.3):
``E = ‖S·p‖/‖M·p‖`` per matrix and ``β = 1/Ē`` with Ē the mean E over a scope: ``beta_scope = "per_factor"`` (default;
App. B.3's ``β_A = 1/E_A``, ``β_B = 1/E_B``, E averaged across all layers as in Fig. 7), ``"per_matrix"`` (each matrix
its own β) or ``"global"`` (one β); β = 1 when ``‖S·p‖ ≤ 1e-12·‖M·p‖`` (S = 0) or ``M·p = 0``. One client, identical
client updates and an all-zero matrix are all common knowledge (``L = M``, ``S = 0``): the FedAvg update. The head is
averaged (``head_agg = "fedavg"``) or decomposed as its own matrices (``"rpca"``). Control variates of SCAFFOLD are
averaged plainly.

Diagnostics (``report``), per round: means over matrices of ADMM iterations, relative residual, rank(L),
non-zero fraction of S, E, β (also split A/B), and the mean pairwise cosine similarity of the clients'
columns of M, L and S (paper Figs. 1, 4); per matrix under ``rpca/<matrix>/<stat>`` when ``per_matrix_metrics``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from ..device import check_device_spec, resolve_device
from ..linalg.rpca import SOLVERS, RPCAResult, robust_pca
from ..message import State
from ..schema import setting
from . import register
from .base import weighted_sum
from .fedit import FedIT

GRANULARITIES = ("per_matrix", "per_module_concat", "global")
BETA_SCOPES = ("per_factor", "per_matrix", "global")
HEAD_AGGS = ("fedavg", "rpca")
EPS = 1e-12          # ‖S·p‖ ≤ EPS·‖M·p‖ counts as S = 0 for the adaptive β (β = 1/E would blow up)


def mean_pairwise_cosine(rows: torch.Tensor) -> torch.Tensor:
    """Mean off-diagonal cosine similarity between the rows of each matrix ``[B, K, n] → [B]`` (zero rows: 0)."""
    K = rows.shape[1]
    unit = rows / torch.linalg.vector_norm(rows, dim=2, keepdim=True).clamp(min=torch.finfo(rows.dtype).tiny)
    cos = unit @ unit.mT
    return (cos.sum((1, 2)) - cos.diagonal(dim1=1, dim2=2).sum(1)) / (K * (K - 1))


@register
@dataclass
class FedRPCA(FedIT):
    """FedRPCA's server (module docstring). The default ``rpca_solver = "adaptive"`` reaches the paper's PCP
    optimum nearer at the same ``rpca_tol`` in about half the time (:func:`fedlowrank.linalg.rpca.robust_pca`);
    ``rpca_solver = "admm"`` runs the paper's Algorithm 2 itself (its iterates, iteration counts and cap), which
    the reproduction scripts pin.
    """

    name = "fedrpca"
    description = "FedIT clients; server splits each LoRA matrix's client updates by Robust PCA, L·p + β·S·p"
    paper = "Jhunjhunwala et al., FedRPCA: Enhancing Federated LoRA Aggregation Using Robust PCA (2025)"
    uplink = "A [r,in] and B [out,r] per target module, head"
    downlink = "A, B per target module, head"
    needs_individual_replies = True
    preset = {"server.weighting": "uniform", "train.weight_decay": 0.1}  # eqs. 4, 10, 11: 1/M; Table 5: wd 0.1
    lr_grid = (1e-4, 3e-4, 1e-3)  # Table 5 uses 1e-4 and 1e-3

    beta: float | str = setting("adaptive", "β on the sparse part: adaptive (β = 1/E each round) or a fixed β (paper "
                                "grid 2, 3, 4; 1 = FedAvg)", gt=0, choices=("adaptive",))
    beta_scope: str = setting("per_factor", "what one adaptive β covers: per_factor (β_A = 1/mean E over the A "
                              "matrices, β_B likewise; App. B.3), per_matrix (one per RPCA call) or global",
                              choices=BETA_SCOPES)
    beta_min: float = setting(0.0, "clip the adaptive β from below (0 = no bound)", ge=0)
    beta_max: float = setting(0.0, "clip the adaptive β from above (0 = no bound; else >= method.beta_min)", ge=0)
    granularity: str = setting("per_matrix", "what one RPCA call decomposes: each LoRA matrix, each module with "
                               "vec(ΔA) stacked over vec(ΔB) (per_module_concat), or all LoRA parameters at once",
                               choices=GRANULARITIES)
    head_agg: str = setting("fedavg", "the head by FedAvg, or by RPCA (each head tensor its own matrix)",
                            choices=HEAD_AGGS)
    fold_residual: bool = setting(False, "use L ← M − S so that L·p + S·p is FedAvg exactly (false = the paper)")
    rpca_tol: float = setting(1e-7, "ADMM stopping tolerance (the paper's 1e-7; adaptive: on the primal and the "
                              "dual residual)", gt=0)
    rpca_max_iter: int = setting(1000, "ADMM iteration cap (the paper's 1000)", ge=1)
    rpca_solver: str = setting("adaptive", "adaptive (over-relaxed ADMM, residual-balanced penalty, float32 "
                               "warm-up: the paper's optimum, nearer, in about half the time) or admm (the paper's "
                               "Algorithm 2, its iterates and stopping rule exactly)", choices=SOLVERS)
    rpca_device: str = setting("cpu", "where RPCA runs (the decomposition comes back to the CPU): cpu (the server "
                               "state lives there), auto (CUDA when available), cuda or cuda:N",
                               check=check_device_spec, form="one of auto, cpu, cuda, cuda:N")
    per_matrix_metrics: bool = setting(True, "also report every matrix's diagnostics")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta_max and self.beta_max < self.beta_min:
            raise ValueError(f"method.beta_max = {self.beta_max} is below method.beta_min = {self.beta_min}; give "
                             "beta_max >= beta_min, or 0 (no upper bound)")

    # -- server side -------------------------------------------------------------------------------------
    def rpca_groups(self, lora_keys: list[str], head_keys: list[str]) -> dict[str, list[str]]:
        """The matrices RPCA decomposes: ``{matrix name: [server keys whose flattened updates it stacks]}``.

        LoRA keys are grouped by ``granularity``; each head tensor (``head_agg = "rpca"``) is its own matrix.
        """
        groups: dict[str, list[str]] = defaultdict(list)
        for k in lora_keys:
            name = {"global": "global", "per_module_concat": k.rsplit(".lora_", 1)[0]}.get(self.granularity, k)
            groups[name].append(k)
        groups.update({k: [k] for k in head_keys})
        return dict(groups)

    def aggregate(self, server, replies, rnd):
        server = State(server)
        p = self.client_weights(replies)
        heads = self.head_keys(server)
        groups = self.rpca_groups(self.lora_keys(server), heads if self.head_agg == "rpca" else [])
        # D[g]: [K, numel] float64, row i = client i's flattened update (the paper's M_X is Dᵀ)
        D = {g: torch.cat([torch.stack([r.message[k].to(torch.float64).flatten() for r in replies])
                           - server[k].to(torch.float64).flatten() for k in ks], dim=1)
             for g, ks in groups.items()}
        corr, stats, seconds = self.corrections(D, p)
        for g, ks in groups.items():
            offset = 0
            for k in ks:
                n = server[k].numel()
                avg = weighted_sum((r.message[k] for r in replies), p)      # FedAvg, as FedIT computes it
                new = avg.to(torch.float64) + corr[g][offset:offset + n].view(server[k].shape)
                server[k] = self.server_step(server[k], new.to(server[k].dtype))
                offset += n
        if self.head_agg == "fedavg":
            self.average_into(server, replies, heads, p)
        self.aggregate_corrections(server, replies)
        self.report_stats(stats, seconds)
        return server

    def corrections(self, D: dict[str, torch.Tensor], p: torch.Tensor
                    ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, float]], float]:
        """FedRPCA's change to the FedAvg update of each matrix, ``(β − 1)·S·p − R·p`` ``[numel]``, the
        per-matrix stats and the seconds spent in RPCA.

        ``D[g]: [K, numel]`` are the client updates of matrix ``g``. Same-shape matrices go to RPCA as one batch.
        """
        K = len(p)
        corr = {g: torch.zeros(d.shape[1], dtype=torch.float64) for g, d in D.items()}
        if K < 2:                                                 # one client: FedAvg, nothing to split
            return corr, {}, 0.0
        by_shape: dict[tuple[int, ...], list[str]] = defaultdict(list)
        for g, d in D.items():
            by_shape[tuple(d.shape)].append(g)
        t0 = time.perf_counter()
        parts: dict[str, tuple[torch.Tensor, torch.Tensor, dict[str, float]]] = {}
        for names in by_shape.values():
            M = torch.stack([D[g] for g in names])                # [B, K, numel]; RPCA(Mᵀ) = RPCA(M)ᵀ
            res = self.decompose(M)
            S = res.S
            R = torch.zeros_like(M) if self.fold_residual else M - res.L - S
            Mp, Sp, Rp = (torch.einsum("bkn,k->bn", X, p) for X in (M, S, R))
            nM, nS = torch.linalg.vector_norm(Mp, dim=1), torch.linalg.vector_norm(Sp, dim=1)
            E = torch.where(nM > 0, nS / nM, 0.0)                              # 0 where M·p = 0
            cos = [mean_pairwise_cosine(X) for X in (M, res.L, S)]
            for i, g in enumerate(names):
                parts[g] = (Sp[i], Rp[i], {
                    "iterations": float(res.iterations[i]), "residual": float(res.residual[i]),
                    "converged": float(res.converged[i]), "rank_L": float(res.rank[i]),
                    "nnz_S": float((S[i] != 0).double().mean()), "E": float(E[i]),
                    "cos_M": float(cos[0][i]), "cos_L": float(cos[1][i]), "cos_S": float(cos[2][i])})
        seconds = time.perf_counter() - t0
        betas = self.betas({g: s["E"] for g, (_, _, s) in parts.items()})
        stats = {}
        for g, (Sp, Rp, s) in parts.items():
            corr[g] = (betas[g] - 1.0) * Sp - Rp
            stats[g] = {**s, "beta": betas[g]}
        return corr, stats, seconds

    def decompose(self, M: torch.Tensor) -> RPCAResult:
        """Robust PCA of every matrix of ``M: [B, K, n]`` (rows = clients).

        A matrix whose K rows are identical (all clients sent the same update, or none changed it) is the
        one-client case repeated: all common knowledge, ``L = M``, ``S = 0``, so FedRPCA gives FedAvg there.
        (The PCP optimum of ``c·1ᵀ`` itself has ``S ≠ 0`` where ``|c_j| > λ√K·‖c‖``.)
        """
        same = (M == M[:, :1]).flatten(1).all(1)
        out = RPCAResult(L=M.clone(), S=torch.zeros_like(M), iterations=torch.zeros(len(M), dtype=torch.int64),
                         residual=torch.zeros(len(M), dtype=M.dtype), rank=(M != 0).flatten(1).any(1).long(),
                         converged=torch.ones(len(M), dtype=torch.bool))
        idx = torch.nonzero(~same).flatten()
        if idx.numel():
            device = resolve_device(self.rpca_device, "method.rpca_device")
            res = robust_pca(M[idx].to(device), tol=self.rpca_tol, max_iter=self.rpca_max_iter,
                             solver=self.rpca_solver)
            for name in ("L", "S", "iterations", "residual", "rank", "converged"):
                getattr(out, name)[idx] = getattr(res, name).cpu()
        return out

    def beta_group(self, matrix: str) -> str:
        """The matrices sharing one adaptive β: the matrix itself, its factor type (``A``, ``B``; a stacked
        module or ``global`` is ``AB``; a head tensor stays its own) or all of them (``beta_scope``)."""
        if self.beta_scope == "per_matrix" or (self.beta_scope == "per_factor" and matrix.startswith("head/")):
            return matrix
        if self.beta_scope == "global":
            return "all"
        return matrix[-1] if matrix.endswith((".lora_A", ".lora_B")) else "AB"

    def betas(self, E: dict[str, float]) -> dict[str, float]:
        """β of every matrix from the ``E = ‖S·p‖/‖M·p‖`` of the matrices (0 when ``M·p = 0``): fixed, or
        adaptive ``1/Ē`` with Ē the mean of the ``E > 0`` in its :meth:`beta_group`.

        Adaptive: β = 1 where ``Ē ≤ 1e-12`` (S = 0 or M·p = 0: β = 1/Ē is undefined), then the optional
        clip.
        """
        if not isinstance(self.beta, str):
            return {g: float(self.beta) for g in E}
        groups: dict[str, list[float]] = defaultdict(list)
        for g, e in E.items():
            if e > 0:
                groups[self.beta_group(g)].append(e)
        mean = {k: sum(v) / len(v) for k, v in groups.items()}
        out = {}
        for g in E:
            e = mean.get(self.beta_group(g), 0.0)
            out[g] = self.clip(1.0 / e) if e > EPS else 1.0
        return out

    def clip(self, beta: float) -> float:
        if self.beta_max > 0:
            beta = min(beta, self.beta_max)
        return max(beta, self.beta_min)

    def report_stats(self, stats: dict[str, dict[str, float]], seconds: float) -> None:
        """Round means over matrices (``rpca/<stat>_mean``, A/B split for E and β), per-matrix values optional."""
        if not stats:
            return
        out = {"rpca/seconds": seconds}
        names = list(stats)
        for stat in ("iterations", "residual", "rank_L", "nnz_S", "E", "beta", "cos_M", "cos_L", "cos_S"):
            values = [stats[g][stat] for g in names]
            out[f"rpca/{stat}_mean"] = sum(values) / len(values)
        out["rpca/iterations_max"] = max(stats[g]["iterations"] for g in names)
        out["rpca/residual_max"] = max(stats[g]["residual"] for g in names)
        out["rpca/not_converged"] = float(sum(1 for g in names if not stats[g]["converged"]))
        for factor in ("A", "B"):
            sub = [g for g in names if g.endswith(f".lora_{factor}")]
            for stat in ("E", "beta"):
                if sub:
                    out[f"rpca/{stat}_{factor}_mean"] = sum(stats[g][stat] for g in sub) / len(sub)
        if self.per_matrix_metrics:
            for g in names:
                out.update({f"rpca/{g}/{stat}": v for stat, v in stats[g].items()})
        self.report(**out)

"""FLoRG (Meng, Tang and Wong, "FLoRG: Federated fine-tuning with low-rank Gram matrices and Procrustes
alignment", arXiv:2602.17095).

Per target linear ``[out, in]``, ``k = min(in, out)``: ``ΔW = s · L AᵀA R`` (eq. 1) with one trainable
``A: [r, k]`` and frozen seeded bases ``L: [out, k]``, ``R: [k, in]`` (:mod:`fedlowrank.adapters.gram`).
Round t:

* down: ``Aᵗ`` per layer and the head; clients train ``A`` and the head locally (autograd gives eq. 2);
* up: ``Aₙ`` per layer (r×k — half of FedIT's ``r(in+out)`` on square layers) and the head;
* server, per layer (:func:`fedlowrank.linalg.gram.aggregate_gram`): ``Q = Σ pₙ AₙᵀAₙ`` (eq. 4, exact),
  canonical factor ``Ã`` with ``ÃᵀÃ = Q`` (eqs. 6–7), Procrustes ``S* = UVᵀ`` from ``Aᵗ Ãᵀ = UΣVᵀ``
  (Theorem 1, eq. 11), ``Aᵗ⁺¹ = S* Ã``; the head is averaged as in FedIT.

Choices where the paper is silent or inconsistent
(docs/methods/florg.md, "Choices for the paper's open points"):

* Procrustes shape: ``S*`` is the thin-SVD ``UVᵀ`` (r×r'). For r' > r (the generic case) it has orthonormal
  rows and acts as a rank-r truncation (Gram(Aᵗ⁺¹) is the Nyström approximation of Q, not Q); the Gram matrix
  is preserved only when r' ≤ r.
* Scaling: ``s`` follows ``lora.alpha``/``lora.scaling`` like every LoRA method (α/r by default).
* Initial factor: ``A¹`` is Gaussian with ``s·σ²·k = init_perturbation`` (default 1e-2), not zero (A = 0 never
  trains); ``compensate_init`` subtracts ``s L A¹ᵀA¹ R`` so that the initial model is the pretrained one.
* Optimizer: the run's ``train.optimizer`` (AdamW in the paper), fresh every round.
* Head and weights: the head is shared and averaged; weights pₙ follow ``server.weighting`` (the preset is the
  paper's uniform 1/N).
* Without Procrustes: ``procrustes = false`` with ``truncate = false`` is the paper's ablation (Table 3,
  ``Aᵗ⁺¹ := Ãᵗ⁺¹``): the factor keeps all r' rows, so the rank and the communication grow each round (up to
  min(k, N·r)); registered as ``florg-no-procrustes``. With ``truncate = true`` it keeps the top-r rows of the
  canonical factor (eigenvalues descending), registered as ``florg-top-rows``.
* ``server.lr`` β < 1 blends the Gram matrices, ``Q = (1−β) AᵗᵀAᵗ + β Σ pₙ AₙᵀAₙ`` (still PSD); β > 1 is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..adapters.gram import A_INITS, BASES_INITS, GramLinear, gram_bases, gram_modules, init_gram_A
from ..adapters.lora import lora_scale
from ..adapters.model import AdaptedModel
from ..linalg.gram import GRAM_DECOMPOSITIONS, aggregate_gram, canonical_rows, gram_distance, stack_gram_factors
from ..message import Message, State
from ..schema import setting, with_default
from ..seeding import torch_generator
from . import register
from .base import Corrected, SetupInfo, Upload, head_tensors, load_head, specs_of, weighted_sum


@register
@dataclass
class FLoRG(Corrected):
    """FLoRG (module docstring). The three ``server_decomp`` give the same factor: ``stacked_svd`` in O(k(Nr)²),
    ``eigh`` in O(k³), ``closed_form`` ``(AQAᵀ)^{-1/2}AQ`` in O(Nr²k). ``correction`` applies FedProx / SCAFFOLD to
    A and the head, as in the LoRA methods.
    """

    name = "florg"
    description = "one trainable A per layer, ΔW = s·L AᵀA R; Gram-matrix aggregation + Procrustes alignment"
    paper = "Meng, Tang and Wong, FLoRG: Federated fine-tuning with low-rank Gram matrices and Procrustes alignment"
    uplink = "A [r,k] per target module (k = min(in,out)), head"
    downlink = "A [r,k] per target module, head (L, R come from the shared seed)"
    needs_individual_replies = True
    supports_heterogeneous_ranks = False
    max_server_lr = 1.0
    server_lr_refusal = "Q must stay positive semi-definite"
    preset = {"server.weighting": "uniform"}  # eq. 4: 1/N
    lr_grid = (1e-3, 3e-3, 1e-2)  # benchmarks/protocols.py's CPU grid (paper: {5e-4, 1e-4, 5e-5, 1e-5}, LLMs)

    procrustes: bool = setting(True, "align the new factor to the previous one (Theorem 1); false = no alignment "
                               "(with method.truncate = false too: the paper's Table 3 ablation)")
    truncate: bool = setting(True, "without Procrustes: keep only the top-r rows of Ã (true) or all r' of them "
                             "(false); ignored with Procrustes")
    server_decomp: str = setting("stacked_svd", "how the server factors Q: SVD of the stacked [Nr, k] factors, the "
                                 "paper's k×k eigendecomposition (eigh), or closed_form (needs method.procrustes)",
                                 choices=GRAM_DECOMPOSITIONS)
    bases_init: str = setting("semi_orthogonal", "initialisation of the frozen bases L, R (svd: of W0)",
                              choices=BASES_INITS)
    a_init: str = setting("gaussian", "initialisation of the trainable factor A¹", choices=A_INITS)
    init_perturbation: float = setting(1e-2, "s·σ²·k of the Gaussian A¹ (A = 0 would never train)", gt=0)
    compensate_init: bool = setting(False, "start from the pretrained model: ΔW = s L(AᵀA − A¹ᵀA¹)R")
    eig_tol: float = setting(1e-10, "relative threshold on the eigenvalues of Q: r' = the number above "
                             "eig_tol·λ_max", gt=0, lt=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.server_decomp == "closed_form" and not self.procrustes:
            raise ValueError("method.server_decomp = 'closed_form' needs method.procrustes = true; "
                             "allowed without Procrustes: 'eigh', 'stacked_svd'")
        if self.growing_rank and self.correction != "none":
            raise ValueError("method.correction: the factor's rank changes every round without Procrustes and "
                             "truncation, so the control variates cannot follow; allowed: 'none'")

    # -- set-up ----------------------------------------------------------------------------------------
    def setup(self, model: AdaptedModel, info: SetupInfo) -> State:
        """Attach a :class:`GramLinear` to every target (bases and A¹ from per-layer seeded streams)."""
        self.info = info
        scale = lora_scale(info.alpha, info.rank, info.scaling)
        index = {name: i for i, name in enumerate(model.target_names)}
        inits: dict[str, torch.Tensor] = {}

        def make(name: str, lin: nn.Linear) -> GramLinear:
            i = index[name]
            L, R = gram_bases(lin.weight, self.bases_init, torch_generator(info.seed, "florg-bases", i))
            k = L.shape[1]
            inits[name] = init_gram_A(info.rank, k, scale, self.a_init, self.init_perturbation,
                                      torch_generator(info.seed, "florg-A", i), lin.weight.dtype)
            return GramLinear(lin, L, R, info.rank, scale, info.dropout,
                              A_ref=inits[name] if self.compensate_init else None)

        model.attach(make)
        server = State({f"{name}.gram_A": A for name, A in inits.items()})
        server.update(head_tensors(model))
        shapes = {k: tuple(v.shape) for k, v in server.items()}
        for c in self._corrections:
            c.init_server(server, shapes)
        return server

    @property
    def growing_rank(self) -> bool:
        """True for the paper's "w/o Procrustes" ablation: the global factor has r' = rank(Q) rows."""
        return not self.procrustes and not self.truncate

    def model_keys(self, server: State) -> list[str]:
        """Keys of the global model in the server state: ``"<module>.gram_A"`` and ``"head/<param>"``."""
        return [k for k in server if (k.endswith(".gram_A") and "/" not in k) or k.startswith("head/")]

    # -- client side -----------------------------------------------------------------------------------
    def load_global(self, model: AdaptedModel, server) -> None:
        for name, mod in gram_modules(model).items():
            mod.set_A(server[f"{name}.gram_A"], any_rows=self.growing_rank)
        load_head(model, server)

    def trainable(self, model: AdaptedModel) -> dict[str, nn.Parameter]:
        params: dict[str, nn.Parameter] = {f"{n}.gram_A": m.gram_A for n, m in gram_modules(model).items()}
        params.update({f"head/{n}": p for n, p in model.head_parameters().items()})
        return params

    def broadcast(self, server: State, client: int, rnd: int) -> Message:
        return self.correction_broadcast(server, Message({k: server[k] for k in self.model_keys(server)}))

    def upload_spec(self, down: Message, rnd: int) -> Upload:
        """The trained ``gram_A`` and head as sent, and the corrections' uploads."""
        return self.with_corrections(down, specs_of(down, self.model_keys(down)))

    def prepare_fit(self, model, msg, state, trainer):
        """One fit of ``gram_A`` and the head (routed per client in a cohort, like LoRA's factors)."""
        self.load_global(model, msg)
        return self.corrected_fit(model, msg, state, self.trainable(model))

    # -- server side -----------------------------------------------------------------------------------
    def aggregate(self, server, replies, rnd):
        """Per layer: Gram sum, decomposition, Procrustes (eqs. 4–11); head: weighted average."""
        new = State(server)
        p = self.client_weights(replies)
        weights = p.tolist()
        beta = self.info.server_lr
        drift2, trunc, ranks = 0.0, [], []
        for key in self.model_keys(server):
            if key.startswith("head/"):
                new[key] = self.server_step(server[key], weighted_sum((r.message[key] for r in replies), p))
                continue
            A_prev = server[key]
            As = [r.message[key] for r in replies]
            w = [beta * x for x in weights]
            if beta < 1:
                As, w = As + [A_prev], w + [1.0 - beta]
            A_next, r_prime = aggregate_gram(A_prev, As, w, self.server_decomp, self.procrustes, self.eig_tol,
                                             self.truncate)
            new[key] = A_next.to(A_prev.dtype)
            rows = max(A_next.shape[0], A_prev.shape[0])          # zero-padded when the rank grew (r' ≠ r)
            drift2 += float((canonical_rows(A_next, rows) - canonical_rows(A_prev, rows)).square().sum())
            M = stack_gram_factors(As, w)                      # MᵀM = Q, for the diagnostics
            trunc.append(gram_distance(A_next, M) / max(gram_distance(M, A_prev), 1e-300))
            if r_prime is not None:
                ranks.append(r_prime)
        for c in self._corrections:
            c.aggregate(new, replies, self.info.num_clients)
        metrics = {"florg_drift": drift2**0.5, "florg_trunc_err": sum(trunc) / len(trunc)}
        if ranks:
            metrics["florg_rank"] = sum(ranks) / len(ranks)
        self.report(**metrics)
        return new



@register
@dataclass
class FLoRGNoProcrustes(FLoRG):
    """The paper's ablation (Table 3): ``Aᵗ⁺¹ := Ãᵗ⁺¹`` with all its r' rows (no alignment, no truncation)."""

    name = "florg-no-procrustes"
    description = "FLoRG without Procrustes (paper's Table 3): the canonical factor with all r' = rank(Q) rows"
    uplink = "A [r',k] per target module (r' = rank of the last aggregated Gram matrix, up to min(k, N·r)), head"
    downlink = "A [r',k] per target module, head"

    procrustes: bool = with_default(FLoRG, "procrustes", False)
    truncate: bool = with_default(FLoRG, "truncate", False)


@register
@dataclass
class FLoRGTopRows(FLoRG):
    """Without Procrustes, truncated: the top-r rows of the canonical factor (the ablation read as keeping rank r)."""

    name = "florg-top-rows"
    description = "FLoRG without Procrustes, truncated to the top-r rows of the canonical factor (rank stays r)"

    procrustes: bool = with_default(FLoRG, "procrustes", False)
    truncate: bool = with_default(FLoRG, "truncate", True)


__all__ = ["FLoRG", "FLoRGNoProcrustes", "FLoRGTopRows"]

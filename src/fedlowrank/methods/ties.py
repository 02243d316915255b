"""TIES-Merging (Yadav et al., "TIES-Merging: Resolving Interference When Merging Models", NeurIPS 2023),
applied each round to the clients' LoRA updates, as FedRPCA (§5) runs it.

Task vector of client i: its update of every LoRA factor, ``τᵢ = {ΔAᵢ = Aᵢ − A^t, ΔBᵢ = Bᵢ − B^t}`` over all
target modules (A ``[r,in]``, B ``[out,r]``). Per round (TIES §3, Algorithm 1):

1. trim: keep the entries of τᵢ whose magnitude is among its top ``keep_fraction`` K, zero the rest: τ̂ᵢ. Of
   d entries, ``trim_count = "official"`` keeps ⌊K·d⌋ + 1 (at most d), as the public code's
   ``topk_values_mask`` does (the ``(d − ⌊K·d⌋)``-th smallest magnitude and every one at or above it: one more than
   K·d when K·d is an integer); ``"paper"`` keeps ⌈K·d⌉, the paper's "top-k%". Entries tied at the threshold are
   all kept. ``trim_scope = "global"`` ranks over the client's whole flattened LoRA vector (TIES' choice),
   ``"tensor"`` within each A or B;
2. elect sign: ``γ = sign(Σᵢ pᵢ τ̂ᵢ)`` entrywise (the sign of the larger total mass);
3. disjoint mean: ``τ_m = Σ_{i∈Aⱼ} pᵢ τ̂ᵢ / Σ_{i∈Aⱼ} pᵢ`` over the clients whose non-zero τ̂ᵢ agrees with γ
   (0 where none does);
4. ``θ^{t+1} = θ^t + λ·τ_m`` with λ = ``server.lr`` (TIES' merge scale; 1 by default, as FedRPCA).

pᵢ follow ``server.weighting``; with ``"uniform"`` steps 2–3 are exactly TIES' unweighted sum and mean. Where the
elected sum is exactly 0 with non-zero trimmed entries (they cancel), the public code takes the sign of the majority
of all elected signs; here the merged entry is 0 (a tie of measure zero with real updates).
The head is not a LoRA factor: it is averaged as in FedIT. The server needs every client's update
(trimming and sign election are not linear), so ``needs_individual_replies`` is True.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..message import State
from . import register
from .fedit import FedIT

TRIM_SCOPES = ("global", "tensor")
TRIM_COUNTS = ("official", "paper")


def kept_count(n: int, keep_fraction: float, count: str = "official") -> int:
    """How many of ``n`` entries the trim keeps (ties at the threshold aside): ``⌊K·n⌋ + 1`` (``"official"``, the
    public ``topk_values_mask``) or ``⌈K·n⌉`` (``"paper"``), between 1 and ``n``."""
    keep = int(n * keep_fraction) + 1 if count == "official" else math.ceil(keep_fraction * n)
    return min(n, max(1, keep))


def magnitude_threshold(values: torch.Tensor, keep_fraction: float, count: str = "official") -> torch.Tensor:
    """The :func:`kept_count`-th largest ``|values|`` (a 0-d tensor): entries at or above it are kept."""
    mags = values.abs().flatten()
    return mags.kthvalue(mags.numel() - kept_count(mags.numel(), keep_fraction, count) + 1).values


def ties_merge(updates: torch.Tensor, weights: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """Trim, elect sign, disjoint weighted mean.

    Args:
        updates: ``[K, ...]`` the K clients' updates of one tensor.
        weights: ``[K]`` pᵢ > 0.
        thresholds: ``[K]`` per-client magnitude thresholds (see :func:`magnitude_threshold`).
    Returns:
        the merged update ``[...]``.
    """
    shape = (-1,) + (1,) * (updates.dim() - 1)
    trimmed = updates * (updates.abs() >= thresholds.view(shape))
    w = weights.to(updates.dtype).view(shape)
    elected = torch.sign((w * trimmed).sum(0))
    agree = w * ((torch.sign(trimmed) == elected) & (trimmed != 0))
    mass = agree.sum(0)
    return (agree * trimmed).sum(0) / torch.where(mass > 0, mass, torch.ones_like(mass))


@register
@dataclass
class Ties(FedIT):
    """Options: ``keep_fraction`` (in (0, 1]; 1 = no trimming), ``trim_scope`` (``"global"`` or ``"tensor"``),
    ``trim_count`` (``"official"``: ⌊K·d⌋ + 1 entries kept, the public code; ``"paper"``: ⌈K·d⌉), and the LoRA
    methods' ``correction``/``mu``."""

    name = "ties"
    description = "TIES-Merging of the clients' LoRA updates each round: trim, elect sign, disjoint mean"
    paper = "Yadav et al., TIES-Merging: Resolving Interference When Merging Models (NeurIPS 2023)"
    uplink = "A [r,in] and B [out,r] per target module, head"
    downlink = "A, B per target module, head"
    needs_individual_replies = True

    keep_fraction: float = 0.2
    trim_scope: str = "global"
    trim_count: str = "official"

    def __post_init__(self) -> None:
        if not 0 < self.keep_fraction <= 1:
            raise ValueError(f"method.keep_fraction must be in (0, 1], got {self.keep_fraction}")
        if self.trim_scope not in TRIM_SCOPES:
            raise ValueError(f"method.trim_scope must be one of {TRIM_SCOPES}, got {self.trim_scope!r}")
        if self.trim_count not in TRIM_COUNTS:
            raise ValueError(f"method.trim_count must be one of {TRIM_COUNTS}, got {self.trim_count!r}")
        super().__post_init__()

    def merged_updates(self, server: State, replies, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{key: τ_m [shape of key]}`` (float64) for every LoRA factor."""
        keys = self.lora_keys(server)
        updates = {k: torch.stack([r.message[k].double() - server[k].double() for r in replies]) for k in keys}
        if self.trim_scope == "global":
            flat = torch.cat([u.flatten(1) for u in updates.values()], 1)
            everywhere = torch.stack([magnitude_threshold(row, self.keep_fraction, self.trim_count) for row in flat])
            thresholds = {k: everywhere for k in keys}
        else:
            thresholds = {k: torch.stack([magnitude_threshold(x, self.keep_fraction, self.trim_count) for x in u])
                          for k, u in updates.items()}
        return {k: ties_merge(u, weights, thresholds[k]) for k, u in updates.items()}

    def aggregate(self, server, replies, rnd):
        server = State(server)
        weights = self.client_weights(replies)
        for k, merged in self.merged_updates(server, replies, weights).items():
            old = server[k]
            server[k] = self.server_step(old, (old.double() + merged).to(old.dtype))
        self.average_into(server, replies, self.head_keys(server), weights)
        self.aggregate_corrections(server, replies)
        return server

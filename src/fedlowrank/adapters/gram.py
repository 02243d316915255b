"""FLoRG's single-matrix Gram adapter (Meng, Tang and Wong, arXiv:2602.17095, eq. 1): ``ΔW = s · L AᵀA R``.

Per target linear ``W0: [out, in]``, with ``k = min(in, out)``:

* ``L: [out, k]``, ``R: [k, in]`` — frozen, shared by all clients, generated from a seed (never sent);
* ``A: [r, k]`` — the only trainable adapter tensor;
* ``s`` — the LoRA scaling rule of :func:`~fedlowrank.adapters.lora.lora_scale` (α/r by default; the paper's
  "scaling factor" does not say whether it is α or s).

The forward pass never forms ``AᵀA`` or the dense ``ΔW``: ``B_eff = L Aᵀ: [out, r]``,
``A_eff = A R: [r, in]``, ``y = x W0ᵀ + s · (x A_effᵀ) B_effᵀ`` — LoRA's per-token cost at rank r.
With ``compensate_init`` a fixed ``A_ref`` is subtracted the same way, ``ΔW = s·L(AᵀA − A_refᵀA_ref)R``, so that
the initial model equals the pretrained one (an option of ours, not in the paper).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..schema import check_choice
from .model import AdaptedLinear, AdaptedModel

BASES_INITS = ("semi_orthogonal", "kaiming", "svd")
A_INITS = ("gaussian", "kaiming")


def gram_bases(weight: torch.Tensor, init: str, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(L: [out, k], R: [k, in])`` for a weight ``[out, in]`` (the paper's §4.4, Table 6).

    ``semi_orthogonal``: ``orthogonal_`` (LᵀL = RRᵀ = I_k); ``kaiming``: ``kaiming_uniform_(a=√5)`` (the
    ``nn.Linear`` default, not orthogonal); ``svd``: ``W0 = UΣVᵀ``, ``L = U[:, :k]``, ``R = Vᵀ[:k]``.
    """
    check_choice("method.bases_init", init, BASES_INITS)
    out_f, in_f = weight.shape
    k = min(out_f, in_f)
    dtype = weight.dtype
    if init == "svd":
        U, _, Vh = torch.linalg.svd(weight.detach().to(torch.float64), full_matrices=False)
        return U[:, :k].to(dtype), Vh[:k].to(dtype)
    L, R = torch.empty(out_f, k, dtype=dtype), torch.empty(k, in_f, dtype=dtype)
    if init == "semi_orthogonal":
        nn.init.orthogonal_(L, generator=generator)
        nn.init.orthogonal_(R, generator=generator)
    else:
        nn.init.kaiming_uniform_(L, a=math.sqrt(5), generator=generator)
        nn.init.kaiming_uniform_(R, a=math.sqrt(5), generator=generator)
    return L, R


def init_gram_A(rank: int, k: int, scale: float, init: str, perturbation: float, generator: torch.Generator,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The initial global factor ``A¹: [r, k]`` (the paper gives none; it must be non-zero: ``A = 0`` has zero gradient).

    ``gaussian``: i.i.d. ``N(0, σ²)`` with ``s·σ²·k = perturbation``, so ``‖s L AᵀA R‖₂ ≈ perturbation``;
    ``kaiming``: LoRA-A's ``kaiming_uniform_(a=√5)``, ``U(−1/√k, 1/√k)`` (a large initial perturbation ≈ s/3).
    """
    check_choice("method.a_init", init, A_INITS)
    if init == "gaussian":
        if not perturbation > 0:
            raise ValueError(f"method.init_perturbation must be > 0 (A = 0 never trains), got {perturbation}")
        sigma = math.sqrt(perturbation / (scale * k))
        return torch.randn(rank, k, generator=generator, dtype=dtype) * sigma
    return (torch.rand(rank, k, generator=generator, dtype=dtype) * 2 - 1) / math.sqrt(k)


class GramLinear(AdaptedLinear):
    """``y = x (W0 + base_delta)ᵀ + s · L AᵀA R x + bias`` in factored form.

    Args:
        base: the frozen linear ``[out, in]``.
        L, R: the shared bases ``[out, k]``, ``[k, in]`` (non-persistent buffers: regenerated from the seed).
        rank: r (rows of ``gram_A``); scale: s; dropout: on the adapter path's input, as in LoRA.
        A_ref: optional fixed ``[r, k]`` subtracted from the update (``compensate_init``).
    """

    def __init__(self, base: nn.Linear, L: torch.Tensor, R: torch.Tensor, rank: int, scale: float,
                 dropout: float = 0.0, A_ref: torch.Tensor | None = None):
        super().__init__(base)
        k = min(base.in_features, base.out_features)
        if L.shape != (base.out_features, k) or R.shape != (k, base.in_features):
            raise ValueError(f"Gram bases L{tuple(L.shape)}, R{tuple(R.shape)} do not fit a "
                             f"[{base.out_features}, {base.in_features}] layer (k = {k})")
        if rank < 1 or rank > k:
            raise ValueError(f"lora.rank must be in [1, {k}] for a Gram adapter, got {rank}")
        self.scale = float(scale)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        device = base.weight.device
        self.register_buffer("L", L.detach().to(device, copy=True), persistent=False)
        self.register_buffer("R", R.detach().to(device, copy=True), persistent=False)
        self.register_buffer("A_ref", None if A_ref is None else A_ref.detach().to(device, copy=True), persistent=False)
        self.gram_A = nn.Parameter(torch.zeros(rank, k, dtype=base.weight.dtype, device=base.weight.device))

    @property
    def k(self) -> int:
        return self.gram_A.shape[1]

    def set_A(self, A: torch.Tensor, any_rows: bool = False) -> None:
        """Load ``A: [r, k]``; ``any_rows`` lets the row count change (FLoRG without truncation: ``[r', k]``)."""
        if A.shape != self.gram_A.shape:
            if not (any_rows and A.dim() == 2 and A.shape[1] == self.k):
                raise ValueError(f"Gram factor of shape {tuple(A.shape)} does not fit {tuple(self.gram_A.shape)}")
            self.gram_A = nn.Parameter(self.gram_A.new_zeros(A.shape))  # on this module's device and dtype
        with torch.no_grad():
            self.gram_A.copy_(A)

    def _factored(self, A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B_eff = L Aᵀ: [out, r], A_eff = A R: [r, in])``, in the bases' dtype (the backbone's)."""
        A = A.to(self.L.dtype)
        return self.L @ A.T, A @ self.R

    def adapter_delta(self) -> torch.Tensor:
        B, A = self._factored(self.gram_A)
        delta = B @ A
        if self.A_ref is not None:
            B0, A0 = self._factored(self.A_ref)
            delta = delta - B0 @ A0
        return self.scale * delta

    def adapter_output(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout(x)
        B, A = self._factored(self.gram_A)
        out = F.linear(F.linear(x, A.to(x.dtype)), B.to(x.dtype))
        if self.A_ref is not None:
            B0, A0 = self._factored(self.A_ref)
            out = out - F.linear(F.linear(x, A0.to(x.dtype)), B0.to(x.dtype))
        return self.scale * out


def gram_modules(model: AdaptedModel) -> dict[str, GramLinear]:
    mods = model.adapters()
    bad = [n for n, m in mods.items() if not isinstance(m, GramLinear)]
    if bad or not mods:
        raise TypeError("the model has no Gram adapters attached" if not mods else f"not Gram adapters: {bad}")
    return mods  # type: ignore[return-value]


__all__ = ["BASES_INITS", "A_INITS", "gram_bases", "init_gram_A", "GramLinear", "gram_modules"]

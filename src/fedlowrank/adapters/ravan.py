"""RAVAN's multi-head adapter (Raje, Askin, Jhunjhunwala, Joshi, "Ravan: Multi-Head Low-Rank Adaptation for
Federated Fine-Tuning", arXiv:2506.05568): ``ΔW = Σᵢ sᵢ Bᵢ Hᵢ Aᵢ`` over h heads.

Per target linear ``W0: [out, in]`` and head i = 1..h, rank r:

* ``Bᵢ: [out, r]``, ``Aᵢ: [r, in]`` — frozen, identical on every client, generated from the run seed and the
  target's index (never sent); stored stacked as ``bases_B: [h, out, r]``, ``bases_A: [h, r, in]``;
* ``Hᵢ: [r, r]`` (the core) and ``sᵢ`` (a scalar scale) — trainable, one parameter each, so a client can train a
  subset of the heads.

The heads are batched: ``B_eff = [s₁B₁H₁ … s_hB_hH_h]: [out, h·r]`` is one einsum over the stacked bases and cores,
``A_cat = [A₁; …; A_h]: [h·r, in]``, and ``y = x (W0 + base_delta)ᵀ + (dropout(x) A_catᵀ) B_effᵀ`` costs a LoRA of
rank h·r per token. There is no α/r factor (the update is ``Σ sᵢ BᵢHᵢAᵢ`` as written).

:class:`CoreLinear` is the one-head case with bases loaded from outside (Fed-SB's ``s·B R A``, arXiv:2502.15436).
"""

from __future__ import annotations

import torch
from torch import nn

from ..schema import check_choice
from .model import AdaptedLinear, AdaptedModel, matrix_shape

BASES_INITS = ("orthonormal", "gaussian")


def ravan_bases(out_features: int, in_features: int, heads: int, rank: int, init: str,
                generator: torch.Generator, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen bases ``(B: [h, out, r], A: [h, r, in])`` of one target, a pure function of ``generator``'s seed.

    ``orthonormal``: each ``Bᵢ`` has orthonormal columns and each ``Aᵢ`` orthonormal rows (QR of a Gaussian draw),
    so ``‖BᵢHᵢAᵢ‖_F = ‖Hᵢ‖_F``; ``gaussian``: i.i.d. N(0, 1) entries, unscaled.
    """
    check_choice("method.bases_init", init, BASES_INITS)
    if rank > min(out_features, in_features):
        raise ValueError(f"lora.rank (each RAVAN head's rank) must be in [1, {min(out_features, in_features)}] for a "
                         f"[{out_features}, {in_features}] target, got {rank}")
    B = torch.randn(heads, out_features, rank, generator=generator, dtype=torch.float64)
    A = torch.randn(heads, in_features, rank, generator=generator, dtype=torch.float64)
    if init == "orthonormal":
        B, A = torch.linalg.qr(B).Q, torch.linalg.qr(A).Q
    return B.to(dtype), A.mT.contiguous().to(dtype)


class RavanLinear(AdaptedLinear):
    """``y = x (W0 + base_delta)ᵀ + Σᵢ sᵢ Bᵢ Hᵢ Aᵢ dropout(x) + bias``, the heads in one batched product.

    Args:
        base: the frozen linear (or convolution) ``[out, in]``.
        bases_B, bases_A: ``[h, out, r]``, ``[h, r, in]`` (non-persistent buffers: regenerated from the seed).
        dropout: on the adapter path's input, as in LoRA.
    """

    def __init__(self, base: nn.Module, bases_B: torch.Tensor, bases_A: torch.Tensor, dropout: float = 0.0):
        super().__init__(base)
        h, out_f, r = bases_B.shape
        if (out_f, bases_A.shape[0], bases_A.shape[1], bases_A.shape[2]) != (self.out_features, h, r, self.in_features):
            raise ValueError(f"RAVAN bases B{tuple(bases_B.shape)}, A{tuple(bases_A.shape)} do not fit a "
                             f"[{self.out_features}, {self.in_features}] layer")
        device, dtype = base.weight.device, base.weight.dtype
        self.register_buffer("bases_B", bases_B.detach().to(device, dtype, copy=True), persistent=False)
        self.register_buffer("bases_A", bases_A.detach().to(device, dtype, copy=True), persistent=False)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.cores = nn.ParameterList([nn.Parameter(torch.zeros(r, r, device=device, dtype=dtype)) for _ in range(h)])
        self.scales = nn.ParameterList([nn.Parameter(torch.ones((), device=device, dtype=dtype)) for _ in range(h)])

    @property
    def heads(self) -> int:
        return self.bases_B.shape[0]

    @property
    def rank(self) -> int:
        return self.bases_B.shape[2]

    def set_heads(self, cores: list[torch.Tensor]) -> None:
        """Load the cores ``Hᵢ: [r, r]`` (one per head) and reset every scale ``sᵢ`` to 1."""
        if len(cores) != self.heads or any(tuple(H.shape) != (self.rank, self.rank) for H in cores):
            raise ValueError(f"RAVAN expects {self.heads} cores of shape [{self.rank}, {self.rank}], got "
                             f"{[tuple(H.shape) for H in cores]}")
        with torch.no_grad():
            for p, H in zip(self.cores, cores):
                p.copy_(H)
            for s in self.scales:
                s.fill_(1.0)

    def folded_cores(self) -> torch.Tensor:
        """``[h, r, r]``: ``sᵢ Hᵢ`` per head (what a client uploads; the scales folded in)."""
        return torch.stack(list(self.cores)) * torch.stack(list(self.scales))[:, None, None]

    def _factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B_eff: [out, h·r], A_cat: [h·r, in])`` with ``B_eff A_cat = Σᵢ sᵢ Bᵢ Hᵢ Aᵢ`` (in the cores' dtype)."""
        G = self.folded_cores()
        B_eff = torch.einsum("hor,hrq->ohq", self.bases_B.to(G.dtype), G).reshape(self.out_features, -1)
        return B_eff, self.bases_A.reshape(-1, self.in_features)

    def adapter_delta(self) -> torch.Tensor:
        B_eff, A_cat = self._factors()
        return B_eff @ A_cat.to(B_eff.dtype)

    def adapter_output(self, x: torch.Tensor) -> torch.Tensor:
        B_eff, A_cat = self._factors()
        return self.output_map(self.input_map(self.dropout(x), A_cat), B_eff)

    @classmethod
    def joint_adapter_output(cls, members: list["RavanLinear"], x: torch.Tensor) -> torch.Tensor | None:
        """Every member's adapter output on its share of ``x [K·n, ..., in]`` as two batched products over the K
        members (each a rank-h·r pair ``(B_eff, A_cat)``); linear targets without adapter dropout, else ``None``."""
        if isinstance(members[0].base, nn.Conv2d) or not all(isinstance(m.dropout, nn.Identity) for m in members):
            return None
        pairs = [m._factors() for m in members]
        B = torch.stack([b for b, _ in pairs]).to(x.dtype)                       # [K, out, h·r]
        A = torch.stack([a for _, a in pairs]).to(x.dtype)                       # [K, h·r, in]
        out = torch.bmm(torch.bmm(x.reshape(len(members), -1, x.shape[-1]), A.mT), B.mT)
        return out.reshape(*x.shape[:-1], out.shape[-1])


class CoreLinear(RavanLinear):
    """One head with bases set from outside (Fed-SB's adapter, arXiv:2502.15436):
    ``y = x (W0 + base_delta)ᵀ + B R A dropout(x) + bias``, ``B: [out, r]`` and ``A: [r, in]`` frozen
    (:meth:`set_bases`), the core ``R: [r, r]`` (``cores[0]``, its scale ``scales[0]`` kept at 1) trained.

    While probing (:meth:`start_probe`), a dense zero parameter ``probe: [out, in]`` adds ``x probeᵀ`` to the output:
    its gradient is the loss gradient with respect to the target's weight at the current model, ``∇_W L``.
    """

    def __init__(self, base: nn.Module, rank: int, dropout: float = 0.0):
        out_f, in_f = matrix_shape(base)
        if not 1 <= rank <= min(out_f, in_f):
            raise ValueError(f"lora.rank must be in [1, {min(out_f, in_f)}] for a [{out_f}, {in_f}] target, got {rank}")
        super().__init__(base, torch.zeros(1, out_f, rank), torch.zeros(1, rank, in_f), dropout)
        self.register_parameter("probe", None)

    def set_bases(self, B: torch.Tensor, A: torch.Tensor) -> None:
        """Replace the frozen bases by ``B: [out, r]``, ``A: [r, in]`` (buffers are replaced, never written into:
        cohort members share them)."""
        if tuple(B.shape) != tuple(self.bases_B.shape[1:]) or tuple(A.shape) != tuple(self.bases_A.shape[1:]):
            raise ValueError(f"bases B{tuple(B.shape)}, A{tuple(A.shape)} do not fit B{tuple(self.bases_B.shape[1:])}, "
                             f"A{tuple(self.bases_A.shape[1:])}")
        like = self.bases_B
        self.bases_B = B[None].detach().to(like.device, like.dtype, copy=True)
        self.bases_A = A[None].detach().to(like.device, like.dtype, copy=True)

    def start_probe(self) -> nn.Parameter:
        """Add the zero ``probe: [out, in]`` (trainable) and return it."""
        w = self.base.weight
        self.probe = nn.Parameter(torch.zeros(self.out_features, self.in_features, device=w.device,
                                              dtype=self.cores[0].dtype))
        return self.probe

    def stop_probe(self) -> None:
        self.probe = None

    def adapter_output(self, x: torch.Tensor) -> torch.Tensor:
        out = super().adapter_output(x)
        return out if self.probe is None else out + self.input_map(x, self.probe)

    @classmethod
    def joint_adapter_output(cls, members: list["CoreLinear"], x: torch.Tensor) -> torch.Tensor | None:
        if any(m.probe is not None for m in members):
            return None
        return super().joint_adapter_output(members, x)


def ravan_modules(model: AdaptedModel) -> dict[str, RavanLinear]:
    mods = model.adapters()
    bad = [n for n, m in mods.items() if not isinstance(m, RavanLinear)]
    if bad or not mods:
        raise TypeError("the model has no RAVAN adapters attached" if not mods else f"not RAVAN adapters: {bad}")
    return mods  # type: ignore[return-value]


__all__ = ["BASES_INITS", "ravan_bases", "RavanLinear", "CoreLinear", "ravan_modules"]

"""LoRA in one place: factors, scaling rule, dropout, initialisation.

Conventions (docs/architecture.md, "Conventions"): ``B: [out, r]``, ``A: [r, in]``, ``ΔW = s · B A`` with ``s = α / r`` (``"standard"``)
or ``s = α / √r`` (``"rslora"``). Ranks can differ per client: :meth:`LoRALinear.set_factors` resizes the
factors and recomputes ``s`` from the new rank by the same rule.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..schema import check_choice
from .model import AdaptedLinear, AdaptedModel

SCALING_RULES = ("standard", "rslora")


def lora_scale(alpha: float, rank: int, rule: str = "standard") -> float:
    """The LoRA scaling ``s``: ``α/r`` (standard) or ``α/√r`` (rsLoRA). The only place it is computed."""
    check_choice("lora.scaling", rule, SCALING_RULES)
    return alpha / rank if rule == "standard" else alpha / math.sqrt(rank)


def init_lora_factors(out_features: int, in_features: int, rank: int, generator: torch.Generator,
                      dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's default init: ``A ~ kaiming_uniform(a=√5)`` (``U(-1/√in, 1/√in)``), ``B = 0``.

    Returns ``(A: [r, in], B: [out, r])``.
    """
    bound = 1.0 / math.sqrt(in_features)
    a = (torch.rand(rank, in_features, generator=generator, dtype=dtype) * 2 - 1) * bound
    return a, torch.zeros(out_features, rank, dtype=dtype)


class LoRALinear(AdaptedLinear):
    """``y = x (W0 + base_delta)ᵀ + s · dropout(x) Aᵀ Bᵀ + bias``, computed in factored form."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, scaling: str = "standard", dropout: float = 0.0):
        super().__init__(base)
        if rank < 1 or rank > min(self.in_features, self.out_features):
            raise ValueError(f"lora.rank must be in [1, {min(self.in_features, self.out_features)}], got {rank}")
        self.alpha = float(alpha)
        self.scaling_rule = scaling
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        like = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.lora_A = nn.Parameter(torch.zeros(rank, self.in_features, **like))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, **like))
        self.scale = lora_scale(self.alpha, rank, scaling)
        self.stack: LoRAStack | None = None  # set while this layer is a cohort member's (its factors: slices)

    @property
    def rank(self) -> int:
        return self.lora_A.shape[0]

    def set_factors(self, A: torch.Tensor, B: torch.Tensor) -> None:
        """Load ``A: [r, in]``, ``B: [out, r]`` (any r); the scale follows the rank by the configured rule."""
        r = A.shape[0]
        if A.shape != (r, self.in_features) or B.shape != (self.out_features, r):
            raise ValueError(f"LoRA factors of shapes A{tuple(A.shape)}, B{tuple(B.shape)} do not fit a "
                             f"[{self.out_features}, {self.in_features}] layer")
        if r != self.rank:  # new factors where the old ones are, in their dtype (fp32 over a bf16 backbone)
            self.lora_A = nn.Parameter(self.lora_A.new_empty(r, self.in_features))
            self.lora_B = nn.Parameter(self.lora_B.new_empty(self.out_features, r))
            self.scale = lora_scale(self.alpha, r, self.scaling_rule)
        with torch.no_grad():
            self.lora_A.copy_(A)
            self.lora_B.copy_(B)

    def adapter_delta(self) -> torch.Tensor:
        return self.scale * (self.lora_B @ self.lora_A)

    def adapter_output(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.output_map(self.input_map(self.dropout(x), self.lora_A), self.lora_B)

    @classmethod
    def joint_adapter_output(cls, members: list["LoRALinear"], x: torch.Tensor) -> torch.Tensor | None:
        """Every member's ``s_k · x_k A_kᵀ B_kᵀ`` as two batched products over the K members, factors zero-padded to
        the largest rank (the padded directions add exact zeros): ``x [K·n, ..., in] → [K·n, ..., out]``. Linear
        layers without LoRA dropout; ``None`` otherwise."""
        if isinstance(members[0].base, nn.Conv2d) or not all(isinstance(m.dropout, nn.Identity) for m in members):
            return None
        stack = members[0].stack
        if stack is not None and stack.members == members:  # the factors are slices of one tensor each
            A, B = stack.A, stack.B
        else:
            r = max(m.rank for m in members)
            A = torch.stack([m.lora_A if m.rank == r else F.pad(m.lora_A, (0, 0, 0, r - m.rank)) for m in members])
            B = torch.stack([m.lora_B if m.rank == r else F.pad(m.lora_B, (0, r - m.rank)) for m in members])
        A, B = A.to(x.dtype), B.to(x.dtype)  # A: [K, r, in], B: [K, out, r], in the input's dtype
        out = torch.bmm(torch.bmm(x.reshape(len(members), -1, x.shape[-1]), A.mT), B.mT)  # [K, n·…, out]
        scales = {m.scale for m in members}
        if len(scales) == 1:
            out = scales.pop() * out
        else:
            out = out * torch.tensor([m.scale for m in members], dtype=out.dtype, device=out.device).view(-1, 1, 1)
        return out.reshape(*x.shape[:-1], out.shape[-1])


class LoRAStack:
    """The factors of K cohort members' :class:`LoRALinear` of one target (equal ranks) held as slices of one
    tensor each, ``A: [K, r, in]``, ``B: [K, out, r]``: member k's ``lora_A``/``lora_B`` become views ``A[k]``,
    ``B[k]`` (their optimizer updates them in place), and the joint forward multiplies by ``A`` and ``B`` themselves
    (:meth:`LoRALinear.joint_adapter_output`), so the backward writes one gradient buffer per stacked factor, not
    one allocation and copy per member; :meth:`hand_out_grads` makes its slices the members' gradients.
    :meth:`release` ends it (the members keep their values)."""

    def __init__(self, members: list[LoRALinear]):
        self.members = list(members)
        self.A = torch.stack([m.lora_A.detach() for m in members]).requires_grad_(members[0].lora_A.requires_grad)
        self.B = torch.stack([m.lora_B.detach() for m in members]).requires_grad_(members[0].lora_B.requires_grad)
        for k, m in enumerate(members):
            m.lora_A.data, m.lora_B.data = self.A.data[k], self.B.data[k]
            m.stack = self

    @staticmethod
    def fits(members: list[nn.Module]) -> bool:
        """Whether ``members`` can be stacked: linear :class:`LoRALinear` layers of one rank, dtype and device,
        each factor trained by all of them or by none."""
        if not all(type(m) is LoRALinear and isinstance(m.base, nn.Linear) for m in members):
            return False
        first = members[0]
        return all(m.rank == first.rank and m.lora_A.dtype == first.lora_A.dtype == m.lora_B.dtype
                   and m.lora_A.device == first.lora_A.device
                   and m.lora_A.requires_grad == first.lora_A.requires_grad
                   and m.lora_B.requires_grad == first.lora_B.requires_grad for m in members)

    def hand_out_grads(self) -> None:
        """After backward: member k's gradient of each factor is the slice k of the stacked gradient (plus what its
        own loss terms put on its parameter, e.g. FedProx's proximal term)."""
        for stacked, name in ((self.A, "lora_A"), (self.B, "lora_B")):
            if stacked.grad is None:
                continue
            for k, m in enumerate(self.members):
                p, g = getattr(m, name), stacked.grad[k]
                if p.grad is not None:
                    g.add_(p.grad)
                p.grad = g
            stacked.grad = None

    def zero_grad(self) -> None:
        self.A.grad = self.B.grad = None

    def release(self) -> None:
        for m in self.members:
            m.stack = None


def attach_lora(model: AdaptedModel, rank: int, alpha: float, scaling: str = "standard", dropout: float = 0.0) -> None:
    """Wrap every target linear of ``model`` in a :class:`LoRALinear` (factors zero until loaded)."""
    model.attach(lambda name, lin: LoRALinear(lin, rank, alpha, scaling, dropout))


def lora_modules(model: AdaptedModel) -> dict[str, LoRALinear]:
    mods = model.adapters()
    bad = [n for n, m in mods.items() if not isinstance(m, LoRALinear)]
    if bad or not mods:
        raise TypeError("the model has no LoRA adapters attached" if not mods else f"not LoRA adapters: {bad}")
    return mods  # type: ignore[return-value]

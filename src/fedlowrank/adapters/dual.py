"""A shared LoRA plus a private one on one target linear, fused by learnable scalar gates (SDFLoRA's dual module,
arXiv:2601.11219).

Per target linear ``W0: [out, in]``: the global module ``lora_A: [r_g, in]``, ``lora_B: [out, r_g]`` (as
:class:`~fedlowrank.adapters.lora.LoRALinear`'s, scale ``s_g`` from ``r_g``), the local module
``local_A: [r_l, in]``, ``local_B: [out, r_l]`` (scale ``s_l`` from ``r_l``; none when ``r_l = 0``) and, when the
gates are learned, two scalar logits ``gate_g``, ``gate_l``:

    y = x (W0 + base_delta)ᵀ + σ(γ_g) s_g B_g A_g dropout(x) + σ(γ_l) s_l B_l A_l dropout(x) + bias

with σ the logistic function (fixed gates: σ(·) replaced by 1).
"""

from __future__ import annotations

import torch
from torch import nn

from .lora import LoRALinear, lora_scale
from .model import AdaptedModel


class DualLoRALinear(LoRALinear):
    """See the module docstring. ``local_rank = 0``: the global module alone; ``learned_gates = False``: both gates 1.
    """

    def __init__(self, base: nn.Linear, rank: int, local_rank: int, alpha: float, scaling: str = "standard",
                 dropout: float = 0.0, learned_gates: bool = True):
        super().__init__(base, rank, alpha, scaling, dropout)
        like = dict(dtype=self.lora_A.dtype, device=self.lora_A.device)
        self.local_A = nn.Parameter(torch.zeros(local_rank, self.in_features, **like)) if local_rank else None
        self.local_B = nn.Parameter(torch.zeros(self.out_features, local_rank, **like)) if local_rank else None
        self.local_scale = lora_scale(self.alpha, local_rank, scaling) if local_rank else 0.0
        self.gate_g = nn.Parameter(torch.zeros((), **like)) if learned_gates else None
        self.gate_l = nn.Parameter(torch.zeros((), **like)) if learned_gates and local_rank else None

    def set_local(self, A: torch.Tensor | None, B: torch.Tensor | None, gate_g: torch.Tensor | None,
                  gate_l: torch.Tensor | None) -> None:
        """Load the local module ``A: [r_l, in]``, ``B: [out, r_l]`` and the gate logits (scalars), each ``None``
        where the layer has none."""
        with torch.no_grad():
            for new, old, what in ((A, self.local_A, "local_A"), (B, self.local_B, "local_B"),
                                   (gate_g, self.gate_g, "gate_g"), (gate_l, self.gate_l, "gate_l")):
                if (new is None) != (old is None) or (old is not None and tuple(new.shape) != tuple(old.shape)):
                    raise ValueError(f"dual LoRA {what}: expected {None if old is None else tuple(old.shape)}, got "
                                     f"{None if new is None else tuple(new.shape)}")
                if old is not None:
                    old.copy_(new)

    def gates(self) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        """``(σ(γ_g), σ(γ_l))``, or 1 for a fixed gate (and 0 for an absent local module)."""
        g = torch.sigmoid(self.gate_g) if self.gate_g is not None else 1.0
        local = 0.0 if self.local_A is None else (torch.sigmoid(self.gate_l) if self.gate_l is not None else 1.0)
        return g, local

    def adapter_delta(self) -> torch.Tensor:
        g, local = self.gates()
        out = g * self.scale * (self.lora_B @ self.lora_A)
        return out if self.local_A is None else out + local * self.local_scale * (self.local_B @ self.local_A)

    def adapter_output(self, x: torch.Tensor) -> torch.Tensor:
        g, local = self.gates()
        h = self.dropout(x)
        out = self.output_map(self.input_map(h, self.lora_A), self.lora_B) * (g * self.scale)
        if self.local_A is None:
            return out
        return out + self.output_map(self.input_map(h, self.local_A), self.local_B) * (local * self.local_scale)

    @classmethod
    def joint_adapter_output(cls, members: list["DualLoRALinear"], x: torch.Tensor) -> torch.Tensor | None:
        return None  # each member on its own rows


def dual_modules(model: AdaptedModel) -> dict[str, DualLoRALinear]:
    mods = model.adapters()
    bad = [n for n, m in mods.items() if not isinstance(m, DualLoRALinear)]
    if bad or not mods:
        raise TypeError("the model has no dual LoRA adapters attached" if not mods
                        else f"not dual LoRA adapters: {bad}")
    return mods  # type: ignore[return-value]


__all__ = ["DualLoRALinear", "dual_modules"]

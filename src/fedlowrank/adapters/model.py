"""The model every method works on: a backbone with named target linears and an explicit head.

Weight layout is ``[out, in]`` everywhere (``nn.Linear``). An adapter replaces a target ``nn.Linear`` by a
wrapper that keeps the frozen pretrained weight ``W0``, an explicit **base delta** (changes methods make to
the frozen weight: FedEx-LoRA residuals, FLoRA merges, ILoRA's QR offset, SSF backfill...) and its own
trainable parameters. The effective weight is ``W0 + base_delta + adapter_delta``.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn


class AdaptedLinear(nn.Module):
    """A frozen ``nn.Linear`` plus an explicit base delta; subclasses add a trainable low-rank path.

    Attributes:
        base: the original linear, ``weight: [out, in]`` frozen.
        base_delta: ``[out, in]`` non-persistent buffer (moves with the module) or ``None`` (= zero), part of
            the frozen weight the server owns.
    """

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base = base
        base.weight.requires_grad_(False)
        if base.bias is not None:
            base.bias.requires_grad_(False)
        self.register_buffer("base_delta", None, persistent=False)

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def in_features(self) -> int:
        return self.base.in_features

    def frozen_weight(self) -> torch.Tensor:
        """``W0 + base_delta``: ``[out, in]``."""
        w = self.base.weight
        return w if self.base_delta is None else w + self.base_delta

    def set_base_delta(self, delta: torch.Tensor | None) -> None:
        if delta is not None and tuple(delta.shape) != tuple(self.base.weight.shape):
            raise ValueError(f"base_delta shape {tuple(delta.shape)} != weight shape {tuple(self.base.weight.shape)}")
        w = self.base.weight
        self.base_delta = None if delta is None else delta.detach().to(device=w.device, dtype=w.dtype)

    def set_frozen_weight(self, weight: torch.Tensor) -> None:
        """Make the frozen weight ``weight`` ``[out, in]`` (on any device): ``base_delta = weight − W0``."""
        w = self.base.weight
        self.set_base_delta(weight.to(w.device) - w.detach())

    def adapter_delta(self) -> torch.Tensor:
        """Dense ``[out, in]`` update of the trainable path (for export and tests; not used in forward)."""
        return torch.zeros_like(self.base.weight)

    def adapter_output(self, x: torch.Tensor) -> torch.Tensor | None:
        """The trainable path's contribution to the output, computed in factored form; ``None`` for none."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.frozen_weight(), self.base.bias)
        extra = self.adapter_output(x)
        return y if extra is None else y + extra


def _get_parent(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    parts = name.split(".")
    parent = root
    for p in parts[:-1]:
        parent = getattr(parent, p)
    return parent, parts[-1]


class AdaptedModel(nn.Module):
    """Backbone ``net`` with resolved target linears and head parameters.

    Args:
        net: the full model (e.g. ``BertForSequenceClassification``); its forward is the task's business.
        target_names: full module names of the target ``nn.Linear`` layers, e.g.
            ``bert.encoder.layer.0.attention.self.query``.
        head_names: full parameter names of the head (trained and shared unless a method says otherwise).
    """

    def __init__(self, net: nn.Module, target_names: list[str], head_names: list[str]):
        super().__init__()
        self.net = net
        self.target_names = list(target_names)
        self.head_names = list(head_names)
        for name in self.target_names:
            mod = net.get_submodule(name)
            if not isinstance(mod, (nn.Linear, AdaptedLinear)):
                raise ValueError(f"target module {name!r} is a {type(mod).__name__}, not nn.Linear")
        params = dict(net.named_parameters())
        missing = [n for n in self.head_names if n not in params]
        if missing:
            raise ValueError(f"head parameters not found in the model: {missing}")
        for p in net.parameters():
            p.requires_grad_(False)

    # -- targets ---------------------------------------------------------------------------------------
    def target(self, name: str) -> nn.Module:
        """The module at a target name: an ``nn.Linear`` or, once attached, its :class:`AdaptedLinear`."""
        return self.net.get_submodule(name)

    def targets(self) -> Iterator[tuple[str, nn.Module]]:
        for name in self.target_names:
            yield name, self.target(name)

    def base_linear(self, name: str) -> nn.Linear:
        mod = self.target(name)
        return mod.base if isinstance(mod, AdaptedLinear) else mod

    def attach(self, make: Callable[[str, nn.Linear], AdaptedLinear]) -> None:
        """Replace every target linear by ``make(name, linear)`` (idempotent per kind: re-wraps the base)."""
        for name in self.target_names:
            parent, attr = _get_parent(self.net, name)
            setattr(parent, attr, make(name, self.base_linear(name)))

    def adapters(self) -> dict[str, AdaptedLinear]:
        return {n: m for n, m in self.targets() if isinstance(m, AdaptedLinear)}

    # -- head ------------------------------------------------------------------------------------------
    def head_parameters(self) -> dict[str, nn.Parameter]:
        params = dict(self.net.named_parameters())
        return {n: params[n] for n in self.head_names}

    def set_trainable(self, params: dict[str, nn.Parameter]) -> None:
        """Freeze everything, then unfreeze exactly ``params``."""
        for p in self.net.parameters():
            p.requires_grad_(False)
        for p in params.values():
            p.requires_grad_(True)

    def forward(self, *args, **kwargs):
        return self.net(*args, **kwargs)

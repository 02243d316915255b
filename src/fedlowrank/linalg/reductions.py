"""Reductions over many tensors at once, read on the host once (not once per tensor): a reply's finiteness and
its update's norm, over its tens or hundreds of factors."""

from __future__ import annotations

from typing import Sequence

import torch


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every entry of ``tensors`` is finite: the largest magnitude of each floating tensor (one multi-tensor
    reduction; a NaN or an infinity makes it non-finite; stacked in the widest dtype), read once. Integer tensors
    are always finite."""
    floating = [t for t in tensors if t.is_floating_point() and t.numel()]
    if not floating:
        return True
    return bool(torch.isfinite(torch.stack(torch._foreach_norm(floating, ord=float("inf")))).all())


def total_norm(tensors: Sequence[torch.Tensor]) -> float:
    """‖concat(tensors)‖₂, as each tensor's dtype computes it (pass float64 tensors for float64), read once."""
    if not tensors:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(list(tensors))).to(torch.float64)))


__all__ = ["all_finite", "total_norm"]

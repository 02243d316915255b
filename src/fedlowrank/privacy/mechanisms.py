"""Clipping and Gaussian noise on replies: the pieces of DP-FedAvg, shared by both modes and both runtimes.

A client's *update* is defined over the floating-point tensors of its reply, each as a delta from what it received:

* a reply tensor whose key is also a tensor of the broadcast with the same shape and dtype: ``reply[key] − down[key]``;
* any other reply tensor (e.g. SCAFFOLD's ``scaffold.dc/*``, which already are deltas, or a factor the method never
  sends down): the whole tensor, i.e. its update w.r.t. zero.

Its norm is the L2 norm of all these deltas concatenated (float64). Clipping to C scales every delta by
``min(1, C/‖Δ‖)`` and leaves the reply untouched (the very same tensors) when ``‖Δ‖ ≤ C``, so that ``C = inf``
changes nothing, bit for bit.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..message import Message


def reference(down: Message, key: str, shape, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """What the update of reply tensor ``key`` (of ``shape`` and ``dtype``) is measured from: ``down[key]`` when it
    is a tensor of that shape (and dtype, when given), else ``None`` (the update is the tensor itself)."""
    ref = down.get(key)
    ok = isinstance(ref, torch.Tensor) and tuple(ref.shape) == tuple(shape) and (dtype is None or ref.dtype == dtype)
    return ref if ok else None


def _reference(down: Message, key: str, t: torch.Tensor) -> torch.Tensor | None:
    return reference(down, key, t.shape, t.dtype)


def update_tensor(reply: Message, down: Message, key: str) -> torch.Tensor:
    """The update of reply tensor ``key`` (float64): ``reply[key] − down[key]``, or ``reply[key]``."""
    t = reply[key].to(torch.float64)
    ref = _reference(down, key, reply[key])
    return t - ref.to(torch.float64) if ref is not None else t


def update_keys(reply: Message) -> list[str]:
    """The reply's tensors that make up the update (floating point), in sorted order."""
    return sorted(k for k, t in reply.tensors().items() if t.is_floating_point())


def update_norms(pairs: Sequence[tuple[Message, Message]]) -> list[float]:
    """‖Δ‖₂ of each ``(reply, down)``'s update (see the module docstring), in float64, as work per reply rather than
    per tensor: a reply's update is written into float64 buffers that the replies of its layout (names and shapes)
    share, by one multi-tensor copy, subtraction and norm, and all the norms are read at once."""
    buffers: dict[tuple, list[torch.Tensor]] = {}
    norms = []
    for reply, down in pairs:
        keys = update_keys(reply)
        tensors = [reply[k] for k in keys]
        layout = tuple((k, tuple(t.shape)) for k, t in zip(keys, tensors))
        if layout not in buffers:
            buffers[layout] = [torch.empty(t.shape, dtype=torch.float64, device=t.device) for t in tensors]
        deltas = buffers[layout]
        if not deltas:
            norms.append(torch.zeros((), dtype=torch.float64))
            continue
        torch._foreach_copy_(deltas, tensors)
        measured = [(d, ref) for d, k, t in zip(deltas, keys, tensors) if (ref := _reference(down, k, t)) is not None]
        if measured:
            torch._foreach_sub_([d for d, _ in measured], [ref for _, ref in measured])
        norms.append(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(deltas))))
    return torch.stack(norms).tolist() if norms else []


def update_norm(reply: Message, down: Message) -> float:
    """‖Δ‖₂ of the reply's update (:func:`update_norms`)."""
    return update_norms([(reply, down)])[0]


def clip_update(reply: Message, down: Message, clip: float) -> tuple[Message, float]:
    """The reply with its update scaled to norm at most ``clip``, and the update's norm before clipping.

    A reply within the bound is returned as is."""
    norm = update_norm(reply, down)
    if norm <= clip:
        return reply, norm
    scale = clip / norm
    out = Message(reply)
    for key in update_keys(reply):
        t = reply[key]
        ref = _reference(down, key, t)
        if ref is None:
            out[key] = (t.to(torch.float64) * scale).to(t.dtype)
        else:
            out[key] = (ref.to(torch.float64) + (t.to(torch.float64) - ref.to(torch.float64)) * scale).to(t.dtype)
    return out, norm


def gaussian_noise(like: Message, std: float, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """``N(0, std²)`` per coordinate of each update tensor of ``like`` (sorted keys, float64 draws, cast to each
    tensor's dtype)."""
    return {key: (torch.randn(like[key].shape, generator=generator, dtype=torch.float64) * std).to(like[key].dtype)
            for key in update_keys(like)}


def add_noise(reply: Message, noise: dict[str, torch.Tensor]) -> Message:
    """``reply`` with ``noise[key]`` added to each noised tensor (a new message; scalars kept)."""
    out = Message(reply)
    for key, z in noise.items():
        out[key] = reply[key] + z
    return out

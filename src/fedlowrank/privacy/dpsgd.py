"""Record-level DP-SGD for local training (Abadi et al. 2016): per-example gradients, per-example clipping, noise.

Per-example gradients come from ``torch.func`` (``functional_call`` + ``vmap`` + ``grad_and_value``) over the
trained parameters only; the task's own ``loss(net, batch)`` is evaluated on each example as a batch of one.
Models whose forward branches on data (Hugging Face's attention-mask builders call ``mask.all()``, which ``vmap``
refuses) get the same gradients from one backward pass per example.
One step sets, for every trained parameter ``p``::

    p.grad = ( Σ_i g_i·min(1, C/‖g_i‖) + N(0, σ²C²) ) / B          ‖g_i‖: norm over all trained parameters

with ``B`` the batch size. The optimiser then steps as usual (any optimiser: post-processing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.utils._pytree import tree_leaves, tree_map


@dataclass
class DPSGD:
    """Per-example clipping norm C, noise multiplier σ and the generator of the noise (the client's round stream)."""

    clip: float
    noise_multiplier: float
    generator: torch.Generator


class _TaskLoss(nn.Module):
    """``task.loss(net, batch)`` as a module, so that ``functional_call`` can substitute the net's parameters."""

    def __init__(self, net: nn.Module, task):
        super().__init__()
        self.net = net
        self.task = task

    def forward(self, batch):
        return self.task.loss(self.net, batch)


def per_example_gradients(net: nn.Module, task, params: dict[str, nn.Parameter],
                          batch) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Gradients of each example's loss w.r.t. ``params`` (``{key: [B, *p.shape]}``) and the losses ``[B]``."""
    names = {id(p): n for n, p in net.named_parameters()}
    keys = list(params)
    values = {f"net.{names[id(params[k])]}": params[k].detach() for k in keys}
    module = _TaskLoss(net, task)

    def loss_of_one(ps, example):
        return functional_call(module, ps, (tree_map(lambda t: t.unsqueeze(0), example),), strict=False)

    try:
        grads, losses = vmap(grad_and_value(loss_of_one), in_dims=(None, 0), randomness="different")(values, batch)
        return {k: grads[f"net.{names[id(params[k])]}"] for k in keys}, losses
    except RuntimeError as exc:
        if "data-dependent control flow" not in str(exc):
            raise
    size = len(next(iter(tree_leaves(batch))))
    rows, losses = [], []
    wrt = [k for k in keys if params[k].requires_grad]
    for i in range(size):
        loss = task.loss(net, tree_map(lambda t: t[i : i + 1], batch))
        rows.append(dict(zip(wrt, torch.autograd.grad(loss, [params[k] for k in wrt], allow_unused=True))))
        losses.append(loss.detach())
    grads = {k: torch.stack([g[k] if g.get(k) is not None else torch.zeros_like(params[k]) for g in rows])
             for k in keys}
    return grads, torch.stack(losses)


def clip_factors(grads: dict[str, torch.Tensor], clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example norms ``[B]`` over all parameters and the factors ``min(1, C/norm)`` ``[B]``."""
    sq = sum(g.reshape(g.shape[0], -1).to(torch.float64).pow(2).sum(1) for g in grads.values())
    norms = sq.sqrt()
    return norms, (clip / norms.clamp_min(1e-12)).clamp(max=1.0)


def private_step_gradients(net: nn.Module, task, params: dict[str, nn.Parameter], batch, dp: DPSGD) -> torch.Tensor:
    """Set ``p.grad`` of every parameter in ``params`` to the noisy clipped mean gradient; returns the mean loss."""
    grads, losses = per_example_gradients(net, task, params, batch)
    _, factors = clip_factors(grads, dp.clip)
    std = dp.noise_multiplier * dp.clip
    for k, p in params.items():
        g = grads[k].to(torch.float64)
        total = torch.einsum("b,b...->...", factors.to(g.device), g)
        if std > 0:
            noise = torch.randn(total.shape, generator=dp.generator, dtype=torch.float64)  # CPU stream
            total = total + noise.to(total.device) * std
        p.grad = (total / g.shape[0]).to(p.dtype)
    return losses.mean().detach()

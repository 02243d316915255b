"""Local training: the loop every method shares, for one client or a cohort's members.

A method prepares a client's fit (:class:`Fit`: the parameters to train, the corrections, its own optimizer) and
the trainer runs it (``trainer.fit(model, params, corrections=..., optimizer=...)``, or the runtime's cohorts,
which step several clients' fits together). The trainer owns the client's data (its indices into the task's
training set), the task's loss, the hyper-parameters and the client's seeded stream for data order and dropout in
this round, so that the result does not depend on which other clients ran before. :class:`LocalSteps` is the one
loop of local steps; :class:`Alone` runs it for one client on its own model.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from ..device import DTYPES, grad_scaler, module_device, optimizer_kernel, stage
from ..execution.compiling import run_compiled
from ..execution.measure import local_step
from ..message import Message, State
from ..privacy.dpsgd import private_step_gradients
from ..schema import Schema, setting
from ..seeding import derive_seed, numpy_rng


@dataclass(frozen=True)
class OptimizerKind:
    """One ``train.optimizer``: the torch optimizer it builds from the config and the state it keeps per trained
    element (``slots``: AdamW's two moments, momentum's buffer; the cohort memory planner counts them)."""

    slots: int
    build: Callable[["TrainConfig", list[dict], float, dict], torch.optim.Optimizer]


OPTIMIZERS: dict[str, OptimizerKind] = {
    "sgd": OptimizerKind(0, lambda cfg, groups, lr, o: torch.optim.SGD(groups, lr=lr, weight_decay=cfg.weight_decay,
                                                                        **o)),
    "momentum": OptimizerKind(1, lambda cfg, groups, lr, o: torch.optim.SGD(
        groups, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **o)),
    "adam": OptimizerKind(2, lambda cfg, groups, lr, o: torch.optim.Adam(
        groups, lr=lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, **o)),
    "adamw": OptimizerKind(2, lambda cfg, groups, lr, o: torch.optim.AdamW(
        groups, lr=lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, **o)),
}
KERNEL_OPTIONS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def make_optimizer(cfg: "TrainConfig", groups: list[dict], kernel: str = "loop") -> torch.optim.Optimizer:
    """``train.optimizer`` (:data:`OPTIMIZERS`) over the parameter ``groups`` (each with its ``lr``), stepping with
    ``kernel`` (:data:`~fedlowrank.device.OPTIMIZER_KERNELS`: one tensor at a time, multi-tensor ``foreach`` or
    ``fused``; the same update to float rounding)."""
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"train.optimizer must be one of {tuple(OPTIMIZERS)}, got {cfg.optimizer!r}")
    return OPTIMIZERS[cfg.optimizer].build(cfg, groups, groups[0]["lr"], KERNEL_OPTIONS[kernel])


def restart_optimizer(opt: torch.optim.Optimizer, lrs: list[float]) -> None:
    """``opt`` as a new optimizer of the same parameters would be, in place (its state tensors keep their
    addresses): every state tensor zero (a zero step count, moments and momentum buffers: the first step then
    equals a fresh optimizer's), each group's learning rate from ``lrs``."""
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    if state:
        torch._foreach_zero_(state)
    for group, lr in zip(opt.param_groups, lrs):
        group["lr"] = lr

SCHEDULES = ("constant", "cosine", "linear")
CHECKPOINTING = ("auto", "true", "false")


@dataclass
class TrainConfig(Schema):
    """Local training hyper-parameters (config section ``[train]``), each declared with its meaning and bounds.

    ``max_grad_norm`` clips the loss gradient before the corrections' ``grad`` hooks add their terms: SCAFFOLD's
    ``c − cᵢ`` is an offset between clients that cancels in the average (Σ(c − cᵢ) = 0); clipping it per client
    would break that and make option II's ``(x − yᵢ)/(Kη)`` differ from the mean of the gradients it estimates.
    ``dtype``: the compute dtype, in which the frozen backbone is stored (see :mod:`fedlowrank.device`; fp16 adds
    CUDA's gradient scaler).
    """

    prefix = "train"

    local_steps: int = setting(5, "optimizer steps per client per round (when train.local_epochs is 0)", ge=0)
    local_epochs: float = setting(0.0, "passes over the client's data per round (> 0 overrides train.local_steps)",
                                  ge=0)
    batch_size: int = setting(16, "examples per local step", ge=1)
    optimizer: str = setting("adamw", "local optimizer (momentum = SGD with train.momentum)",
                             choices=tuple(OPTIMIZERS))
    lr: float = setting(5e-4, "local learning rate (of round 1; train.schedule decays it over rounds)", gt=0)
    head_lr: float = setting(0.0, "learning rate of the classifier head (0 = train.lr)", ge=0)
    momentum: float = setting(0.9, "momentum of the momentum optimizer", ge=0)
    weight_decay: float = setting(0.0, "weight decay of the local optimizer", ge=0)
    betas: tuple[float, float] = setting((0.9, 0.999), "Adam β1, β2", ge=0, lt=1)
    eps: float = setting(1e-8, "Adam ε (added to the root of the second moment)", gt=0)
    max_grad_norm: float = setting(0.0, "clip the gradient norm to this (0 = no clipping)", ge=0)
    schedule: str = setting("constant", "learning rate over rounds", choices=SCHEDULES)
    warmup_rounds: int = setting(0, "rounds of linear learning-rate warm-up", ge=0)
    dtype: str = setting("fp32", "compute dtype: fp32, bf16 or fp16 (CUDA); the frozen backbone is stored in it, what "
                         "is trained (adapters, head, optimizer state) stays fp32", choices=tuple(DTYPES))
    gradient_checkpointing: str = setting("auto", "recompute each layer's activations during backward (transformers' "
                                          "gradient checkpointing): far less activation memory for about a third "
                                          "more compute; auto = on on CUDA when the cohort fits only with it "
                                          "(run.cohort = 0: when it lets a larger cohort fit), else off",
                                          choices=CHECKPOINTING)

    def lr_at(self, rnd: int, rounds: int, base: float | None = None) -> float:
        """Learning rate in round ``rnd`` (1-based) of ``rounds``."""
        lr = self.lr if base is None else base
        if self.warmup_rounds and rnd <= self.warmup_rounds:
            return lr * rnd / self.warmup_rounds
        progress = (rnd - 1) / max(rounds - 1, 1)
        if self.schedule == "cosine":
            return lr * 0.5 * (1 + math.cos(math.pi * progress))
        if self.schedule == "linear":
            return lr * (1 - progress) + lr * 0.01 * progress
        return lr


@dataclass
class FitResult:
    """What a local fit reports: mean training loss, steps taken and the learning rate used."""

    loss: float
    steps: int
    lr: float
    head_lr: float | None = None  # the head's learning rate when it has its own group (None: ``lr``)


def steps_per_round(cfg: TrainConfig, num_examples: int) -> int:
    """Optimizer steps of a client with ``num_examples`` examples in one round."""
    if cfg.local_epochs > 0:
        return max(1, math.ceil(cfg.local_epochs * num_examples / cfg.batch_size))
    return cfg.local_steps


OptimizerFactory = Callable[[dict[str, nn.Parameter], float], torch.optim.Optimizer]


@dataclass
class Fit:
    """One client's local fit as its method prepares it (:meth:`~fedlowrank.methods.base.Method.prepare_fit`) and
    finishes it (:meth:`~fedlowrank.methods.base.Method.finish_fit`): ``params`` of ``model`` to train (already
    loaded), the ``corrections`` composed on the step (this fit's own copies, started), the method's own
    ``optimizer`` (``None``: ``train.optimizer``), and what the finish reads: the message received (``msg``), the
    client's new state being made (``state``; the corrections' ``finish`` adds to it) and ``carry`` (anything else
    the method keeps between the two phases)."""

    model: Any
    params: dict[str, nn.Parameter]
    corrections: list = field(default_factory=list)
    optimizer: OptimizerFactory | None = None
    msg: Message | None = None
    state: State | None = None
    carry: dict[str, Any] = field(default_factory=dict)


class LocalTrainer:
    """One client's local training in one round.

    Args:
        task: provides ``batch(indices) -> batch`` and ``loss(net, batch) -> scalar``.
        indices: the client's example indices into the task's training set, shape ``[n_k]``.
        cfg: :class:`TrainConfig`.
        client, rnd, rounds, seed: identify the stream (data order, dropout) and the learning rate.
        on_step: progress hook called after each optimizer step as ``on_step(step, total)`` (1-based).
        dpsgd: record-level DP-SGD (:class:`fedlowrank.privacy.dpsgd.DPSGD`): each step's gradient of the task loss
            is the noisy mean of per-example clipped gradients; ``None`` = plain training.
    """

    def __init__(self, task, indices: np.ndarray, cfg: TrainConfig, client: int, rnd: int, rounds: int, seed: int,
                 on_step: Callable[[int, int], None] | None = None, dpsgd=None):
        self.task = task
        self.dpsgd = dpsgd
        self.indices = np.asarray(indices)
        self.cfg = cfg
        self.client, self.rnd, self.rounds, self.seed = client, rnd, rounds, seed
        self.compute_seconds = 0.0
        self.on_step = on_step

    @property
    def num_examples(self) -> int:
        return len(self.indices)

    @property
    def lr(self) -> float:
        return self.cfg.lr_at(self.rnd, self.rounds)

    @property
    def num_steps(self) -> int:
        return steps_per_round(self.cfg, self.num_examples)

    def batches(self) -> Iterator:
        """Minibatches of the client's data, reshuffled each epoch, wrapping around."""
        rng = numpy_rng(self.seed, "data-order", self.client, self.rnd)
        bs = min(self.cfg.batch_size, self.num_examples)
        order = rng.permutation(self.indices)
        pos = 0
        while True:
            if pos + bs > len(order):
                order, pos = rng.permutation(self.indices), 0
            yield self.task.client_batch(order[pos : pos + bs], self.indices)
            pos += bs

    def fit(self, model, params: dict[str, nn.Parameter], corrections: Sequence = (),
            optimizer: OptimizerFactory | None = None) -> FitResult:
        """Train ``params`` (already loaded into ``model``) for :attr:`num_steps` steps, alone (:class:`Alone`), with
        ``corrections`` on each step and the method's own ``optimizer`` (``None``: ``train.optimizer``)."""
        member = MemberFit(self, Fit(model, dict(params), list(corrections), optimizer))
        return LocalSteps([member], Alone(member)).run(self.on_step)[0]


class MemberFit:
    """One client's fit in progress, alone or as one member of a cohort: its trainer and :class:`Fit`, learning
    rates, optimizer groups, fp16's loss scaler, its stream of host batches and its step losses (on the device)."""

    def __init__(self, trainer: LocalTrainer, fit: Fit):
        cfg = trainer.cfg
        self.trainer, self.fit = trainer, fit
        self.model, self.params, self.corrections = fit.model, fit.params, fit.corrections
        self.net = fit.model.net
        self.lr = self.head_lr = trainer.lr
        self.groups: list[dict] = []  # the default optimizer's parameter groups (none with a method's own optimizer)
        if fit.optimizer is None:
            self.head_lr = cfg.lr_at(trainer.rnd, trainer.rounds, cfg.head_lr) if cfg.head_lr else self.lr
            body = [p for k, p in fit.params.items() if not k.startswith("head/")]
            head = [p for k, p in fit.params.items() if k.startswith("head/")]
            self.groups = [g for g in ({"params": body, "lr": self.lr}, {"params": head, "lr": self.head_lr})
                           if g["params"]]
        self.device = module_device(self.net)
        self.scaler = grad_scaler(self.device, cfg.dtype)
        self.steps = trainer.num_steps
        self.batches = trainer.batches()  # host batches
        self.losses: list[torch.Tensor] = []

    @cached_property
    def opt(self) -> torch.optim.Optimizer:
        """This client's own optimizer: the method's (``fit.optimizer``), else ``train.optimizer`` over
        :attr:`groups` with the device's kernel (:func:`~fedlowrank.device.optimizer_kernel`); made when first used
        (a cohort steps its members with one optimizer of its own)."""
        if self.fit.optimizer is not None:
            return self.fit.optimizer(self.params, self.lr)
        return make_optimizer(self.trainer.cfg, self.groups, optimizer_kernel(self.device))

    def correction_terms(self, batch) -> list[torch.Tensor]:
        """The corrections' loss terms on this client's network and ``batch`` (FedProx, MOON)."""
        terms = (c.loss(self.params, self.net, batch, self.trainer.task) for c in self.corrections)
        return [t for t in terms if t is not None]

    def scaled(self, total: torch.Tensor) -> torch.Tensor:
        """What to call ``backward`` on: ``total``, times fp16's loss scale."""
        return total if self.scaler is None else self.scaler.scale(total)

    def corrected_gradients(self) -> None:
        """The corrections' ``grad`` hooks (SCAFFOLD: ``g + c − cᵢ``), after clipping."""
        for c in self.corrections:
            c.grad(self.params)

    def finish(self, losses: list[float]) -> FitResult:
        """The fit's :class:`FitResult`: the mean of the step ``losses``."""
        return FitResult(loss=float(np.mean(losses)) if losses else float("nan"), steps=self.steps, lr=self.lr,
                         head_lr=self.head_lr)


class LocalSteps:
    """The local steps of K ≥ 1 members' fits, the loop every local fit runs. Each step: the active members' (those
    with steps left) next batches, staged on the device before the step; inside :func:`local_step` (nothing moves
    between host and device there): the gradients cleared, one forward and one backward of the sum of the members'
    losses and correction terms (compiled with ``run.compile``), the gradients the optimizer steps with (clipping,
    the corrections' hooks) and the optimizer step. The losses are read from the device once, at the end.

    Where the forward runs and where the gradients are is the ``group``'s: one client alone on its own model
    (:class:`Alone`), or a cohort's members routed through one shared backbone
    (:class:`fedlowrank.runtime.cohort.Joint`). A group has ``stage(active)``, ``forward_backward(active,
    inputs) → losses [len(active)]``, ``update(active)`` (gradients and optimizer step), ``leave(member)`` (a member
    whose steps are done) and ``finish()``."""

    def __init__(self, members: list[MemberFit], group):
        self.members, self.group = members, group
        self.steps = max(m.steps for m in members)
        self.staged: dict[int, Any] = {}  # step → its inputs on the device
        self.losses: list[tuple[list[int], torch.Tensor]] = []  # per step: the members that stepped, their losses

    def active(self, step: int) -> list[int]:
        return [i for i, m in enumerate(self.members) if step < m.steps]

    def stage(self, step: int) -> None:
        """Prepare step ``step``'s inputs on the host and start their move to the device (not waited for)."""
        self.staged[step] = self.group.stage(self.active(step))

    def step(self, step: int) -> None:
        """Step ``step`` (0-based) of the members with steps left, on its staged inputs (staged now if not)."""
        active = self.active(step)
        inputs = self.staged.pop(step) if step in self.staged else self.group.stage(active)
        with local_step():
            losses = self.group.forward_backward(active, inputs)
            self.group.update(active)
        self.losses.append((active, losses.detach()))
        for i in active:
            if step + 1 == self.members[i].steps and step + 1 < self.steps:
                self.group.leave(i)

    def run(self, on_step: Callable[[int, int], None] | None = None) -> list[FitResult]:
        """Every step (the next one staged while the device runs the current one), ``on_step(step, total)`` after
        each; the time spent is shared among the members' trainers. Returns each member's :class:`FitResult`."""
        t0 = time.perf_counter()
        for step in range(self.steps):
            self.step(step)
            if step + 1 < self.steps:
                self.stage(step + 1)
            if on_step is not None:
                on_step(step + 1, self.steps)
        elapsed = time.perf_counter() - t0
        for m in self.members:
            m.trainer.compute_seconds += elapsed / len(self.members)
        return self.finish()

    def finish(self) -> list[FitResult]:
        values = torch.cat([x.reshape(-1) for _, x in self.losses]).tolist() if self.losses else []
        per_member: list[list[float]] = [[] for _ in self.members]
        at = 0
        for active, x in self.losses:
            for i in active:
                per_member[i].append(values[at])
                at += 1
        self.group.finish()
        return [m.finish(losses) for m, losses in zip(self.members, per_member)]


class Alone:
    """The :class:`LocalSteps` group of one client on its own model: the task's loss of the client's batch plus its
    corrections' terms, backward (through fp16's loss scale); then its gradients unscaled, the loss gradient clipped
    (``train.max_grad_norm``), the corrections' ``grad`` hooks, its own optimizer's step. With ``privacy.dpsgd`` the
    gradient of the loss is DP-SGD's noisy mean of per-example clipped gradients instead
    (:func:`~fedlowrank.privacy.dpsgd.private_step_gradients`). Dropout draws from the client's own stream."""

    def __init__(self, member: MemberFit):
        self.member = member
        trainer = member.trainer
        torch.manual_seed(derive_seed(trainer.seed, "dropout", trainer.client, trainer.rnd))
        self.task = trainer.task
        member.net.train()

    def stage(self, active: list[int]):
        """The next batch on the device: the task's step inputs (:meth:`Task.device_batch`), or with
        ``privacy.dpsgd``, which slices every tensor of a batch per example, the batch's own tensors."""
        m = self.member
        batch = next(m.batches)
        return stage(batch, m.device) if m.trainer.dpsgd else self.task.device_batch(batch, m.device)

    def zero_grad(self) -> None:
        self.member.opt.zero_grad(set_to_none=True)

    def forward_backward(self, active: list[int], batch) -> torch.Tensor:
        m, trainer = self.member, self.member.trainer
        self.zero_grad()
        if trainer.dpsgd is not None:
            if m.scaler is not None:
                raise ValueError("privacy.dpsgd: train.dtype = 'fp16' is not supported (its loss scaler would "
                                 "rescale the noisy gradient); use bf16 or fp32")
            loss = private_step_gradients(m.net, self.task, m.params, batch, trainer.dpsgd)
            if any(c.loss(m.params, m.net, batch, self.task) is not None for c in m.corrections):
                raise ValueError("privacy.dpsgd: corrections that add a loss term (fedprox, moon) are not "
                                 "supported (their gradient would not be clipped per example)")
            return loss

        def forward_backward() -> torch.Tensor:
            loss = self.task.loss(m.net, batch)
            m.scaled(sum(m.correction_terms(batch), loss)).backward()
            return loss
        return run_compiled(self.task.compiled_module(m.net), forward_backward, self.zero_grad)

    def update(self, active: list[int]) -> None:
        m = self.member
        if m.scaler is not None:
            m.scaler.unscale_(m.opt)  # clipping and corrections see true gradients
        if m.trainer.cfg.max_grad_norm > 0:      # clip the gradient of the loss, then correct it (SCAFFOLD)
            nn.utils.clip_grad_norm_(list(m.params.values()), m.trainer.cfg.max_grad_norm)
        m.corrected_gradients()
        if m.scaler is None:
            m.opt.step()
        else:
            m.scaler.step(m.opt)
            m.scaler.update()

    def leave(self, member: int) -> None:
        pass

    def finish(self) -> None:
        self.member.net.eval()

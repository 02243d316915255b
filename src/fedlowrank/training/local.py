"""Local training on one client: the loop every method shares.

A method calls ``trainer.fit(model, params, corrections=..., optimizer=...)``. The trainer owns the client's
data (its indices into the task's training set), the task's loss, the hyper-parameters and the client's
seeded stream for data order and dropout in this round, so that the result does not depend on which other
clients ran before.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from ..device import DTYPES, grad_scaler, local_step, module_device, optimizer_kernel, run_compiled, stage
from ..privacy.dpsgd import private_step_gradients
from ..schema import Schema, setting
from ..seeding import derive_seed, numpy_rng

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
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
    optimizer: str = setting("adamw", "local optimizer (momentum = SGD with train.momentum)", choices=OPTIMIZERS)
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
                                          "more compute; auto = on when run.cohort = 0 finds that it lets a larger "
                                          "cohort fit on CUDA, else off", choices=CHECKPOINTING)

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


def make_optimizer(cfg: TrainConfig, groups: list[dict], kernel: str = "loop") -> torch.optim.Optimizer:
    """``train.optimizer`` over the parameter ``groups`` (each with its ``lr``), stepping with ``kernel``
    (:data:`~fedlowrank.device.OPTIMIZER_KERNELS`: one tensor at a time, multi-tensor ``foreach`` or ``fused``;
    the same update to float rounding)."""
    options = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[kernel]
    lr = groups[0]["lr"]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, weight_decay=cfg.weight_decay, **options)
    if cfg.optimizer == "momentum":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **options)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(groups, lr=lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, **options)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, **options)
    raise ValueError(f"train.optimizer must be one of {OPTIMIZERS}, got {cfg.optimizer!r}")


def steps_per_round(cfg: TrainConfig, num_examples: int) -> int:
    """Optimizer steps of a client with ``num_examples`` examples in one round."""
    if cfg.local_epochs > 0:
        return max(1, math.ceil(cfg.local_epochs * num_examples / cfg.batch_size))
    return cfg.local_steps


OptimizerFactory = Callable[[dict[str, nn.Parameter], float], torch.optim.Optimizer]


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
        """Train ``params`` (already loaded into ``model``) for :attr:`num_steps` steps."""
        torch.manual_seed(derive_seed(self.seed, "dropout", self.client, self.rnd))
        run = FitRun(self, model, params, corrections, optimizer)
        t0 = time.perf_counter()
        for step in range(run.steps):
            run.train_step()
            if step + 1 < run.steps:
                run.stage_next()  # the next step's inputs, while the device still runs this one
            if self.on_step is not None:
                self.on_step(step + 1, run.steps)
        self.compute_seconds += time.perf_counter() - t0
        return run.finish()


class FitRun:
    """One client's fit in progress: its optimizer, loss scaler, data stream and losses. :meth:`LocalTrainer.fit`
    drives one; a cohort's joint loop (:mod:`fedlowrank.runtime.cohort`) drives several, one step of each per
    joint forward and backward.

    Each step: ``opt.zero_grad``; the task loss of :meth:`next_batch`, plus the corrections' loss terms
    (:meth:`with_corrections`), backward through :meth:`scaled`; then :meth:`step`. A step's inputs are staged on
    the device before it (:meth:`stage_next`, :meth:`Task.device_batch <fedlowrank.tasks.base.Task.device_batch>`):
    inside the step (:func:`~fedlowrank.device.local_step`) nothing moves between host and device.
    """

    def __init__(self, trainer: LocalTrainer, model, params: dict[str, nn.Parameter], corrections: Sequence = (),
                 optimizer: OptimizerFactory | None = None):
        cfg = trainer.cfg
        self.trainer, self.model, self.params, self.corrections = trainer, model, params, list(corrections)
        self.factory = optimizer
        self.lr = self.head_lr = trainer.lr
        self.groups: list[dict] = []  # the default optimizer's parameter groups (none with a method's own optimizer)
        if optimizer is None:
            self.head_lr = cfg.lr_at(trainer.rnd, trainer.rounds, cfg.head_lr) if cfg.head_lr else self.lr
            body = [p for k, p in params.items() if not k.startswith("head/")]
            head = [p for k, p in params.items() if k.startswith("head/")]
            self.groups = [g for g in ({"params": body, "lr": self.lr}, {"params": head, "lr": self.head_lr})
                           if g["params"]]
        self.net = model.net
        self.net.train()
        self.device = module_device(self.net)
        self.scaler = grad_scaler(self.device, cfg.dtype)
        self.steps = trainer.num_steps
        self.batches = trainer.batches()  # host batches
        self.staged = None  # the next step's batch on the device (stage_next)
        self.losses: list[torch.Tensor] = []

    @cached_property
    def opt(self) -> torch.optim.Optimizer:
        """This client's optimizer: the method's own (``optimizer``), else ``train.optimizer`` over :attr:`groups`
        with the device's kernel (:func:`~fedlowrank.device.optimizer_kernel`). Made when first used: a cohort
        steps its members together (:mod:`fedlowrank.runtime.cohort`)."""
        if self.factory is not None:
            return self.factory(self.params, self.lr)
        return make_optimizer(self.trainer.cfg, self.groups, optimizer_kernel(self.device))

    def train_step(self) -> None:
        """One local step alone: :meth:`next_batch`, ``zero_grad``, the task loss plus the corrections' terms and
        backward (compiled with ``run.compile``; with ``privacy.dpsgd``: the noisy mean of clipped per-example
        gradients instead), :meth:`step`."""
        batch = self.next_batch()
        with local_step():
            self._train_step(batch)

    def _train_step(self, batch) -> None:
        trainer = self.trainer
        self.opt.zero_grad(set_to_none=True)
        if trainer.dpsgd is not None:
            if self.scaler is not None:
                raise ValueError("privacy.dpsgd: train.dtype = 'fp16' is not supported (its loss scaler would "
                                 "rescale the noisy gradient); use bf16 or fp32")
            loss = private_step_gradients(self.net, trainer.task, self.params, batch, trainer.dpsgd)
            if any(c.loss(self.params, self.net, batch, trainer.task) is not None for c in self.corrections):
                raise ValueError("privacy.dpsgd: corrections that add a loss term (fedprox, moon) are not "
                                 "supported (their gradient would not be clipped per example)")
        else:
            def forward_backward() -> torch.Tensor:
                loss = trainer.task.loss(self.net, batch)
                self.scaled(self.with_corrections(loss, batch)).backward()
                return loss

            restart = partial(self.opt.zero_grad, set_to_none=True)
            loss = run_compiled(trainer.task.compiled_module(self.net), forward_backward, restart)
        self.step(loss)

    def stage_next(self) -> None:
        """Prepare the next step's batch on the host and start its move to the device (staged, not waited for):
        the task's step inputs (:meth:`Task.device_batch`), or with ``privacy.dpsgd``, which slices every tensor of
        a batch per example, the batch's own tensors."""
        batch = next(self.batches)
        task = self.trainer.task
        self.staged = stage(batch, self.device) if self.trainer.dpsgd else task.device_batch(batch, self.device)

    def next_batch(self):
        """The next step's batch on the device: the staged one (:meth:`stage_next`), else staged now."""
        if self.staged is None:
            self.stage_next()
        batch, self.staged = self.staged, None
        return batch

    def with_corrections(self, loss: torch.Tensor, batch) -> torch.Tensor:
        """``loss`` plus the corrections' loss terms (:meth:`correction_terms`)."""
        return sum(self.correction_terms(batch), loss)

    def correction_terms(self, batch) -> list[torch.Tensor]:
        """The corrections' loss terms on this client's network and ``batch`` (FedProx, MOON)."""
        terms = (c.loss(self.params, self.net, batch, self.trainer.task) for c in self.corrections)
        return [t for t in terms if t is not None]

    def scaled(self, total: torch.Tensor) -> torch.Tensor:
        """What to call ``backward`` on: ``total``, times fp16's loss scale."""
        return total if self.scaler is None else self.scaler.scale(total)

    def step(self, loss: torch.Tensor) -> None:
        """After backward: :meth:`final_gradients`, :meth:`optimizer_step`, :meth:`record` ``loss``."""
        self.final_gradients()
        self.optimizer_step()
        self.record(loss)

    def optimizer_step(self) -> None:
        """This client's optimizer step (through fp16's loss scaler)."""
        if self.scaler is None:
            self.opt.step()
        else:
            self.scaler.step(self.opt)
            self.scaler.update()

    def final_gradients(self) -> None:
        """The gradients the optimizer steps with: unscaled (fp16), the loss gradient clipped, then the corrections'
        ``grad`` hooks (SCAFFOLD)."""
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)  # clipping and corrections see true gradients
        if self.trainer.cfg.max_grad_norm > 0:      # clip the gradient of the loss, then correct it (SCAFFOLD)
            nn.utils.clip_grad_norm_(list(self.params.values()), self.trainer.cfg.max_grad_norm)
        for c in self.corrections:
            c.grad(self.params)

    def record(self, loss: torch.Tensor) -> None:
        self.losses.append(loss.detach())  # read once in finish: no device synchronisation per step

    def finish(self, losses: list[float] | None = None) -> FitResult:
        """The fit's :class:`FitResult` (the mean of the step losses, read from the device at once unless given
        as ``losses``); the network back in eval mode."""
        self.net.eval()
        if losses is None:
            losses = torch.stack(self.losses).tolist() if self.losses else []
        return FitResult(loss=float(np.mean(losses)) if losses else float("nan"), steps=self.steps, lr=self.lr,
                         head_lr=self.head_lr)

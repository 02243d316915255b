"""How a run trains, decided once per run in one place and passed down (:class:`Plan`): how many clients train
together (``run.cohort``, with the cohort memory planner on CUDA), whether a causal-LM cohort's examples are packed
(``task.options.pack = auto``), gradient checkpointing (``train.gradient_checkpointing``) and compilation
(``run.compile``). The task is built with the packing decision (:func:`packs_cohorts`); the rest is decided before
the first client trains (:func:`plan_training`) and applied to the model by :meth:`Plan.prepare`, the one place
that stores the backbone in ``train.dtype``, switches checkpointing and compiles.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..adapters.model import AdaptedModel
from ..device import can_checkpoint, module_device, resolve_device, set_checkpointing, store_frozen
from ..execution.compiling import compile_module
from ..execution.measure import allocated_bytes, measured_bytes
from ..methods import method_class
from ..methods.base import Method
from ..models.quantize import weight_bytes
from ..training.local import OPTIMIZERS

log = logging.getLogger("fedlowrank")


@dataclass(frozen=True)
class Plan:
    """How a run trains (:func:`plan_training`).

    Attributes:
        dtype: ``train.dtype``, the backbone's storage and compute dtype.
        cohort: how many clients train together (1: one at a time); ``cohort_reason``: why 1 when ``run.cohort``
            asked for more (``""`` otherwise).
        checkpointing: gradient checkpointing on.
        compile: the training steps compiled; ``compile_rule``: why, in one line (logged once by the run).
        static_shapes: the steps' shapes are static (length buckets), so that each compiles once.
    """

    dtype: str
    cohort: int = 1
    cohort_reason: str = ""
    checkpointing: bool = False
    compile: bool = False
    compile_rule: str = ""
    static_shapes: bool = False

    def prepare(self, model: AdaptedModel, task) -> None:
        """Apply the plan to ``model`` before a client trains on it (idempotent): the frozen backbone in
        ``train.dtype`` (:func:`~fedlowrank.device.store_frozen`), gradient checkpointing on or off, and the
        compiled forward of the task's :meth:`~fedlowrank.tasks.base.Task.compiled_module` when it compiles."""
        store_frozen(model, self.dtype)
        set_checkpointing(model.net, self.checkpointing)
        if self.compile:
            compile_module(task.compiled_module(model.net), module_device(model.net), self.static_shapes)


def packs_cohorts(cfg) -> bool:
    """Whether ``task.options.pack = "auto"`` packs: when the run trains cohorts (``run.cohort`` > 1, or 0 on CUDA,
    with a method that supports them) and packing is correct: not with DP-SGD (it clips each example's gradient,
    and a packed row holds several examples) nor with a method that reads each example's features (a packed row
    has no per-example representation). The task is built with it (:func:`fedlowrank.tasks.build_task`)."""
    method = method_class(cfg.method_name)
    cohorts = cfg.run.cohort > 1 or (cfg.run.cohort == 0 and resolve_device(cfg.run.device).type == "cuda")
    return cohorts and method.supports_cohorts and not method.reads_features and not cfg.privacy.dpsgd


def plan_training(cfg, method: Method, task, model: AdaptedModel, device: torch.device,
                  one_at_a_time: bool = False) -> Plan:
    """The run's :class:`Plan`: the cohort size (:func:`cohort_size`; on CUDA with ``run.cohort = 0`` the largest
    that fits, with gradient checkpointing when ``train.gradient_checkpointing = auto`` and that fits more; 1 for a
    run that trains ``one_at_a_time``, a Flower node's), the checkpointing (``true``/``false`` as set; ``auto``:
    the planner's choice, else off) and the compilation (:func:`compile_decision`). Called once, before the first
    client trains."""
    mode = cfg.train.gradient_checkpointing
    size, reason, checkpointing = (1, "", False) if one_at_a_time else cohort_size(cfg, method, task, model, device)
    if mode != "auto":
        checkpointing = mode == "true"
    compiles, rule = compile_decision(cfg, task, device, size)
    return Plan(dtype=cfg.train.dtype, cohort=size, cohort_reason=reason, checkpointing=checkpointing,
                compile=compiles, compile_rule=rule, static_shapes=bool(cfg.task.length_buckets))


def cohort_size(cfg, method: Method, task, model: AdaptedModel, device: torch.device) -> tuple[int, str, bool]:
    """How many clients train together (``run.cohort`` resolved for ``device``), why it is 1 when ``run.cohort``
    asked for more ("" otherwise), and whether gradient checkpointing is needed for it. Automatic
    (``run.cohort = 0``): one on the CPU; on CUDA the most of a round's clients whose estimated peak
    (:func:`cohort_memory`) fits ``run.gpu_memory_fraction`` of the memory this process can still use, with
    gradient checkpointing when that fits more (:func:`largest_fitting_cohort`); a fixed cohort on CUDA with
    ``train.gradient_checkpointing = auto`` checkpoints when only that fits it (:func:`needs_checkpointing`)."""
    asked = cfg.run.cohort or (cfg.run.clients_per_round if device.type == "cuda" else 1)
    if asked == 1:
        return 1, "", False
    if cfg.privacy.dpsgd:
        reason = "privacy.dpsgd clips per example within one client's step"
    elif cfg.train.dtype == "fp16":
        reason = "train.dtype = fp16: its loss scaler skips a client's step when that client's gradients overflow"
    elif not method.supports_cohorts:
        reason = (f"method {method.name!r} trains one client at a time (it has its own train, not the two phases "
                  f"prepare_fit and finish_fit)")
    elif not task.supports_cohorts:
        reason = f"task {task.name!r} cannot join several clients' batches"
    elif any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.net.modules()):
        reason = "the network's batch normalisation would mix the clients' rows"
    else:
        asked = min(asked, cfg.run.clients_per_round)
        if not cfg.run.cohort:
            size, checkpointing = largest_fitting_cohort(cfg, task, model, device, asked)
            return size, "", checkpointing
        return asked, "", needs_checkpointing(cfg, task, model, device, asked)
    return 1, reason, False


@dataclass
class CohortMemory:
    """Estimated peak bytes of a cohort of ``k`` members: :meth:`resident` (the shared model as stored, what else
    the device already holds, each member's own parameters and optimizer state) plus :meth:`step` (what a joint
    step allocates at its peak: the larger of its forward's peak and its backward's, each a fixed part plus a part
    per row, the backward's with each member's gradients), with or without gradient checkpointing
    (``checkpointing``)."""

    base: int         # the shared model's parameters and buffers, as stored (train.dtype; 4/8-bit weights packed)
    own: int          # one member's own parameters (adapters, head), fp32
    slots: int        # optimizer state per parameter element (AdamW: 2)
    forward: tuple[float, float]   # (fixed, per row): the forward's peak (workspace, a chunk of logits, activations)
    backward: tuple[float, float]  # (fixed, per row): the activations the forward left plus the backward's peak
    rows: float       # rows per member per step (train.batch_size; packed rows: Task.rows_per_step)
    checkpointing: bool = False    # the probes ran with gradient checkpointing
    held: int = 0     # device memory held besides the model and one member's parameters (libraries' workspaces)

    def resident(self, k: int) -> float:
        return self.base + self.held + k * self.own * (1 + self.slots)

    def step(self, k: int) -> float:
        rows = k * self.rows
        return max(self.forward[0] + self.forward[1] * rows, self.backward[0] + self.backward[1] * rows + k * self.own)

    def peak(self, k: int) -> float:
        return self.resident(k) + self.step(k)

    def largest(self, budget: float, most: int) -> int:
        """The largest cohort up to ``most`` whose :meth:`peak` fits ``budget`` bytes; at least 1."""
        return max([k for k in range(1, most + 1) if self.peak(k) <= budget] or [1])


def cohort_memory(cfg, task, model: AdaptedModel, checkpointing: bool | None = None,
                  per_layer: bool = True) -> CohortMemory:
    """:class:`CohortMemory` from the model's size and dtype (its tensors as training stores them,
    :func:`~fedlowrank.device.store_frozen`; quantised weights at their packed size), the trained parameters
    (adapters at their rank, head), the optimizer, the batch size, and two probe steps (forward and backward, no
    optimizer, each phase's peak measured apart: which one is the step's peak can change with the rows, e.g. a
    chunk of logits in the forward against a checkpointed layer's recomputation in the backward) on the model's
    device of r and r + 2 rows of the task's longest padded batch (:meth:`~fedlowrank.tasks.base.Task.probe_batch`;
    r from :meth:`~fedlowrank.tasks.base.Task.probe_rows`: enough rows for a full chunk of logits when a round's
    joint batch fills one, so that the chunk is part of the fixed bytes and the estimate holds from r rows on,
    above it for fewer), whose differences are what 2 rows add. The probes run with gradient checkpointing on or
    off as ``checkpointing`` says (``None``: as the model is); the model is left as it was. An unmeasured probe of
    one row runs first, so that what a device allocates once at its first step (cuBLAS's workspaces) is held
    before the measured probes and counted in ``held`` (what is allocated beyond the model and one member's
    parameters), not in the step's bytes.

    With ``per_layer`` (the default) and a decoder of L ≥ 3 layers of one kind (:func:`stacked_layers`), each probe
    runs on the decoder cut to its first 1 and then 2 layers and is extrapolated to L,
    ``bytes(L) = bytes(1) + (L − 1)·(bytes(2) − bytes(1))``: every layer adds the same activations (and, with
    checkpointing, the same saved input) while the head's chunk of logits and a layer's recomputation are counted
    once; layers past the second are never run (they may even stay on the ``meta`` device)."""
    store_frozen(model, cfg.train.dtype)
    net, device = model.net, module_device(model.net)
    own = model.own_parameters()
    own_bytes = sum(p.numel() * 4 for p in own)
    was_training, requires = net.training, [p.requires_grad for p in own]
    was_checkpointing = bool(getattr(net, "is_activation_checkpointing", False))
    checkpointing = was_checkpointing if checkpointing is None else checkpointing

    def probe(rows: int) -> tuple[int, int]:
        """(forward peak, backward peak above what was allocated before the forward) of ``rows`` rows."""
        batch = task.device_batch(task.probe_batch(rows), device)
        out = {}

        def forward():
            out["loss"] = task.loss(net, batch)
        try:
            forward_peak, held = measured_bytes(forward, device)
            backward_peak, _ = measured_bytes(lambda: out.pop("loss").backward(), device)
            return forward_peak, held + backward_peak
        finally:
            for p in own:
                p.grad = None

    stack = stacked_layers(net) if per_layer else None

    def probes(rows: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The probes of ``rows`` and ``rows + 2`` rows, extrapolated over the layers when ``per_layer``."""
        if stack is None:
            return probe(rows), probe(rows + 2)
        layers = len(stack[1])
        one, two = (cut_decoder(net, n, lambda: (probe(rows), probe(rows + 2))) for n in (1, 2))
        return tuple(tuple(a + (layers - 1) * (b - a) for a, b in zip(p1, p2)) for p1, p2 in zip(one, two))

    net.train()
    for p in own:
        p.requires_grad_(True)
    set_checkpointing(net, checkpointing)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # dropout draws: not the run's
            rows = task.probe_rows(cfg.run.clients_per_round * task.rows_per_step(cfg.train.batch_size))
            if stack is None:  # the warm-up, not measured
                probe(1)
            else:
                cut_decoder(net, 1, lambda: probe(1))
            held = max(allocated_bytes(device) - weight_bytes(net) - own_bytes, 0)
            small, large = probes(rows)
    finally:
        set_checkpointing(net, was_checkpointing)
        net.train(was_training)
        for p, r in zip(own, requires):
            p.requires_grad_(r)

    def line(phase: int, member_bytes: int) -> tuple[float, float]:
        per_row = max(large[phase] - small[phase], 0) / 2
        return max(small[phase] - rows * per_row - member_bytes, 0), per_row

    return CohortMemory(base=weight_bytes(net), own=own_bytes, slots=OPTIMIZERS[cfg.train.optimizer].slots, forward=line(0, 0),
                        backward=line(1, own_bytes), rows=task.rows_per_step(cfg.train.batch_size),
                        checkpointing=checkpointing, held=held)


def stacked_layers(net: nn.Module) -> tuple[nn.Module, nn.ModuleList] | None:
    """``(decoder, its layers)`` of a transformers decoder (``get_decoder().layers``) of at least 3 layers, all of one
    class and size and of one attention kind (``config.layer_types``), which a probe may cut
    (:func:`cut_decoder`); ``None`` otherwise."""
    decoder = net.get_decoder() if hasattr(net, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    config = getattr(decoder, "config", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) < 3 or config is None:
        return None
    sizes = {(type(layer), sum(p.numel() for p in layer.parameters())) for layer in layers}
    kinds = set(getattr(config, "layer_types", None) or [None])
    return (decoder, layers) if len(sizes) == 1 and len(kinds) == 1 else None


def cut_decoder(net: nn.Module, layers: int, fn: Callable[[], Any]) -> Any:
    """``fn()`` with ``net``'s decoder (:func:`stacked_layers`) cut to its first ``layers`` layers; restored after."""
    decoder, full = stacked_layers(net)
    config = decoder.config
    depth = config.num_hidden_layers
    decoder.layers, config.num_hidden_layers = nn.ModuleList(full[:layers]), layers
    try:
        return fn()
    finally:
        decoder.layers, config.num_hidden_layers = full, depth


def memory_budget(cfg, device: torch.device) -> float:
    """``run.gpu_memory_fraction`` of the memory this process can use on ``device`` (free plus what torch's
    allocator already holds), in bytes."""
    free, _ = torch.cuda.mem_get_info(device)
    return cfg.run.gpu_memory_fraction * (free + torch.cuda.memory_reserved(device))


def largest_fitting_cohort(cfg, task, model: AdaptedModel, device: torch.device, most: int) -> tuple[int, bool]:
    """The largest cohort up to ``most`` whose estimated peak (:func:`cohort_memory`) fits :func:`memory_budget`
    (at least 1), and whether it checkpoints: with ``train.gradient_checkpointing = "auto"`` (and a model that
    supports it) when that fits a larger cohort than without (a joint step of more members gains more than
    checkpointing's recomputation costs). Logs the choice in one line."""
    budget = memory_budget(cfg, device)
    mode = cfg.train.gradient_checkpointing
    choices = [False, True] if mode == "auto" and can_checkpoint(model.net) else [mode == "true"]
    size, memory = 0, None
    for checkpointing in choices:
        estimate = cohort_memory(cfg, task, model, checkpointing)
        fits = estimate.largest(budget, most)
        if fits > size:
            size, memory = fits, estimate
        if size == most:
            break
    log.info("run.cohort = 0: %d of %d clients train together (estimated peak %.2f GiB; budget %.2f GiB = "
             "run.gpu_memory_fraction %.2f of the free memory; gradient checkpointing %s)", size, most,
             memory.peak(size) / 2**30, budget / 2**30, cfg.run.gpu_memory_fraction,
             ("on" if memory.checkpointing else "off") + (" (auto)" if mode == "auto" else ""))
    return size, memory.checkpointing


def needs_checkpointing(cfg, task, model: AdaptedModel, device: torch.device, size: int) -> bool:
    """Whether a fixed cohort of ``size`` (``run.cohort`` > 1) checkpoints: on CUDA with
    ``train.gradient_checkpointing = "auto"`` and a model that supports it, when its estimated peak without
    checkpointing exceeds :func:`memory_budget` and with it fits (one line says so); never elsewhere."""
    if device.type != "cuda" or cfg.train.gradient_checkpointing != "auto" or not can_checkpoint(model.net):
        return False
    budget = memory_budget(cfg, device)
    if cohort_memory(cfg, task, model, False).peak(size) <= budget:
        return False
    fits = cohort_memory(cfg, task, model, True).peak(size) <= budget
    if fits:
        log.info("run.cohort = %d: gradient checkpointing on (auto): the cohort fits the budget of %.2f GiB only "
                 "with it", size, budget / 2**30)
    return fits


COMPILE_WARMUP_S = 98.0  # one shape's torch.compile warm-up (inductor, CUDA graphs), measured on an H100
COMPILE_SAVED_S = 0.128  # the time a compiled step saved there (142.6 → 14.8 ms; SmolLM2-135M, bf16, batch 4)
COMPILE_BREAK_EVEN = round(COMPILE_WARMUP_S / COMPILE_SAVED_S)  # steps per compiled shape that repay its warm-up


def planned_steps(cfg, task, cohort: int) -> int:
    """The local steps a run's compiled module will take (one per cohort step): ``run.rounds`` × the round's
    cohorts of ``cohort`` clients × the steps per client (``train.local_steps``, or ``train.local_epochs`` over a
    client's mean share of the examples)."""
    train = cfg.train
    per_client = (math.ceil(train.local_epochs * task.num_train / cfg.partition.num_clients / train.batch_size)
                  if train.local_epochs > 0 else train.local_steps)
    return cfg.run.rounds * math.ceil(cfg.run.clients_per_round / cohort) * max(per_client, 1)


def compile_decision(cfg, task, device: torch.device, cohort: int = 1) -> tuple[bool, str]:
    """Whether a run compiles (``run.compile``), and the rule in one line. ``auto``: on CUDA with length buckets
    (static shapes: each compiled once, replayed as a CUDA graph) when the planned steps per bucket
    (:func:`planned_steps`) reach :data:`COMPILE_BREAK_EVEN`, a measured warm-up per shape over the time a step
    saved, else eager, naming how many buckets would repay it; never on the CPU (tiny-llama, inductor: 3 rounds
    took 106.6 s compiled against 3.4 s eager)."""
    if cfg.run.compile != "auto":
        return cfg.run.compile == "true", f"run.compile = {cfg.run.compile}"
    shapes = len(cfg.task.length_buckets)
    steps = planned_steps(cfg, task, cohort)
    if device.type != "cuda" or not shapes:
        why = "on the CPU" if device.type != "cuda" else "without task.length_buckets (no static shapes)"
        return False, f"run.compile = auto: eager {why}"
    per_shape = steps / shapes
    wanted = per_shape >= COMPILE_BREAK_EVEN
    fewer = steps // COMPILE_BREAK_EVEN
    advice = f"; {fewer} length bucket(s) would repay it" if not wanted and fewer else ""
    return wanted, (f"run.compile = auto: {'compiled' if wanted else 'eager'}: {steps} planned steps over {shapes} "
                    f"length buckets = {per_shape:.0f} per bucket {'≥' if wanted else '<'} {COMPILE_BREAK_EVEN}, the "
                    f"steps that repay a bucket's warm-up (≈ {COMPILE_WARMUP_S:.0f} s against "
                    f"{1000 * COMPILE_SAVED_S:.0f} ms saved per step, measured on an H100){advice}")


__all__ = ["COMPILE_BREAK_EVEN", "CohortMemory", "Plan", "cohort_memory", "cohort_size", "compile_decision",
           "cut_decoder", "largest_fitting_cohort", "memory_budget", "needs_checkpointing", "packs_cohorts",
           "plan_training", "planned_steps", "stacked_layers"]

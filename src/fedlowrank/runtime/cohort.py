"""Client cohorts: several sampled clients of a round train together, one forward and backward per step.

``run.cohort`` clients (0 = automatic: every sampled client of the round on CUDA, 1 on the CPU, where a joint step
measured no gain) form a cohort. Each member runs its own :func:`~.engine.client_update` exactly as alone: its own
copy of the method (:meth:`~fedlowrank.methods.base.Method.cohort_member`: own correction objects), on its own
model view (:meth:`~fedlowrank.adapters.model.AdaptedModel.shared_copy`: own adapter factors, base deltas,
scales and head; the frozen backbone shared), with its own trainer (data order, learning rates). Only the local
steps are shared:

1. **Rendezvous** (:func:`run_together`): each member's ``client_update`` runs in a worker thread that runs only
   while the caller waits for it (one thread at a time, in member order: deterministic). It stops at its first
   ``trainer.fit(...)`` (:class:`CohortTrainer`) and hands over the arguments, a :class:`FitRequest`.
2. **Joint loop** (:class:`JointFit`): every step, each member's next minibatch (from its own stream) is joined
   into one batch (:meth:`Task.join_batches`: rows in member order, sequences padded), one forward runs through
   the shared backbone with every adapted target and the head routing member k's rows through member k's own
   modules (:meth:`AdaptedModel.routed`: the shared ``W0`` multiplies all rows at once, and LoRA's paths run as
   products batched over the members when they have as many rows each, their factors slices of one tensor per
   target and factor, :class:`~fedlowrank.adapters.lora.LoRAStack`, so that the backward fills one gradient
   buffer for all members), the members' losses come out together
   (:meth:`Task.output_losses`), and one backward of ``Σₖ (lossₖ + correction termsₖ)`` puts each member's
   gradient on its own parameters. Then each member does what :meth:`LocalTrainer.fit` does after backward
   (:meth:`~fedlowrank.training.local.FitRun.final_gradients`): its gradient clipping, its corrections' ``grad``
   hooks (SCAFFOLD, ILoRA-S); and one optimizer step updates every member (:func:`joint_optimizer`: each
   parameter keeps its own state, so it equals the members' own steps). A member whose steps are done (fewer
   examples with ``train.local_epochs``) leaves the joint batch. The losses are read from the device once, at
   the end.
3. Each member's ``client_update`` then goes on from ``fit``'s result to its reply and new state, alone.

A member that never calls ``fit`` just runs alone, and so does a second ``fit`` of a member, or a cohort left with
one member at the rendezvous. The result equals one client at a time up to float rounding (tests/test_cohort.py),
as long as the forward draws no random numbers: with dropout in training mode (the backbone's or ``lora.dropout``)
the joint forward draws every member's masks from one stream per cohort and round (``"cohort-dropout"``, round,
members), not from each client's own ``"dropout"`` stream, so results then depend on which clients share a cohort
(and match one-at-a-time runs in distribution only). A MOON member's extra forward passes run on its own view.

Joint training needs a method that declares ``supports_cohorts`` (its ``train`` trains adapter and head
parameters with one ``trainer.fit``), a task that declares ``supports_cohorts`` (it can join batches), no
batch normalisation (it would mix the members' rows) and no ``privacy.dpsgd`` (per-example clipping inside one
client's step; ``run.cohort > 1`` with it is refused by the config). Otherwise clients train one at a time, and a
run that asked for ``run.cohort > 1`` says why in one line. Flower nodes always train one client each.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..adapters.lora import LoRAStack
from ..adapters.model import AdaptedModel
from ..device import (allocated_bytes, can_checkpoint, local_step, measured_bytes, module_device, optimizer_kernel,
                      prepare_training, run_compiled, set_checkpointing, stage_tensor)
from ..message import Message, State
from ..methods.base import Method
from ..models.quantize import weight_bytes
from ..seeding import derive_seed
from ..training.local import FitResult, FitRun, LocalTrainer, OptimizerFactory, make_optimizer
from .engine import client_update

log = logging.getLogger("fedlowrank")


def cohort_size(cfg, method: Method, task, model: AdaptedModel, device: torch.device) -> tuple[int, str]:
    """How many clients train together (``run.cohort`` resolved for ``device``), and why it is 1 when ``run.cohort``
    asked for more ("" otherwise). Automatic (``run.cohort = 0``): one on the CPU; on CUDA the most of a round's
    clients whose estimated peak (:func:`cohort_memory`) fits ``run.gpu_memory_fraction`` of the memory this
    process can still use, with gradient checkpointing when that fits more (:func:`largest_fitting_cohort`)."""
    asked = cfg.run.cohort or (cfg.run.clients_per_round if device.type == "cuda" else 1)
    if asked == 1:
        return 1, ""
    if cfg.privacy.dpsgd:
        reason = "privacy.dpsgd clips per example within one client's step"
    elif not method.supports_cohorts:
        reason = f"method {method.name!r} trains one client at a time (it does not declare supports_cohorts)"
    elif not task.supports_cohorts:
        reason = f"task {task.name!r} cannot join several clients' batches"
    elif any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.net.modules()):
        reason = "the network's batch normalisation would mix the clients' rows"
    else:
        asked = min(asked, cfg.run.clients_per_round)
        return (asked if cfg.run.cohort else largest_fitting_cohort(cfg, task, model, device, asked)), ""
    return 1, reason


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
    :func:`~fedlowrank.device.prepare_training`; quantised weights at their packed size), the trained parameters
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
    prepare_training(model, task, cfg)
    net, device = model.net, module_device(model.net)
    own = model.own_parameters()
    own_bytes = sum(p.numel() * 4 for p in own)
    was_training, requires = net.training, [p.requires_grad for p in own]
    was_checkpointing = bool(getattr(net, "is_gradient_checkpointing", False))
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

    slots = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}[cfg.train.optimizer]
    return CohortMemory(base=weight_bytes(net), own=own_bytes, slots=slots, forward=line(0, 0),
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


def largest_fitting_cohort(cfg, task, model: AdaptedModel, device: torch.device, most: int) -> int:
    """The largest cohort up to ``most`` whose estimated peak (:func:`cohort_memory`) fits ``run.gpu_memory_fraction``
    of the memory this process can use on ``device`` (free plus what torch's allocator already holds); at least 1.
    With ``train.gradient_checkpointing = "auto"`` (and a model that supports it) checkpointing is switched on
    when that fits a larger cohort than without (a joint step of more members gains more than checkpointing's
    recomputation costs), else left off. Logs the choice in one line."""
    free, _ = torch.cuda.mem_get_info(device)
    budget = cfg.run.gpu_memory_fraction * (free + torch.cuda.memory_reserved(device))
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
    set_checkpointing(model.net, memory.checkpointing)
    log.info("run.cohort = 0: %d of %d clients train together (estimated peak %.2f GiB; budget %.2f GiB = "
             "run.gpu_memory_fraction %.2f of the free memory; gradient checkpointing %s)", size, most,
             memory.peak(size) / 2**30, budget / 2**30, cfg.run.gpu_memory_fraction,
             ("on" if memory.checkpointing else "off") + (" (auto)" if mode == "auto" else ""))
    return size


@dataclass
class FitRequest:
    """The arguments of one member's ``trainer.fit``."""

    trainer: LocalTrainer
    model: AdaptedModel
    params: dict[str, nn.Parameter]
    corrections: Sequence
    optimizer: OptimizerFactory | None


class Member:
    """One member's work (``job(member)``) in a worker thread that runs only while the caller waits in
    :meth:`resume`, so exactly one thread runs at any time. Its first ``fit`` (:meth:`meet`) stops it there."""

    def __init__(self, job: Callable[["Member"], Any]):
        self.job = job
        self.request: FitRequest | None = None
        self.fit_result: FitResult | None = None  # from the joint loop; None: fit alone
        self.fit_error: BaseException | None = None  # the joint loop failed: end the worker with this
        self.gathering = True
        self.done, self.result, self.error = False, None, None
        self._worker_turn, self._caller_turn = threading.Semaphore(0), threading.Semaphore(0)
        self.thread = threading.Thread(target=self._work, daemon=True)
        self.thread.start()

    def _work(self) -> None:
        self._worker_turn.acquire()
        try:
            self.result = self.job(self)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
            self.error = exc
        self.done = True
        self._caller_turn.release()

    def resume(self) -> None:
        """Caller: let the worker run until it stops at ``fit`` or ends."""
        self._worker_turn.release()
        self._caller_turn.acquire()

    def meet(self, request: FitRequest) -> FitResult | None:
        """Worker, in ``fit``: the first time, hand ``request`` over and wait for the joint loop's result (``None``:
        train alone); any later ``fit`` trains alone at once."""
        if not self.gathering:
            return None
        self.gathering, self.request = False, request
        self._caller_turn.release()
        self._worker_turn.acquire()
        if self.fit_error is not None:
            raise RuntimeError("the cohort's joint training failed") from self.fit_error
        return self.fit_result


class CohortTrainer(LocalTrainer):
    """A :class:`LocalTrainer` whose ``fit`` meets the cohort (:meth:`Member.meet`) and trains alone only when
    the cohort sends it back."""

    def __init__(self, member: Member, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.member = member

    def fit(self, model, params, corrections=(), optimizer=None) -> FitResult:
        result = self.member.meet(FitRequest(self, model, params, list(corrections), optimizer))
        return super().fit(model, params, corrections, optimizer) if result is None else result


def run_together(jobs: list[Callable[[Member], Any]],
                 joint: Callable[[list[FitRequest]], list[FitResult]]) -> list[Any]:
    """Run ``jobs`` (each ``job(member)`` trains through a :class:`CohortTrainer` of ``member``) up to their first
    ``fit`` one after the other, train the requests of those that got there with ``joint`` (when two or more did),
    then finish each job in order. Returns the jobs' results; raises the first member's error."""
    members = [Member(job) for job in jobs]
    for m in members:
        m.resume()
    waiting = [m for m in members if not m.done]
    try:
        failed = next((m.error for m in members if m.error is not None), None)
        if failed is not None:
            raise failed
        results = joint([m.request for m in waiting]) if len(waiting) > 1 else [None] * len(waiting)
    except BaseException as exc:
        for m in waiting:
            m.fit_error = exc
            m.resume()
        for m in members:
            m.thread.join()
        raise
    for m, result in zip(waiting, results):
        m.fit_result = result
        m.resume()
    for m in members:
        m.thread.join()
        if m.error is not None:
            raise m.error
    return [m.result for m in members]


class JointFit:
    """The joint local steps of a cohort's fit requests on ``model`` (whose frozen tensors the requests' models
    share): each step joins the active members' next batches, runs one forward and one backward, then each
    member's :meth:`~FitRun.final_gradients` (clipping, corrections) and one optimizer step for all of them
    (:func:`joint_optimizer`)."""

    def __init__(self, model: AdaptedModel, requests: list[FitRequest], seed: int):
        for r in requests:
            own = {id(p) for p in r.model.own_parameters()}
            bad = [k for k, p in r.params.items() if id(p) not in own]
            if bad:
                raise RuntimeError(f"a cohort member trains {bad[0]!r}, neither an adapter's nor the head's "
                                   f"parameter: its method must not declare supports_cohorts")
        self.model, self.trainers = model, [r.trainer for r in requests]
        self.task, self.cfg = self.trainers[0].task, self.trainers[0].cfg
        torch.manual_seed(derive_seed(seed, "cohort-dropout", self.trainers[0].rnd, *(t.client for t in self.trainers)))
        self.runs = [FitRun(r.trainer, r.model, r.params, r.corrections, r.optimizer) for r in requests]
        layers = ([r.model.net.get_submodule(name) for r in requests] for name in model.target_names)
        self.stacks = [LoRAStack(members) for members in layers if LoRAStack.fits(members)]
        self.opt = joint_optimizer(self.runs)
        self.net = model.net
        self.net.train()
        self.device = module_device(self.net)
        self.steps = max(run.steps for run in self.runs)
        self.losses: list[tuple[list[int], torch.Tensor]] = []  # per step: the members that stepped, their losses
        self.staged: dict[int, tuple] = {}  # step → its inputs on the device (stage)

    def stage(self, step: int) -> None:
        """Prepare joint step ``step``'s inputs on the host and start their move to the device, before the step:
        the active members' next batches (:meth:`Task.device_batch`), joined (:meth:`Task.join_batches` of the
        host batches), and the routing (:meth:`Routing.prepare`)."""
        members = [i for i, run in enumerate(self.runs) if step < run.steps]
        host = [next(self.runs[i].batches) for i in members]
        joined, routing = self.task.join_batches(host)
        routing.prepare(self.device, stage_tensor)
        self.staged[step] = (members, [self.task.device_batch(b, self.device) for b in host],
                             self.task.device_batch(joined, self.device), routing)

    def step(self, step: int) -> None:
        """Joint step ``step`` (0-based) of the members that have steps left, on its staged inputs (:meth:`stage`;
        staged now if it was not)."""
        if step not in self.staged:
            self.stage(step)
        members, batches, joined, routing = self.staged.pop(step)
        with local_step():
            self._step(members, batches, joined, routing)

    def _step(self, members: list[int], batches: list, joined, routing) -> None:
        active = [self.runs[i] for i in members]
        self.zero_grad()

        def forward_backward() -> torch.Tensor:
            with self.model.routed([run.model for run in active], routing):  # backward too: checkpointed layers
                out = self.task.output(self.net, joined)
                losses = self.task.output_losses(out, routing, batches)                      # [K]
                terms = [run.correction_terms(batch) for run, batch in zip(active, batches)]
                if any(run.scaler is not None for run in active):
                    total = sum(run.scaled(losses[i] + sum(t)) for i, (run, t) in enumerate(zip(active, terms)))
                else:
                    total = sum((x for t in terms for x in t), losses.sum())
                total.backward()
            return losses

        losses = run_compiled(self.task.compiled_module(self.net), forward_backward, self.zero_grad)
        for stack in self.stacks:
            stack.hand_out_grads()
        self.losses.append((members, losses.detach()))
        for run in active:
            run.final_gradients()
            if self.opt is None:
                run.optimizer_step()
        if self.opt is not None:
            self.opt.step()

    def zero_grad(self) -> None:
        for opt in [self.opt] if self.opt is not None else [run.opt for run in self.runs]:
            opt.zero_grad(set_to_none=True)
        for stack in self.stacks:
            stack.zero_grad()

    def finish(self) -> list[FitResult]:
        """Each member's :class:`FitResult`; the step losses read from the device at once."""
        values = torch.cat([x for _, x in self.losses]).tolist() if self.losses else []
        per_member: list[list[float]] = [[] for _ in self.runs]
        at = 0
        for members, x in self.losses:
            for i in members:
                per_member[i].append(values[at])
                at += 1
        self.net.eval()
        for stack in self.stacks:
            stack.release()
        return [run.finish(losses) for run, losses in zip(self.runs, per_member)]


def joint_optimizer(runs: list[FitRun]) -> torch.optim.Optimizer | None:
    """One ``train.optimizer`` over every member's parameters, its groups those of the members merged by learning
    rate: each parameter keeps its own state (an update is elementwise), so one multi-tensor step equals the
    members' own steps. ``None`` when a member needs its own optimizer step: a method's own optimizer, or fp16's
    loss scaler (which skips the step of a member whose gradients overflowed)."""
    if any(run.factory is not None or run.scaler is not None for run in runs):
        return None
    merged: dict[float, list[nn.Parameter]] = {}
    for run in runs:
        for group in run.groups:
            merged.setdefault(group["lr"], []).extend(group["params"])
    groups = [{"params": params, "lr": lr} for lr, params in merged.items()]
    return make_optimizer(runs[0].trainer.cfg, groups, optimizer_kernel(module_device(runs[0].net)))


def joint_fit(model: AdaptedModel, requests: list[FitRequest], seed: int,
              on_step: Callable[[int, int], None] | None = None) -> list[FitResult]:
    """Every request's ``fit`` in one loop of joint steps on ``model`` (:class:`JointFit`); ``on_step(step,
    total)`` after each joint step. Returns each request's :class:`FitResult`."""
    fit = JointFit(model, requests, seed)
    t0 = time.perf_counter()
    for step in range(fit.steps):
        fit.step(step)
        if step + 1 < fit.steps:
            fit.stage(step + 1)  # while the device still runs this step
        if on_step is not None:
            on_step(step + 1, fit.steps)
    elapsed = time.perf_counter() - t0
    for t in fit.trainers:
        t.compute_seconds += elapsed / len(fit.trainers)
    return fit.finish()


def cohort_update(method: Method, model: AdaptedModel, views: list[AdaptedModel], msgs: list[Message],
                  states: list[State], task, parts: list, cfg, clients: list[int], rnd: int,
                  on_step: Callable[[int, int], None] | None = None) -> list[tuple[Message, State, LocalTrainer]]:
    """:func:`~.engine.client_update` of ``clients`` together: client ``clients[i]`` with message ``msgs[i]``,
    state ``states[i]`` and data ``parts[i]`` on ``views[i]`` (a :meth:`~AdaptedModel.shared_copy` of ``model``),
    their local steps joint on ``model``. Returns ``(reply, new state, trainer)`` per client, in order."""
    def job(i: int, member_method: Method) -> Callable[[Member], Any]:
        return lambda member: client_update(member_method, views[i], msgs[i], states[i], task, parts[i], cfg,
                                            clients[i], rnd, on_step, partial(CohortTrainer, member))

    prepare_training(model, task, cfg)  # the shared backbone (and the model's own head, for evaluation)
    jobs = [job(i, method.cohort_member()) for i in range(len(clients))]
    return run_together(jobs, lambda requests: joint_fit(model, requests, cfg.run.seed, on_step))


__all__ = ["CohortMemory", "CohortTrainer", "FitRequest", "JointFit", "Member", "cohort_memory", "cohort_size",
           "cohort_update", "cut_decoder", "joint_fit", "joint_optimizer", "largest_fitting_cohort", "run_together",
           "stacked_layers"]

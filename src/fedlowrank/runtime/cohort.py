"""Client cohorts: several sampled clients of a round train together, one forward and backward per step.

``run.cohort`` clients form a cohort (how many: :mod:`.plan`). Each member's round is a client's round, in two
phases around the shared steps, with no thread and no pause: for every member in order, the parts of
:func:`~.engine.client_update` before training (:func:`~.engine.client_trainer`) and its method's
:meth:`~fedlowrank.methods.base.Method.prepare_fit` on its own model view (:meth:`Cohort.views`, an
:meth:`~fedlowrank.adapters.model.AdaptedModel.shared_copy`: own adapter factors, base deltas, scales and head;
the frozen backbone shared); then the members' local steps together (:class:`~fedlowrank.training.local.LocalSteps`
with the :class:`Joint` group); then for every member :meth:`~fedlowrank.methods.base.Method.finish_fit` and the
parts after training (:func:`~.engine.client_reply`).

A joint step: each active member's next minibatch (from its own stream) joined into one batch
(:meth:`Task.join_batches`: rows in member order, sequences padded, or packed with each token's member), one
forward through the shared backbone with every adapted target and the head routing member k's rows (or tokens)
through member k's own modules (:meth:`AdaptedModel.routed`: the shared ``W0`` multiplies all rows at once, and
LoRA's paths run as products batched over the members, their factors slices of one tensor per target and factor,
:class:`~fedlowrank.adapters.lora.LoRAStack`, so that the backward fills one gradient buffer for all of them), the
members' losses together (:meth:`Task.output_losses`), one backward of ``Σₖ (lossₖ + correction termsₖ)``; then
each member's clipping and its corrections' ``grad`` hooks (SCAFFOLD, ILoRA-S), and one optimizer step for every
member (each parameter keeps its own state, so it equals the members' own steps). A member whose steps are done
(fewer examples with ``train.local_epochs``) leaves the joint batch. The losses are read from the device once, at
the end.

The result equals one client at a time up to float rounding (tests/test_cohort.py), as long as the forward draws
no random numbers: with dropout in training mode (the backbone's or ``lora.dropout``) the joint forward draws every
member's masks from one stream per cohort and round (``"cohort-dropout"``, round, members), not from each client's
own ``"dropout"`` stream, so results then depend on which clients share a cohort (and match one-at-a-time runs in
distribution only). A MOON member's extra forward passes run on its own view.

Joint training needs a method with the two phases (``supports_cohorts``), a task that declares
``supports_cohorts`` (it can join batches), no batch normalisation (it would mix the members' rows), no
``privacy.dpsgd`` (per-example clipping inside one client's step) and no fp16 loss scaler (it skips one client's
step on its own overflow); :func:`~.plan.cohort_size` says why otherwise. Flower nodes train one client each.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..adapters.lora import LoRAStacks
from ..adapters.model import AdaptedModel, AdapterRouter
from ..device import DTYPES, module_device, optimizer_kernel, stage_tensor
from ..execution.compiling import run_compiled
from ..execution.measure import phase
from ..message import Message, State
from ..methods.base import Method
from ..seeding import derive_seed
from ..training.corrections import ClientCorrection
from ..training.local import LocalSteps, LocalTrainer, MemberFit, make_optimizer, restart_optimizer
from .engine import client_reply, client_trainer
from .plan import Plan


class Cohort:
    """The cohorts of one model, kept across rounds: its members' views (:meth:`views`), the members' LoRA factors
    stacked (:class:`~fedlowrank.adapters.lora.LoRAStacks`, ``slots`` members) and the optimizer over them
    (:meth:`optimizer`), whose tensors keep their addresses from round to round."""

    def __init__(self, model: AdaptedModel, slots: int):
        self.model = model
        self.stacks = LoRAStacks(slots)
        self._views: list[AdaptedModel] = []
        self._opt: torch.optim.Optimizer | None = None
        self._opt_params: list[int] = []

    def views(self, count: int) -> list[AdaptedModel]:
        """``count`` member models, each a :meth:`~AdaptedModel.shared_copy` of the model."""
        while len(self._views) < count:
            self._views.append(self.model.shared_copy())
        return self._views[:count]

    def optimizer(self, cfg, groups: list[dict], device: torch.device, anew: bool) -> torch.optim.Optimizer | None:
        """``train.optimizer`` over ``groups``, as a new one is at a fit's start: the last fit's, restarted in place
        (:func:`~fedlowrank.training.local.restart_optimizer`), when it steps the same tensors and not ``anew``;
        ``None`` without any."""
        if not groups:
            return None
        params = [id(p) for g in groups for p in g["params"]]
        if self._opt is None or anew or params != self._opt_params:
            self._opt, self._opt_params = make_optimizer(cfg, groups, optimizer_kernel(device)), params
        else:
            restart_optimizer(self._opt, [g["lr"] for g in groups])
        return self._opt


class Joint:
    """The :class:`~fedlowrank.training.local.LocalSteps` group of a cohort's members: the module docstring's
    joint step on the cohort's model (whose frozen tensors the members' views share).

    The members' LoRA factors are stacked (:meth:`LoRAStacks.bind`), so the optimizer steps the stacked tensors
    (and the members' other parameters, e.g. heads, but those a method steps with its own optimizer, e.g. Fed-SB's
    gradient sums) for every member at once, and clipping is per member in a few
    batched operations (each member's norm over its slot of every stacked gradient and its other gradients). Only
    where a member's own parameter gets a gradient (a correction's loss term, e.g. FedProx's; a target routed per
    member, e.g. one with a base delta) is it added to the member's slot; only for a member whose corrections read
    or change its gradient (SCAFFOLD's ``grad`` hook) are its slots handed to it as its parameters' gradients."""

    def __init__(self, cohort: Cohort, members: list[MemberFit], seed: int):
        model = cohort.model
        for m in members:
            own = {id(p) for p in m.model.own_parameters()}
            bad = [k for k, p in m.params.items() if id(p) not in own]
            if bad:
                raise RuntimeError(f"a cohort member trains {bad[0]!r}, neither an adapter's nor the head's "
                                   f"parameter: its method must not train in cohorts")
            if m.scaler is not None:
                raise RuntimeError("a cohort member steps with a loss scaler of its own")
        self.model, self.members, self.stacks = model, members, cohort.stacks
        trainer = members[0].trainer
        cfg = trainer.cfg
        self.task, self.clip, self.dtype = trainer.task, cfg.max_grad_norm, DTYPES[cfg.dtype]
        torch.manual_seed(derive_seed(seed, "cohort-dropout", trainer.rnd, *(m.trainer.client for m in members)))
        layers = {name: [m.model.net.get_submodule(name) for m in members] for name in model.target_names}
        anew = self.stacks.bind(layers)
        self.stacked: list[list[tuple[str, str, nn.Parameter]]] = []  # per member: (target, factor, its parameter)
        self.unstacked: list[list[nn.Parameter]] = []                  # per member: its other trained parameters
        for k, m in enumerate(members):
            trained = {id(p) for p in m.params.values()}
            mine = [(n, f, getattr(layers[n][k], f"lora_{f}")) for n in self.stacks.names for f in ("A", "B")]
            self.stacked.append([(n, f, p) for n, f, p in mine if id(p) in trained])
            ids = {id(p) for *_, p in mine}
            self.unstacked.append([p for p in m.params.values() if id(p) not in ids])
            if m.fit.optimizer is not None and self.stacked[-1]:
                raise RuntimeError("a cohort member steps its stacked LoRA factors with an optimizer of its own")
        self.own = [m for m in members if m.fit.optimizer is not None]  # members stepping their own optimizer
        shared = [ps for m, ps in zip(members, self.unstacked) if m.fit.optimizer is None]
        heads = {id(p) for m in members for k, p in m.params.items() if k.startswith("head/")}
        body = self.stacks.trained() + [p for ps in shared for p in ps if id(p) not in heads]
        head = [p for ps in shared for p in ps if id(p) in heads]
        lrs = {(m.lr, m.head_lr) for m in members}
        if len(lrs) != 1:
            raise RuntimeError("a cohort's members train with different learning rates")
        lr, head_lr = lrs.pop()
        groups = [g for g in ({"params": body, "lr": lr}, {"params": head, "lr": head_lr}) if g["params"]]
        self.net = model.net
        self.device = module_device(self.net)
        self.opt = cohort.optimizer(cfg, groups, self.device, anew)
        self.reads_batch = any(c.reads_batch for m in members for c in m.corrections)
        self.losses_on_own = any(type(c).loss is not ClientCorrection.loss for m in members for c in m.corrections)
        self.hands_out = [any(type(c).grad is not ClientCorrection.grad for c in m.corrections) for m in members]
        self._routers: dict[tuple[int, ...], dict] = {}
        self.net.train()

    def routers(self, active: list[int]) -> dict:
        """The routers of the ``active`` members (made once per set of members)."""
        key = tuple(active)
        if key not in self._routers:
            stacked = {name: partial(self.stacks.factors, name) for name in self.stacks.names}
            self._routers[key] = self.model.routers([self.members[i].model for i in active], stacked)
        return self._routers[key]

    def stage(self, active: list[int]):
        """The active members' next host batches, joined (:meth:`Task.join_batches`), the routing
        (:meth:`Routing.prepare`) and the joined batch on the device; each member's own batch too when a correction
        reads it (MOON); the active members' slots when some member has left."""
        host = [next(self.members[i].batches) for i in active]
        joined, routing = self.task.join_batches(host)
        routing.prepare(self.device, stage_tensor)
        own = [self.task.device_batch(b, self.device) for b in host] if self.reads_batch else [None] * len(host)
        select = None if active == list(range(len(active))) else stage_tensor(torch.tensor(active), self.device)
        return own, self.task.device_batch(joined, self.device), routing, select

    def zero_grad(self) -> None:
        if self.opt is not None:
            self.opt.zero_grad(set_to_none=True)
        for m in self.own:
            m.opt.zero_grad(set_to_none=True)

    def forward_backward(self, active: list[int], inputs) -> torch.Tensor:
        batches, joined, routing, select = inputs
        members = [self.members[i] for i in active]
        routers = self.routers(active)
        self.zero_grad()

        def forward_backward() -> torch.Tensor:
            self.stacks.prepare(len(active), self.dtype, select)
            with self.model.routed(routers, routing):  # backward too: checkpointed layers
                out = self.task.output(self.net, joined)
                losses = self.task.output_losses(out, routing, joined)                       # [K]
                terms = [t for m, batch in zip(members, batches) for t in m.correction_terms(batch)]
                sum(terms, losses.sum()).backward()
            return losses
        return run_compiled(self.task.compiled_module(self.net), forward_backward, self.zero_grad)

    def update(self, active: list[int]) -> None:
        """The gradients the optimizer steps with (the members' own gradients added to their slots, each member's
        clipping, the corrections' ``grad`` hooks), then one optimizer step."""
        routed = self.routers(active).values()
        if self.losses_on_own or any(isinstance(r, AdapterRouter) and r.stacked is not None and not r.batched
                                     for r in routed):
            self._merge(active)
        if self.clip > 0:
            self._clip()
        for i in active:
            if self.hands_out[i]:
                self._hand_out(i, True)
                self.members[i].corrected_gradients()
                self._hand_out(i, False)
        if self.opt is not None:
            self.opt.step()
        for m in self.own:
            m.opt.step()

    def _merge(self, active: list[int]) -> None:
        """A member's own gradient (a loss term on its parameters, a target routed per member) into its slot."""
        for i in active:
            for name, factor, p in self.stacked[i]:
                if p.grad is None:
                    continue
                group = self.stacks.groups[self.stacks.where[name][0 if factor == "A" else 2]]
                if group.grad is None:
                    group.grad = torch.zeros_like(group)
                self.stacks.member_grad(name, i, factor, p.shape[0 if factor == "A" else 1]).add_(p.grad)
                p.grad = None

    def _clip(self) -> None:
        """Each member's gradient scaled to at most ``train.max_grad_norm`` (as ``clip_grad_norm_`` of its own
        parameters): its squared norm summed over its slot of every stacked gradient and its other gradients."""
        squares = None
        for group in self.stacks.trained():
            if group.grad is not None:
                norm = torch.linalg.vector_norm(group.grad, dim=(0, 2, 3))                    # [slots]
                squares = norm * norm if squares is None else squares + norm * norm
        if any(p.grad is not None for ps in self.unstacked for p in ps):
            own = torch.stack([sum((torch.linalg.vector_norm(p.grad) ** 2 for p in ps if p.grad is not None),
                                   torch.zeros((), device=self.device)) for ps in self.unstacked])
            squares = own if squares is None else squares + F.pad(own, (0, len(squares) - len(own)))
        if squares is None:
            return
        coef = (self.clip / (squares.sqrt() + 1e-6)).clamp(max=1.0)
        for group in self.stacks.trained():
            if group.grad is not None:
                group.grad.mul_(coef.view(1, -1, 1, 1))
        for k, ps in enumerate(self.unstacked):
            for p in ps:
                if p.grad is not None:
                    p.grad.mul_(coef[k])

    def _hand_out(self, i: int, on: bool) -> None:
        """Member i's slots as its parameters' gradients (``on``), or taken back."""
        for name, factor, p in self.stacked[i]:
            p.grad = self.stacks.member_grad(name, i, factor, p.shape[0 if factor == "A" else 1]) if on else None

    def leave(self, member: int) -> None:
        """A member whose steps are done keeps its factors as they are (the optimizer goes on stepping its slot,
        with zero gradients); the next round writes them back (:meth:`LoRAStacks.bind`)."""
        for _, _, p in self.stacked[member]:
            p.data = p.data.clone()

    def finish(self) -> None:
        self.net.eval()


def cohort_members(method: Method, cohort: Cohort, msgs: list[Message], states: list[State], task, parts: list,
                   cfg, clients: list[int], rnd: int, plan: Plan,
                   on_step: Callable[[int, int], None] | None = None) -> list[MemberFit]:
    """The first phase of every member's round, in order: the plan applied to its view (:meth:`Cohort.views`), its
    trainer (:func:`~.engine.client_trainer`), its method's :meth:`~fedlowrank.methods.base.Method.prepare_fit` of
    message ``msgs[i]`` and state ``states[i]`` for client ``clients[i]`` on data ``parts[i]``."""
    plan.prepare(cohort.model, task)  # the shared backbone (and the model's own head, for evaluation)
    members = []
    for i, view in enumerate(cohort.views(len(clients))):
        plan.prepare(view, task)
        trainer = client_trainer(view, task, parts[i], cfg, clients[i], rnd, on_step)
        members.append(MemberFit(trainer, method.prepare_fit(view, msgs[i], states[i], trainer)))
    return members


def cohort_update(method: Method, cohort: Cohort, msgs: list[Message], states: list[State], task, parts: list,
                  cfg, clients: list[int], rnd: int, plan: Plan,
                  on_step: Callable[[int, int], None] | None = None) -> list[tuple[Message, State, LocalTrainer]]:
    """:func:`~.engine.client_update` of ``clients`` together: :func:`cohort_members`, their local steps joint on
    the cohort's model (:class:`Joint`), then each member's :meth:`~fedlowrank.methods.base.Method.finish_fit` and
    :func:`~.engine.client_reply`. Returns ``(reply, new state, trainer)`` per client, in order."""
    with phase("client_update"):
        members = cohort_members(method, cohort, msgs, states, task, parts, cfg, clients, rnd, plan, on_step)
        results = LocalSteps(members, Joint(cohort, members, cfg.run.seed)).run(on_step)
        out = []
        for i, (member, result) in enumerate(zip(members, results)):
            reply, state = method.finish_fit(member.fit, result, member.trainer)
            out.append((*client_reply(cfg, reply, state, msgs[i], clients[i], rnd), member.trainer))
        return out


__all__ = ["Cohort", "Joint", "cohort_members", "cohort_update"]

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

from typing import Callable

import torch
from torch import nn

from ..adapters.lora import LoRAStack
from ..adapters.model import AdaptedModel
from ..device import module_device, optimizer_kernel, stage_tensor
from ..execution.compiling import run_compiled
from ..execution.measure import phase
from ..message import Message, State
from ..methods.base import Method
from ..seeding import derive_seed
from ..training.local import LocalSteps, LocalTrainer, MemberFit, make_optimizer
from .engine import client_reply, client_trainer
from .plan import Plan


class Cohort:
    """The cohorts of one model: its members' views (:meth:`views`), made once and reused every round."""

    def __init__(self, model: AdaptedModel):
        self.model = model
        self._views: list[AdaptedModel] = []

    def views(self, count: int) -> list[AdaptedModel]:
        """``count`` member models, each a :meth:`~AdaptedModel.shared_copy` of the model."""
        while len(self._views) < count:
            self._views.append(self.model.shared_copy())
        return self._views[:count]


class Joint:
    """The :class:`~fedlowrank.training.local.LocalSteps` group of a cohort's members on ``model`` (whose frozen
    tensors the members' views share): the module docstring's joint step, with one optimizer over every member's
    parameters (their groups merged by learning rate)."""

    def __init__(self, model: AdaptedModel, members: list[MemberFit], seed: int):
        for m in members:
            own = {id(p) for p in m.model.own_parameters()}
            bad = [k for k, p in m.params.items() if id(p) not in own]
            if bad:
                raise RuntimeError(f"a cohort member trains {bad[0]!r}, neither an adapter's nor the head's "
                                   f"parameter: its method must not train in cohorts")
            if m.fit.optimizer is not None or m.scaler is not None:
                raise RuntimeError("a cohort member steps with an optimizer or loss scaler of its own")
        self.model, self.members = model, members
        trainer = members[0].trainer
        self.task = trainer.task
        torch.manual_seed(derive_seed(seed, "cohort-dropout", trainer.rnd, *(m.trainer.client for m in members)))
        layers = ([m.model.net.get_submodule(name) for m in members] for name in model.target_names)
        self.stacks = [LoRAStack(layers) for layers in layers if LoRAStack.fits(layers)]
        merged: dict[float, list[nn.Parameter]] = {}
        for m in members:
            for group in m.groups:
                merged.setdefault(group["lr"], []).extend(group["params"])
        self.net = model.net
        self.device = module_device(self.net)
        self.opt = make_optimizer(trainer.cfg, [{"params": params, "lr": lr} for lr, params in merged.items()],
                                  optimizer_kernel(self.device))
        self.reads_batch = any(c.reads_batch for m in members for c in m.corrections)
        self.clip = trainer.cfg.max_grad_norm
        self.net.train()

    def stage(self, active: list[int]):
        """The active members' next host batches, joined (:meth:`Task.join_batches`), the routing
        (:meth:`Routing.prepare`) and the joined batch on the device; each member's own batch too when a correction
        reads it (MOON)."""
        host = [next(self.members[i].batches) for i in active]
        joined, routing = self.task.join_batches(host)
        routing.prepare(self.device, stage_tensor)
        own = [self.task.device_batch(b, self.device) for b in host] if self.reads_batch else [None] * len(host)
        return own, self.task.device_batch(joined, self.device), routing

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        for stack in self.stacks:
            stack.zero_grad()

    def forward_backward(self, active: list[int], inputs) -> torch.Tensor:
        batches, joined, routing = inputs
        members = [self.members[i] for i in active]
        self.zero_grad()

        def forward_backward() -> torch.Tensor:
            with self.model.routed([m.model for m in members], routing):  # backward too: checkpointed layers
                out = self.task.output(self.net, joined)
                losses = self.task.output_losses(out, routing, joined)                       # [K]
                terms = [t for m, batch in zip(members, batches) for t in m.correction_terms(batch)]
                sum(terms, losses.sum()).backward()
            return losses
        return run_compiled(self.task.compiled_module(self.net), forward_backward, self.zero_grad)

    def update(self, active: list[int]) -> None:
        for stack in self.stacks:
            stack.hand_out_grads()
        for i in active:
            m = self.members[i]
            if self.clip > 0:
                nn.utils.clip_grad_norm_(list(m.params.values()), self.clip)
            m.corrected_gradients()
        self.opt.step()

    def leave(self, member: int) -> None:
        pass

    def finish(self) -> None:
        self.net.eval()
        for stack in self.stacks:
            stack.release()


def cohort_update(method: Method, cohort: Cohort, msgs: list[Message], states: list[State], task, parts: list,
                  cfg, clients: list[int], rnd: int, plan: Plan,
                  on_step: Callable[[int, int], None] | None = None) -> list[tuple[Message, State, LocalTrainer]]:
    """:func:`~.engine.client_update` of ``clients`` together: client ``clients[i]`` with message ``msgs[i]``,
    state ``states[i]`` and data ``parts[i]`` on its view (:meth:`Cohort.views`), their local steps joint on the
    cohort's model (:class:`Joint`). Returns ``(reply, new state, trainer)`` per client, in order."""
    with phase("client_update"):
        plan.prepare(cohort.model, task)  # the shared backbone (and the model's own head, for evaluation)
        members = []
        for i, view in enumerate(cohort.views(len(clients))):
            plan.prepare(view, task)
            trainer = client_trainer(view, task, parts[i], cfg, clients[i], rnd, on_step)
            members.append(MemberFit(trainer, method.prepare_fit(view, msgs[i], states[i], trainer)))
        results = LocalSteps(members, Joint(cohort.model, members, cfg.run.seed)).run(on_step)
        out = []
        for i, (member, result) in enumerate(zip(members, results)):
            reply, state = method.finish_fit(member.fit, result, member.trainer)
            out.append((*client_reply(cfg, reply, state, msgs[i], clients[i], rnd), member.trainer))
        return out


__all__ = ["Cohort", "Joint", "cohort_update"]

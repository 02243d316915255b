"""Vectorised runner: all S participants of a round at once, for tasks whose gradients are closed-form.

Same run as :class:`~fedlowrank.runtime.simulator.Simulation` — same task, partition, :class:`SetupInfo`, client
sampling (:func:`engine.sample_clients`), minibatches (each client's :class:`LocalTrainer` stream) and
evaluation (``method.load_global`` + ``task.evaluate``) — but each round is one call of the method's hook::

    server = method.batched_round(model, server, clients [S], oracle, rnd)

where ``oracle.grad({key: W [S, out, in]}, step)`` returns the S clients' minibatch gradients of step ``step``
from ``task.batched_grad(weights, examples[step])`` (``examples = task.batched_examples(batch_indices [K, S, b])``,
gathered once per round), and ``oracle.steps``/``oracle.lr`` are the local
steps K and learning rate. The runner never looks at the method's name: a method without ``batched_round`` is
refused. Local steps are plain SGD, so ``train.optimizer`` must be ``"sgd"`` without weight decay or clipping.
No messages exist here, so there is no communication ledger (use the simulator for bytes).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from ..methods import get_method
from ..tasks.partition import partition_task
from ..seeding import torch_generator
from ..tasks import Task, build_task
from ..training.local import LocalTrainer
from .engine import sample_clients, setup_info


@dataclass
class ClosedFormOracle:
    """The round's minibatch gradients: ``batches [K, S, b]`` example indices, learning rate ``lr``."""

    task: Task
    batches: torch.Tensor
    lr: float

    def __post_init__(self) -> None:
        self.examples = self.task.batched_examples(self.batches)  # type: ignore[attr-defined]

    @property
    def steps(self) -> int:
        return self.batches.shape[0]

    def grad(self, weights: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
        return self.task.batched_grad(weights, self.examples[step])  # type: ignore[attr-defined]


@dataclass
class VectorizedRun:
    """Result: ``history`` rows ``{"round", <metrics>}`` every ``eval_every`` rounds and at the end;
    ``diverged_at`` is the first evaluated round whose stop metric was non-finite or beyond the bound."""

    method: str
    rounds: int
    history: list[dict[str, Any]] = field(default_factory=list)
    diverged_at: int | None = None
    seconds: float = 0.0
    server: Any = None

    @property
    def final(self) -> dict[str, Any]:
        return self.history[-1] if self.history else {}


def check_train_config(train) -> None:
    if train.optimizer != "sgd":
        raise ValueError(f"train.optimizer must be 'sgd' for the vectorised runner, got {train.optimizer!r}")
    if train.weight_decay != 0 or train.max_grad_norm != 0:
        raise ValueError("train.weight_decay and train.max_grad_norm must be 0 for the vectorised runner")


def trainer_batches(task: Task, parts, train, clients: list[int], rnd: int, rounds: int, seed: int) -> ClosedFormOracle:
    """The S clients' minibatches of round ``rnd``, exactly those their :class:`LocalTrainer` would use in the
    simulator (one seeded stream per client and round; slow: for equivalence checks)."""
    steps, lr = [], 0.0
    for k in clients:
        trainer = LocalTrainer(task, parts[k], train, k, rnd, rounds, seed)
        it = trainer.batches()
        steps.append(torch.stack([next(it) for _ in range(trainer.num_steps)]))
        lr = trainer.lr
    if len({s.shape for s in steps}) != 1:
        raise ValueError("the vectorised runner needs the same number of local steps and batch size on every client")
    return ClosedFormOracle(task, torch.stack(steps, 1), lr)


def fresh_batches(task: Task, parts, train, clients: list[int], rnd: int, rounds: int, seed: int) -> ClosedFormOracle:
    """A fresh minibatch per client and step, without replacement within the batch (spec A6), all drawn at once
    from the round's stream ``("vectorized-batches", rnd)``: ``[K, S, b]``. Needs equal client sizes."""
    sizes = {len(parts[k]) for k in clients}
    if len(sizes) != 1:
        raise ValueError("batches = 'fresh' needs equal client sizes; use batches = 'trainer'")
    trainer = LocalTrainer(task, parts[clients[0]], train, clients[0], rnd, rounds, seed)
    n = sizes.pop()
    b = min(train.batch_size, n)
    own = np.stack([parts[k].numpy() for k in clients])                                    # [S, n]
    local = torch.rand(trainer.num_steps, len(clients), n, generator=torch_generator(seed, "vectorized-batches", rnd))
    picks = np.argsort(local.numpy(), axis=-1, kind="stable")[..., :b]                      # [K, S, b]
    rows = own[np.arange(len(clients))[:, None], picks]                                     # [K, S, b]
    return ClosedFormOracle(task, torch.from_numpy(rows), trainer.lr)


BATCHES = {"fresh": fresh_batches, "trainer": trainer_batches}


def run_vectorized(cfg, task: Task | None = None, log: Callable[[str], None] | None = None,
                   batches: str = "fresh") -> VectorizedRun:
    """Run ``cfg`` (a :class:`~fedlowrank.config.RunConfig`) with the vectorised rounds.

    ``batches``: ``"fresh"`` (fast, one stream per round) or ``"trainer"`` (the simulator's exact minibatches).
    Stops early when ``run.stop_metric`` (if set) is non-finite or above ``run.stop_above`` at an evaluation.
    """
    check_train_config(cfg.train)
    if cfg.privacy.mode or cfg.privacy.dpsgd:
        raise ValueError("privacy: the vectorised runner has no privacy hooks; run without --vectorized")
    if batches not in BATCHES:
        raise ValueError(f"batches must be one of {tuple(BATCHES)}, got {batches!r}")
    draw = BATCHES[batches]
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    task = task if task is not None else build_task(cfg)
    if not hasattr(task, "batched_grad"):
        raise ValueError(f"task {task.name!r} has no closed-form batched_grad; use the simulator")
    parts = [torch.as_tensor(p, dtype=torch.long)
             for p in partition_task(task, cfg.partition, cfg.run.seed)[0]]
    method = get_method(cfg.method_name, **cfg.method_options)
    hook = getattr(method, "batched_round", None)
    if hook is None:
        raise ValueError(f"method {method.name!r} has no vectorised round (batched_round); use the simulator")
    model = task.build_model()
    info = setup_info(cfg, [len(p) for p in parts])
    server = method.setup(model, info)
    run = VectorizedRun(method.name, 0)
    stop_key, stop_above = cfg.run.stop_metric, cfg.run.stop_above
    t0 = time.perf_counter()
    for rnd in range(1, cfg.run.rounds + 1):
        clients = sample_clients(cfg.run.seed, rnd, cfg.partition.num_clients, cfg.run.clients_per_round)
        oracle = draw(task, parts, cfg.train, clients, rnd, cfg.run.rounds, cfg.run.seed)
        server = hook(model, server, torch.tensor(clients), oracle, rnd)
        run.rounds = rnd
        if rnd % cfg.run.eval_every == 0 or rnd == cfg.run.rounds:
            method.load_global(model, server)
            row = {"round": rnd, **task.evaluate(model.net)}
            run.history.append(row)
            if log:
                log(f"[{method.name}] round {rnd}/{cfg.run.rounds} " + " ".join(f"{k}={v:.4g}" for k, v in row.items()
                                                                           if k != "round"))
            if stop_key and stop_key in row and (not math.isfinite(row[stop_key]) or row[stop_key] > stop_above):
                run.diverged_at = rnd
                break
    run.seconds = time.perf_counter() - t0
    run.server = server
    return run

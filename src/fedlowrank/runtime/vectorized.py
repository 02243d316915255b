"""Vectorised runner: all S participants of a round at once, for tasks whose gradients are closed-form.

Same run as :class:`~fedlowrank.runtime.simulator.Simulation` — the same :func:`~.run.build_run` (task, partition,
:class:`SetupInfo`, method, model), client sampling (:func:`engine.sample_clients`), minibatches (each client's
:class:`LocalTrainer` stream) and evaluation (``method.load_global`` + ``task.evaluate``) — but each round is one
call of the method's hook::

    server = method.batched_round(model, server, clients [S] (NumPy), oracle, rnd)

where ``oracle.grad({key: W [S, out, in]}, step)`` returns the S clients' minibatch gradients of step ``step``
from ``task.batched_grad(weights, examples[step])`` (``examples = task.batched_examples(batch_indices [K, S, b])``,
gathered once per round), and ``oracle.steps``/``oracle.lr`` are the local
steps K and learning rate. The oracle's arrays are NumPy's: at these sizes (S·out ≈ 100 rows) a round is a few
hundred small products, and NumPy's per-call cost is a fraction of torch's. The runner never looks at the method's
name: a method without ``batched_round`` is refused. Local steps are plain SGD, so ``train.optimizer`` must be
``"sgd"`` without weight decay or clipping.

It is a run like the simulator's (:class:`Vectorized` is a :class:`~.server_run.ServerRun`): the same run directory
(``config.json``, ``partition.json``, ``metrics.jsonl``, ``summary.json``, ``checkpoints/``, plots), the same round
lines and the same handling of SIGINT/SIGTERM and ``fedlowrank resume`` (``run.vectorized = true`` in the config
says which runner continues it). It writes one metrics row per evaluated round (every ``run.eval_every`` rounds and
the last), covering the rounds since the previous one, and checkpoints at those rounds. No messages exist here, so
there is no communication ledger (use the simulator for bytes) and no train loss. A run whose stop metric
(``run.stop_metric``) is non-finite or above ``run.stop_above`` at an evaluation, or whose global state is
non-finite, stops there (``diverged_at``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..seeding import torch_generator
from ..tasks import Task
from ..training.local import LocalTrainer, steps_per_round
from .engine import sample_clients
from .run import DivergenceError, build_run, peak_rss_mb
from .server_run import ServerRun


@dataclass
class ClosedFormOracle:
    """The round's minibatch gradients: ``batches [K, S, b]`` example indices, learning rate ``lr``."""

    task: Task
    batches: np.ndarray
    lr: float

    def __post_init__(self) -> None:
        self.examples = self.task.batched_examples(self.batches)  # type: ignore[attr-defined]

    @property
    def steps(self) -> int:
        return self.batches.shape[0]

    def grad(self, weights: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
        return self.task.batched_grad(weights, self.examples[step])  # type: ignore[attr-defined]


@dataclass
class VectorizedRun:
    """Result of :func:`run_vectorized`: ``history`` rows ``{"round", <metrics>, ...}`` every ``eval_every`` rounds
    and at the end; ``diverged_at`` is the first evaluated round whose stop metric was non-finite or beyond the bound
    (or whose global state was non-finite)."""

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


def smallest_first(values: np.ndarray, count: int) -> np.ndarray:
    """Indices of the ``count`` smallest entries of each last-axis row of ``values`` (float32, ≥ 0), smallest first
    and ties in index order, as a stable argsort gives them. Non-negative floats order as their bit patterns do, so
    ``bits · n + index`` is a distinct integer key per entry and an unstable (faster) sort gives the same order."""
    n = values.shape[-1]
    keys = values.view(np.int32).astype(np.int64) * n + np.arange(n)
    return np.argsort(keys, axis=-1)[..., :count]


class TrainerBatches:
    """The S clients' minibatches of each round, exactly those their :class:`LocalTrainer` would use in the
    simulator (one seeded stream per client and round; slow: for equivalence checks)."""

    def __init__(self, task: Task, parts: list[np.ndarray], train, rounds: int, seed: int):
        self.task, self.parts, self.train, self.rounds, self.seed = task, parts, train, rounds, seed

    def __call__(self, clients: list[int], rnd: int) -> ClosedFormOracle:
        steps, lr = [], 0.0
        for k in clients:
            trainer = LocalTrainer(self.task, self.parts[k], self.train, k, rnd, self.rounds, self.seed)
            it = trainer.batches()
            steps.append(np.stack([np.asarray(next(it)) for _ in range(trainer.num_steps)]))
            lr = trainer.lr
        if len({s.shape for s in steps}) != 1:
            raise ValueError("the vectorised runner needs the same number of local steps and batch size on every "
                             "client")
        return ClosedFormOracle(self.task, np.stack(steps, 1), lr)


class FreshBatches:
    """A fresh minibatch per client and step, without replacement within the batch (the SSF paper, arXiv:2604.25467
    §5.1, gives only its size), all drawn at once from the round's stream ``("vectorized-batches", rnd)``:
    ``[K, S, b]``. Needs equal client sizes."""

    def __init__(self, task: Task, parts: list[np.ndarray], train, rounds: int, seed: int):
        sizes = sorted({len(p) for p in parts})
        if len(sizes) != 1:
            raise ValueError(f"batches = 'fresh' needs equal client sizes (partition.kind = natural gives them), got "
                             f"sizes {sizes[0]}..{sizes[-1]}; use batches = 'trainer' (run_vectorized) or the "
                             f"simulator (run without --vectorized)")
        self.task, self.train, self.rounds, self.seed = task, train, rounds, seed
        self.rows = np.stack(parts)                                                 # [N, n]
        self.size = sizes[0]
        self.batch = min(train.batch_size, self.size)
        self.steps = steps_per_round(train, self.size)

    def __call__(self, clients: list[int], rnd: int) -> ClosedFormOracle:
        local = torch.rand(self.steps, len(clients), self.size,
                           generator=torch_generator(self.seed, "vectorized-batches", rnd))
        picks = smallest_first(local.numpy(), self.batch)                          # [K, S, b]
        rows = self.rows[np.asarray(clients)[:, None], picks]                       # [K, S, b]
        return ClosedFormOracle(self.task, rows, self.train.lr_at(rnd, self.rounds))


BATCHES = {"fresh": FreshBatches, "trainer": TrainerBatches}


def check_vectorizable(cfg, batches: str = "fresh") -> None:
    """Refuse (``ValueError`` naming the setting), before any work, what the vectorised runner cannot run."""
    from ..methods import method_class
    from ..tasks import task_class

    check_train_config(cfg.train)
    if cfg.privacy.mode or cfg.privacy.dpsgd:
        raise ValueError("privacy: the vectorised runner has no privacy hooks; run without --vectorized")
    if batches not in BATCHES:
        raise ValueError(f"batches must be one of {tuple(BATCHES)}, got {batches!r}")
    if not task_class(cfg.task.kind).batched:
        raise ValueError(f"task.kind = {cfg.task.kind!r} has no closed-form batched_grad; use the simulator")
    if not method_class(cfg.method_name).batched:
        raise ValueError(f"method {cfg.method_name!r} has no vectorised round (batched_round); use the simulator")


class Vectorized(ServerRun):
    """A run of ``cfg`` with vectorised rounds (see the module docstring); arguments as
    :class:`~.simulator.Simulation`'s. ``batches``: ``"fresh"`` (fast, one stream per round) or ``"trainer"`` (the
    simulator's exact minibatches; slow, for equivalence checks).

    Attributes:
        diverged_at: the evaluated round at which the run diverged (``None``: it did not).
    """

    def __init__(self, cfg, task: Task | None = None, run_dir: str | Path | None = None,
                 log: Callable[[str], None] | None = None, overwrite: bool = False, batches: str = "fresh"):
        check_vectorizable(cfg, batches)
        self.check(cfg, run_dir, overwrite)
        run = build_run(cfg, task)
        run.model.cpu()  # closed-form rounds on the CPU, whatever run.device says
        run.device = torch.device("cpu")
        draw = BATCHES[batches](run.task, run.parts, cfg.train, cfg.run.rounds, cfg.run.seed)  # refuses before any file
        super().__init__(run, run_dir, log, overwrite)
        self.draw = draw
        self.batched_round = self.method.batched_round
        self.diverged_at: int | None = None
        self._block = (0, 0.0, 0.0)  # (rounds, compute seconds, start) since the last recorded row

    def done(self) -> bool:
        return self.diverged_at is not None or super().done()

    def run_round(self) -> None:
        """One vectorised round; at an evaluated round, its metrics row (covering the rounds since the last)."""
        cfg, rnd = self.cfg, self.round + 1
        count, compute, start = self._block
        if count == 0:
            start = time.perf_counter()
            self.progress.round_start(rnd, cfg.run.clients_per_round)
        t0 = time.perf_counter()
        clients = sample_clients(cfg.run.seed, rnd, cfg.partition.num_clients, cfg.run.clients_per_round)
        oracle = self.draw(clients, rnd)
        self.server = self.batched_round(self.model, self.server, np.asarray(clients), oracle, rnd)
        self.round = rnd
        self._block = (count + 1, compute + time.perf_counter() - t0, start)
        if self.evaluator.due(rnd):
            self.record_block(clients)

    def history_rounds(self, rnd: int) -> list[int]:
        """The evaluated rounds up to ``rnd``: one row each."""
        return [r for r in range(1, rnd + 1) if self.evaluator.due(r)]

    def record_block(self, clients: list[int]) -> None:
        """Evaluate, and record the row of the rounds since the last row; a divergence stops the run."""
        count, compute, start = self._block
        self._block = (0, 0.0, 0.0)
        t_eval = time.perf_counter()
        metrics = self.evaluator.evaluate(self.server, {})
        evaluation = time.perf_counter() - t_eval
        total = time.perf_counter() - start
        row: dict[str, Any] = {
            "round": self.round, **metrics, "rounds": count, "clients": clients, "replied": clients,
            "train_loss": float("nan"), "bytes_up": 0, "bytes_down": 0, "cum_bytes_up": 0, "cum_bytes_down": 0,
            "time": {"client_compute": compute, "aggregation": 0.0, "evaluation": evaluation,
                     "other": total - compute - evaluation, "total": total},
            "peak_rss_mb": peak_rss_mb(),
        }
        try:
            self.record_row(row, [], metrics, count)
        except DivergenceError as exc:
            self.diverged_at = self.round
            if self.log:
                self.log(f"[{self.method.name}] {exc}; the run stops here")

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        if self.diverged_at is not None:
            out["diverged_at"] = self.diverged_at
            self.files.write_summary(out)
        return out


def run_vectorized(cfg, task: Task | None = None, log: Callable[[str], None] | None = None,
                   batches: str = "fresh", run_dir: str | Path | None = None, overwrite: bool = False) -> VectorizedRun:
    """Run ``cfg`` (a :class:`~fedlowrank.config.RunConfig`) with the vectorised rounds (:class:`Vectorized`),
    writing ``run_dir`` when given; returns its :class:`VectorizedRun`.

    ``batches``: ``"fresh"`` (fast, one stream per round) or ``"trainer"`` (the simulator's exact minibatches).
    Stops early when ``run.stop_metric`` (if set) is non-finite or above ``run.stop_above`` at an evaluation.
    """
    run = Vectorized(cfg, task, run_dir, log, overwrite, batches)
    t0 = time.perf_counter()
    run.run()
    return VectorizedRun(run.method.name, run.round, run.history, run.diverged_at, time.perf_counter() - t0,
                         run.server)

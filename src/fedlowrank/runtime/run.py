"""The run every runtime shares, and the one function that sets it up from a config.

A :class:`Run` is what a federated run *is*, whoever drives it: the task, the partition of its training data into
client index arrays, the method (set up), the model (on its device), the method's :class:`SetupInfo`, the server
state, and what the rounds so far left behind (round counter, metrics history, communication ledger, last
evaluation). :func:`build_run` is the one place where a config becomes a run; the simulator
(:mod:`.simulator`), the vectorised runner (:mod:`.vectorized`), the Flower ServerApp and every Flower node
(:mod:`.flower`) call it, so they set up the same run from the same config. The server side adds its collaborators
(run directory, evaluation, checkpoints, tracking) in :class:`~.server_run.ServerRun`; a Flower node uses the run's
task, partition, method and model only.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..adapters.model import AdaptedModel
from ..codecs import Link
from ..config.checks import check_requirements
from ..device import check_dtype, resolve_device
from ..message import State
from ..methods import get_method
from ..methods.base import Method, SetupInfo
from ..tasks import Task, build_task
from ..tasks.partition import SplitOn, partition_task, split_on
from .engine import setup_info
from .plan import Plan, packs_cohorts, plan_training


class DivergenceError(RuntimeError):
    """The run diverged (non-finite loss or parameters, or a metric beyond its bound)."""


@dataclass
class Ledger:
    """Bytes sent per client per round, counted from serialised messages."""

    rows: list[dict[str, Any]] = field(default_factory=list)

    def add(self, round: int, client: int, down: int, up: int, phase: str | None = None) -> None:
        """One client's bytes in ``round``; ``phase``: an exchange after the round's training (``"ccvr"``)."""
        row: dict[str, Any] = {"round": round, "client": client, "down": down, "up": up}
        if phase is not None:
            row["phase"] = phase
        self.rows.append(row)

    @property
    def total_up(self) -> int:
        return sum(r["up"] for r in self.rows)

    @property
    def total_down(self) -> int:
        return sum(r["down"] for r in self.rows)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@dataclass(eq=False)
class Run:
    """One federated run of one method on one task (see the module docstring).

    Attributes:
        cfg: the validated :class:`~fedlowrank.config.RunConfig`.
        task: the task (data, model builder, loss, evaluation).
        parts: each client's training example indices (length M).
        split: what the configured partition splits on (labels, a column, clusters), for the report; or ``None``.
        method: the method, set up (:meth:`Method.setup`) on ``model`` with ``info``.
        model: the adapted model, on ``device``.
        info: the method's view of the run.
        device: where the model computes (``run.device`` resolved).
        server: the method's server state (the global model and whatever the method keeps).
        uplink, downlink: the codec of each direction (``[uplink]``, ``[downlink]``; :mod:`fedlowrank.codecs`), which
            every message crosses at the wire (:func:`~.engine.send_down`, :func:`~.engine.send_up`).
        round: rounds finished; history: their metrics rows; ledger: their bytes per client; last_eval: the
            metrics of the newest evaluated round.
        plan: how it trains (cohorts, checkpointing, compilation; :mod:`.plan`), decided before its first client
            trains (:meth:`training_plan`).
    """

    cfg: Any
    task: Task
    parts: list[np.ndarray]
    split: SplitOn | None
    method: Method
    model: AdaptedModel
    info: SetupInfo
    device: torch.device
    server: State
    uplink: Link
    downlink: Link
    round: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    ledger: Ledger = field(default_factory=Ledger)
    last_eval: dict[str, float] = field(default_factory=dict)
    plan: Plan | None = None

    def training_plan(self, one_at_a_time: bool = False) -> Plan:
        """:attr:`plan`, decided at the first call (:func:`~.plan.plan_training`; ``one_at_a_time``: a Flower
        node's run, which trains one client)."""
        if self.plan is None:
            self.plan = plan_training(self.cfg, self.method, self.task, self.model, self.device, one_at_a_time)
        return self.plan


def build_run(cfg, task: Task | None = None, parts: list[np.ndarray] | None = None) -> Run:
    """Set up the run of ``cfg``: torch threads (``run.threads``), the task (``task``, or built from the config),
    the partition (``parts``, or the configured one), the method and its model, the setup info, the initial server
    state, the model on ``run.device``, and each direction's codec.

    ``parts`` replaces the configured partition (``fedlowrank tune`` passes it with each client's validation
    examples held out; a Flower node with its own data passes its own); ``split`` then still reports what the
    configured partition splits on.
    """
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    task = task if task is not None else build_task(cfg, cohorts=packs_cohorts(cfg))
    if parts is None:
        parts, split = partition_task(task, cfg.partition, cfg.run.seed)
    else:
        split = split_on(task, cfg.partition, cfg.run.seed)
    method = get_method(cfg.method_name, **cfg.method_options)
    model = task.build_model()
    info = setup_info(cfg, [len(p) for p in parts])
    check_requirements(cfg, method)  # config validation's check, again for a config changed after it
    server = method.setup(model, info)
    device = resolve_device(cfg.run.device)
    check_dtype(cfg.train.dtype, device)
    model.to(device)  # after setup: the method derives its server state on the CPU
    links = [Link(getattr(cfg, d), d, cfg.run.seed, method.exact_entries) for d in ("uplink", "downlink")]
    return Run(cfg, task, parts, split, method, model, info, device, server, *links)

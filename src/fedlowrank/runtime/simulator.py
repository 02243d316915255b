"""The in-process simulator: one backbone in memory, per-client state in a store, every message on the wire.

Each round: sample K of M clients from the round's stream; for each, serialise the broadcast (counted in the
ledger), run :func:`~fedlowrank.runtime.engine.client_update` on the shared model, serialise the reply
(counted); then ``method.aggregate``; evaluate every ``run.eval_every`` rounds. Memory grows with the
clients' small states, never with model copies.

A run directory holds ``config.json`` (resolved), ``partition.json`` (per-client label histograms),
``metrics.jsonl`` (a row per round: metrics, bytes, time breakdown) and ``ledger.jsonl`` (a row per client
per round: bytes up and down).
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..message import Reply, State
from ..methods import get_method
from ..partition import format_histograms, label_histograms, partition
from ..tasks import Task, build_task
from .engine import client_update, sample_clients, setup_info, wire


class DivergenceError(RuntimeError):
    """The run diverged (non-finite loss or parameters, or a metric beyond its bound)."""


@dataclass
class Ledger:
    """Bytes sent per client per round, counted from serialised messages."""

    rows: list[dict[str, int]] = field(default_factory=list)

    def add(self, rnd: int, client: int, down: int, up: int) -> None:
        self.rows.append({"round": rnd, "client": client, "down": down, "up": up})

    @property
    def total_up(self) -> int:
        return sum(r["up"] for r in self.rows)

    @property
    def total_down(self) -> int:
        return sum(r["down"] for r in self.rows)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class Simulation:
    """A federated run of one method on one task, in this process.

    Args:
        cfg: a validated :class:`~fedlowrank.config.RunConfig`.
        task: a task to reuse (its data and tokenisation); built from ``cfg`` when ``None``.
        run_dir: where to write the run's files; ``None`` writes nothing.
        log: where progress lines go (``None`` = silent).
    """

    def __init__(self, cfg, task: Task | None = None, run_dir: str | Path | None = None,
                 log: Callable[[str], None] | None = None):
        self.cfg = cfg
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.task = task if task is not None else build_task(cfg)
        self.parts = partition(self.task.num_train, self.task.train_labels, cfg.partition, cfg.run.seed,
                               self.task.natural_partition)
        self.method = get_method(cfg.method_name, **cfg.method_options)
        self.model = self.task.build_model()
        self.info = setup_info(cfg, [len(p) for p in self.parts])
        if self.info.heterogeneous_ranks and not self.method.supports_heterogeneous_ranks:
            raise ValueError(f"lora.ranks: method {self.method.name!r} does not support heterogeneous ranks")
        self.server: State = self.method.setup(self.model, self.info)
        self.store: dict[int, State] = {}
        self.ledger = Ledger()
        self.history: list[dict[str, Any]] = []
        self.round = 0
        self.last_eval: dict[str, float] = {}
        self.log = log
        self.run_dir = Path(run_dir) if run_dir is not None else None
        if self.run_dir is not None:
            self._start_run_dir()

    # -- files ---------------------------------------------------------------------------------------
    def _start_run_dir(self) -> None:
        assert self.run_dir is not None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(self.cfg.to_json())
        report: dict[str, Any] = {"task": self.task.describe(), "client_sizes": [len(p) for p in self.parts]}
        if self.task.train_labels is not None:
            hist = label_histograms(self.task.train_labels, self.parts, int(self.task.train_labels.max()) + 1)
            report["label_histograms"] = hist.tolist()
            if self.log:
                names = getattr(getattr(self.task, "data", None), "label_names", None)
                self.log("per-client label counts:\n" + format_histograms(hist, names))
        (self.run_dir / "partition.json").write_text(json.dumps(report, indent=1))
        for name in ("metrics.jsonl", "ledger.jsonl"):
            (self.run_dir / name).write_text("")

    def _append(self, name: str, rows: list[dict[str, Any]]) -> None:
        if self.run_dir is None:
            return
        with (self.run_dir / name).open("a") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")

    # -- rounds --------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        self.method.load_global(self.model, self.server)
        return self.task.evaluate(self.model.net)

    def run_round(self) -> dict[str, Any]:
        """Run the next round; returns its metrics row."""
        cfg, rnd = self.cfg, self.round + 1
        t_start = time.perf_counter()
        clients = sample_clients(cfg.run.seed, rnd, cfg.partition.num_clients, cfg.run.clients_per_round)
        replies: list[Reply] = []
        ledger_rows: list[dict[str, int]] = []
        compute = 0.0
        losses: list[float] = []
        for k in clients:
            msg = self.method.broadcast(self.server, k, rnd)
            down = msg.nbytes()
            state = self.store.get(k)
            if state is None:
                state = self.method.init_client(k)
            reply, new_state, trainer = client_update(self.method, self.model, wire(msg), state, self.task,
                                                      self.parts[k], cfg, k, rnd)
            compute += trainer.compute_seconds
            up = reply.nbytes()
            self.store[k] = new_state
            loss = float(reply.get("train_loss", float("nan")))
            if not math.isfinite(loss):
                raise DivergenceError(f"round {rnd}: method {self.method.name!r}: client {k} reported a "
                                      f"non-finite training loss ({loss})")
            losses.append(loss)
            replies.append(Reply(k, int(reply["num_examples"]), wire(reply)))
            self.ledger.add(rnd, k, down, up)
            ledger_rows.append({"round": rnd, "client": k, "down": down, "up": up})
        t_agg = time.perf_counter()
        self.server = self.method.aggregate(self.server, replies, rnd)
        aggregation = time.perf_counter() - t_agg
        diagnostics = self.method.pop_metrics()
        evaluation, metrics = 0.0, {}
        if rnd % cfg.run.eval_every == 0 or rnd == cfg.run.rounds:
            t_eval = time.perf_counter()
            metrics = self.evaluate()
            self.last_eval = metrics
            evaluation = time.perf_counter() - t_eval
        total = time.perf_counter() - t_start
        row: dict[str, Any] = {
            "round": rnd, "clients": clients, "train_loss": float(np.mean(losses)), **metrics,
            "bytes_up": sum(r["up"] for r in ledger_rows), "bytes_down": sum(r["down"] for r in ledger_rows),
            "cum_bytes_up": self.ledger.total_up, "cum_bytes_down": self.ledger.total_down,
            "time": {"client_compute": compute, "aggregation": aggregation, "evaluation": evaluation,
                     "other": total - compute - aggregation - evaluation, "total": total},
            "peak_rss_mb": peak_rss_mb(),
        }
        if diagnostics:
            row["diagnostics"] = diagnostics
        self.round = rnd
        self.history.append(row)
        self._append("metrics.jsonl", [row])
        self._append("ledger.jsonl", ledger_rows)
        self._check_divergence(row)
        if self.log:
            acc = f" acc={metrics['accuracy']:.4f}" if "accuracy" in metrics else ""
            extra = "".join(f" {k}={v:.4g}" for k, v in metrics.items() if k not in ("accuracy", "loss"))
            self.log(f"[{self.method.name}] round {rnd}/{cfg.run.rounds}{acc}{extra} loss={row['train_loss']:.4f} "
                     f"up={row['bytes_up'] / 1e6:.2f}MB down={row['bytes_down'] / 1e6:.2f}MB {total:.1f}s")
        return row

    def _check_divergence(self, row: dict[str, Any]) -> None:
        bound_key = self.cfg.run.stop_metric
        if bound_key and bound_key in row and (not math.isfinite(row[bound_key]) or row[bound_key] > self.cfg.run.stop_above):
            raise DivergenceError(f"round {row['round']}: method {self.method.name!r}: {bound_key} = {row[bound_key]} "
                                  f"beyond run.stop_above = {self.cfg.run.stop_above}")

    def run(self) -> dict[str, Any]:
        """Run the remaining rounds and return a summary."""
        while self.round < self.cfg.run.rounds:
            self.run_round()
        return self.summary()

    def summary(self) -> dict[str, Any]:
        times = {k: sum(r["time"][k] for r in self.history) for k in ("client_compute", "aggregation", "evaluation", "other", "total")}
        out = {"method": self.method.name, "rounds": self.round, "bytes_up": self.ledger.total_up,
               "bytes_down": self.ledger.total_down, "time": times, "peak_rss_mb": peak_rss_mb()}
        out.update(self.last_eval)
        accuracies = [r["accuracy"] for r in self.history if "accuracy" in r]
        if accuracies:
            out["best_accuracy"] = max(accuracies)
        if self.run_dir is not None:
            (self.run_dir / "summary.json").write_text(json.dumps(out, indent=1))
        return out

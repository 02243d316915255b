"""The in-process simulator: one backbone in memory, per-client state in a store, every message on the wire.

Each round: sample K of M clients from the round's stream; for each, serialise the broadcast (counted in the
ledger), run :func:`~fedlowrank.runtime.engine.client_update` on the shared model, serialise the reply
(counted); then ``method.aggregate``; evaluate every ``run.eval_every`` rounds. Memory grows with the
clients' small states, never with model copies. With ``run.cohort`` > 1 (by default on CUDA) the sampled clients
go in groups of that many: broadcasts, then their local training together (:mod:`.cohort`; each member's model
shares the frozen backbone), then each reply in client order as above.

A run directory holds ``config.json`` (resolved), ``partition.json`` (per-client label histograms),
``metrics.jsonl`` (a row per round: metrics, bytes, time breakdown, ``per_client``), ``ledger.jsonl`` (a row per client
per round: bytes up and down) and ``checkpoints/`` (every ``run.checkpoint_every`` rounds, and always at the
last round so that every finished run can be exported); ``run.tracking`` mirrors each metrics row to TensorBoard,
W&B or MLflow (:mod:`fedlowrank.reporting.tracking`). A run directory must be empty unless ``overwrite``, and is locked
while a run writes it (:mod:`.rundir`); ``resume`` checks that the checkpoint is of the directory's config
(:func:`~.checkpoint.config_fingerprint`).

A metrics row: ``round``, ``clients`` (sampled), ``replied`` (used), ``train_loss`` (mean over the used
replies), the test metrics when the round was evaluated (``accuracy``, ``loss``; for personalised methods the
mean over the clients' own models), ``bytes_up``/``bytes_down`` (this round), ``cum_bytes_up``/
``cum_bytes_down``, ``time`` (``client_compute``, ``aggregation``, ``evaluation``, ``other``, ``total``, in
seconds), ``peak_rss_mb``, optional ``dropped``, ``rejected``, ``skipped``, ``diagnostics``, and ``per_client``:
one entry per sampled client, ``{"client", "train_loss", "num_examples", "bytes_up", "bytes_down"}``
(``train_loss`` and ``num_examples`` are ``null`` for a client whose reply was dropped or rejected); in an
evaluated round of a personalised method each evaluated client's entry also has ``"test": {"accuracy",
"loss"}`` of its own model (clients evaluated but not sampled get an entry with zero bytes).

Robustness: sampled clients may drop out (``run.dropout``, ``run.dropout_schedule``); every reply is
checked (:func:`~fedlowrank.runtime.engine.check_reply`) and a bad one is rejected with a logged reason,
its client's state left as it was; a round with fewer than ``run.min_replies`` usable replies is skipped
and the global state is not touched.
"""

from __future__ import annotations

import json
import math
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..adapters.model import AdaptedModel
from ..device import check_dtype, resolve_device
from ..message import Message, Reply, State
from ..methods import get_method
from ..tasks.partition import format_histograms, label_histograms, partition_task, split_on
from ..reporting.plots import plot_label_histograms
from ..privacy.runtime import accounting, central_replies
from ..reporting.progress import Progress
from ..reporting.tracking import open_tracker, require_package
from ..tasks import Task, build_task
from ..seeding import numpy_rng
from .checkpoint import (Checkpoint, CheckpointError, config_fingerprint, drop_checkpoints_after, find_checkpoint,
                         save_checkpoint)
from .rundir import check_run_dir, claim_run_dir, lock_run_dir
from .cohort import cohort_size, cohort_update
from .engine import check_reply, client_update, sample_clients, setup_info, wire
from .store import ClientStore


class DivergenceError(RuntimeError):
    """The run diverged (non-finite loss or parameters, or a metric beyond its bound)."""


@dataclass
class Ledger:
    """Bytes sent per client per round, counted from serialised messages."""

    rows: list[dict[str, int]] = field(default_factory=list)

    def add(self, round: int, client: int, down: int, up: int) -> None:
        self.rows.append({"round": round, "client": client, "down": down, "up": up})

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
        run_dir: where to write the run's files; ``None`` writes nothing. It must be empty or absent unless
            ``overwrite`` (which deletes the old run's files), and is locked until :meth:`close` (which
            :meth:`run` calls when it ends) or the end of the process.
        log: where progress lines go (``None`` = silent); a log with a true ``bars`` attribute
            (:class:`~fedlowrank.reporting.progress.StderrLog` on a terminal) also gets tqdm bars.
        tamper: fault injection for tests and robustness studies: ``tamper(rnd, client, reply) -> reply`` is
            applied to every reply before it is sent.
        parts: client index arrays to train on instead of the configured partition (``fedlowrank tune`` passes
            the partition with each client's validation examples held out).
        log_partition: log the per-client label counts when the run directory is made (``compare`` logs them
            once for all its methods, which share the partition).
    """

    def __init__(self, cfg, task: Task | None = None, run_dir: str | Path | None = None,
                 log: Callable[[str], None] | None = None,
                 tamper: Callable[[int, int, Message], Message] | None = None,
                 parts: list[np.ndarray] | None = None, overwrite: bool = False,
                 log_partition: bool = True):
        self.cfg = cfg
        if cfg.run.tracking:
            require_package(cfg.run.tracking)  # before any work
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self._lock = None
        if self.run_dir is not None:
            check_run_dir(self.run_dir, overwrite)  # refuse before building anything; claimed in _start_run_dir
        self.client_states = True  # False when the clients keep their own states (the Flower server's run)
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.task = task if task is not None else build_task(cfg)
        if parts is None:
            self.parts, self.split = partition_task(self.task, cfg.partition, cfg.run.seed)
        else:  # what the configured partition splits on, for the report
            self.parts, self.split = parts, split_on(self.task, cfg.partition, cfg.run.seed)
        self.method = get_method(cfg.method_name, **cfg.method_options)
        self.model = self.task.build_model()
        self.info = setup_info(cfg, [len(p) for p in self.parts])
        if self.info.heterogeneous_ranks and not self.method.supports_heterogeneous_ranks:
            raise ValueError(f"lora.ranks: method {self.method.name!r} does not support heterogeneous ranks")
        self.server: State = self.method.setup(self.model, self.info)
        self.device = resolve_device(cfg.run.device)
        check_dtype(cfg.train.dtype, self.device)
        self.model.to(self.device)  # after setup: the method derives its server state on the CPU
        self._cohort: int | None = None  # clients trained together (run.cohort resolved at the first round)
        self._views: list[AdaptedModel] = []  # the cohort members' models (shared frozen backbone)
        self.store = ClientStore(cfg.run.state_memory_mb, None if run_dir is None else Path(run_dir) / "client_states")
        self.ledger = Ledger()
        self.history: list[dict[str, Any]] = []
        self.round = 0
        self.last_eval: dict[str, float] = {}
        self.client_eval: dict[int, dict[str, float]] = {}  # personalised methods: each client's test metrics
        self.progress = Progress(log, self.method.name, cfg.run.rounds, counts=self.task.metric_counts)
        self.log = self.progress.write if log is not None else None
        self.tracker = None
        self.tamper = tamper
        self.log_partition = log_partition
        if self.run_dir is not None:
            self._start_run_dir(overwrite)

    # -- files ---------------------------------------------------------------------------------------
    def _start_run_dir(self, overwrite: bool) -> None:
        assert self.run_dir is not None
        self._lock = claim_run_dir(self.run_dir, overwrite)
        (self.run_dir / "config.json").write_text(self.cfg.to_json())
        report: dict[str, Any] = {"task": self.task.describe(), "client_sizes": [len(p) for p in self.parts]}
        report.update(self.task.describe_partition(self.parts))
        if self.split is not None:  # per-client counts of what the partition split on (labels, column, clusters)
            hist = label_histograms(self.split.values, self.parts, len(self.split.names))
            report.update(split_on=self.split.what, split_names=self.split.names, label_histograms=hist.tolist())
            domains = report.get("client_domains")
            plot_label_histograms(hist, self.run_dir / "partition.png", self.split.names, domains, self.split.what)
            if self.log and self.log_partition:
                self.log(f"per-client counts of each {self.split.what}:\n"
                         + format_histograms(hist, self.split.names, domains))
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
    def personal_eval_clients(self) -> list[int]:
        """Clients whose own model a personalised method's evaluation loads: every client with a state, or the
        first ``run.personal_eval_clients`` of them in a fixed order drawn from ``run.seed`` (the same every
        round, so later rounds re-evaluate the same clients once they have a state)."""
        n = self.cfg.run.personal_eval_clients
        if n == 0:
            return sorted(self.store)
        order = numpy_rng(self.cfg.run.seed, "personal-eval").permutation(self.cfg.partition.num_clients)
        return sorted([int(k) for k in order if int(k) in self.store][:n])

    def evaluate(self) -> dict[str, float]:
        """Global model on the test set; for personalised methods, the mean over the evaluated clients
        (:meth:`personal_eval_clients`) of their own model's metrics."""
        if self.method.personalized and self.store:
            clients = self.personal_eval_clients()
            self.progress.eval_start(len(clients))
            self.client_eval = {}
            for k in clients:
                self.method.load_personal(self.model, self.server, self.store[k])
                self.client_eval[k] = self.task.evaluate(self.model.net)
                self.progress.eval_step()
            rows = list(self.client_eval.values())
            return {key: float(np.mean([r[key] for r in rows])) for key in rows[0]}
        self.method.load_global(self.model, self.server)
        with self.progress.evaluating(self.model.net):
            return self.task.evaluate(self.model.net)

    def dropped_clients(self, rnd: int, clients: list[int]) -> set[int]:
        """Sampled clients that do not reply this round: ``run.dropout_schedule`` pairs ``[round, client]`` and,
        independently, each with probability ``run.dropout`` (from the round's own stream)."""
        r = self.cfg.run
        dropped = {c for rr, c in r.dropout_schedule if rr == rnd and c in clients}
        if r.dropout > 0:
            rng = numpy_rng(r.seed, "dropout", rnd)
            dropped |= {c for c, u in zip(clients, rng.random(len(clients))) if u < r.dropout}
        return dropped

    def cohort_size(self) -> int:
        """How many clients train together (:func:`~.cohort.cohort_size`, resolved at the first round); when
        ``run.cohort`` asked for more than can be, one line says why."""
        if self._cohort is None:
            self._cohort, reason = cohort_size(self.cfg, self.method, self.task, self.model, self.device)
            if reason and self.cfg.run.cohort > 1 and self.log:
                self.log(f"[{self.method.name}] run.cohort = {self.cfg.run.cohort}: {reason}; clients train one at "
                         f"a time")
        return self._cohort

    def train_clients(self, rnd: int, sent: list[tuple[int, int, Message, State]]) -> list[tuple[Message, State, Any]]:
        """``(reply, new state, trainer)`` of each client in ``sent``: alone on the model, or as a cohort, each
        member on its own :meth:`~fedlowrank.adapters.model.AdaptedModel.shared_copy` of it (made once, reused)."""
        clients = [k for k, *_ in sent]
        on_step = self.progress.client_start(clients[0] if len(clients) == 1 else clients)
        if len(sent) == 1:
            k, _, down, state = sent[0]
            return [client_update(self.method, self.model, down, state, self.task, self.parts[k], self.cfg, k, rnd,
                                  on_step)]
        while len(self._views) < len(sent):
            self._views.append(self.model.shared_copy())
        return cohort_update(self.method, self.model, self._views[:len(sent)], [down for _, _, down, _ in sent],
                             [state for *_, state in sent], self.task, [self.parts[k] for k in clients], self.cfg,
                             clients, rnd, on_step)

    def run_round(self) -> dict[str, Any]:
        """Run the next round; returns its metrics row."""
        cfg, rnd = self.cfg, self.round + 1
        t_start = time.perf_counter()
        clients = sample_clients(cfg.run.seed, rnd, cfg.partition.num_clients, cfg.run.clients_per_round)
        dropped = self.dropped_clients(rnd, clients)
        replies: list[Reply] = []
        new_states: dict[int, State] = {}  # committed only when the round is aggregated
        downs: dict[int, Message] = {}  # what each client was sent (central DP measures updates from it)
        rejected: list[dict[str, Any]] = []
        ledger_rows: list[dict[str, int]] = []
        compute = 0.0
        losses: list[float] = []
        self.progress.round_start(rnd, len(clients))
        self.client_eval = {}  # filled by this round's evaluation, if any
        size = self.cohort_size()
        for chunk in (clients[i:i + size] for i in range(0, len(clients), size)):
            sent: list[tuple[int, int, Message, State]] = []  # (client, bytes down, what it received, its state)
            for k in chunk:
                msg = self.method.broadcast(self.server, k, rnd)
                down = downs[k] = wire(msg)
                state = self.store.get(k)
                sent.append((k, msg.nbytes(), down, self.method.init_client(k) if state is None else state))
            for (k, down_bytes, down, _), (reply, new_state, trainer) in zip(sent, self.train_clients(rnd, sent)):
                compute += trainer.compute_seconds
                self.progress.client_done()
                if k in dropped:
                    ledger_rows.append({"round": rnd, "client": k, "down": down_bytes, "up": 0})
                    continue
                if self.tamper is not None:
                    reply = self.tamper(rnd, k, reply)
                received = wire(reply)
                ledger_rows.append({"round": rnd, "client": k, "down": down_bytes, "up": reply.nbytes()})
                reason = check_reply(self.method, down, received, rnd, len(self.parts[k]))
                if reason is not None:
                    rejected.append({"client": k, "reason": reason})
                    if self.log:
                        self.log(f"[{self.method.name}] round {rnd}: rejected the reply of client {k}: {reason}")
                    continue
                new_states[k] = new_state
                losses.append(float(received["train_loss"]))
                replies.append(Reply(k, int(received["num_examples"]), received))
        for row in ledger_rows:
            self.ledger.add(**row)
        aggregation = 0.0
        privacy: dict[str, Any] = {}
        skipped = len(replies) < cfg.run.min_replies
        if skipped:
            if self.log:
                self.log(f"[{self.method.name}] round {rnd}: only {len(replies)} usable replies, fewer than "
                         f"run.min_replies = {cfg.run.min_replies}: round skipped, global state unchanged")
        else:
            t_agg = time.perf_counter()
            replies, privacy = central_replies(cfg, replies, downs, rnd, self.history)
            self.server = self.method.aggregate(self.server, replies, rnd)
            self.store.update(new_states)
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
            "round": rnd, "clients": clients, "replied": [r.client for r in replies],
            "train_loss": float(np.mean(losses)) if losses else float("nan"), **metrics,
            "bytes_up": sum(r["up"] for r in ledger_rows), "bytes_down": sum(r["down"] for r in ledger_rows),
            "cum_bytes_up": self.ledger.total_up, "cum_bytes_down": self.ledger.total_down,
            "time": {"client_compute": compute, "aggregation": aggregation, "evaluation": evaluation,
                     "other": total - compute - aggregation - evaluation, "total": total},
            "peak_rss_mb": peak_rss_mb(),
        }
        if dropped:
            row["dropped"] = sorted(dropped)
        if rejected:
            row["rejected"] = rejected
        if skipped:
            row["skipped"] = True
        if diagnostics:
            row["diagnostics"] = diagnostics
        if privacy:
            row["privacy"] = privacy
        self.record_round(row, ledger_rows, replies)
        self.progress.round_end(row, metrics)
        return row

    def client_rows(self, ledger_rows: list[dict[str, int]], replies: list[Reply]) -> list[dict[str, Any]]:
        """The round's ``per_client`` entries (see the module's docstring), sorted by client; consumes
        :attr:`client_eval`."""
        used = {r.client: r for r in replies}
        rows: dict[int, dict[str, Any]] = {}
        for lr in ledger_rows:
            reply = used.get(lr["client"])
            rows[lr["client"]] = {
                "client": lr["client"], "train_loss": float(reply.message["train_loss"]) if reply else None,
                "num_examples": reply.num_examples if reply else None, "bytes_up": lr["up"], "bytes_down": lr["down"]}
        for k, test in self.client_eval.items():
            rows.setdefault(k, {"client": k, "train_loss": None, "num_examples": None, "bytes_up": 0,
                                "bytes_down": 0})["test"] = test
        self.client_eval = {}
        return [rows[k] for k in sorted(rows)]

    def record_round(self, row: dict[str, Any], ledger_rows: list[dict[str, int]], replies: Sequence[Reply] = ()) -> None:
        """Store a finished round (both runtimes): its ``per_client`` entries (from the ledger rows and the used
        ``replies``), history, metrics.jsonl, ledger.jsonl, tracker, divergence check, checkpoint."""
        row.update(accounting(self.cfg, self.info.client_sizes, self.history, row))
        row["per_client"] = self.client_rows(ledger_rows, list(replies))
        self.round = row["round"]
        self.history.append(row)
        self._append("metrics.jsonl", [row])
        self._append("ledger.jsonl", ledger_rows)
        generations = self.task.pop_generations()  # e.g. a causal LM's answers to a few test questions
        if generations and self.run_dir is not None:
            (self.run_dir / f"generations-round{self.round}.jsonl").write_text(
                "".join(json.dumps(g) + "\n" for g in generations))
        if self.run_dir is not None and self.cfg.run.tracking:
            if self.tracker is None:
                self.tracker = open_tracker(self.cfg, self.run_dir)
            self.tracker.log(row)
        self._check_divergence(row)
        every = self.cfg.run.checkpoint_every
        if self.run_dir is not None and (self.round == self.cfg.run.rounds or (every and self.round % every == 0)):
            self.save_checkpoint()

    # -- checkpoints ----------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        assert self.run_dir is not None
        ck = Checkpoint(self.round, self.method.name, self.server, self.store, self.history, self.ledger.rows,
                        config_fingerprint(self.cfg), self.client_states)
        return save_checkpoint(self.run_dir, ck)

    def close(self) -> None:
        """Close the progress bars and the tracker (a later round reopens the tracker) and release the run
        directory's lock (nothing is written to it after this)."""
        self.progress.close()
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None
        if self._lock is not None:
            self._lock.release()

    @classmethod
    def from_checkpoint(cls, run_dir: str | Path, task: Task | None = None,
                        log: Callable[[str], None] | None = None, round: int | None = None,
                        warn: Callable[[str], None] | None = None) -> "Simulation":
        """The run in ``run_dir`` at its newest intact checkpoint (or that of ``round``), after checking that the
        checkpoint is of the directory's ``config.json``. Reads only: nothing in ``run_dir`` is written.
        ``warn`` (default ``log``) gets a line when a damaged checkpoint is skipped (:func:`find_checkpoint`)."""
        from ..config import ConfigError, from_dict

        run_dir = Path(run_dir)
        warn = warn or log
        path, ck = find_checkpoint(run_dir, round, warn)
        try:
            cfg = from_dict(json.loads((run_dir / "config.json").read_text()))
        except (OSError, json.JSONDecodeError, ConfigError) as exc:
            raise CheckpointError(f"{run_dir}: config.json unreadable ({exc})") from exc
        if ck.method != cfg.method_name:
            raise CheckpointError(f"checkpoint {path} is of method {ck.method!r}, {run_dir / 'config.json'} says "
                                  f"{cfg.method_name!r}: they are not of the same run")
        if ck.config_fingerprint and ck.config_fingerprint != config_fingerprint(cfg):
            raise CheckpointError(f"checkpoint {path} was written with another config (fingerprint "
                                  f"{ck.config_fingerprint[:12]}) than {run_dir / 'config.json'} (fingerprint "
                                  f"{config_fingerprint(cfg)[:12]}): they are not of the same run")
        if ck.round > cfg.run.rounds:
            raise CheckpointError(f"checkpoint {path} is of round {ck.round}, beyond run.rounds = {cfg.run.rounds} "
                                  f"in {run_dir / 'config.json'}: they are not of the same run")
        sim = cls(cfg, task=task, run_dir=None, log=log)
        sim.server, sim.round, sim.client_states = ck.server, ck.round, ck.client_states
        sim.store.restore(ck.clients, ck.spilled)
        sim.history, sim.ledger.rows = ck.history, ck.ledger
        evals = [r for r in ck.history if "accuracy" in r or "loss" in r]
        metric_keys = ("accuracy", "loss", "perplexity", "exact_match")
        sim.last_eval = {k: v for k, v in evals[-1].items() if k in metric_keys} if evals else {}
        return sim

    @classmethod
    def resume(cls, run_dir: str | Path, task: Task | None = None, log: Callable[[str], None] | None = None,
               round: int | None = None, warn: Callable[[str], None] | None = None) -> "Simulation":
        """Rebuild the run in ``run_dir`` from its resolved config and newest intact checkpoint (or that of
        ``round``), ready to continue, holding the directory's lock; ``metrics.jsonl`` and ``ledger.jsonl`` are
        cut back to the checkpoint's round and later checkpoints deleted."""
        lock = lock_run_dir(run_dir) if Path(run_dir).is_dir() else None
        try:
            sim = cls.from_checkpoint(run_dir, task, log, round, warn)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        sim.run_dir, sim._lock = Path(run_dir), lock
        drop_checkpoints_after(sim.run_dir, sim.round)
        if not sim.client_states and (warn or log):
            (warn or log)(f"note: the checkpoint of round {sim.round} is the Flower server's; the clients' states "
                          f"stayed on the SuperNodes, so clients start here from their initial states")
        sim.client_states = True  # from here on the simulator holds them
        for name, rows in (("metrics.jsonl", sim.history), ("ledger.jsonl", sim.ledger.rows)):
            (sim.run_dir / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return sim

    def _check_divergence(self, row: dict[str, Any]) -> None:
        """Stop on a non-finite global parameter, a round whose every reply was non-finite, or a metric bound."""
        name, rnd = self.method.name, row["round"]
        bad = [k for k, v in self.server.tensors().items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
        if bad:
            raise DivergenceError(f"round {rnd}: method {name!r}: non-finite global parameter {bad[0]!r}")
        rejected = row.get("rejected", [])
        if rejected and not row["replied"] and all("finite" in r["reason"] for r in rejected):
            raise DivergenceError(f"round {rnd}: method {name!r}: every client's training diverged "
                                  f"({rejected[0]['reason']})")
        bound_key = self.cfg.run.stop_metric
        if bound_key and bound_key in row and (not math.isfinite(row[bound_key]) or row[bound_key] > self.cfg.run.stop_above):
            raise DivergenceError(f"round {row['round']}: method {self.method.name!r}: {bound_key} = {row[bound_key]} "
                                  f"beyond run.stop_above = {self.cfg.run.stop_above}")

    def run(self) -> dict[str, Any]:
        """Run the remaining rounds and return a summary."""
        try:
            while self.round < self.cfg.run.rounds:
                self.run_round()
            return self.summary()
        finally:
            self.close()

    def summary(self) -> dict[str, Any]:
        times = {k: sum(r["time"][k] for r in self.history) for k in ("client_compute", "aggregation", "evaluation", "other", "total")}
        out = {"method": self.method.name, "rounds": self.round, "bytes_up": self.ledger.total_up,
               "bytes_down": self.ledger.total_down, "time": times, "peak_rss_mb": peak_rss_mb()}
        out.update(self.last_eval)
        if self.history and "epsilon" in self.history[-1]:
            out["epsilon"] = self.history[-1]["epsilon"]
        accuracies = [r["accuracy"] for r in self.history if "accuracy" in r]
        if accuracies:
            out["best_accuracy"] = max(accuracies)
        if self.run_dir is not None:
            (self.run_dir / "summary.json").write_text(json.dumps(out, indent=1))
        return out

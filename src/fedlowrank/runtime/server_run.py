"""The server side of a run, shared by the simulator and the Flower ServerApp.

A :class:`ServerRun` holds a :class:`~.run.Run` (:attr:`ServerRun.state`, whose fields it reads and sets as its
own attributes: ``cfg``, ``task``, ``method``, ``model``, ``server``, ``round``...) and adds the collaborators the round loop calls: the client states the
server holds (:class:`~.store.ClientStore`; none on Flower, where they stay on the nodes), the run directory's files
(:class:`~.rundir.RunFiles`, in the directory :mod:`.rundir` claims and locks), evaluation (:mod:`.evaluation`),
checkpoints (:mod:`.checkpoint`), the experiment tracker (:class:`~fedlowrank.reporting.tracking.RunTracker`) and
progress lines (:mod:`fedlowrank.reporting.progress`). A round ends the same way in both runtimes:

* :meth:`ServerRun.close_round` — the server's step (:func:`.rounds.close_round`: skip, server-side reply
  transforms, ``method.aggregate``, the metrics row), changing nothing yet;
* :meth:`ServerRun.evaluate_round` — the new global model (or the clients' own models) on the test set, when due;
* :meth:`ServerRun.commit_round` — the round becomes the run's: server state, client states, ledger, history,
  files, tracker, divergence check, checkpoint, progress line.

:meth:`ServerRun.run` is the loop of the in-process runners (the simulator, the vectorised runner): a fresh run's
model evaluated before training (round 0, :meth:`ServerRun.evaluate_initial`), then their ``run_round`` until the
last round, stopping cleanly on SIGINT or SIGTERM (:mod:`.stopping`); :meth:`ServerRun.resume`
continues a run from its checkpoint.
"""

from __future__ import annotations

import math
import time
from collections import ChainMap
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ..codecs import RESIDUAL
from ..execution.compiling import release_compiled
from ..linalg.reductions import all_finite
from ..message import State
from ..privacy.runtime import PRIVACY_KEYS, accounting
from ..reporting.progress import Progress
from ..reporting.tracking import RunTracker, require_package
from ..serialization import FormatError
from .calibration import ClassifierCalibration
from .checkpoint import (ROW_TIMES, Checkpointer, CheckpointError, StateSchema, check_history, check_state,
                         read_run_checkpoint, restart_from, restore)
from .evaluation import Evaluator, collapse_line, collapse_of, run_collapse, scalar_metrics
from .rounds import RoundOutcome, RoundReplies, Warn, client_rows, close_round
from .run import DivergenceError, Run, peak_rss_mb
from .rundir import RunDirError, RunFiles, check_run_dir, claim_run_dir, lock_run_dir, own, read_claim
from .stopping import StopRequested, check_stop, stop_signals
from .store import ClientStore


def _held(name: str) -> property:
    """The field ``name`` of the held :class:`~.run.Run`, read and set through :attr:`ServerRun.state`."""
    return property(lambda self: getattr(self.state, name), lambda self, value: setattr(self.state, name, value),
                    doc=f"``state.{name}`` (:class:`~.run.Run`)")


class ServerRun:
    """A :class:`~.run.Run` with the server's collaborators (see the module docstring).

    Args:
        run: the run (from :func:`~.run.build_run`), held as :attr:`state`.
        run_dir: where to write the run's files; ``None`` writes nothing. It must be empty or absent unless
            ``overwrite`` (which deletes the old run's files), and is locked until :meth:`close` or the end of the
            process. Call :meth:`check` with it before building the run, to refuse it before any work.
        log: where progress lines go (``None`` = silent); a log with a true ``bars`` attribute
            (:class:`~fedlowrank.reporting.progress.StderrLog` on a terminal) also gets tqdm bars.
        log_partition: log the per-client label counts when the run directory is made.
        client_states: whether the server holds the clients' states (``False`` on Flower; checkpoints say so).
    """

    stops_together = False  # a stop signal is only noted: the runner agrees on it with its peers (distributed ranks)

    cfg = _held("cfg")
    task = _held("task")
    parts = _held("parts")
    split = _held("split")
    method = _held("method")
    model = _held("model")
    info = _held("info")
    device = _held("device")
    server = _held("server")
    round = _held("round")
    history = _held("history")
    ledger = _held("ledger")
    last_eval = _held("last_eval")

    def training_plan(self):
        """The held run's :meth:`~.run.Run.training_plan`."""
        return self.state.training_plan()

    def __init__(self, run: Run, run_dir: str | Path | None = None, log: Callable[[str], None] | None = None,
                 overwrite: bool = False, log_partition: bool = True, client_states: bool = True):
        self.state = run
        cfg = self.cfg
        self.client_states = client_states
        self.initial_eval: dict[str, Any] = {}  # round 0, before training (:meth:`evaluate_initial`)
        self.store = ClientStore(cfg.run.state_memory_mb, None if run_dir is None else Path(run_dir) / "client_states")
        self.progress = Progress(log, self.method.name, cfg.run.rounds, counts=self.task.metric_counts)
        self.log = self.progress.write if log is not None else None
        self.evaluator = Evaluator(cfg, self.task, self.method, self.model, self.progress, self.parts)
        self.calibration = ClassifierCalibration.of_run(run)  # CCVR after the last round, or None
        self._lock = None
        self.use_dir(None)
        if run_dir is not None:
            self._lock = claim_run_dir(Path(run_dir), overwrite)
            self.use_dir(Path(run_dir))
            self.files.start(self, self.log if log_partition else None)

    @staticmethod
    def check(cfg, run_dir: str | Path | None, overwrite: bool = False, flag: str = "--overwrite") -> None:
        """Refuse, before any work, what :class:`ServerRun` would: a missing tracking package, a run directory that
        holds another run (unless ``overwrite``; ``flag`` is how the user asks for it) or is in use."""
        if cfg.run.tracking:
            require_package(cfg.run.tracking)
        if run_dir is not None:
            check_run_dir(run_dir, overwrite, flag)

    def use_dir(self, run_dir: Path | None) -> None:
        """Write the run's files, tracker and checkpoints to ``run_dir`` (``None``: nowhere)."""
        self.run_dir = run_dir
        self.files = RunFiles(run_dir)
        self.tracker = RunTracker(self.cfg, run_dir, own)
        self.checkpoints = Checkpointer(self.cfg, run_dir)

    def warn(self, line: str) -> None:
        if self.log is not None:
            self.log(f"[{self.method.name}] {line}")

    # -- a round's end ----------------------------------------------------------------------------------
    def close_round(self, got: RoundReplies, started: float, warn: Warn | None = None) -> RoundOutcome:
        """The server's step of round ``got.round`` (:func:`.rounds.close_round`); ``warn`` (default: the run's
        log) gets the round's warnings. At the last round, with ``task.options.ccvr_samples``, the aggregated model's
        classifier is calibrated (:mod:`.calibration`): the row's ``ccvr``, its exchange in the ledger and the
        round's bytes, its seconds in ``time.aggregation``."""
        outcome = close_round(self.state, got, started, warn or self.warn)
        if self.calibration is None or outcome.skipped or got.round != self.cfg.run.rounds:
            return outcome
        before = scalar_metrics(self.evaluator.evaluate(outcome.server, self.store))
        outcome.server, ledger, info = self.calibration.calibrate(self.state, outcome.server, got.round)
        row = outcome.row
        row["time"]["aggregation"] += info.pop("seconds")
        row["ccvr"] = {**info, "before": before}
        for key, side in (("bytes_up", "up"), ("bytes_down", "down")):
            added = sum(r[side] for r in ledger)
            row[key] += added
            row[f"cum_{key}"] += added
        outcome.ledger.extend(ledger)
        return outcome

    def evaluate_round(self, outcome: RoundOutcome,
                       new_states: Mapping[int, State] | None = None) -> tuple[dict[str, float], float]:
        """``(metrics, seconds)`` of the round's evaluation when it is due (else ``({}, 0)``): the model after
        ``outcome``, with the clients' states after it (``new_states`` over the store)."""
        if not self.evaluator.due(outcome.row["round"]):
            return {}, 0.0
        t_eval = time.perf_counter()
        server = self.server if outcome.skipped else outcome.server
        states = self.store if outcome.skipped or not new_states else ChainMap(dict(new_states), self.store)
        metrics = self.evaluator.evaluate(server, states)
        return metrics, time.perf_counter() - t_eval

    def commit_round(self, outcome: RoundOutcome, metrics: dict[str, float], evaluation: float,
                     new_states: Mapping[int, State] | None = None) -> dict[str, Any]:
        """Make ``outcome`` (evaluated: ``metrics`` in ``evaluation`` seconds) the run's: the new server state and
        the clients' ``new_states`` (unless the round was skipped), ledger, history, files, tracker; then stop on
        divergence, checkpoint when due, write the progress line. Returns the round's row."""
        row = outcome.row
        if not outcome.skipped:
            self.server = outcome.server
            self.store.update(new_states or {})
        for entry in outcome.ledger:
            self.ledger.add(**entry)
        row.update(metrics)
        t = row["time"]
        total = time.perf_counter() - outcome.started
        t.update({"evaluation": evaluation, "other": total - t["client_compute"] - t["aggregation"] - evaluation
                  - t.get("collective", 0.0), "total": total})
        row["peak_rss_mb"] = peak_rss_mb()
        row.update(accounting(self.cfg, self.info.client_sizes, self.history, row))
        row["per_client"] = client_rows(outcome.ledger, outcome.replies, self.evaluator.pop_client_tests())
        self.round = row["round"]
        self.record_row(row, outcome.ledger, metrics)
        return row

    def record_row(self, row: dict[str, Any], ledger: list[dict[str, int]], metrics: dict[str, float],
                   rounds: int = 1) -> None:
        """Record the metrics row of the run's newest round (covering its last ``rounds`` rounds; ``metrics``: its
        evaluation, if any): history, files, tracker; then stop on divergence, checkpoint when due, progress line."""
        if metrics:
            self.last_eval = metrics
        self.history.append(row)
        self.files.append_round(row, ledger, self.task.pop_generations())
        self.tracker.log(row)
        self.check_divergence(row)
        if self.checkpoint_due(self.round):
            self.save_checkpoint()
        self.progress.round_end(row, metrics, rounds)
        if collapse_of(row) and not any(collapse_of(r) for r in self.history[:-1]):
            self.warn(collapse_line(collapse_of(row), self.task.collapse_advice()))

    def checkpoint_due(self, rnd: int) -> bool:
        """Whether the state after round ``rnd`` is saved (:meth:`~.checkpoint.Checkpointer.due`)."""
        return self.checkpoints.due(rnd)

    def check_divergence(self, row: dict[str, Any]) -> None:
        """Stop on a non-finite global parameter, a round whose every reply was non-finite (from two clients or
        more: one client's bad reply is that node's, not the run's), or a metric bound."""
        name, rnd = self.method.name, row["round"]
        tensors = self.server.tensors()
        bad = [] if all_finite(list(tensors.values())) else \
            [k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
        if bad:
            raise DivergenceError(f"round {rnd}: method {name!r}: non-finite global parameter {bad[0]!r}")
        rejected = row.get("rejected", [])
        if len(rejected) > 1 and not row["replied"] and all("finite" in r["reason"] for r in rejected):
            raise DivergenceError(f"round {rnd}: method {name!r}: every client's training diverged "
                                  f"({rejected[0]['reason']})")
        bound_key = self.cfg.run.stop_metric
        if bound_key and bound_key in row and (not math.isfinite(row[bound_key]) or row[bound_key] > self.cfg.run.stop_above):
            raise DivergenceError(f"round {rnd}: method {name!r}: {bound_key} = {row[bound_key]} "
                                  f"beyond run.stop_above = {self.cfg.run.stop_above}")

    # -- the loop ---------------------------------------------------------------------------------------
    def run_round(self) -> Any:
        """Run the next round (the simulator's and the vectorised runner's own; Flower's strategy drives rounds)."""
        raise NotImplementedError

    def done(self) -> bool:
        """Whether the run has no round left to run."""
        return self.round >= self.cfg.run.rounds

    def run(self) -> dict[str, Any]:
        """Run the remaining rounds (:meth:`run_round`) and return the summary. Stopped by SIGINT or SIGTERM
        (:mod:`.stopping`), it saves the state after its last finished round as a checkpoint (with a run
        directory) and raises :class:`~.stopping.StopRequested`."""
        try:
            with stop_signals(hold=self.stops_together):
                try:
                    if self.round == 0 and not self.initial_eval:
                        self.evaluate_initial()
                    while not self.done():
                        check_stop()
                        self.run_round()
                    check_stop()  # one held through the last round's checkpoint stops the caller too
                except StopRequested:
                    if self.run_dir is not None and self.checkpoints.saved_round != self.round:
                        self.save_checkpoint()
                    raise
            return self.summary()
        finally:
            self.close()

    # -- evaluation, checkpoints, the end ---------------------------------------------------------------
    def personal_eval_clients(self) -> list[int]:
        """The clients whose own model a personalised method's evaluation loads (:class:`~.evaluation.Evaluator`)."""
        return self.evaluator.personal_clients(self.store)

    def evaluate(self) -> dict[str, float]:
        """The metrics of the run's model now: the global model on the test set, or for a personalised method the
        mean over the evaluated clients of their own models'."""
        return self.evaluator.evaluate(self.server, self.store)

    def evaluate_initial(self) -> None:
        """Round 0: the model before training on the test set (:attr:`initial_eval`, the summary's ``initial``)."""
        self.initial_eval = self.evaluate()
        if self.log is not None:
            self.log(f"[{self.method.name}] before training (round 0): " + ", ".join(
                f"{k} {v:.4g}" for k, v in scalar_metrics(self.initial_eval).items()))

    def save_checkpoint(self) -> Path:
        return self.checkpoints.save(self)

    def summary(self) -> dict[str, Any]:
        """The run's summary (also ``summary.json``): method, rounds, bytes, time by part, peak memory, the last
        evaluation's metrics, ``initial`` (round 0: the model before training, when this process ran it), ``epsilon``
        under client-level DP, ``dpsgd_epsilon`` under DP-SGD (:data:`~..privacy.runtime.PRIVACY_KEYS`),
        ``best_accuracy``, ``collapse`` when the global model collapsed (:func:`~.evaluation.run_collapse`),
        ``remedies``, the task's label-skew remedies in use (:meth:`~fedlowrank.tasks.base.Task.remedies_in_use`),
        ``ccvr``, the last round's classifier calibration (:mod:`.calibration`)."""
        times = {k: sum(r["time"][k] for r in self.history) for k in ROW_TIMES}
        out = {"method": self.method.name, "rounds": self.round, "bytes_up": self.ledger.total_up,
               "bytes_down": self.ledger.total_down, "time": times, "peak_rss_mb": peak_rss_mb()}
        out.update(self.last_eval)
        if self.initial_eval:
            out["initial"] = self.initial_eval
        for key in PRIVACY_KEYS:
            if self.history and key in self.history[-1]:
                out[key] = self.history[-1][key]
        collapse = run_collapse(self.history)
        if collapse:
            out["collapse"] = collapse
        remedies = self.task.remedies_in_use()
        if remedies:
            out["remedies"] = remedies
        if self.history and "ccvr" in self.history[-1]:
            out["ccvr"] = self.history[-1]["ccvr"]
        accuracies = [r["accuracy"] for r in self.history if "accuracy" in r]
        if accuracies:
            out["best_accuracy"] = max(accuracies)
        self.files.write_summary(out)
        return out

    def history_rounds(self, rnd: int) -> list[int]:
        """The rounds of the metrics rows this runner records up to round ``rnd``: every round."""
        return list(range(1, rnd + 1))

    def state_schema(self, client: int | None = None) -> StateSchema:
        """What the server state (``client=None``) or client ``client``'s state may hold
        (:class:`~.checkpoint.StateSchema`): the run's initial ones (this run is not yet restored: ``server`` is
        :meth:`~fedlowrank.methods.base.Method.setup`'s) and the method's declared further entries; with the uplink's
        error feedback, a client's residual of each tensor its replies may hold
        (:meth:`~fedlowrank.methods.base.Method.upload_templates`)."""
        server_entries, client_entries = self.method.state_entries()
        if self.state.uplink.error_feedback:
            client_entries += tuple(RESIDUAL + t for t in self.method.upload_templates())
        initial = self.server if client is None else self.method.init_client(client)
        return StateSchema(initial, server_entries if client is None else client_entries, self.server,
                           self.model.target_names, list(self.model.head_parameters()), self.cfg.partition.num_clients,
                           same_shapes=client is not None)

    def check_checkpoint(self, path: Path, ck) -> None:
        """:class:`~.checkpoint.CheckpointError` naming the file and the defect when checkpoint ``ck`` (of folder
        ``path``) does not fit this run, before anything of it is used: its history rows are not those of
        :meth:`history_rounds`, a row's field is not of its type, or its ledger does not count the rows' bytes
        (:func:`~.checkpoint.check_history`); its server state or a client's state holds an entry the method does
        not keep, lacks one, or holds a non-finite value (:meth:`state_schema`); or the server state (and for a
        personalised method, each client's) does not load into the model (a tensor of another shape)."""
        check_history(path, ck, self.history_rounds(ck.round), self.task.metrics)
        check_state(path, ck.server, self.state_schema())
        states = dict(ck.clients)
        for client, file in ck.spilled.items():
            try:
                states[client] = State.from_bytes(file.read_bytes())
            except (OSError, FormatError) as exc:
                raise CheckpointError(f"checkpoint {path}: clients/{file.name}: unreadable ({exc})") from None
        for client in sorted(states):
            where = f"clients.safetensors: client {client}" if client not in ck.spilled else f"clients/{ck.spilled[client].name}"
            if not 0 <= client < self.cfg.partition.num_clients:
                raise CheckpointError(f"checkpoint {path}: {where}: no such client (partition.num_clients = "
                                      f"{self.cfg.partition.num_clients})")
            check_state(path, states[client], self.state_schema(client), where)
        try:  # the shapes: what the model reads from the states
            for client in sorted(states) if self.method.personalized else ():
                self.method.load_personal(self.model, ck.server, states[client])
            self.method.load_global(self.model, ck.server)
        except (RuntimeError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise CheckpointError(f"checkpoint {path}: its states do not load into the run's model "
                                  f"({str(exc).splitlines()[0][:200]})") from None
        loss = self.probe_loss()
        if not math.isfinite(loss):
            raise CheckpointError(f"checkpoint {path}: its global model computes a non-finite loss ({loss}) on a "
                                  "training example")

    def probe_loss(self) -> float:
        """The model's loss as it is now on one training example (:meth:`~fedlowrank.tasks.base.Task.probe_batch`),
        in evaluation mode, without gradients."""
        net = self.model.net
        was_training = net.training
        net.eval()
        try:
            with torch.no_grad():
                return float(self.task.loss(net, self.task.device_batch(self.task.probe_batch(1), self.device)))
        finally:
            net.train(was_training)

    @classmethod
    def from_checkpoint(cls, run_dir: str | Path, task=None, log: Callable[[str], None] | None = None,
                        round: int | None = None, warn: Callable[[str], None] | None = None, **build):
        """The run in ``run_dir`` at its newest intact checkpoint (or that of ``round``), after checking that the
        checkpoint is of the directory's ``config.json``. Reads only: nothing in ``run_dir`` is written.
        ``warn`` (default ``log``) gets a line when a damaged checkpoint is skipped. For the runners built as
        ``cls(cfg, task=..., log=..., **build)`` (:class:`~.simulator.Simulation`, whose ``build`` may give the
        ``parts`` the run trained on, :class:`~.vectorized.Vectorized`)."""
        built = []

        def fits(cfg):
            built.append(cls(cfg, task=task, log=log, **build))
            return built[0].check_checkpoint

        _, ck = read_run_checkpoint(run_dir, round, warn or log, fits)
        restore(built[0], ck)
        return built[0]

    @classmethod
    def resume(cls, run_dir: str | Path, task=None, log: Callable[[str], None] | None = None,
               round: int | None = None, warn: Callable[[str], None] | None = None, **build):
        """Rebuild the run in ``run_dir`` from its resolved config and newest intact checkpoint (or that of
        ``round``), ready to continue, holding the directory's lock; ``metrics.jsonl`` and ``ledger.jsonl`` are
        cut back to the checkpoint's round (saying so when that drops rounds) and later checkpoints deleted
        (:func:`~.checkpoint.restart_from`). ``build``: the runner's further constructor arguments
        (:meth:`from_checkpoint`)."""
        claim = read_claim(run_dir) if Path(run_dir).is_dir() else None
        if Path(run_dir).is_dir() and (claim is None or claim.kind != "run"):
            what = "no valid claim file" if claim is None else f"the output of `fedlowrank {claim.kind}`"
            raise RunDirError(f"{run_dir} holds no fedlowrank run ({what}): nothing to resume, and nothing is "
                              f"written into it")
        lock = lock_run_dir(run_dir) if Path(run_dir).is_dir() else None
        try:
            run = cls.from_checkpoint(run_dir, task, log, round, warn, **build)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        run.use_dir(Path(run_dir))
        run._lock = lock
        restart_from(run.run_dir, run.round, run.history, run.ledger.rows, warn or log)
        keeps = run.method.keeps_client_state() or run.state.uplink.error_feedback
        if not run.client_states and keeps and (warn or log):
            (warn or log)(f"note: the checkpoint of round {run.round} is the Flower server's; the clients' states "
                          f"stayed on the SuperNodes, so clients start here from their initial states")
        run.client_states = True  # from here on the runner holds them
        return run

    def close(self) -> None:
        """Close the progress bars and the tracker (a later round reopens the tracker) and release the run
        directory's lock (nothing is written to it after this); compiled modules are released
        (:func:`~fedlowrank.execution.compiling.release_compiled`) and the plan with them (a later round decides
        and compiles again)."""
        release_compiled(self.model.net, self.task.compiled_module(self.model.net))
        self.state.plan = None
        self.progress.close()
        self.tracker.close()
        if self._lock is not None:
            self._lock.release()

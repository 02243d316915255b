"""The in-process simulator: one backbone in memory, per-client state in a store, every message on the wire.

Each round: sample K of M clients from the round's stream; for each, code and serialise the broadcast
(:func:`~.engine.send_down`; counted in the ledger), run :func:`~fedlowrank.runtime.engine.client_update` on the
shared model, code the reply (:meth:`~fedlowrank.codecs.Link.encode_reply`: with error feedback, the client's
residual rides in its state, out of what ``method.train`` gets) and serialise it (counted); then the server's step
shared with Flower (:meth:`~.server_run.ServerRun.close_round`: server-side reply transforms, ``method.aggregate``),
the evaluation every ``run.eval_every`` rounds, and the commit of the round
(:meth:`~.server_run.ServerRun.commit_round`). Memory grows with the clients' small states, never with model copies. With ``run.cohort`` > 1 (by default on CUDA) the sampled clients
go in groups of that many: broadcasts, then their local training together (:mod:`.cohort`; each member's model
shares the frozen backbone), then each reply in client order as above. A pooled method (``method.pooled``, the
centralised reference) trains one client per round, holding the sampled clients' pooled data
(:func:`~.engine.pool`).

A run directory holds ``config.json`` (resolved), ``partition.json`` (per-client label histograms),
``metrics.jsonl`` (a row per round: metrics, bytes, time breakdown, ``per_client``), ``ledger.jsonl`` (a row per client
per round: bytes up and down) and ``checkpoints/`` (:mod:`.checkpoint`: every ``run.checkpoint_seconds``, every
``run.checkpoint_every`` rounds, at the last round so that every finished run can be exported, and when the run is
stopped by SIGINT or SIGTERM, :mod:`.stopping`); ``run.tracking`` mirrors each metrics row to TensorBoard,
W&B or MLflow (:mod:`fedlowrank.reporting.tracking`). A run directory must be empty unless ``overwrite``, and is locked
while a run writes it (:mod:`.rundir`); ``resume`` checks that the checkpoint is of the directory's config
(:func:`~.checkpoint.config_fingerprint`).

A metrics row: ``round``, ``clients`` (sampled), ``replied`` (used), ``train_loss`` (mean over the used
replies), the test metrics when the round was evaluated (``accuracy``, ``loss``; for personalised methods the
mean over the clients' own models; a classification task's evaluation of the global model adds ``predictions``:
the most-predicted class, its share of the test set, the per-class recall, the chance level), ``bytes_up``/``bytes_down`` (this round), ``cum_bytes_up``/
``cum_bytes_down`` (the coded messages' bytes, :mod:`fedlowrank.codecs`), ``time`` (``client_compute``,
``aggregation``, ``evaluation``, ``other``, ``total``, in seconds; with a codec ``codec``, the seconds spent coding and
decoding in this process, a part of ``other``), ``peak_rss_mb``, optional ``codec`` (each direction's codec in words, when one is configured), ``dropped``,
``rejected``, ``skipped``, ``diagnostics``, ``privacy``, ``ccvr`` (the last round's classifier calibration,
:mod:`.calibration`), ``robust``
(``server.update_clip``, ``server.aggregate``: :mod:`.robust`), ``update_norm`` (the median norm per local step of
the aggregated replies' updates, what a later round's lone reply is measured against: :mod:`.robust`), and
``per_client``:
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

import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..codecs import split_state
from ..message import Message, State
from ..seeding import numpy_rng
from ..tasks import Task
from .cohort import Cohort, cohort_update
from .engine import client_update, pool, sample_clients, send_down, wire
from .rounds import RoundReplies
from .run import DivergenceError, Ledger, build_run, peak_rss_mb
from .server_run import ServerRun
from .stopping import interruptible

__all__ = ["DivergenceError", "Ledger", "Simulation", "peak_rss_mb"]


class Simulation(ServerRun):
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
            applied to every reply before it is sent (as coded, when the uplink has a codec).
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
        if cfg.run.vectorized:
            raise ValueError("run.vectorized = true: this run is the vectorised runner's (runtime/vectorized.py, "
                             "`fedlowrank run --vectorized`), not the simulator's")
        self.check(cfg, run_dir, overwrite)  # refuse before building anything
        super().__init__(build_run(cfg, task, parts), run_dir, log, overwrite, log_partition)
        self.tamper = tamper
        self._cohort: Cohort | None = None  # the cohorts' member views (made at the first cohort)

    # -- clients -------------------------------------------------------------------------------------
    def dropped_clients(self, rnd: int, clients: list[int]) -> dict[int, str]:
        """Sampled clients that do not reply this round, with the reason: ``run.dropout_schedule`` pairs
        ``[round, client]`` and, independently, each with probability ``run.dropout`` (from the round's own
        stream)."""
        r = self.cfg.run
        dropped = {c: "fault injection: run.dropout_schedule" for rr, c in r.dropout_schedule
                   if rr == rnd and c in clients}
        if r.dropout > 0:
            rng = numpy_rng(r.seed, "dropout", rnd)
            for c, u in zip(clients, rng.random(len(clients))):
                if u < r.dropout:
                    dropped.setdefault(c, "fault injection: run.dropout")
        return dropped

    def cohort_size(self) -> int:
        """How many clients train together (the run's :meth:`~.run.Run.training_plan`, decided before the first
        client trains); when ``run.cohort`` asked for more than can be, one line says why, as one line says whether
        the run compiles (on the CPU only when ``run.compile`` is set)."""
        first = self.state.plan is None
        plan = self.training_plan()
        if first and self.log:
            if plan.cohort_reason and self.cfg.run.cohort > 1:
                self.log(f"[{self.method.name}] run.cohort = {self.cfg.run.cohort}: {plan.cohort_reason}; clients "
                         f"train one at a time")
            if self.device.type == "cuda" or self.cfg.run.compile != "auto":
                self.log(plan.compile_rule)
        return plan.cohort

    def train_clients(self, rnd: int, sent: list[tuple[int, int, Message, State]], data: dict[int, np.ndarray],
                      cfg) -> list[tuple[Message, State, Any]]:
        """``(reply, new state, trainer)`` of each client in ``sent`` (``data``: its example indices; ``cfg``: the
        round's config): alone on the model, or as a cohort, each member on its own view of it
        (:class:`~.cohort.Cohort`: made once, reused)."""
        clients = [k for k, *_ in sent]
        on_step = self.progress.client_start(clients[0] if len(clients) == 1 else clients)
        plan = self.training_plan()
        if len(sent) == 1:
            k, _, down, state = sent[0]
            return [client_update(self.method, self.model, down, state, self.task, data[k], cfg, k, rnd, plan,
                                  on_step)]
        if self._cohort is None:
            self._cohort = Cohort(self.model, plan.cohort)
        return cohort_update(self.method, self._cohort, [down for _, _, down, _ in sent],
                             [state for *_, state in sent], self.task, [data[k] for k in clients], cfg,
                             clients, rnd, plan, on_step)

    # -- rounds --------------------------------------------------------------------------------------
    def trained_clients(self, rnd: int, clients: list[int], data: dict[int, np.ndarray], cfg):
        """Broadcast to ``clients`` and train them, a cohort of :meth:`cohort_size` at a time; yields per client
        (client, bytes down, the message it received, its coded reply, its new state, its trainer)."""
        size = self.cohort_size()
        uplink = self.state.uplink
        for chunk in (clients[i:i + size] for i in range(0, len(clients), size)):
            sent: list[tuple[int, int, Message, State]] = []  # (client, bytes down, what it received, its state)
            residuals = []  # error feedback's, kept apart from the method's state
            for k in chunk:
                coded, down = send_down(self.state.downlink, self.method.broadcast(self.server, k, rnd), k, rnd)
                state = self.store.get(k)
                state = self.method.init_client(k) if state is None else state
                state, residual = split_state(state) if uplink.error_feedback else (state, {})
                sent.append((k, coded.nbytes(), down, state))
                residuals.append(residual)
            with interruptible():
                trained = self.train_clients(rnd, sent, data, cfg)
            for (k, down_bytes, down, _), residual, (reply, new_state, trainer) in zip(sent, residuals, trained):
                reply, new_state = uplink.encode_reply(reply, down, new_state, residual, k, rnd)
                yield k, down_bytes, down, reply, new_state, trainer

    def run_round(self) -> dict[str, Any]:
        """Run the next round; returns its metrics row."""
        cfg, rnd = self.cfg, self.round + 1
        started = time.perf_counter()
        clients = sample_clients(cfg.run.seed, rnd, cfg.partition.num_clients, cfg.run.clients_per_round)
        data = {k: self.parts[k] for k in clients}
        if self.method.pooled:  # one model on the pooled data of the round's clients, for their steps
            first, data, cfg = pool(cfg, data)
            clients = [first]
        dropped = self.dropped_clients(rnd, clients)
        got = RoundReplies(rnd, clients, uplink=self.state.uplink, downlink=self.state.downlink)
        new_states: dict[int, State] = {}  # committed only when the round is aggregated
        self.progress.round_start(rnd, len(clients))
        for k, down_bytes, down, reply, new_state, trainer in self.trained_clients(rnd, clients, data, cfg):
            got.compute += trainer.compute_seconds
            self.progress.client_done()
            if k in dropped:
                got.drop(k, dropped[k], down_bytes)
                continue
            if self.tamper is not None:
                reply = self.tamper(rnd, k, reply)
            if got.receive(self.method, k, down, wire(reply), len(data[k]), reply.nbytes(), down_bytes=down_bytes):
                new_states[k] = new_state
        outcome = self.close_round(got, started)
        used = {r.client for r in outcome.replies}  # a reply rejected in close_round leaves its client's state
        new_states = {k: state for k, state in new_states.items() if k in used}
        metrics, evaluation = self.evaluate_round(outcome, new_states)
        return self.commit_round(outcome, metrics, evaluation, new_states)

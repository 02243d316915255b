"""Evaluation of a run on the server: when, which models, and the per-client metrics of personalised methods.

Every ``run.eval_every`` rounds and at the last round (:meth:`Evaluator.due`) the global model
(``method.load_global``) is evaluated on the task's test set. A personalised method (``method.personalized``)
is evaluated through its clients' own models instead (``method.load_personal`` with each client's state): the
round's metric is their mean, and each evaluated client's metrics go to its ``per_client`` entry. Which clients:
every client with a state, or the first ``run.personal_eval_clients`` of them in a fixed order drawn from
``run.seed`` (the same every round). Without client states (the Flower server's run: they stay on the nodes)
the global model is evaluated.

**Own-task evaluation.** When the data set declares the column that the partition splits on
(``partition.partition_by``) on its test examples too (:meth:`~fedlowrank.tasks.Task.test_column`: a task or group
per example, e.g. task-mix's ``task``), each client is scored on the test examples of its own values of that column
(:func:`own_groups`): a personalised method's clients with their own models, and for every other method the global
model on each client's subset (each distinct subset evaluated once, its metrics given to every client that has it).
Every method then reports the same ``per_client`` entries, and the round's metrics are the mean over the evaluated
clients of their own-task metrics (:data:`OWN_TASK`), with ``by_task``: that mean per value (clients of several
values under their values joined by ``+``). Which clients: as for a personalised method, among all clients for a
global model.

A classification task's evaluation also says what the model predicted (``predictions``:
:func:`fedlowrank.tasks.base.prediction_summary`). The global model has *collapsed* in a round when one class takes
at least :data:`COLLAPSE_SHARE` of its test predictions (:func:`collapse_of`); the run says so in one line at the
first such round (:func:`collapse_line`) and its summary records it (:func:`run_collapse`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from ..message import State
from ..reporting.progress import Progress
from ..seeding import numpy_rng
from .stopping import interruptible


class Evaluator:
    """Evaluates the models of a run (see the module docstring); ``progress`` shows the evaluation bar."""

    def __init__(self, cfg, task, method, model, progress: Progress, parts: list[np.ndarray] | None = None):
        self.cfg, self.task, self.method, self.model, self.progress = cfg, task, method, model, progress
        self.client_tests: dict[int, dict[str, float]] = {}  # the last evaluation's per-client metrics
        self.own = own_groups(task, cfg.partition.partition_by, parts) if parts is not None else None

    def due(self, rnd: int) -> bool:
        return rnd % self.cfg.run.eval_every == 0 or rnd == self.cfg.run.rounds

    def personal_clients(self, with_state: Collection[int]) -> list[int]:
        """The clients whose own model is evaluated, among those ``with_state`` (see the module docstring)."""
        n = self.cfg.run.personal_eval_clients
        if n == 0:
            return sorted(with_state)
        order = numpy_rng(self.cfg.run.seed, "personal-eval").permutation(self.cfg.partition.num_clients)
        return sorted([int(k) for k in order if int(k) in with_state][:n])

    def evaluate(self, server: State, states: Mapping[int, State]) -> dict[str, float]:
        """The metrics of the global model ``server``, or for a personalised method with client ``states`` the mean
        of its evaluated clients' own models (each client's in :attr:`client_tests`)."""
        self.client_tests = {}
        if self.own is not None:
            return self.evaluate_own(server, states)
        if self.method.personalized and len(states):
            clients = self.personal_clients(states)
            self.progress.eval_start(len(clients))
            for k in clients:
                self.client_tests[k] = self.evaluate_client(server, states[k], k)
                self.progress.eval_step()
            return mean_metrics(list(self.client_tests.values()))
        self.method.load_global(self.model, server)
        with interruptible(), self.progress.evaluating(self.model.net):
            return self.task.evaluate(self.model.net)

    def evaluate_client(self, server: State, state: State, client: int) -> dict[str, Any]:
        """The metrics of client ``client``'s own model (``method.load_personal`` with its ``state``) on the test
        set, or on the test examples of its own values when the evaluation is own-task (:func:`own_groups`)."""
        self.method.load_personal(self.model, server, state)
        with interruptible():
            if self.own is None:
                return self.task.evaluate(self.model.net)
            groups, test_values = self.own
            return self.task.evaluate_subset(self.model.net, np.isin(test_values, groups[client]))

    def evaluate_own(self, server: State, states: Mapping[int, State]) -> dict[str, Any]:
        """Each evaluated client's own-task metrics (in :attr:`client_tests`) and their mean over the clients, with
        ``by_task`` (the module docstring's own-task evaluation)."""
        groups, test_values = self.own
        personal = self.method.personalized and len(states)
        clients = self.personal_clients(states if personal else range(len(groups)))
        if not personal:
            self.method.load_global(self.model, server)
        by_subset: dict[tuple[str, ...], dict[str, float]] = {}
        self.progress.eval_start(len(clients))
        for k in clients:
            own = groups[k]
            if personal or own not in by_subset:
                if personal:
                    self.method.load_personal(self.model, server, states[k])
                with interruptible():
                    by_subset[own] = self.task.evaluate_subset(self.model.net, np.isin(test_values, own))
            self.client_tests[k] = by_subset[own]
            self.progress.eval_step()
        metrics: dict[str, Any] = mean_metrics([self.client_tests[k] for k in clients])
        labels = sorted({"+".join(groups[k]) for k in clients})
        metrics["by_task"] = {g: mean_metrics([self.client_tests[k] for k in clients if "+".join(groups[k]) == g])
                              for g in labels}
        return metrics

    def pop_client_tests(self) -> dict[int, dict[str, float]]:
        """The per-client metrics of the last evaluation, once (a round's ``per_client`` entries take them)."""
        tests, self.client_tests = self.client_tests, {}
        return tests


OWN_TASK = "mean own-task {metric} over clients"
"""What an own-task evaluation's metric is (:func:`metric_description`)."""


def own_groups(task, column: str, parts: list[np.ndarray]) -> tuple[list[tuple[str, ...]], np.ndarray] | None:
    """``(groups, test_values)`` when the data set declares the partition's ``column`` on its test examples
    (:meth:`~fedlowrank.tasks.Task.test_column`), else ``None``: ``groups[k]`` the sorted values of ``column`` among
    client ``k``'s training examples ``parts[k]``, ``test_values`` ``[num_test]`` the column of the test
    examples."""
    test = task.test_column(column) if column else None
    if test is None:
        return None
    train = task.column_values(column)
    return [tuple(sorted({train[int(i)] for i in p})) for p in parts], np.asarray(test)


def mean_metrics(rows: list[Mapping[str, Any]]) -> dict[str, float]:
    """The mean of each numeric metric over the ``rows`` that have it."""
    rows = [scalar_metrics(r) for r in rows]
    keys = dict.fromkeys(k for r in rows for k in r)
    return {k: float(np.mean([r[k] for r in rows if k in r])) for k in keys}


def metric_description(metric: str, rows: list[Mapping[str, Any]]) -> str:
    """What ``metric`` of the metrics ``rows`` of a run is: :data:`OWN_TASK` when they come from an own-task
    evaluation (they have ``by_task``), else the metric's name."""
    if any("by_task" in r for r in rows):
        return OWN_TASK.format(metric=metric.replace("_", " "))
    return metric


COLLAPSE_SHARE = 0.95
"""A model predicting one class for at least this share of the test set has collapsed."""


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numeric metrics of an evaluation (without ``predictions``)."""
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def collapse_of(row: Mapping[str, Any]) -> dict[str, Any] | None:
    """``{"round", "top_class", "top_label", "top_share", "majority_share"}`` when the evaluation in ``row`` (a
    metrics row) predicted one class for at least :data:`COLLAPSE_SHARE` of the test set, else ``None``."""
    pred = row.get("predictions")
    if not pred or pred["top_share"] < COLLAPSE_SHARE:
        return None
    return {"round": row["round"], **{k: pred[k] for k in ("top_class", "top_label", "top_share", "majority_share")}}


def run_collapse(history: list[Mapping[str, Any]]) -> dict[str, Any] | None:
    """A run's collapse (its first collapsed round, :func:`collapse_of`) with ``rounds``, every collapsed round,
    and ``at_end``, whether its last evaluation is collapsed; ``None`` when no evaluation collapsed."""
    evaluated = [r for r in history if r.get("predictions")]
    rounds = [r["round"] for r in evaluated if collapse_of(r)]
    if not rounds:
        return None
    first = next(collapse_of(r) for r in evaluated if r["round"] == rounds[0])
    return {**first, "rounds": rounds, "at_end": rounds[-1] == evaluated[-1]["round"]}


def collapse_line(collapse: Mapping[str, Any], advice: str = "") -> str:
    """``collapse: round 3: the global model predicts class 'World' for 97.4 % of the test set (≥ 95 %; chance
    level 25.0 %)``, then ``; advice`` (the task's :meth:`~fedlowrank.tasks.base.Task.collapse_advice`) if any."""
    return (f"collapse: round {collapse['round']}: the global model predicts class {collapse['top_label']!r} for "
            f"{100 * collapse['top_share']:.1f} % of the test set (≥ {100 * COLLAPSE_SHARE:.0f} %; chance level "
            f"{100 * collapse['majority_share']:.1f} %)" + (f"; {advice}" if advice else ""))

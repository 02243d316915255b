"""Own-task evaluation: on task-heterogeneous clients (task-mix partitioned by ``task``) every client is scored on
the test examples of its own task, a personalised method's clients with their own models and a global-model method's
global model on each client's subset; data sets without a test-side column keep the global test set."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedlowrank.cli import summary_table
from fedlowrank.config import load_config
from fedlowrank.experiments.sweep import split_validation
from fedlowrank.experiments.tune import run_tuning
from fedlowrank.runtime.evaluation import OWN_TASK, metric_description, own_groups
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.tasks.causal_lm import CausalLM
from fedlowrank.tasks.instructions import InstructionData

from helpers import require_dataset

OPTIONS = ("task.options={eval_examples=0, eval_generate=100, max_new_tokens=4, generation_batch_size=4, "
           "write_generations=1}")


def mix_sets(clients: int = 3) -> list[str]:
    """The task mix, one task per client, one round of one step: the settings of every test here."""
    return ["data.source=task-mix", "partition.kind=shards", "partition.partition_by=task",
            "partition.classes_per_client=1", f"partition.num_clients={clients}", f"run.clients_per_round={clients}",
            "run.rounds=1", "train.local_steps=1", "data.max_train_examples=0", "data.max_test_examples=12", OPTIONS]


def mix_config(method: str, clients: int = 3, *sets: str):
    return load_config("tiny-lm", [*mix_sets(clients), f"method.name={method}", *sets])


def own_task_reference(task: CausalLM, name: str) -> CausalLM:
    """A task holding exactly the test examples of task ``name`` (all of them evaluated), on the same model."""
    d = task.data
    test = np.flatnonzero(np.asarray(d.test_columns["task"]) == name)
    only = InstructionData(d.train_prompts, d.train_responses, [d.test_prompts[i] for i in test],
                           [d.test_responses[i] for i in test])
    return CausalLM(only, "tiny-llama", task.max_length, eval_examples=0, eval_generate=100, max_new_tokens=4,
                    generation_batch_size=4)


def client_tests(row) -> dict[int, dict[str, float]]:
    return {e["client"]: e["test"] for e in row["per_client"] if "test" in e}


@pytest.fixture(autouse=True)
def _data():
    require_dataset("gsm8k")
    require_dataset("agnews")


def test_each_clients_metric_is_its_own_model_on_exactly_its_tasks_test_examples():
    sim = Simulation(mix_config("fedalt"))
    row = sim.run_round()
    train = sim.task.data.train_columns["task"]
    tests = client_tests(row)
    assert sorted(tests) == [0, 1, 2]
    for k, got in tests.items():
        (name,) = {train[i] for i in sim.parts[k]}
        sim.method.load_personal(sim.model, sim.server, sim.store[k])
        want = own_task_reference(sim.task, name).evaluate(sim.model.net)
        assert set(got) == set(want) == {"loss", "perplexity", "exact_match"}
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (k, key)
    for key in ("loss", "exact_match"):
        assert row[key] == pytest.approx(np.mean([t[key] for t in tests.values()]))
    assert sorted(row["by_task"]) == sorted({train[i] for p in sim.parts for i in p})


def test_a_global_model_is_scored_on_each_clients_subset_once_per_subset(monkeypatch):
    sim = Simulation(mix_config("fedit", 6))
    calls = []
    subset = sim.task.evaluate_subset
    monkeypatch.setattr(sim.task, "evaluate_subset", lambda net, keep: calls.append(keep) or subset(net, keep))
    row = sim.run_round()
    train = sim.task.data.train_columns["task"]
    names = {k: train[sim.parts[k][0]] for k in range(6)}
    tests = client_tests(row)
    assert sorted(tests) == list(range(6)) and len(calls) == len(set(names.values()))  # each subset once
    sim.method.load_global(sim.model, sim.server)
    for name in set(names.values()):
        want = own_task_reference(sim.task, name).evaluate(sim.model.net)
        for k in (k for k in tests if names[k] == name):
            assert tests[k]["loss"] == pytest.approx(want["loss"], rel=1e-4)
            assert tests[k]["exact_match"] == pytest.approx(want["exact_match"])
        assert row["by_task"][name]["loss"] == pytest.approx(want["loss"], rel=1e-4)
    assert row["loss"] == pytest.approx(np.mean([t["loss"] for t in tests.values()]))
    assert metric_description("exact_match", [row]) == OWN_TASK.format(metric="exact match")


def test_data_without_a_test_side_column_keeps_the_global_test_set():
    cfg = load_config("tiny-lm", ["partition.kind=shards", "partition.partition_by=skill",
                                  "partition.classes_per_client=1", "run.rounds=1", "train.local_steps=1"])
    sim = Simulation(cfg)
    assert sim.task.test_column("skill") is None and own_groups(sim.task, "skill", sim.parts) is None
    row = sim.run_round()
    assert "by_task" not in row and not client_tests(row)
    assert metric_description("exact_match", [row]) == "exact_match"
    unpartitioned = Simulation(mix_config("fedit", 3, "partition.kind=iid", "partition.partition_by="))
    assert unpartitioned.evaluator.own is None  # the column is there but the partition did not use it


def test_own_task_resume_is_identical(tmp_path):
    sets = ("run.rounds=2", "run.checkpoint_every=1")
    straight = Simulation(mix_config("fedalt", 3, *sets), run_dir=tmp_path / "a")
    straight.run()
    interrupted = Simulation(mix_config("fedalt", 3, *sets), run_dir=tmp_path / "b")
    interrupted.run_round()
    del interrupted
    resumed = Simulation.resume(tmp_path / "b")
    resumed.run()
    for c in straight.store:
        for k, v in straight.store[c].tensors().items():
            assert torch.equal(v, resumed.store[c][k]), (c, k)
    keys = ("loss", "exact_match", "by_task", "per_client")
    assert [{k: r[k] for k in keys} for r in straight.history] == [{k: r[k] for k in keys} for r in resumed.history]
    summary = straight.summary()
    assert summary["by_task"] == resumed.summary()["by_task"]
    table = summary_table(summary)
    for name, metrics in summary["by_task"].items():
        assert f"task {name}" in table and f"exact_match {metrics['exact_match']:.4g}" in table


def test_compare_tabulates_the_mean_own_task_metric_and_says_so(tmp_path):
    from fedlowrank.experiments.compare import results_markdown, run_comparison

    sets = ["data.source=task-mix", "partition.kind=shards", "partition.partition_by=task",
            "partition.classes_per_client=1", "partition.num_clients=3", "run.clients_per_round=3", "run.rounds=1",
            "train.local_steps=1", "data.max_train_examples=0", "data.max_test_examples=12", OPTIONS,
            "run.stop_metric=exact_match", "train.local_epochs=0", "train.batch_size=4"]
    res = run_comparison("tiny-lm", "fedalt,fedit", "0", sets, tmp_path / "c")
    assert res["metric"] == "exact_match"
    assert res["metric_description"] == "mean own-task exact match over clients"
    for row in res["rows"]:
        metrics = tmp_path / "c" / f"{row['method']}-seed0" / "metrics.jsonl"
        history = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert row["runs"][0]["final"] == pytest.approx(history[-1]["exact_match"])
    assert "| method | final mean own-task exact match over clients |" in results_markdown(res)


def test_the_round_line_says_the_metrics_are_own_task_means():
    from fedlowrank.reporting.progress import round_line

    row = {"round": 1, "train_loss": 1.0, "replied": [0], "clients": [0], "bytes_up": 1, "bytes_down": 1,
           "time": {"total": 1.0}}
    metrics = {"loss": 2.0, "exact_match": 0.25, "by_task": {"gsm8k": {"exact_match": 0.25}}}
    line = round_line("fedit", row, metrics, 1, 0.0, {"exact_match": 60})
    assert "own-task mean over clients: test loss 2.0000, exact_match 0.25" in line and "/60" not in line


def test_a_subset_whose_responses_were_all_cut_reports_no_loss():
    sim = Simulation(mix_config("fedit", 3, "task.max_length=256"))  # tiny-llama's bytes: articles fill 256 tokens
    topic = np.asarray(sim.task.data.test_columns["task"]) == "topic"
    assert all(e.lost_response for e, i in zip(sim.task.eval_encoded, sim.task.eval_order) if topic[i])
    metrics = sim.task.evaluate_subset(sim.model.net, topic)
    assert "loss" not in metrics and "exact_match" in metrics


def test_tuning_scores_each_client_on_its_own_tasks_validation_examples():
    """The validation split (``fedlowrank tune``) keeps the run's own-task evaluation: each client's own model on
    the held-out training examples of its own task only, and the round's metric their mean."""
    cfg = mix_config("fedalt", 3)
    sim = Simulation(cfg)
    task = sim.task
    train = task.data.train_columns["task"]
    parts, held_out = split_validation(sim.parts, 0.2, cfg.run.seed)
    view = task.validation(held_out)
    assert view.test_column("task") == [train[i] for i in held_out]
    own_task_sim = Simulation(cfg, task=view, parts=parts)
    row = own_task_sim.run_round()
    tests = client_tests(row)
    assert sorted(tests) == [0, 1, 2]
    for k, got in tests.items():
        (name,) = {train[i] for i in parts[k]}
        mine = held_out[[train[i] == name for i in held_out]]
        assert 0 < len(mine) < len(held_out)
        own_task_sim.method.load_personal(own_task_sim.model, own_task_sim.server, own_task_sim.store[k])
        want = task.evaluate_examples(own_task_sim.model.net, mine)
        full = task.evaluate_examples(own_task_sim.model.net, held_out)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5) and got["loss"] != pytest.approx(full["loss"])
    assert row["loss"] == pytest.approx(np.mean([t["loss"] for t in tests.values()]))
    assert sorted(row["by_task"]) == sorted({train[i] for p in parts for i in p})


def test_validation_of_data_without_a_test_side_column_is_on_every_held_out_example():
    cfg = load_config("tiny-lm", ["partition.kind=shards", "partition.partition_by=skill",
                                  "partition.classes_per_client=1", "run.rounds=1", "train.local_steps=1"])
    sim = Simulation(cfg)
    parts, held_out = split_validation(sim.parts, 0.2, cfg.run.seed)
    view = sim.task.validation(held_out)
    assert view.test_column("skill") is None
    assert Simulation(cfg, task=view, parts=parts).evaluator.own is None


def test_tune_md_says_its_score_is_the_mean_own_task_loss(tmp_path):
    result = run_tuning("tiny-lm", ["fedalt"], "1e-3", "0", mix_sets(), tmp_path / "tune")
    (run,) = result["runs"]
    assert set(run["validation"]["by_task"]) == {"arithmetic", "gsm8k", "topic"}
    assert result["setup"]["metric_description"] == OWN_TASK.format(metric="loss")
    assert "Score: the validation mean own-task loss over clients after the last round" in (
        tmp_path / "tune" / "tune.md").read_text()

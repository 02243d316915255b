"""A task registered in one file (this one) is usable by ``run`` (and its plot), ``compare``, ``config``, config
validation and the metric direction; the bundled tasks declare what the CLI and ``compare`` used to hard-code."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import nn

import fedlowrank.tasks as tasks
from fedlowrank.adapters.model import AdaptedModel
from fedlowrank.cli import main
from fedlowrank.config import load_config
from fedlowrank.schema import Schema, setting
from fedlowrank.tasks import Task, headline_metric, higher_is_better, register_task, task_class


@dataclass
class ToyOptions(Schema):
    prefix = "task.options"

    dim: int = setting(3, "inputs of the toy regression", ge=1, le=64)
    examples: int = setting(40, "training examples", ge=8)


class ToyRegression(Task):
    """y = x·w + noise, fitted by one LoRA-adapted linear layer; ``score`` = −test MSE (higher is better)."""

    name = "toy-regression"
    metrics = ("score", "loss")
    primary_metric = "score"
    maximize = ("score",)
    Options = ToyOptions

    @classmethod
    def from_config(cls, cfg, cohorts: bool = False) -> "ToyRegression":  # cohorts: whether its batches are joined
        return cls(cls.checked_options(cfg), cfg.run.seed)

    def __init__(self, options: ToyOptions, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.dim = options.dim
        self.x = torch.randn(options.examples + 16, options.dim, generator=g)
        self.y = self.x @ torch.arange(1.0, options.dim + 1)[:, None] + 0.01 * torch.randn(len(self.x), 1, generator=g)
        self.n = options.examples

    @property
    def num_train(self) -> int:
        return self.n

    def build_model(self) -> AdaptedModel:
        net = nn.Sequential()
        net.add_module("linear", nn.Linear(self.dim, 1, bias=False))
        nn.init.zeros_(net.linear.weight)
        return AdaptedModel(net, ["linear"], [])

    def batch(self, indices):
        idx = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        return self.x[idx], self.y[idx]

    def loss(self, net, batch):
        return ((net(batch[0]) - batch[1]) ** 2).mean()

    @torch.no_grad()
    def evaluate(self, net) -> dict[str, float]:
        mse = float(((net(self.x[self.n:]) - self.y[self.n:]) ** 2).mean())
        return {"score": -mse, "loss": mse}


@pytest.fixture
def toy(monkeypatch):
    """ToyRegression registered for this test only (the registry is restored afterwards)."""
    tasks.available_tasks()
    monkeypatch.setattr(tasks, "_REGISTRY", dict(tasks._REGISTRY))
    register_task(ToyRegression)
    return ToyRegression


def toy_config(tmp_path, *extra: str):
    path = tmp_path / "toy.toml"
    path.write_text("\n".join([
        '[run]', 'name = "toy"', 'rounds = 2', 'clients_per_round = 2', 'checkpoint_every = 0',
        '[task]', 'kind = "toy-regression"', 'options = {dim = 2}',
        '[partition]', 'kind = "iid"', 'num_clients = 2', 'min_partition_size = 1',
        '[train]', 'local_steps = 2', 'batch_size = 4', 'optimizer = "sgd"', 'lr = 0.05',
        '[lora]', 'rank = 1', *extra]) + "\n")
    return str(path)


def test_a_task_registered_in_one_file_runs_plots_compares_and_is_configured(toy, tmp_path, capsys, monkeypatch):
    config = toy_config(tmp_path)
    cfg = load_config(config)
    assert task_class("toy-regression") is toy and headline_metric(cfg) == "score" and higher_is_better("score")

    plotted = []
    import fedlowrank.reporting.plots as plots

    real = plots.plot_run
    monkeypatch.setattr(plots, "plot_run", lambda history, out, metric, title: plotted.append(metric)
                        or real(history, out, metric, title))
    assert main(["run", config, "--out", str(tmp_path / "run"), "--quiet", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["rounds"] == 2 and summary["score"] == -summary["loss"] and plotted == ["score"]

    assert main(["compare", config, "--methods", "fedit,fedavg-full", "--seeds", "0", "--out",
                 str(tmp_path / "cmp"), "--quiet"]) == 0
    results = json.loads((tmp_path / "cmp" / "results.json").read_text())
    assert results["metric"] == "score" and results["higher_is_better"]
    assert [r["method"] for r in results["rows"]] == ["fedit", "fedavg-full"]
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "cmp" / "score_vs_round.png").exists()
    capsys.readouterr()

    assert main(["config", config]) == 0
    out = capsys.readouterr().out
    assert 'task.kind = "toy-regression"\n' in out
    assert "task.options.dim = 2\n    inputs of the toy regression\n    an integer in [1, 64] (default 3)\n" in out
    assert "task.options.examples = 40\n" in out
    assert main(["config", "--markdown", "--set", "task.kind=toy-regression"]) == 0
    row = "| `toy-regression` | score (higher is better), loss (lower is better) | none | no |"
    assert row in capsys.readouterr().out


def test_the_registered_task_s_declarations_are_checked(toy, tmp_path, capsys):
    assert main(["config", toy_config(tmp_path), "--set", "task.options.dim=0"]) == 2
    assert "task.options.dim must be in [1, 64], got 0" in capsys.readouterr().err
    assert main(["config", toy_config(tmp_path), "--set", "task.options.width=4"]) == 2
    assert "task.options.width is not an option of toy-regression; allowed: dim, examples" in capsys.readouterr().err
    assert main(["config", toy_config(tmp_path), "--set", "run.stop_metric=accuracy"]) == 2
    assert "run.stop_metric must be one of score, loss for task.kind = 'toy-regression'" in capsys.readouterr().err
    assert main(["config", toy_config(tmp_path), "--set", "data.source=agnews"]) == 2
    assert "task.kind = 'toy-regression' makes its data from task.options" in capsys.readouterr().err


def test_registration_refuses_contradicting_declarations(toy):
    class Twice(ToyRegression):
        pass

    with pytest.raises(ValueError, match="task 'toy-regression' registered twice"):
        register_task(Twice)

    class LowerAccuracy(ToyRegression):
        name = "lower-accuracy"
        metrics = ("accuracy",)
        primary_metric = "accuracy"
        maximize = ()

    with pytest.raises(ValueError, match="metric 'accuracy' is maximised by one of"):
        register_task(LowerAccuracy)

    class Unreported(ToyRegression):
        name = "unreported"
        primary_metric = "f1"

    with pytest.raises(ValueError, match="primary_metric 'f1'"):
        register_task(Unreported)
    assert "lower-accuracy" not in tasks.available_tasks() and "unreported" not in tasks.available_tasks()


def test_bundled_tasks_declare_their_primary_metric_and_direction():
    expected = {"text-classification": ("accuracy", True), "image-classification": ("accuracy", True),
                "causal-lm": ("loss", False), "matrix-regression": ("rel_error", False)}
    assert {k: (c.primary_metric, higher_is_better(c.primary_metric))
            for k, c in tasks.available_tasks().items()} == expected
    assert higher_is_better("exact_match") and not higher_is_better("perplexity")
    assert headline_metric(load_config("gsm8k")) == "loss"  # run gsm8k plots its loss, not rel_error
    assert headline_metric(load_config("tiny", ["run.stop_metric=loss"])) == "loss"

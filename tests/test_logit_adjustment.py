"""``task.options.logit_adjustment`` of text classification: each client's training loss is the cross-entropy of
``logits + τ · log π``, ``π`` its own label distribution (Menon et al., "Long-tail learning via logit adjustment",
arXiv:2007.07314); τ = 0 is the plain loss, evaluation reads the plain logits."""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import pytest
import torch

from fedlowrank.config import ConfigError, load_config
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.tasks import build_task
from fedlowrank.tasks.base import PRIOR_FLOOR, log_prior
from test_cohort import assert_same_run, simulate, without_dropout

SETS = ["run.clients_per_round=4", "train.local_epochs=0.3"]


@lru_cache(maxsize=None)
def task_with(tau: float):
    return without_dropout(build_task(load_config("tiny", [f"task.options.logit_adjustment={tau}"])))


def test_the_prior_is_the_clients_label_histogram_with_a_floor():
    prior = log_prior(np.array([0, 0, 1, 0]), 3).exp()
    torch.testing.assert_close(prior, torch.tensor([0.75, 0.25, PRIOR_FLOOR]))


def test_a_batch_carries_tau_times_the_log_prior_of_its_client():
    task = task_with(0.5)
    client = np.flatnonzero(task.train_labels == task.train_labels[0])[:5]  # a client holding one class
    client = np.concatenate([client, np.flatnonzero(task.train_labels != task.train_labels[0])[:15]])
    batch = task.client_batch(client[:4], client)
    counts = np.bincount(task.train_labels[client], minlength=task.num_labels) / len(client)
    expected = 0.5 * np.log(np.maximum(counts, PRIOR_FLOOR))
    assert batch["logit_offset"].shape == (4, task.num_labels)
    for row in batch["logit_offset"]:
        np.testing.assert_allclose(row.numpy(), expected, rtol=1e-6)


def test_the_adjusted_loss_equals_a_dense_reference():
    task = task_with(2.0)
    client = np.arange(0, task.num_train, 7)
    batch = task.client_batch(client[:3], client)
    logits = torch.randn(3, task.num_labels, generator=torch.Generator().manual_seed(1))
    counts = np.bincount(task.train_labels[client], minlength=task.num_labels)
    pi = [max(c / len(client), PRIOR_FLOOR) for c in counts]
    expected = 0.0
    for z, y in zip(logits.tolist(), batch["labels"].tolist()):
        adjusted = [zc + 2.0 * math.log(p) for zc, p in zip(z, pi)]
        expected += -(adjusted[y] - math.log(sum(math.exp(a) for a in adjusted))) / 3
    assert float(task.output_loss(logits, batch)) == pytest.approx(expected, rel=1e-5)


def test_tau_zero_is_the_plain_loss_bit_for_bit():
    task = task_with(0.0)
    client = np.arange(20)
    batch, plain = task.client_batch(client[:5], client), task.batch(client[:5])
    assert batch.keys() == plain.keys()
    logits = torch.randn(5, task.num_labels, generator=torch.Generator().manual_seed(0))
    assert torch.equal(task.output_loss(logits, batch), torch.nn.functional.cross_entropy(logits, batch["labels"]))


def test_tau_zero_runs_as_without_the_option_and_tau_one_changes_training(tmp_path):
    plain = Simulation(load_config("tiny", SETS), task=without_dropout(build_task(load_config("tiny"))))
    plain.run()
    zero = simulate("tiny", task_with(0.0), 1, [*SETS, "task.options.logit_adjustment=0"])
    one = simulate("tiny", task_with(1.0), 1, [*SETS, "task.options.logit_adjustment=1"])
    assert [r["train_loss"] for r in zero.history] == [r["train_loss"] for r in plain.history]
    assert [r["accuracy"] for r in zero.history] == [r["accuracy"] for r in plain.history]
    for key, value in plain.server.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(zero.server[key], value), key
    assert [r["train_loss"] for r in one.history] != [r["train_loss"] for r in plain.history]


def test_cohort_equals_one_at_a_time_with_logit_adjustment(tmp_path):
    sets = [*SETS, "task.options.logit_adjustment=1"]
    one = simulate("tiny", task_with(1.0), 1, sets, tmp_path / "one")
    joint = simulate("tiny", task_with(1.0), 3, sets, tmp_path / "joint")
    assert joint.cohort_size() == 3
    assert_same_run(one, joint)


@pytest.mark.parametrize("value, message", [
    ("-1", "error: task.options.logit_adjustment must be >= 0, got -1.0"),
    ("x", "error: task.options.logit_adjustment must be a number, got 'x'"),
])
def test_bad_values_are_one_error_line(value, message):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", [f"task.options.logit_adjustment={value}"])
    assert str(err.value).count("\n") == 0
    assert message.removeprefix("error: ") in str(err.value)


def test_images_take_the_same_option_and_cohorts_equal_one_at_a_time():
    """Image classification shares the loss: a ViT on label-skewed clients (Dirichlet), cohorts of 4 and 1."""
    import test_image
    from fedlowrank.tasks.image import ImageClassification

    base = test_image.image_task()
    task = without_dropout(ImageClassification(base.data, "tiny-vit", eval_batch_size=64, logit_adjustment=1.0))
    runs = []
    for cohort in (1, 4):
        cfg = test_image.image_config("fedit", per_round=4, partition_kind="dirichlet")
        cfg.task.options = {"logit_adjustment": 1.0}
        cfg.run.cohort = cohort
        runs.append(Simulation(cfg, task=task))
        runs[-1].run()
    assert "logit_offset" in task.client_batch(np.arange(4), np.arange(20))
    assert runs[1].cohort_size() == 4
    assert_same_run(*runs)


def test_dpsgd_refuses_logit_adjustment_in_one_line():
    """Each example's loss reads the client's other labels through the prior: per-example clipping bounds it not."""
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["task.options.logit_adjustment=1", "privacy.dpsgd=true"])
    assert str(err.value).count("\n") == 0
    assert "task.options.logit_adjustment" in str(err.value) and "privacy.dpsgd" in str(err.value)
    load_config("tiny", ["task.options.logit_adjustment=0", "privacy.dpsgd=true"])

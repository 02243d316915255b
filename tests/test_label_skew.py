"""The label-skew remedies of classification tasks (``task.options``, :class:`ClassificationOptions`): each client's
training loss is the cross-entropy of ``logits · scale + offset`` — logit adjustment (``offset = τ · log π``, π its own
label distribution; Menon et al., arXiv:2007.07314), FedLC's calibration (``offset = −τ · n_c^{−1/4}``; Zhang et al.,
arXiv:2209.00189) and FedRS's restricted softmax (``scale = α`` on the classes it lacks; Li & Zhan, KDD 2021), alone or
together; off is the plain loss, evaluation reads the plain logits."""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import pytest
import torch

from fedlowrank.config import ConfigError, load_config
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.tasks import build_task
from fedlowrank.tasks.base import PRIOR_FLOOR, ClassificationOptions, calibration_offset, log_prior
from test_cohort import assert_same_run, simulate, without_dropout

SETS = ["run.clients_per_round=4", "train.local_epochs=0.3"]


@lru_cache(maxsize=None)
def task_with(tau: float = 0.0, calibration: float = 0.0, alpha: float = 1.0):
    return without_dropout(build_task(load_config("tiny", option_sets(tau, calibration, alpha))))


def option_sets(tau: float = 0.0, calibration: float = 0.0, alpha: float = 1.0) -> list[str]:
    return [f"task.options.logit_adjustment={tau}", f"task.options.calibration={calibration}",
            f"task.options.restricted_softmax={alpha}"]


def skewed_client(task, held: int = 2) -> np.ndarray:
    """Indices of a client holding only the ``held`` most frequent classes, the first of them 4× the others."""
    classes = np.argsort(-np.bincount(task.train_labels))[:held]
    picks = [np.flatnonzero(task.train_labels == c)[: 16 if i == 0 else 4] for i, c in enumerate(classes)]
    return np.concatenate(picks)


def dense_loss(logits: torch.Tensor, labels: list[int], client_labels: np.ndarray, num_classes: int, tau: float,
               calibration: float, alpha: float) -> float:
    """The remedied cross-entropy written out per example and class (the papers' formulas)."""
    counts = np.bincount(client_labels, minlength=num_classes)
    total = 0.0
    for z, y in zip(logits.tolist(), labels):
        adjusted = []
        for c, zc in enumerate(z):
            value = zc * (1.0 if counts[c] else alpha)
            value += tau * math.log(max(counts[c] / len(client_labels), PRIOR_FLOOR))
            if calibration:
                value = value - calibration * counts[c] ** -0.25 if counts[c] else -math.inf
            adjusted.append(value)
        total += -(adjusted[y] - math.log(sum(math.exp(a) for a in adjusted if a > -math.inf)))
    return total / len(labels)


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


@pytest.mark.parametrize("option, value, message", [
    ("logit_adjustment", "-1", "error: task.options.logit_adjustment must be >= 0, got -1.0"),
    ("logit_adjustment", "x", "error: task.options.logit_adjustment must be a number, got 'x'"),
    ("calibration", "-0.5", "error: task.options.calibration must be >= 0, got -0.5"),
    ("restricted_softmax", "1.5", "error: task.options.restricted_softmax must be in [0, 1], got 1.5"),
    ("restricted_softmax", "-1", "error: task.options.restricted_softmax must be in [0, 1], got -1.0"),
])
def test_bad_values_are_one_error_line(option, value, message):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", [f"task.options.{option}={value}"])
    assert str(err.value).count("\n") == 0
    assert message.removeprefix("error: ") in str(err.value)


def test_images_take_the_same_option_and_cohorts_equal_one_at_a_time():
    """Image classification shares the loss: a ViT on label-skewed clients (Dirichlet), cohorts of 4 and 1."""
    import test_image
    from fedlowrank.tasks.image import ImageClassification

    base = test_image.image_task()
    task = without_dropout(ImageClassification(base.data, "tiny-vit", eval_batch_size=64,
                                                  remedies=ClassificationOptions(logit_adjustment=1.0)))
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


@pytest.mark.parametrize("option, on, off", [("logit_adjustment", 1, 0), ("calibration", 1, 0),
                                              ("restricted_softmax", 0.5, 1)])
def test_dpsgd_refuses_each_remedy_in_one_line(option, on, off):
    """Each example's loss reads the client's other labels through its terms: per-example clipping bounds it not."""
    with pytest.raises(ConfigError) as err:
        load_config("tiny", [f"task.options.{option}={on}", "privacy.dpsgd=true"])
    assert str(err.value).count("\n") == 0
    assert f"task.options.{option}" in str(err.value) and "privacy.dpsgd" in str(err.value)
    load_config("tiny", [f"task.options.{option}={off}", "privacy.dpsgd=true"])


def test_fedlc_offset_is_minus_the_count_to_the_minus_quarter_and_a_lacking_class_leaves():
    offset = calibration_offset(np.array([0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]), 3)
    torch.testing.assert_close(offset, torch.tensor([-(15 ** -0.25), -1.0, -math.inf]))


@pytest.mark.parametrize("tau, calibration, alpha", [(0.0, 1.0, 1.0), (0.0, 0.0, 0.5), (0.0, 0.0, 0.0),
                                                     (1.0, 0.5, 0.3)])
def test_each_remedy_and_their_composition_equal_the_dense_formula(tau, calibration, alpha):
    task = task_with(tau, calibration, alpha)
    client = skewed_client(task)
    rows = np.concatenate([client[:2], client[-2:]])  # both classes the client holds
    batch = task.client_batch(rows, client)
    assert ("logit_scale" in batch) == (alpha < 1) and ("logit_offset" in batch) == (tau > 0 or calibration > 0)
    logits = torch.randn(len(rows), task.num_labels, generator=torch.Generator().manual_seed(3)) * 3
    expected = dense_loss(logits, batch["labels"].tolist(), task.train_labels[client], task.num_labels, tau,
                          calibration, alpha)
    assert float(task.output_loss(logits, batch)) == pytest.approx(expected, rel=1e-5)
    logits.requires_grad_(True)
    task.output_loss(logits, batch).backward()
    assert torch.isfinite(logits.grad).all()  # a class left out of the softmax gets a zero gradient, not NaN
    if calibration:
        lacking = np.bincount(task.train_labels[client], minlength=task.num_labels) == 0
        assert torch.equal(logits.grad[:, torch.as_tensor(lacking)], torch.zeros(len(rows), int(lacking.sum())))


def test_off_values_add_nothing_to_a_batch():
    """The neutral values (τ = 0, τ_LC = 0, α = 1) are today's plain loss: no term in the batch at all."""
    options = ClassificationOptions(logit_adjustment=0.0, calibration=0.0, restricted_softmax=1.0)
    assert options.in_use() == [] and options.client_terms(np.array([0, 1, 1]), 3) == {}
    task = task_with()
    assert task.client_batch(np.arange(4), np.arange(20)).keys() == task.batch(np.arange(4)).keys()


FAMILY_METHODS = {"fedit": [], "florg": [], "ffa-lora": [], "fedsa-lora": [], "fedavg-full": [],
                  "ssf": ["train.optimizer=sgd"], "fedgalore": [], "fedalt": []}


@pytest.mark.parametrize("method", FAMILY_METHODS)
def test_remedies_train_every_method_family_and_resume_bit_identically(method, tmp_path):
    """FedLC and FedRS together on a method of each family: a finite round that differs from the plain one, and a
    run resumed after its first round equal to the straight run."""
    sets = [f"method.name={method}", "run.rounds=2", "run.checkpoint_every=1", "run.clients_per_round=4",
            "train.local_epochs=0.3", *FAMILY_METHODS[method]]
    remedied = task_with(0.0, 1.0, 0.5)
    plain = Simulation(load_config("tiny", sets), task=task_with())
    plain.run()
    straight = Simulation(load_config("tiny", [*sets, *option_sets(0.0, 1.0, 0.5)]), task=remedied,
                          run_dir=tmp_path / "a")
    straight.run()
    assert all(math.isfinite(r["train_loss"]) and not r.get("rejected") for r in straight.history)
    assert [r["train_loss"] for r in straight.history] != [r["train_loss"] for r in plain.history]
    assert_resumes_as(straight, [*sets, *option_sets(0.0, 1.0, 0.5)], remedied, tmp_path / "b")


def assert_resumes_as(straight: Simulation, sets: list[str], task, run_dir) -> None:
    """A run of ``sets`` stopped after its first round and resumed from ``run_dir`` ends as ``straight``."""
    from test_robustness import _assert_same_run

    interrupted = Simulation(load_config("tiny", sets), task=task, run_dir=run_dir)
    interrupted.run_round()
    del interrupted
    resumed = Simulation.resume(run_dir, task=task)
    resumed.run()
    _assert_same_run(straight, resumed)


def test_cohort_equals_one_at_a_time_with_every_remedy(tmp_path):
    sets = [*SETS, *option_sets(0.5, 1.0, 0.3)]
    task = task_with(0.5, 1.0, 0.3)
    one = simulate("tiny", task, 1, sets, tmp_path / "one")
    joint = simulate("tiny", task, 3, sets, tmp_path / "joint")
    assert joint.cohort_size() == 3
    assert_same_run(one, joint)


def test_flower_equals_the_simulator_with_remedies(monkeypatch):
    """The ClientApp builds the same remedied task from the run's config: same global state, ledger and losses."""
    pytest.importorskip("flwr")
    import test_flower
    from flwr.supercore.task_identity import TaskIdentity

    import fedlowrank.runtime.run as run_module
    from fedlowrank.runtime.flower import client_app

    task = task_with(0.0, 1.0, 0.5)
    for name in ("run_id", "node_id", "task_id"):
        monkeypatch.setattr(TaskIdentity, f"_{name}", 7)
    monkeypatch.setattr(run_module, "build_task", lambda cfg, cohorts=False: task)
    monkeypatch.setattr(test_flower, "tiny_task", lambda: task)
    client_app._runs.clear()
    sets = ["method.name=fedit", "run.rounds=2", *option_sets(0.0, 1.0, 0.5)]
    try:
        ref = Simulation(load_config("tiny", sets), task=task)
        ref.run()
        sim, *_ = test_flower.run_flower(*sets)
    finally:
        client_app._runs.clear()
    test_flower.assert_same_state(sim.server, ref.server)
    assert sim.ledger.rows == ref.ledger.rows
    assert [r["train_loss"] for r in sim.history] == [r["train_loss"] for r in ref.history]


# -- FedBABU's frozen head -------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def frozen_head_task():
    return without_dropout(build_task(load_config("tiny", ["task.options.frozen_head=true"])))


def test_a_frozen_head_is_the_initial_classifier_trained_by_no_client_and_sent_in_no_message():
    """FedBABU on tiny (FedIT, 2 rounds): the classifier ends as it began, no message or server state holds it, the
    uplink carries the adapters' bytes only, and the body trains (its adapters move, the loss is finite)."""
    sets = ["method.name=fedit", "run.rounds=2", "task.options.frozen_head=true"]
    task = frozen_head_task()
    model = task.build_model()
    assert model.head_names == [] and model.frozen_head_names == ["classifier.weight", "classifier.bias"]
    frozen = Simulation(load_config("tiny", sets), task=task)
    frozen.run()
    plain = Simulation(load_config("tiny", sets[:2]), task=task_with())
    plain.run()
    start = task.build_model().net.classifier
    frozen.method.load_global(frozen.model, frozen.server)
    assert torch.equal(frozen.model.net.classifier.weight, start.weight)
    assert torch.equal(frozen.model.net.classifier.bias, start.bias)
    assert not [k for k in frozen.server if k.startswith("head/")] and [k for k in plain.server if k.startswith("head/")]
    head_bytes = sum(v.numel() * v.element_size() for k, v in plain.server.items() if k.startswith("head/"))
    per_reply = [(p["bytes_up"] - f["bytes_up"]) / len(f["clients"]) for p, f in zip(plain.history, frozen.history)]
    assert all(d >= head_bytes for d in per_reply), (per_reply, head_bytes)
    assert all(math.isfinite(r["train_loss"]) for r in frozen.history)
    assert any(bool(m.lora_B.abs().max() > 0) for m in frozen.model.adapters().values())
    assert frozen.summary()["remedies"] == {"frozen_head": True}
    assert "task.options.frozen_head = true" in task.collapse_advice()


@pytest.mark.parametrize("method", FAMILY_METHODS)
def test_a_frozen_head_trains_every_method_family_and_resumes_bit_identically(method, tmp_path):
    sets = [f"method.name={method}", "run.rounds=2", "run.checkpoint_every=1", "run.clients_per_round=4",
            "train.local_epochs=0.3", "task.options.frozen_head=true", *FAMILY_METHODS[method]]
    task = frozen_head_task()
    straight = Simulation(load_config("tiny", sets), task=task, run_dir=tmp_path / "a")
    straight.run()
    assert all(math.isfinite(r["train_loss"]) and not r.get("rejected") for r in straight.history)
    assert not [k for k in straight.server if "classifier" in k]
    straight.method.load_global(straight.model, straight.server)
    assert torch.equal(straight.model.net.classifier.weight, task.build_model().net.classifier.weight)
    assert_resumes_as(straight, sets, task, tmp_path / "b")


def test_cohort_equals_one_at_a_time_with_a_frozen_head(tmp_path):
    sets = [*SETS, "task.options.frozen_head=true"]
    one = simulate("tiny", frozen_head_task(), 1, sets, tmp_path / "one")
    joint = simulate("tiny", frozen_head_task(), 3, sets, tmp_path / "joint")
    assert joint.cohort_size() == 3
    assert_same_run(one, joint)


def test_a_frozen_head_composes_with_dpsgd_and_with_the_loss_remedies():
    cfg = load_config("tiny", ["task.options.frozen_head=true", "privacy.dpsgd=true"])
    assert cfg.task.options["frozen_head"] is True
    options = ClassificationOptions(frozen_head=True, calibration=1.0)
    assert options.in_use() == ["calibration", "frozen_head"] and options.changing_loss() == ["calibration"]
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["task.options.frozen_head=maybe"])
    assert str(err.value).count("\n") == 0 and "task.options.frozen_head" in str(err.value)


def test_an_export_of_a_frozen_head_run_carries_the_head_the_base_does_not_hold(tmp_path):
    """The peft export's ``modules_to_save`` holds the frozen classifier: loaded over a base whose new head was
    initialised otherwise (as transformers does for a base without these classes), it gives the run's logits."""
    from fedlowrank.export import export_run, load_peft

    task = frozen_head_task()
    sim = Simulation(load_config("tiny", ["method.name=fedit", "run.rounds=1", "run.checkpoint_every=1",
                                          "train.lr=0.02", "task.options.frozen_head=true"]),
                     task=task, run_dir=tmp_path / "run")
    sim.run()
    sim.method.load_global(sim.model, sim.server)
    report = export_run(tmp_path / "run", tmp_path / "peft", "peft", task=task)
    assert report["peft"]["modules_to_save"] == ["classifier"]
    other = task.build_model().net
    with torch.no_grad():
        other.classifier.weight.normal_(generator=torch.Generator().manual_seed(5))
        other.classifier.bias.fill_(0.3)
    loaded = load_peft(other, tmp_path / "peft")
    batch = {"input_ids": task.test_ids[:16], "attention_mask": task.test_mask[:16]}
    with torch.no_grad():
        expected = sim.model.net.eval()(**batch).logits
        assert torch.allclose(loaded(**batch).logits, expected, atol=1e-5)


def test_a_frozen_head_holds_the_image_classifier_and_trains_the_other_head_parameters():
    """ResNet-20's head is its classifier and its norms: the frozen head is the classifier alone."""
    from fedlowrank.models.loading import load_image_model
    from fedlowrank.tasks.base import adapted_copy

    loaded = load_image_model("resnet20", 10)
    model = adapted_copy(loaded, None, train_outputs=True, frozen_classifier=True)
    assert model.frozen_head_names == ["classifier.weight", "classifier.bias"]
    assert model.head_names and not [n for n in model.head_names if n.startswith("classifier.")]
    assert set(model.exported_head()) == {*model.head_names, *model.frozen_head_names}

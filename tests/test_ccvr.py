"""CCVR (``task.options.ccvr_samples``; Luo et al., arXiv:2106.05001): class-conditional feature statistics pooled
exactly, virtual features drawn from the pooled Gaussians, the global classifier calibrated on them after the last
round — counted in the ledger, resumable, refused where it cannot hold."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest
import torch

from fedlowrank.config import ConfigError, load_config
from fedlowrank.linalg.class_moments import class_moments, gaussian_samples, pooled_class_moments
from fedlowrank.message import Message
from fedlowrank.runtime.calibration import ClassifierCalibration
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.tasks import build_task
from test_label_skew import FAMILY_METHODS, assert_resumes_as

CCVR = "task.options.ccvr_samples=40"


@lru_cache(maxsize=None)
def ccvr_task(samples: int = 40):
    return build_task(load_config("tiny", [f"task.options.ccvr_samples={samples}"]))


@lru_cache(maxsize=None)
def plain_task():
    return build_task(load_config("tiny"))


def dense_moments(x: np.ndarray, y: np.ndarray, c: int) -> tuple[int, np.ndarray, np.ndarray]:
    rows = x[y == c]
    cov = np.cov(rows, rowvar=False, ddof=1) if len(rows) > 1 else np.zeros((x.shape[1],) * 2)
    return len(rows), rows.mean(0) if len(rows) else np.zeros(x.shape[1]), cov


def test_class_moments_are_each_class_mean_and_unbiased_covariance():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(30, 5, generator=g, dtype=torch.float64), torch.tensor([0] * 12 + [2] * 17 + [3])
    counts, means, covs = class_moments(x, y, 5)
    assert counts.tolist() == [12, 0, 17, 1, 0]
    for c in range(5):
        n, mu, cov = dense_moments(x.numpy(), y.numpy(), c)
        np.testing.assert_allclose(means[c].numpy(), mu, atol=1e-12)
        np.testing.assert_allclose(covs[c].numpy(), cov, atol=1e-12)  # one example (class 3): zero


def test_pooled_moments_equal_the_moments_of_the_pooled_features():
    """Eqs. 3–4: three clients' statistics, one lacking a class and one holding a single example of another, pool
    into the mean and unbiased covariance of all their features."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(60, 4, generator=g, dtype=torch.float64) + torch.arange(4.0, dtype=torch.float64)
    y = torch.randint(0, 3, (60,), generator=g)
    y[40:] = torch.where(y[40:] == 1, 2, y[40:])  # client 2 lacks class 1
    y[20:40] = torch.where(y[20:40] == 0, 2, y[20:40])
    y[20] = 0  # client 1 holds one example of class 0
    stats = [class_moments(x[s], y[s], 3) for s in (slice(0, 20), slice(20, 40), slice(40, 60))]
    total, mu, cov = pooled_class_moments(*(torch.stack(t) for t in zip(*stats)))
    for c in range(3):
        n, m, s = dense_moments(x.numpy(), y.numpy(), c)
        assert int(total[c]) == n
        np.testing.assert_allclose(mu[c].numpy(), m, atol=1e-12)
        np.testing.assert_allclose(cov[c].numpy(), s, atol=1e-12)


def test_gaussian_samples_follow_their_moments_and_a_singular_covariance():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(3, 3, generator=g, dtype=torch.float64)
    cov, mean = a @ a.T + 0.1 * torch.eye(3, dtype=torch.float64), torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    draws = gaussian_samples(mean, cov, 20000, torch.Generator().manual_seed(3))
    np.testing.assert_allclose(draws.mean(0).numpy(), mean.numpy(), atol=0.05)
    np.testing.assert_allclose(np.cov(draws.numpy(), rowvar=False), cov.numpy(), atol=0.1)
    line = torch.tensor([[1.0, 2.0, 2.0]], dtype=torch.float64) / 3  # rank one: draws lie on mean + t·line
    on_line = gaussian_samples(mean, line.T @ line, 50, torch.Generator().manual_seed(4)) - mean
    residual = on_line - (on_line @ line.T) * line
    assert residual.abs().max() < 1e-6  # the zero eigenvalues, computed to rounding: √1e-16
    assert torch.equal(gaussian_samples(mean, cov, 20000, torch.Generator().manual_seed(3)), draws)


def synthetic_statistics(seed: int = 5) -> tuple[list[Message], torch.Tensor]:
    """Three one-sided clients of 3 separable Gaussian classes in 4 dimensions; their messages and the means."""
    g = torch.Generator().manual_seed(seed)
    centres = 3 * torch.eye(4, dtype=torch.float64)[:3]
    messages = []
    for held in ([0, 0, 0, 1], [1, 1, 2], [2, 2, 2, 2, 0]):
        y = torch.tensor(held).repeat_interleave(10)
        x = centres[y] + 0.5 * torch.randn(len(y), 4, generator=g, dtype=torch.float64)
        counts, means, covs = class_moments(x, y, 3)
        messages.append(Message({"ccvr/count": counts, "ccvr/mean": means.float(), "ccvr/cov": covs.float()}))
    return messages, centres


def test_calibration_retrains_a_biased_classifier_on_the_virtual_features_deterministically():
    """A classifier that predicts class 0 everywhere (bias +5) is calibrated into one that separates the classes,
    on features it never saw (fresh draws from the true class distributions); the same call gives the same bits."""
    messages, centres = synthetic_statistics()
    calibration = ClassifierCalibration(samples=100, epochs=20, lr=0.05, classifier="classifier", seed=0)
    weight, bias = torch.zeros(3, 4), torch.tensor([5.0, 0.0, 0.0])
    new_w, new_b, info = calibration.calibrated_head(weight, bias, messages)
    assert info == {"classes": 3, "virtual_features": 300}
    g = torch.Generator().manual_seed(9)
    y = torch.arange(3).repeat_interleave(200)
    x = (centres[y] + 0.5 * torch.randn(600, 4, generator=g, dtype=torch.float64)).float()
    assert float(((x @ weight.T + bias).argmax(1) == y).float().mean()) == pytest.approx(1 / 3)
    assert float(((x @ new_w.T + new_b).argmax(1) == y).float().mean()) > 0.95
    again_w, again_b, _ = calibration.calibrated_head(weight, bias, messages)
    assert torch.equal(again_w, new_w) and torch.equal(again_b, new_b)
    no_bias_w, no_bias, _ = calibration.calibrated_head(weight, None, messages)  # a classifier without a bias
    assert no_bias is None and float(((x @ no_bias_w.T).argmax(1) == y).float().mean()) > 0.95


def test_a_clients_statistics_are_the_moments_of_the_features_its_classifier_reads():
    """The message of a client equals the dense moments of the classifier's input (the pooler output of tiny's
    BERT, :meth:`~fedlowrank.tasks.text.TextClassification.features`) over its examples."""
    sim = Simulation(load_config("tiny", ["method.name=fedit", "run.rounds=1", CCVR]), task=ccvr_task())
    task, model = sim.task, sim.model
    sim.method.load_global(model, sim.server)
    indices = sim.parts[1]
    msg = sim.calibration.client_statistics(task, model, indices, sim.device)
    with torch.no_grad():
        feats = torch.cat([task.features(model.net, task.batch(indices[i:i + 7])) for i in range(0, len(indices), 7)])
    labels = task.train_labels[indices]
    assert msg["ccvr/count"].tolist() == np.bincount(labels, minlength=task.num_labels).tolist()
    for c in range(task.num_labels):
        n, mu, cov = dense_moments(feats.double().numpy(), labels, c)
        np.testing.assert_allclose(msg["ccvr/mean"][c].numpy(), mu, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(msg["ccvr/cov"][c].numpy(), cov, rtol=1e-3, atol=1e-5)
    d = feats.shape[1]
    assert msg["ccvr/cov"].shape == (task.num_labels, d, d) and msg["ccvr/mean"].dtype == torch.float32


def test_a_calibrated_run_changes_only_the_classifier_and_counts_every_clients_statistics():
    """FedIT on tiny, 2 rounds: the same run as without CCVR up to the classifier of the last round, which the
    calibration changes; its ``before`` is the plain run's last evaluation; every client's exchange is in the
    ledger (up: its statistics message; down: the global model) and in the round's bytes, not in ``per_client``."""
    sets = ["method.name=fedit", "run.rounds=2"]
    plain = Simulation(load_config("tiny", sets), task=plain_task())
    plain.run()
    calibrated = Simulation(load_config("tiny", [*sets, CCVR]), task=ccvr_task())
    summary = calibrated.run()
    changed = [k for k, v in plain.server.items() if not torch.equal(v, calibrated.server[k])]
    assert changed == ["head/classifier.weight", "head/classifier.bias"]
    assert plain.history[0] | {"time": None, "peak_rss_mb": None} == calibrated.history[0] | {"time": None,
                                                                                                "peak_rss_mb": None}
    last, plain_last = calibrated.history[-1], plain.history[-1]
    scalar = {k: plain_last[k] for k in ("accuracy", "loss")}
    assert last["ccvr"]["before"] == scalar
    task = calibrated.task
    d = calibrated.model.net.classifier.in_features
    stats = Message({"ccvr/count": torch.zeros(task.num_labels, dtype=torch.int64),
                     "ccvr/mean": torch.zeros(task.num_labels, d), "ccvr/cov": torch.zeros(task.num_labels, d, d)})
    rows = [r for r in calibrated.ledger.rows if r.get("phase") == "ccvr"]
    assert [r["client"] for r in rows] == list(range(len(calibrated.parts))) and {r["round"] for r in rows} == {2}
    assert {r["up"] for r in rows} == {stats.nbytes()}
    down = calibrated.method.broadcast(calibrated.server, 0, 2).nbytes()
    assert {r["down"] for r in rows} == {down}
    assert last["bytes_up"] == plain_last["bytes_up"] + len(rows) * stats.nbytes()
    assert last["bytes_down"] == plain_last["bytes_down"] + len(rows) * down
    assert last["cum_bytes_up"] == calibrated.ledger.total_up == summary["bytes_up"]
    assert [c["bytes_up"] for c in last["per_client"]] == [c["bytes_up"] for c in plain_last["per_client"]]
    assert last["ccvr"] | {"before": None} == {"classes": task.num_labels, "virtual_features": 40 * task.num_labels,
                                               "clients": len(rows), "bytes_up": len(rows) * stats.nbytes(),
                                               "bytes_down": len(rows) * down, "before": None}
    assert summary["remedies"] == {"ccvr_samples": 40} and summary["ccvr"] == last["ccvr"]
    from fedlowrank.cli import summary_table

    line = next(x for x in summary_table(summary).splitlines() if x.startswith("ccvr"))
    assert f"on {40 * task.num_labels} virtual features of {task.num_labels} classes from {len(rows)} clients" in line
    assert f"before it: accuracy {scalar['accuracy']:.4g}" in line
    assert "task.options.ccvr_samples = 40" in task.collapse_advice()


def test_zero_samples_is_the_plain_run_bit_for_bit():
    sets = ["method.name=fedit", "run.rounds=1"]
    plain = Simulation(load_config("tiny", sets), task=plain_task())
    plain.run()
    off = Simulation(load_config("tiny", [*sets, "task.options.ccvr_samples=0"]), task=plain_task())
    off.run()
    assert off.calibration is None and off.server.to_bytes() == plain.server.to_bytes()
    assert off.ledger.rows == plain.ledger.rows


CALIBRATED = [m for m in FAMILY_METHODS if m not in ("fedsa-lora", "ssf", "fedalt")]


@pytest.mark.parametrize("method", CALIBRATED)
def test_every_method_family_with_a_global_head_calibrates_and_resumes_bit_identically(method, tmp_path):
    sets = [f"method.name={method}", "run.rounds=2", "run.checkpoint_every=1", "run.clients_per_round=4",
            "train.local_epochs=0.3", *FAMILY_METHODS[method], CCVR]
    straight = Simulation(load_config("tiny", sets), task=ccvr_task(), run_dir=tmp_path / "a")
    straight.run()
    last = straight.history[-1]
    assert last["ccvr"]["clients"] == len(straight.parts) and "ccvr" not in straight.history[0]
    assert_resumes_as(straight, sets, ccvr_task(), tmp_path / "b")


@pytest.mark.parametrize("method, message", [
    ("fedsa-lora", "method 'fedsa-lora' is personalised"),
    ("fedalt", "method 'fedalt' is personalised"),
    ("ssf", "method 'ssf' holds no head/classifier.weight in its server state"),
])
def test_a_method_without_one_global_classifier_is_refused_in_one_line(method, message):
    extra = FAMILY_METHODS[method]
    with pytest.raises(ValueError, match=message) as info:
        Simulation(load_config("tiny", [f"method.name={method}", *extra, CCVR]), task=ccvr_task())
    assert "\n" not in str(info.value) and "task.options.ccvr_samples" in str(info.value)


@pytest.mark.parametrize("sets, message", [
    (["privacy.dpsgd=true"], "cannot run with privacy.dpsgd or privacy.mode"),
    (["privacy.mode=central", "privacy.noise_multiplier=0.1", "privacy.clip=1"],
     "cannot run with privacy.dpsgd or privacy.mode"),
    (["task.options.frozen_head=true"], "cannot run with task.options.frozen_head"),
    (["task.options.ccvr_samples=-1"], "task.options.ccvr_samples"),
    (["task.options.ccvr_epochs=0"], "task.options.ccvr_epochs"),
    (["task.options.ccvr_lr=0"], "task.options.ccvr_lr"),
])
def test_settings_it_cannot_run_with_are_one_error_line(sets, message):
    with pytest.raises((ConfigError, ValueError), match=message) as info:
        load_config("tiny", [CCVR, *sets])
    assert "\n" not in str(info.value)


def test_flower_refuses_it_in_one_line():
    pytest.importorskip("flwr")
    from fedlowrank.runtime.flower.settings import FlowerSettings
    from fedlowrank.runtime.flower.strategy import MethodStrategy
    from fedlowrank.runtime.run import build_run
    from fedlowrank.runtime.server_run import ServerRun

    run = ServerRun(build_run(load_config("tiny", [CCVR]), task=ccvr_task()), client_states=False)
    with pytest.raises(ValueError, match="task.options.ccvr_samples: CCVR's class statistics") as info:
        MethodStrategy(run, FlowerSettings())
    assert "\n" not in str(info.value)

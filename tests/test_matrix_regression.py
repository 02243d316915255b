"""The synthetic federated matrix-regression task (SSF paper, arXiv:2604.25467 §5.1) and the
vectorised runner on it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedlowrank.adapters.lora import attach_lora
from fedlowrank.config import from_dict
from fedlowrank.methods.ssf import SubspaceLinear, projector
from fedlowrank.runtime import runner_for
from fedlowrank.runtime.simulator import DivergenceError, Simulation
from fedlowrank.runtime.vectorized import Vectorized, run_vectorized, smallest_first
from fedlowrank.tasks.matrix_regression import MatrixRegression, make_problem


SMALL = {"num_clients": 4, "dim": 8, "outputs": 3, "samples": 6, "het": 0.5}


def config(method: str, rounds: int = 3, per_round: int = 2, lr: float = 0.02, **options) -> object:
    return from_dict({
        "run": {"rounds": rounds, "clients_per_round": per_round, "eval_every": 1, "seed": 3},
        "task": {"kind": "matrix-regression", "options": SMALL},
        "partition": {"kind": "natural", "num_clients": SMALL["num_clients"]},
        "train": {"optimizer": "sgd", "lr": lr, "local_steps": 3, "batch_size": 4},
        "lora": {"rank": 2, "alpha": 2.0}, "method": {"name": method, **options}})


def test_problem_matches_the_recipe_and_x_star_is_the_minimiser():
    task = MatrixRegression(**SMALL)
    A, B, x_star = make_problem(0, 4, 8, 3, 6, 0.5, 0.1, 0.01)
    assert torch.equal(task.A, torch.from_numpy(A.reshape(24, 8)))
    # ∇F(X*) = (1/N) Σ_i full-batch gradient of client i = 0 (weights in the [out, in] layout)
    rows = np.arange(24).reshape(4, 6)
    W = np.ascontiguousarray(np.broadcast_to(x_star.T, (4, 3, 8)))
    grad = task.batched_grad({"linear": W}, task.batched_examples(rows[None])[0])["linear"].mean(0)
    assert np.abs(grad).max() < 1e-12
    # natural clients: rows in client order, feature means shifted per client
    assert np.array_equal(task.natural_partition, np.repeat(np.arange(4), 6))


def test_batched_gradient_equals_autograd_of_the_loss_through_any_adapter():
    task = MatrixRegression(**SMALL)
    idx = torch.tensor([[0, 5, 2, 3], [7, 8, 11, 6]])
    g = torch.Generator().manual_seed(0)
    W = torch.randn(2, 3, 8, generator=g, dtype=torch.float64)
    examples = task.batched_examples(idx[None].numpy())[0]
    closed = torch.from_numpy(task.batched_grad({"linear": W.numpy()}, examples)["linear"])
    for s in range(2):
        model = task.build_model()
        model.base_linear("linear").weight.data.copy_(W[s])
        w = model.base_linear("linear").weight
        w.requires_grad_(True)
        task.loss(model.net, idx[s]).backward()
        assert torch.allclose(w.grad, closed[s], atol=1e-12)
    # through a subspace adapter the gradient of the coefficients is the projected gradient G Pᵀ
    model = task.build_model()
    P = projector(0, 0, 0, 8, 3)
    model.attach(lambda name, lin: SubspaceLinear(lin, 3))
    mod = model.target("linear")
    mod.set_base_delta(W[0])
    mod.reset(P)
    mod.coef.requires_grad_(True)
    task.loss(model.net, idx[0]).backward()
    assert torch.allclose(mod.coef.grad, closed[0] @ P.T, atol=1e-12)


def test_evaluate_reads_x_through_lora_and_reports_rel_error():
    task = MatrixRegression(**SMALL)
    model = task.build_model()
    assert task.evaluate(model.net)["rel_error"] == pytest.approx(1.0)
    attach_lora(model, rank=2, alpha=2.0)
    mod = model.target("linear")
    mod.set_base_delta(task.x_star.T.clone())
    assert task.evaluate(model.net)["rel_error"] < 1e-12
    mod.set_base_delta(torch.full((3, 8), math.inf, dtype=torch.float64))
    assert math.isnan(task.evaluate(model.net)["rel_error"])


def test_objective_is_reported_only_when_asked():
    task = MatrixRegression(**SMALL)
    model = task.build_model()
    assert set(task.evaluate(model.net)) == {"rel_error"}
    asked = MatrixRegression(**SMALL, objective=True)
    model = asked.build_model()
    attach_lora(model, rank=2, alpha=2.0)
    model.target("linear").set_base_delta(asked.x_star.T.clone())
    metrics = asked.evaluate(model.net)
    assert set(metrics) == {"rel_error", "objective"} and abs(metrics["objective"]) < 1e-12
    model.target("linear").set_base_delta(torch.zeros(3, 8, dtype=torch.float64))
    assert asked.evaluate(model.net)["objective"] == pytest.approx(asked.objective(torch.zeros(8, 3, dtype=torch.float64))
                                                                   - asked.objective(asked.x_star))


def test_weight_has_the_values_of_the_forward_pass_on_the_identity():
    task = MatrixRegression(**SMALL)
    g = torch.Generator().manual_seed(1)
    eye = torch.eye(8, dtype=torch.float64)
    plain = task.build_model()
    plain.base_linear("linear").weight.data.normal_(generator=g)
    with torch.no_grad():
        assert torch.equal(task.weight(plain.net), plain.net(eye))
    for attach in (lambda m: attach_lora(m, rank=2, alpha=2.0), lambda m: m.attach(lambda n, lin: SubspaceLinear(lin, 3))):
        model = task.build_model()
        attach(model)
        mod = model.target("linear")
        mod.set_base_delta(torch.randn(3, 8, generator=g, dtype=torch.float64))
        for p in mod.parameters():
            if p is not mod.base.weight:
                p.data.normal_(generator=g)
        if isinstance(mod, SubspaceLinear):
            mod.proj = projector(0, 0, 0, 8, 3)
        with torch.no_grad():
            assert torch.equal(task.weight(model.net), model.net(eye))


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="task.options.dim"):
        MatrixRegression(dim=0)
    with pytest.raises(ValueError, match="task.options.dtype"):
        MatrixRegression(dtype="float16")
    with pytest.raises(ValueError, match="task.options.objective"):
        MatrixRegression(objective="yes")


def test_every_kind_of_method_runs_and_divergence_stops_the_run():
    for method, opts in (("fedit", {}), ("fedavg-full", {"correction": "scaffold"}), ("ssf", {}), ("fedsub", {})):
        summary = Simulation(config(method, **opts)).run()
        assert 0 < summary["rel_error"] < 1.0
    cfg = config("ssf", rounds=40, lr=5.0)
    cfg.run.stop_metric, cfg.run.stop_above = "rel_error", 1e6
    with pytest.raises(DivergenceError, match="rel_error"):
        Simulation(cfg).run()
    run = run_vectorized(cfg)
    assert run.diverged_at is not None and run.diverged_at < 40
    assert not run.final["rel_error"] <= 1e6


def test_vectorised_runner_refuses_what_it_cannot_do(tmp_path):
    cfg = config("ssf")
    cfg.train.optimizer = "adamw"
    with pytest.raises(ValueError, match="train.optimizer"):
        run_vectorized(cfg)
    with pytest.raises(ValueError, match="batched_round"):
        run_vectorized(config("fedit"))
    unequal = config("ssf")
    unequal.partition.kind, unequal.partition.min_partition_size = "quantity", 2   # clients of different sizes
    with pytest.raises(ValueError, match="batches = 'fresh' needs equal client sizes.* got sizes .*'trainer'"):
        run_vectorized(unequal, run_dir=tmp_path / "refused")
    assert not (tmp_path / "refused").exists()                    # refused before any file is written
    assert run_vectorized(unequal, batches="trainer").rounds == unequal.run.rounds


def test_runner_for_picks_the_vectorised_runner_only_when_the_config_asks():
    cfg = config("ssf")
    assert runner_for(cfg) is Simulation
    cfg.run.vectorized = True
    assert runner_for(cfg) is Vectorized


def test_minibatch_picks_are_those_of_a_stable_argsort_ties_included():
    rng = np.random.default_rng(0)
    for values in (rng.random((5, 10, 50), dtype=np.float32),                      # distinct values
                   rng.integers(0, 4, (5, 10, 50)).astype(np.float32) / 4,         # many ties, zeros included
                   np.zeros((2, 3, 7), dtype=np.float32)):                          # all tied
        for count in (1, 3, values.shape[-1]):
            expected = np.argsort(values, axis=-1, kind="stable")[..., :count]
            assert np.array_equal(smallest_first(values, count), expected)

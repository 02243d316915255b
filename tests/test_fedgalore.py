"""FedGaLore / FedGaLore- and FR-LoRA on the tiny task: ledger, seeded bases, state hand-over, aggregation."""

from __future__ import annotations

import copy
from functools import lru_cache

import numpy as np
import pytest
import torch
from helpers import run_tiny, tiny_config, tiny_simulation, tiny_task

from fedlowrank.message import Reply, State
from fedlowrank.methods import get_method
from fedlowrank.runtime.engine import setup_info, wire
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.tasks import build_task
from fedlowrank.training.local import LocalTrainer


RECTANGULAR = 'lora.targets=["query","value","dense"]'  # adds 64x32 (right) and 32x64 (left) blocks


@lru_cache(maxsize=None)
def rectangular_task():
    return build_task(tiny_config(RECTANGULAR))


def run_rectangular(method: str, *sets: str, rounds: int = 2) -> Simulation:
    sim = Simulation(tiny_config(f"method.name={method}", f"run.rounds={rounds}", RECTANGULAR, *sets),
                     task=rectangular_task())
    sim.run()
    return sim


class SpyTrainer(LocalTrainer):
    """A LocalTrainer that keeps the optimiser it built and a copy of its state right after construction."""

    def fit(self, model, params, corrections=(), optimizer=None):
        def factory(ps, lr):
            self.opt = optimizer(ps, lr)
            self.initial = {id(p): copy.deepcopy(self.opt.block_state(p)) for p in ps.values()}
            return self.opt
        return super().fit(model, params, corrections, factory)


def setup(method_name, *sets, **options):
    cfg = tiny_config(f"method.name={method_name}", *sets)
    task = rectangular_task() if RECTANGULAR in sets else tiny_task()
    model = task.build_model()
    method = get_method(method_name, **options)
    info = setup_info(cfg, [40, 40])
    return cfg, task, model, method, method.setup(model, info)


def client_round(cfg, task, model, method, server, client, rnd, indices, trainer_cls=SpyTrainer):
    trainer = trainer_cls(task, indices, cfg.train, client, rnd, cfg.run.rounds, cfg.run.seed)
    for mod in model.adapters().values():
        mod.set_base_delta(None)
    reply, _ = method.train(model, wire(method.broadcast(server, client, rnd)), State(), trainer)
    return wire(reply), trainer


def test_ledger_shows_the_projected_second_moment_uplink():
    """Per client and round, FedGaLore's upload exceeds FedGaLore-'s by one [d_u, r] fp32 buffer per block
    (plus its header entry); from round 2 the download carries S̄ the same way."""
    sets = ("train.local_steps=5", "lora.rank=2")
    full = run_rectangular("fedgalore", *sets)
    minus = run_rectangular("fedgalore-minus", *sets)
    blocks = {n: tuple(full.model.base_linear(n).weight.shape) for n in full.model.target_names}
    assert {(64, 32), (32, 64)} <= set(blocks.values())  # right and left rectangular blocks
    extra = sum(4 * max(m, n) * 2 for m, n in blocks.values())  # d_u = max(m, n) for std projection
    for row_full, row_minus in zip(full.ledger.rows, minus.ledger.rows):
        up = row_full["up"] - row_minus["up"]
        assert extra <= up <= extra + 128 * (len(blocks) + 1)
        if row_full["round"] == 2:
            assert extra <= row_full["down"] - row_minus["down"] <= extra + 128 * (len(blocks) + 3)
    for name, (m, n) in blocks.items():
        assert full.server[f"{name}.galore_v"].shape == (max(m, n), 2)
        assert f"{name}.galore_Q" not in full.server  # the final basis is seeded: nothing but an index goes up
    assert all(r["diagnostics"]["sync_compact_path"] == 1.0 for r in full.history)


def test_seeded_basis_identical_on_server_and_client_and_one_client_is_identity():
    cfg, task, model, method, server = setup("fedgalore", "train.local_steps=5", RECTANGULAR, tau=2, svd_refreshes=1)
    reply, spy = client_round(cfg, task, model, method, server, 0, 1, np.arange(40))
    assert reply["galore_basis_index"] == 2
    new = method.aggregate(server, [Reply(0, 40, reply)], 1)
    for b, name in enumerate(model.target_names):
        W = model.base_linear(name).weight
        assert torch.equal(spy.opt.block_state(W)["Q"], method.sync_basis(new, b, name))
        # a single view: AJIVE's joint part plus the means gives the client's own buffer back
        torch.testing.assert_close(new[f"{name}.galore_v"], reply[f"{name}.galore_v"], atol=1e-9, rtol=1e-5)


@pytest.mark.parametrize("init_mode", ["carry", "svd"])
def test_next_round_starts_from_the_synced_state(init_mode):
    cfg, task, model, method, server = setup("fedgalore", "train.local_steps=5", RECTANGULAR, tau=2, init_mode=init_mode)
    replies = [Reply(k, 40, client_round(cfg, task, model, method, server, k, 1, np.arange(40 * k, 40 * k + 40))[0])
               for k in (0, 1)]
    new = method.aggregate(server, replies, 1)
    _, spy = client_round(cfg, task, model, method, new, 0, 2, np.arange(40))
    for b, name in enumerate(model.target_names):
        W = model.base_linear(name).weight
        start = spy.initial[id(W)]
        assert torch.equal(start["Q"], method.sync_basis(new, b, name))
        assert start["warm"] and start["skip_first_refresh"] == (init_mode == "carry")
        expected = new[f"{name}.galore_v"].clamp(min=0) if init_mode == "carry" else new[f"{name}.galore_v"]
        torch.testing.assert_close(start["exp_avg_sq"], expected)
        assert float(start["exp_avg"].abs().max()) == 0.0


def test_dense_path_when_the_final_basis_is_not_seeded():
    """Always-SVD clients upload their basis; the server works on the lifted views and re-factors exactly."""
    cfg, task, model, method, server = setup("fedgalore", "train.local_steps=3", RECTANGULAR, tau=2, svd_refreshes=-1)
    reply, _ = client_round(cfg, task, model, method, server, 0, 1, np.arange(40))
    new = method.aggregate(server, [Reply(0, 40, reply)], 1)
    for b, name in enumerate(model.target_names):
        Q, S = reply[f"{name}.galore_Q"], reply[f"{name}.galore_v"]
        lifted = new[f"{name}.galore_v"] @ method.sync_basis(new, b, name).T
        torch.testing.assert_close(lifted, S @ Q.T, atol=1e-6, rtol=1e-4)
    assert method.pop_metrics()["sync_compact_path"] == 0.0


def test_the_synced_basis_of_the_dense_path_is_a_declared_server_entry():
    """Clients on unseeded bases leave ``{module}.galore_Q`` in the global state: the checkpoint check accepts it."""
    sets = ("method.svd_refreshes=-1", "train.local_steps=3")
    sim = run_tiny("fedgalore", *sets, rounds=1)
    assert any(k.endswith(".galore_Q") for k in sim.server)
    assert tiny_simulation("fedgalore", *sets, rounds=1).state_schema(None).problem(sim.server) is None


def test_fedgalore_minus_sends_no_state_and_options_are_validated():
    sim = run_tiny("fedgalore-minus", rounds=2)
    assert not any(".galore_" in k or k.startswith("galore_sync") for k in sim.server)
    with pytest.raises(ValueError, match="method.state_sync"):
        get_method("fedgalore", state_sync="mean")
    with pytest.raises(ValueError, match="method.init_mode"):
        get_method("fedgalore", init_mode="warm")
    with pytest.raises(ValueError, match="train.optimizer"):
        run_tiny("fedgalore", "train.optimizer=sgd", rounds=1)
    assert run_tiny("fedgalore-minus", "train.optimizer=momentum", rounds=1).history[0]["train_loss"] > 0


def effective_weights(model):
    return {n: (m.frozen_weight() + m.adapter_delta()).detach().clone() for n, m in model.adapters().items()}


def test_fr_lora_starts_at_the_global_weight_and_aggregates_the_lifted_updates():
    """At load the model equals W₀ + R_g; after aggregation the global weight is Σ pᵢ (client weight i)."""
    cfg, task, model, method, server = setup("fr-lora", "train.local_steps=3")
    W0 = {n: model.base_linear(n).weight.detach().clone() for n in model.target_names}
    server = State(server)
    for n in model.target_names:  # a non-zero global residual
        server[f"{n}.residual"] = 0.01 * torch.ones_like(W0[n])
    method.load_message(model, wire(method.broadcast(server, 0, 1)))
    for n, W in effective_weights(model).items():
        torch.testing.assert_close(W, W0[n] + server[f"{n}.residual"], atol=1e-5, rtol=1e-5)
    replies, trained = [], []
    for k, size in ((0, 30), (1, 50)):
        reply, _ = client_round(cfg, task, model, method, server, k, 1, np.arange(60 * k, 60 * k + size), LocalTrainer)
        replies.append(Reply(k, size, reply))
        trained.append(effective_weights(model))
    assert all(f"{n}.lora_B" in replies[0].message for n in model.target_names)
    new = method.aggregate(server, replies, 1)
    moved = 0.0
    for n in model.target_names:
        avg = 0.375 * trained[0][n] + 0.625 * trained[1][n]
        torch.testing.assert_close(W0[n] + new[f"{n}.residual"], avg, atol=1e-5, rtol=1e-5)
        moved += float((trained[0][n] - W0[n] - server[f"{n}.residual"]).abs().max())
    assert moved > 0


@pytest.mark.parametrize("init_mode", ["carry", "svd"])
def test_segment_upload_reconstructs_the_trained_weights_and_is_smaller(init_mode):
    """upload=segments: from D_T and the per-basis coefficients the server rebuilds the client's trained W (up to
    fp32 rounding), in round 1 and in round 2 (which starts in the sync basis under carry); only SVD bases go up."""
    cfg, task, model, method, server = setup("fedgalore", "train.local_steps=6", "train.weight_decay=0.1",
                                             RECTANGULAR, tau=2, svd_refreshes=1, init_mode=init_mode, upload="segments")
    blocks = {n: tuple(model.base_linear(n).weight.shape) for n in model.target_names}
    assert {(64, 32), (32, 64)} <= set(blocks.values())
    for rnd, expected in ((1, [0, 1, 2]), (2, [-1, 1, 2] if init_mode == "carry" else [0, 1, 2])):
        reply, _ = client_round(cfg, task, model, method, server, 0, rnd, np.arange(40))
        assert reply["galore_segments"] == expected and 0 < reply["galore_decay"] < 1
        rebuilt = method.reconstruct(server, reply, rnd)
        for b, (name, (m, n)) in enumerate(blocks.items()):
            torch.testing.assert_close(rebuilt[f"{name}.weight"], model.base_linear(name).weight.detach(),
                                       atol=1e-6, rtol=1e-5)
            assert (f"{name}.galore_seg0.Q" in reply) == (expected[0] == 0)  # only the SVD segment's basis
            assert f"{name}.galore_seg1.Q" not in reply and f"{name}.weight" not in reply
        n_svd = int(expected[0] == 0)
        floats = sum(3 * max(m, n) * 2 + n_svd * min(m, n) * 2 + max(m, n) * 2 for m, n in blocks.values())
        head = sum(4 * p.numel() for p in model.head_parameters().values())
        assert 4 * floats + head < reply.nbytes() < 4 * floats + head + 200 * (3 * len(blocks) + 4)
        assert reply.nbytes() < sum(4 * m * n for m, n in blocks.values())
        server = method.aggregate(server, [Reply(0, 40, reply)], rnd)


def test_state_sync_estimators():
    """avg = Σ p S_i; avg_svd = its rank-`sync_rank` truncation; ajive with one shared direction keeps it."""
    g = torch.Generator().manual_seed(0)
    views = [torch.rand(30, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    w = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    avg = sum(wi * v for wi, v in zip(w, views))
    est, _ = get_method("fedgalore", state_sync="avg").estimate(views, w, 4)
    torch.testing.assert_close(est, avg)
    est, kept = get_method("fedgalore", state_sync="avg_svd", sync_rank=1).estimate(views, w, 4)
    U, S, Vh = torch.linalg.svd(avg)
    assert kept == 1 and int(torch.linalg.matrix_rank(est)) == 1
    torch.testing.assert_close(est, S[0] * torch.outer(U[:, 0], Vh[0]))


def test_uploaded_second_moment_is_bias_corrected_after_a_cold_round_and_raw_is_the_buffer():
    """After a cold round of T steps the client uploads ṽ/(1 − β₂ᵀ) (default) and ``raw`` uploads the optimiser's
    buffer bit for bit (the literal reading of Alg. 1 l.9); a warm round's buffer already has the
    scale of E[g̃²], so both upload it unchanged."""
    sets = ("train.local_steps=5", RECTANGULAR)
    for v_sync in ("bias_corrected", "raw"):
        cfg, task, model, method, server = setup("fedgalore", *sets, tau=2, v_sync=v_sync)
        reply, spy = client_round(cfg, task, model, method, server, 0, 1, np.arange(40))
        for name in model.target_names:
            buffer = spy.opt.block_state(model.base_linear(name).weight)["exp_avg_sq"]
            if v_sync == "raw":
                assert torch.equal(reply[f"{name}.galore_v"], buffer)
            else:
                torch.testing.assert_close(reply[f"{name}.galore_v"], buffer / (1 - 0.999**5), rtol=1e-6, atol=0)
        new = method.aggregate(server, [Reply(0, 40, reply)], 1)
        warm_reply, spy = client_round(cfg, task, model, method, new, 0, 2, np.arange(40))
        for name in model.target_names:
            assert torch.equal(warm_reply[f"{name}.galore_v"],
                               spy.opt.block_state(model.base_linear(name).weight)["exp_avg_sq"])
    with pytest.raises(ValueError, match="method.v_sync"):
        get_method("fedgalore", v_sync="scaled")

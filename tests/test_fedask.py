"""FedASK (arXiv:2507.09990): the two-stage sketch against dense references (exact when s ≥ rank ΔW, within 1e-2 of the
optimal truncation below it for a decaying spectrum), the global product equals Σ pᵢ sᵢ BᵢAᵢ when r and s cover its
rank and FlexLoRA's truncation when s does, Ω seeded and fixed (or fresh), both factors under DP-SGD with FedIT's ε,
the ledger counting both uploads and the mid-round Q, refusals."""

from __future__ import annotations

import pytest
import torch
from test_lora_baselines import play_round, sim_of, weights_of

from fedlowrank.adapters.lora import lora_scale
from fedlowrank.cli import main
from fedlowrank.config import ConfigError
from fedlowrank.linalg.lowrank import sketched_svd
from fedlowrank.message import Message
from fedlowrank.methods import get_method
from fedlowrank.runtime.simulator import Simulation

from helpers import DPSGD, assert_client_level_dp, run_tiny, run_with_dpsgd, tiny_config, tiny_task


def _product(sim, name, msg=None) -> torch.Tensor:
    """``s B A`` of target ``name`` in the server state (or a message at its own rank), float64."""
    src = sim.server if msg is None else msg
    B, A = src[f"{name}.lora_B"].double(), src[f"{name}.lora_A"].double()
    info = sim.method.info
    return lora_scale(info.alpha, A.shape[0], info.scaling) * B @ A


def test_the_sketch_is_exact_when_it_covers_the_rank_and_near_optimal_below_it():
    g = torch.Generator().manual_seed(0)
    B, A = torch.randn(12, 5, generator=g, dtype=torch.float64), torch.randn(5, 9, generator=g, dtype=torch.float64)
    U, S, Vh = sketched_svd(B, A, torch.randn(9, 5, generator=g, dtype=torch.float64))
    torch.testing.assert_close(U * S @ Vh, B @ A, rtol=0, atol=1e-10)                     # s = rank: exact
    torch.testing.assert_close(U.T @ U, torch.eye(U.shape[1], dtype=torch.float64), rtol=0, atol=1e-10)
    # rank 8 with singular values 1, 1/4, 1/16, ...: a sketch of s = 4 < 8, truncated to r = 2
    Uo = torch.linalg.qr(torch.randn(12, 8, generator=g, dtype=torch.float64)).Q
    Vo = torch.linalg.qr(torch.randn(9, 8, generator=g, dtype=torch.float64)).Q
    sigma = 4.0 ** -torch.arange(8, dtype=torch.float64)
    W = Uo * sigma @ Vo.T
    U, S, Vh = sketched_svd(Uo * sigma, Vo.T, torch.randn(9, 4, generator=g, dtype=torch.float64))
    best = Uo[:, :2] * sigma[:2] @ Vo[:, :2].T
    error = float((U[:, :2] * S[:2] @ Vh[:2] - best).norm() / W.norm())
    assert error <= 1e-2, error
    U1, S1, Vh1 = sketched_svd(Uo * sigma, Vo.T, torch.randn(9, 1, generator=g, dtype=torch.float64))
    assert float((U1 * S1 @ Vh1 - best).norm() / W.norm()) > 1e-2              # s = 1 < r misses the second


def test_with_r_and_s_covering_the_rank_the_global_product_is_the_weighted_sum_of_the_clients():
    """Three rank-1 clients of a rank-4 global adapter (s = K·r = 12 ≥ 3): ``s B A = Σᵢ pᵢ sᵢ Bᵢ Aᵢ`` to 1e-5 —
    every round's global model is the weighted mean of the clients' (a factor-wise mean would fail)."""
    sim = sim_of("fedask", "lora.ranks=[1]", "lora.server_rank=4", "run.clients_per_round=3")
    for rnd, clients in enumerate([[0, 1, 2], [1, 2, 3]], start=1):
        out = play_round(sim, clients, rnd)
        p = weights_of(out)
        for name in sim.model.adapters():
            expected = sum(pk * _product(sim, name, rep.message) for pk, (_, rep, _) in zip(p.tolist(), out))
            torch.testing.assert_close(_product(sim, name), expected, rtol=0, atol=1e-5)


def test_with_s_covering_the_rank_it_is_flexloras_truncation():
    """Three rank-2 clients, r = 2, s = 6: the global product equals FlexLoRA's ``[ΔW]_r`` to 1e-5 on the same
    replies, and so does each client's download; with s = 1 it does not."""
    ask, flex = sim_of("fedask", "run.clients_per_round=3"), sim_of("flexlora")
    short = sim_of("fedask", "method.sketch_dim=1")
    out = play_round(ask, [0, 1, 2], 1)
    replies = [r for _, r, _ in out]
    flex.server = flex.method.aggregate(flex.server, replies, 1)
    short.server = short.method.aggregate(short.server, replies, 1)
    for name in ask.model.adapters():
        torch.testing.assert_close(_product(ask, name), _product(flex, name), rtol=0, atol=1e-5)
        assert not torch.allclose(_product(short, name), _product(flex, name), atol=1e-5)
        down = ask.method.broadcast(ask.server, 0, 2)
        flex_down = flex.method.broadcast(flex.server, 0, 2)
        torch.testing.assert_close(_product(ask, name, down), _product(flex, name, flex_down), rtol=0, atol=1e-5)


def test_omega_is_seeded_fixed_across_rounds_unless_fresh():
    method = sim_of("fedask").method
    assert torch.equal(method.omega(0, 32, 32, 1), method.omega(0, 32, 32, 7))
    assert not torch.equal(method.omega(0, 32, 32, 1), method.omega(1, 32, 32, 1))
    fresh = sim_of("fedask", "method.omega_fresh_each_round=true").method
    assert not torch.equal(fresh.omega(0, 32, 32, 1), fresh.omega(0, 32, 32, 2))
    assert method.sketch_size(32, 32) == method.info.clients_per_round * method.info.rank
    assert sim_of("fedask", "method.sketch_dim=64").method.sketch_size(32, 16) == 16


def test_the_ledger_counts_both_uploads_and_the_mid_round_q():
    """Each usable reply's ledger row is the true protocol's: down the factors and head plus Q [out, s]; up Y [out, s],
    then P [in, s] and the head — not the simulation's A, B upload."""
    sent, replied = {}, {}
    sim = Simulation(tiny_config("method.name=fedask", "run.rounds=1"), task=tiny_task(),
                     tamper=lambda rnd, k, reply: replied.setdefault(k, reply) or reply)
    real = sim.method.broadcast
    sim.method.broadcast = lambda server, k, rnd: sent.setdefault(k, real(server, k, rnd))
    sim.run()
    s = sim.method.sketch_size(32, 32)
    head = sum(p.numel() * 4 for p in sim.model.head_parameters().values())
    for row in sim.ledger.rows:
        down, reply = sent[row["client"]], Message(replied[row["client"]])
        downs, ups = sim.method.protocol_messages(down, reply)
        assert (row["down"], row["up"]) == (sum(m.nbytes() for m in downs), sum(m.nbytes() for m in ups))
        sketches = sum((m.out_features + m.in_features) * s * 4 for m in sim.model.adapters().values())
        assert sketches + head <= row["up"] < sketches + head + 4096 and row["up"] != reply.nbytes()
        assert down.nbytes() + sum(m.out_features * s * 4 for m in sim.model.adapters().values()) <= row["down"]


def test_dpsgd_noises_both_factors_and_costs_what_fedit_costs(monkeypatch):
    """Both A and B (and the head) are clipped and noised per example; the sketches are post-processing, so the
    accountant's ε equals FedIT's under the same settings."""
    sim, seen = run_with_dpsgd(monkeypatch, "fedask")
    names = {k.rsplit(".", 1)[-1] for keys in seen for k in keys if "/" not in k}
    assert names == {"lora_A", "lora_B"} and all(any(k.startswith("head/") for k in keys) for keys in seen)
    fedit = run_tiny("fedit", *DPSGD)
    assert [r["dpsgd_epsilon"] for r in sim.history] == [r["dpsgd_epsilon"] for r in fedit.history]
    assert 0 < sim.history[-1]["dpsgd_epsilon"] < float("inf")


def test_privacy_modes_and_refusals():
    assert_client_level_dp("fedask", "local")
    with pytest.raises(ConfigError, match="'central' is not supported by method 'fedask'"):
        tiny_config("method.name=fedask", "privacy.mode=central", "privacy.clip=0.5", "privacy.noise_multiplier=1.0",
                    "server.weighting=uniform")
    with pytest.raises(ValueError, match="method.sketch_dim"):
        get_method("fedask", sketch_dim=-1)


def test_methods_name_lists_fedask(capsys):
    assert main(["methods", "fedask"]) == 0
    out = capsys.readouterr().out
    assert "arXiv:2507.09990" in out and "method.sketch_dim" in out and "privacy: local" in out

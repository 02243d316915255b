"""FedMomentum (arXiv:2603.08014): with τ = 1 the merged residual conserves the global model (the weighted mean of
the clients' models), without merging it is FlexLoRA's balanced split, one client of rank ≤ r leaves no residual,
the ledger counts the dense base delta down once it exists, the energy rank, DP and refusals."""

from __future__ import annotations

import pytest
import torch
from test_lora_baselines import global_weights, play_round, sim_of, weights_of

from fedlowrank.cli import main
from fedlowrank.config import ConfigError
from fedlowrank.linalg.lowrank import energy_rank
from fedlowrank.methods import get_method
from fedlowrank.methods.fedmomentum import FedMomentum

from helpers import DPSGD, assert_client_level_dp, run_tiny, run_with_dpsgd, tiny_config


def _client_mean(out) -> dict[str, torch.Tensor]:
    """``Σₖ pₖ (W0 + D + sₖBₖAₖ)`` of the clients' trained models (float64)."""
    p = weights_of(out)
    return {name: sum(pk * t.end[name] for pk, (_, _, t) in zip(p.tolist(), out)) for name in out[0][2].end}


@pytest.mark.parametrize("scale, conserved", [("lora", True), ("none", False)])
def test_with_tau_1_the_merged_residual_conserves_the_global_model(scale, conserved):
    """``W0 + D⁺ + s B⁺A⁺ = Σₖ pₖ (W0 + D + s Bₖ Aₖ)`` to 1e-5 over three rounds of three rank-2 clients (sums of
    rank 6, so directions 3–6 are merged each round). ``residual_scale = none`` (the reference's residual without s,
    s = α/r = 2 here) breaks it: the check fails on that variant, as it would on any merge of a wrong scale or of
    the wrong directions."""
    sim = sim_of("fedmomentum", "method.tau=1.0", f'method.residual_scale="{scale}"')
    merged = False
    for rnd, clients in enumerate([[0, 1, 2], [1, 2, 3], [0, 2, 3]], start=1):
        out = play_round(sim, clients, rnd)
        after, mean = global_weights(sim), _client_mean(out)
        close = all(torch.allclose(after[n], mean[n], rtol=0, atol=1e-5) for n in after)
        assert close == conserved, rnd
        merged |= any(k.endswith(".base_delta") for k in sim.server.tensors())
        sim.method.pop_metrics()
    assert merged
    for msg, _, _ in out:              # each client started from the global model of the previous round
        assert any(k.endswith(".base_delta") for k in msg.tensors())


def test_without_merging_it_is_flexloras_balanced_split():
    """Same replies, ``merge_residual = false``, τ = 1: FedMomentum's server state equals FlexLoRA's with the even
    (√Σ) split, so ``s B⁺A⁺ = [ΔW]_r``; nothing is merged."""
    mom = sim_of("fedmomentum", "method.tau=1.0", "method.merge_residual=false")
    flex = sim_of("flexlora", "method.split=even")
    out = play_round(mom, [0, 1, 2], 1)
    replies = [r for _, r, _ in out]
    flex.server = flex.method.aggregate(flex.server, replies, 1)
    assert set(mom.server) == set(flex.server)
    for key, value in flex.server.items():
        torch.testing.assert_close(mom.server[key].double(), value.double(), rtol=0, atol=1e-6)


def test_one_client_of_rank_at_most_r_leaves_no_residual_and_its_product_is_the_global_one():
    sim = sim_of("fedmomentum", "method.tau=1.0")
    out = play_round(sim, [1], 1)
    assert not any(k.endswith(".base_delta") for k in sim.server.tensors())
    after = global_weights(sim)
    for name, w in after.items():
        torch.testing.assert_close(w, out[0][2].end[name], rtol=0, atol=1e-6)
    assert sim.method.pop_metrics()["residual_rank"] == 0.0


def test_tau_below_1_keeps_the_energy_share_and_drops_the_tail():
    sim = sim_of("fedmomentum", "method.tau=0.5")
    play_round(sim, [0, 1, 2], 1)
    metrics = sim.method.pop_metrics()
    assert 0 < metrics["dropped_energy"] < 0.5


def test_energy_rank_is_the_fewest_directions_holding_the_share():
    S = torch.tensor([3.0, 2.0, 1.0, 0.0])
    total = 14.0
    assert energy_rank(S, 1.0) == 3                                   # the zero direction carries nothing
    assert energy_rank(S, 9 / total) == 1 and energy_rank(S, 9.5 / total) == 2 and energy_rank(S, 13 / total) == 2
    assert energy_rank(torch.zeros(3), 0.9) == 0


def test_the_ledger_counts_the_dense_base_delta_down_once_it_exists():
    sim = run_tiny("fedmomentum", "run.clients_per_round=4", "method.tau=1.0", rounds=2)
    fedit = run_tiny("fedit", "run.clients_per_round=4", rounds=2)
    dense = sum(m.base.weight.numel() * 4 for m in sim.model.adapters().values())
    first, second = ([row for row in sim.ledger.rows if row["round"] == rnd] for rnd in (1, 2))
    first_fedit = [row for row in fedit.ledger.rows if row["round"] == 1]
    assert [r["down"] for r in first] == [r["down"] for r in first_fedit]
    assert [r["up"] for r in sim.ledger.rows] == [r["up"] for r in fedit.ledger.rows]
    for row, ref in zip(second, first):
        assert dense <= row["down"] - ref["down"] < dense + 4096


def test_heterogeneous_clients_get_their_leading_directions_and_the_same_base_delta():
    sim = sim_of("fedmomentum", "lora.ranks=[2,1]", "method.tau=1.0")
    play_round(sim, [0, 1, 2], 1)
    m0, m1 = sim.method.broadcast(sim.server, 0, 2), sim.method.broadcast(sim.server, 1, 2)
    name = next(iter(sim.model.adapters()))
    assert m0[f"{name}.lora_A"].shape[0] == 2 and m1[f"{name}.lora_A"].shape[0] == 1
    for key in (k for k in m0.tensors() if k.endswith(".base_delta")):
        assert torch.equal(m0[key], m1[key])


def test_dpsgd_and_local_dp_and_the_refusals(monkeypatch):
    sim, seen = run_with_dpsgd(monkeypatch, "fedmomentum")
    assert seen and all(k.endswith((".lora_A", ".lora_B")) or k.startswith("head/") for keys in seen for k in keys)
    assert [r["dpsgd_epsilon"] for r in sim.history] == [r["dpsgd_epsilon"] for r in run_tiny("fedit", *DPSGD).history]
    assert_client_level_dp("fedmomentum", "local")
    with pytest.raises(ConfigError, match="'central' is not supported by method 'fedmomentum'"):
        tiny_config("method.name=fedmomentum", "privacy.mode=central", "privacy.clip=0.5",
                    "privacy.noise_multiplier=1.0", "server.weighting=uniform")
    with pytest.raises(ValueError, match="method.tau"):
        get_method("fedmomentum", tau=0.0)
    with pytest.raises(ValueError, match="method.residual_scale"):
        get_method("fedmomentum", residual_scale="half")
    assert FedMomentum.supports_heterogeneous_ranks and FedMomentum.supports_cohorts


def test_methods_name_lists_fedmomentum(capsys):
    assert main(["methods", "fedmomentum"]) == 0
    out = capsys.readouterr().out
    assert "arXiv:2603.08014" in out and "method.tau" in out and "privacy: local" in out


def test_a_server_step_below_1_mixes_the_old_adapter_into_the_product():
    """β = 0.5: the new global update is ``½ s B A + ½ Σ pₖ s Bₖ Aₖ`` (τ = 1, conserved with the base delta)."""
    sim = sim_of("fedmomentum", "method.tau=1.0", "server.lr=0.5")
    play_round(sim, [0, 1], 1)
    before = global_weights(sim)
    out = play_round(sim, [1, 2, 3], 2)
    after, mean = global_weights(sim), _client_mean(out)
    for name in after:
        torch.testing.assert_close(after[name], 0.5 * before[name] + 0.5 * mean[name], rtol=0, atol=1e-5)

"""SSF and FedSub (methods/ssf.py): r = d ≡ SCAFFOLD, c = mean cᵢ, the complement untouched by a round, the
4rm payload, and exact convergence with full-batch gradients.

Runs use the small matrix-regression task through the real simulator (every message on the wire, counted by
the ledger) and through the vectorised runner, which must give the same iterates.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedlowrank.config import from_dict, load_config
from fedlowrank.message import State
from fedlowrank.methods import get_method
from fedlowrank.methods.ssf import local_sgd, project, projector
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.runtime.vectorized import run_vectorized
from helpers import run_tiny


N, D, M = 4, 8, 3


def config(method: str, rounds: int = 6, per_round: int = 2, rank: int = 3, batch: int = 4, steps: int = 3,
           lr: float = 0.02, eval_every: int = 1, **options):
    return from_dict({
        "run": {"rounds": rounds, "clients_per_round": per_round, "eval_every": eval_every, "seed": 5},
        "task": {"kind": "matrix-regression",
                 "options": {"num_clients": N, "dim": D, "outputs": M, "samples": 6, "het": 0.5}},
        "partition": {"kind": "natural", "num_clients": N},
        "train": {"optimizer": "sgd", "lr": lr, "local_steps": steps, "batch_size": batch},
        "lora": {"rank": rank}, "method": {"name": method, **options}})


def simulate(cfg, float64_controls: bool = False) -> Simulation:
    sim = Simulation(cfg)
    if float64_controls:   # Scaffold.init_server creates float32 controls; the toy runs in float64
        sim.server = State({k: v.double() if k.startswith("scaffold.c/") else v for k, v in sim.server.items()})
    sim.run()
    return sim


def weight(sim: Simulation) -> torch.Tensor:
    """The global X of a finished simulation."""
    sim.method.load_global(sim.model, sim.server)
    return sim.task.weight(sim.model.net)


def test_projector_is_orthonormal_shared_and_unbiased():
    P = projector(7, 3, 1, 20, 5)
    assert (P @ P.T - torch.eye(5, dtype=torch.float64)).abs().max() < 1e-12
    assert torch.equal(P, projector.__wrapped__(7, 3, 1, 20, 5))   # regenerated from the seed alone
    assert not torch.equal(P, projector(7, 4, 1, 20, 5))
    mean = sum(projector(0, e, 0, 6, 2).T @ projector(0, e, 0, 6, 2) for e in range(400)) / 400
    assert (mean - torch.eye(6, dtype=torch.float64) * 2 / 6).abs().max() < 0.06


def test_ssf_with_full_rank_equals_full_scaffold():
    ssf = simulate(config("ssf", rank=D))
    scaffold = simulate(config("fedavg-full", correction="scaffold"), float64_controls=True)
    for r_ssf, r_sc in zip(ssf.history, scaffold.history):
        assert r_ssf["rel_error"] == pytest.approx(r_sc["rel_error"], rel=1e-10, abs=1e-13)
    assert (weight(ssf) - weight(scaffold)).abs().max() < 1e-12
    c_ssf = ssf.server["c/linear"]
    assert (c_ssf - scaffold.server["scaffold.c/linear.weight"]).abs().max() < 1e-12


@pytest.mark.parametrize("method,options", [("ssf", {}), ("ssf", {"control_update": "sample_mean"}),
                                            ("fedsub", {}), ("fedsub", {"refresh_every": 2})])
def test_vectorised_round_equals_the_message_contract(method, options):
    cfg = config(method, rounds=7, **options)
    sim = simulate(cfg)
    run = run_vectorized(cfg, batches="trainer")
    for a, b in zip(sim.history, run.history):
        assert a["rel_error"] == pytest.approx(b["rel_error"], rel=1e-12)
    for key in sim.server:
        if isinstance(sim.server[key], torch.Tensor) and not key.startswith("inc/"):
            assert (sim.server[key] - run.server[key]).abs().max() < 1e-12, key


@pytest.mark.parametrize("correction", ["none", "scaffold"])
def test_vectorised_full_methods_equal_the_simulator(correction):
    """Full-FedAvg / Full-SCAFFOLD through fedavg-full's batched_round hook (the round of ssf.py with P = I)."""
    cfg = config("fedavg-full", rounds=5, correction=correction)
    sim = simulate(cfg, float64_controls=True)
    run = run_vectorized(cfg, batches="trainer")
    for a, b in zip(sim.history, run.history):
        assert a["rel_error"] == pytest.approx(b["rel_error"], rel=1e-12)


def test_controls_stay_the_mean_and_only_the_subspace_moves():
    cfg = config("ssf", rounds=5)
    sim = Simulation(cfg)
    for rnd in range(1, 6):
        before = State(sim.server)
        before["ci/linear"] = before["ci/linear"].clone()
        sim.run_round()
        after = sim.server
        P = projector(cfg.run.seed, rnd, 0, D, 3)
        residual = torch.eye(D, dtype=torch.float64) - P.T @ P
        assert (after["c/linear"] - after["ci/linear"].mean(0)).abs().max() < 1e-14
        for key in ("w/linear", "c/linear", "ci/linear"):
            moved = after[key] - before[key]
            assert moved.abs().max() > 1e-6
            assert (moved @ residual).abs().max() < 1e-13, key
        idle = [k for k in range(N) if k not in sim.history[-1]["clients"]]
        assert torch.equal(after["ci/linear"][idle], before["ci/linear"][idle])


def test_local_iterates_never_leave_the_subspace():
    P = projector(0, 0, 0, D, 3).numpy()
    rng = np.random.default_rng(0)
    start = rng.standard_normal((M, D))
    seen = []

    class Oracle:
        steps, lr = 4, 0.1

        def grad(self, weights, step):
            seen.append(weights["w"])
            return {"w": rng.standard_normal((2, M, D))}

    coef, gbar = local_sgd({"w": start}, {"w": P}, {"w": rng.standard_normal((2, M, 3))}, Oracle())
    residual = np.eye(D) - P.T @ P
    assert len(seen) == 4 and np.abs(seen[-1] - start).max() > 1e-3
    for w in seen:
        assert np.abs((w - start) @ residual).max() < 1e-14
    assert coef["w"].shape == gbar["w"].shape == (2, M, 3)


def test_full_batch_ssf_and_scaffold_reach_x_star_while_fedavg_stalls():
    full = dict(batch=6, steps=5, per_round=N, eval_every=25, lr=0.1)   # b = n: exact local gradients
    ssf = run_vectorized(config("ssf", rounds=300, rank=4, **full))
    assert ssf.final["rel_error"] < 1e-10
    scaffold = simulate(config("fedavg-full", rounds=100, correction="scaffold", **full), float64_controls=True)
    assert scaffold.history[-1]["rel_error"] < 1e-10
    fedavg = [row["rel_error"] for row in simulate(config("fedavg-full", rounds=60, **{**full, "eval_every": 20})).history
              if "rel_error" in row]
    no_controls = run_vectorized(config("ssf", rounds=200, rank=4, controls="none", **full))
    assert fedavg[-1] > 1e-3 and no_controls.final["rel_error"] > 1e-3
    # the drift floor is a fixed point, not slow progress
    assert fedavg[-1] == pytest.approx(fedavg[-2], rel=1e-3)


def test_fedsub_equals_ssf_in_a_fixed_subspace_with_full_participation():
    fixed = dict(rounds=6, per_round=N, refresh_every=100)
    fedsub = simulate(config("fedsub", **fixed))
    ssf = simulate(config("ssf", **fixed))
    assert (weight(fedsub) - weight(ssf)).abs().max() < 1e-12
    # Λᵢ = −Kη(cᵢ − c)Pᵀ and Σᵢ Λᵢ = 0
    P = projector(5, 0, 0, D, 3)
    expect = -3 * 0.02 * project(ssf.server["ci/linear"] - ssf.server["c/linear"], P)
    assert (fedsub.server["dual/linear"] - expect).abs().max() < 1e-12
    assert fedsub.server["dual/linear"].sum(0).abs().max() < 1e-13


def floats(msg) -> int:
    return sum(t.numel() for t in msg.tensors().values())


def counted(cfg):
    """Run ``cfg`` in the simulator, recording the floats of every message next to the ledger's bytes."""
    sim = Simulation(cfg)
    rows = []
    broadcast, train = sim.method.broadcast, sim.method.train

    def down(server, client, rnd):
        msg = broadcast(server, client, rnd)
        rows.append({"round": rnd, "client": client, "down": floats(msg), "down_bytes": msg.nbytes()})
        return msg

    def up(model, msg, state, trainer):
        reply, new = train(model, msg, state, trainer)
        rows[-1].update(up=floats(reply), up_bytes=reply.nbytes())
        return reply, new

    sim.method.broadcast, sim.method.train = down, up
    sim.run()
    for row, led in zip(rows, sim.ledger.rows):
        assert (row["down_bytes"], row["up_bytes"]) == (led["down"], led["up"])
        assert 0 <= row["down_bytes"] - 8 * row["down"] < 512 and 0 <= row["up_bytes"] - 8 * row["up"] < 512
    return rows


def test_ledger_counts_4rm_for_ssf_and_4dm_for_scaffold():
    r = 2
    rows = counted(config("ssf", rounds=4, per_round=N, rank=r))
    assert all(row["down"] + row["up"] == 4 * r * M for row in rows if row["round"] > 1)
    assert all(row["down"] == r * M for row in rows if row["round"] == 1)   # nothing to catch up yet
    rows = counted(config("fedavg-full", rounds=3, per_round=N, correction="scaffold"))
    assert all(row["down"] + row["up"] == 4 * D * M for row in rows)
    rows = counted(config("fedsub", rounds=4, per_round=N, rank=r))
    assert all(row["down"] + row["up"] == 3 * r * M for row in rows if row["round"] > 1)
    # partial participation: a client that missed rounds downloads one increment per missed projector epoch
    # (here one per round), or the full weight when that is smaller
    rows = counted(config("ssf", rounds=8, per_round=1, rank=r))
    last = {}
    for row in rows:
        gap = row["round"] - 1 - last.get(row["client"], 0)
        catch_up = min(gap * r, D) * M if gap else 0
        assert row["down"] == catch_up + r * M and row["up"] == 2 * r * M
        last[row["client"]] = row["round"] - 1   # the version it was brought to


def test_client_copies_follow_the_server_through_a_skipped_aggregate():
    sim = Simulation(config("ssf", rounds=6, per_round=2))
    sim.run_round()
    sim.run_round()
    sim.cfg.run.min_replies = 99          # the next round trains but its aggregate is skipped
    sim.run_round()
    sim.cfg.run.min_replies, sim.cfg.run.clients_per_round = 1, N
    for _ in range(2):                    # full participation: every client catches up
        before = sim.server["w/linear"].clone()
        sim.run_round()
        for k in range(N):
            assert (sim.store[k]["w/linear"] - before).abs().max() < 1e-13


def test_options_are_validated():
    for name, option, value in (("ssf", "control_update", "mean"), ("ssf", "controls", "half"),
                                ("ssf", "head_update", "freeze"), ("fedsub", "dual_transfer", "spin"),
                                ("ssf", "refresh_every", 0), ("fedsub", "ratio", 2.0)):
        with pytest.raises(ValueError, match=f"method.{option}"):
            get_method(name, **{option: value})
    with pytest.raises(ValueError, match="train.optimizer = 'adamw': method 'ssf' needs one of sgd"):
        load_config("tiny", ["method.name=ssf", "train.optimizer=adamw"])
    cfg = config("ssf", rounds=1)
    cfg.train.optimizer = "adamw"  # changed after validation: refused when the run is built
    with pytest.raises(ValueError, match="train.optimizer = 'adamw': method 'ssf' needs one of sgd"):
        Simulation(cfg)


def test_ssf_on_a_network_with_a_scaffold_head_sends_less_than_full_scaffold():
    ssf = run_tiny("ssf", "train.optimizer=sgd", "train.lr=0.05", "method.ratio=0.25", rounds=1)
    full = run_tiny("fedavg-full", "train.optimizer=sgd", "train.lr=0.05", "method.correction=scaffold", rounds=1)
    assert ssf.ledger.total_up < full.ledger.total_up
    head = [k for k in ssf.server if k.startswith("ci/head/")]
    assert head and all(ssf.server[k].abs().sum() > 0 for k in head)
    assert all(0 <= r["accuracy"] <= 1 for r in ssf.history if "accuracy" in r)
    # the round-trip of the server state (lists and tensors) is exact
    again = State.from_bytes(ssf.server.to_bytes())
    assert set(again) == set(ssf.server) and all(
        torch.equal(again[k], v) if isinstance(v, torch.Tensor) else again[k] == v for k, v in ssf.server.items())

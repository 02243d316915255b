"""RAVAN (arXiv:2506.05568): the batched multi-head adapter against a per-head dense reference, exact aggregation
(the aggregate of the clients' updates is the update of the averaged cores, also per head with head subsets),
seeded bases identical everywhere and never sent, s folded into H, DP-SGD on what is trained, export, refusals."""

from __future__ import annotations

import pytest
import torch
from test_lora_baselines import play_round, sim_of, weights_of

from fedlowrank.adapters.ravan import RavanLinear, ravan_bases, ravan_modules
from fedlowrank.config import ConfigError
from fedlowrank.methods import get_method
from fedlowrank.methods.ravan import core_key
from fedlowrank.runtime.simulator import Simulation

from helpers import DPSGD, run_tiny, run_with_dpsgd, tiny_config, tiny_task


def _layer(init="orthonormal", heads=3, rank=2, out=6, inp=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, A = ravan_bases(out, inp, heads, rank, init, g)
    mod = RavanLinear(torch.nn.Linear(inp, out), B, A)
    with torch.no_grad():
        for i in range(heads):
            mod.cores[i].copy_(torch.randn(rank, rank, generator=g))
            mod.scales[i].fill_(0.5 + i)
    return mod


@pytest.mark.parametrize("init", ["orthonormal", "gaussian"])
def test_batched_heads_equal_the_per_head_dense_sum(init):
    mod = _layer(init)
    dense = sum(mod.scales[i] * mod.bases_B[i] @ mod.cores[i] @ mod.bases_A[i] for i in range(mod.heads))
    torch.testing.assert_close(mod.adapter_delta(), dense, rtol=1e-5, atol=1e-6)
    x = torch.randn(4, 7, 5, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(mod(x), mod.base(x) + x @ dense.T, rtol=1e-5, atol=1e-5)
    if init == "orthonormal":
        eye = torch.eye(2).expand(3, 2, 2)
        torch.testing.assert_close(mod.bases_B.mT @ mod.bases_B, eye, rtol=0, atol=1e-6)
        torch.testing.assert_close(mod.bases_A @ mod.bases_A.mT, eye, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="lora.rank"):
        ravan_bases(3, 8, 2, 4, init, torch.Generator())


def test_set_heads_loads_cores_and_resets_scales_and_folded_cores_are_the_upload():
    mod = _layer()
    cores = [torch.full((2, 2), float(i)) for i in range(3)]
    mod.set_heads(cores)
    assert all(float(s.detach()) == 1.0 for s in mod.scales)
    torch.testing.assert_close(mod.folded_cores(), torch.stack(cores))
    with pytest.raises(ValueError, match="3 cores"):
        mod.set_heads(cores[:2])


def _global_delta(sim) -> dict[str, torch.Tensor]:
    sim.method.load_global(sim.model, sim.server)
    return {n: m.adapter_delta().detach().double() for n, m in sim.model.adapters().items()}


def test_aggregate_of_client_updates_equals_the_update_of_the_averaged_cores():
    sim = sim_of("ravan")
    for rnd, clients in enumerate([[0, 1, 2], [1, 3], [0, 2, 3]], start=1):
        before = _global_delta(sim)
        out = play_round(sim, clients, rnd)
        after, p = _global_delta(sim), weights_of(out)
        base = {n: m.frozen_weight().detach().double() for n, m in sim.model.adapters().items()}
        for name in after:
            client_mean = sum(pk * (t.end[name] - base[name]) for pk, (_, _, t) in zip(p.tolist(), out))
            torch.testing.assert_close(after[name], client_mean, rtol=0, atol=1e-6)   # Σₖ pₖ ΔWₖ, exact
            assert not torch.allclose(after[name], before[name])
        for msg, reply, trainer in out:               # the upload is sᵢHᵢ of the trained parameters
            for name in sim.model.adapters():
                for i in range(sim.method.heads):
                    key = core_key(name, i)
                    s = trainer.params[f"{name}.ravan_s.{i}"]
                    assert float(s) == 1.0                                               # s reset to 1 on load
                    assert reply.message[key].dtype == torch.float32


def test_head_subsets_are_averaged_per_head_over_the_clients_that_trained_them():
    sim = sim_of("ravan", "method.client_heads=[1, 2, 4]")
    method = sim.method
    assert [len(method.trained_heads(k, 1)) for k in range(4)] == [1, 2, 4, 1]
    assert method.trained_heads(0, 3) == method.trained_heads(0, 3)                     # seeded
    old = {k: v.clone() for k, v in sim.server.items() if ".ravan_H." in k}
    out = play_round(sim, [0, 1, 2, 3], 1)
    for msg, reply, _ in out:
        sent = {int(k.rsplit(".", 1)[1]) for k in reply.message.tensors() if ".ravan_H." in k}
        assert sent == set(msg["ravan.heads"])
    for key, value in old.items():
        have = [(r.num_examples, r.message[key]) for _, r, _ in out if key in r.message]
        if not have:
            assert torch.equal(sim.server[key], value)                                   # nobody trained it
            continue
        total = sum(n for n, _ in have)
        expected = sum(n / total * t.double() for n, t in have)
        torch.testing.assert_close(sim.server[key].double(), expected, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match=r"method.client_heads: each entry must be in \[1, method.heads = 4\]"):
        get_method("ravan", client_heads=[5])


def test_bases_are_identical_on_every_client_from_the_seed_and_never_sent(tmp_path):
    a = Simulation(tiny_config("method.name=ravan"), task=tiny_task())
    b = Simulation(tiny_config("method.name=ravan"), task=tiny_task())              # another node's build
    c = Simulation(tiny_config("method.name=ravan", "run.seed=1"), task=tiny_task())
    for name, mod in ravan_modules(a.model).items():
        other, third = ravan_modules(b.model)[name], ravan_modules(c.model)[name]
        assert torch.equal(mod.bases_B, other.bases_B) and torch.equal(mod.bases_A, other.bases_A)
        assert not torch.equal(mod.bases_B, third.bases_B)
        assert not any("bases" in k for k in mod.state_dict())                    # not persistent: not saved
    a.run_round()
    r, h = a.cfg.lora.rank, a.method.heads
    heads_bytes = sum(p.numel() * 4 for p in a.model.head_parameters().values())
    cores_bytes = len(a.model.target_names) * h * r * r * 4
    bases_bytes = sum(m.bases_B.numel() * 4 + m.bases_A.numel() * 4 for m in ravan_modules(a.model).values())
    for row in a.ledger.rows:                        # tensors + a few hundred bytes of header, never the bases
        assert cores_bytes + heads_bytes <= row["down"] < cores_bytes + heads_bytes + 4096 < bases_bytes
        assert row["up"] < cores_bytes + heads_bytes + 4096
    msg = a.method.broadcast(a.server, 0, 2)
    assert set(msg.tensors()) == {k for k in a.server if ".ravan_H." in k or k.startswith("head/")}


def test_dpsgd_clips_and_noises_only_the_cores_scales_and_head(monkeypatch):
    sim, seen = run_with_dpsgd(monkeypatch, "ravan")
    assert seen and all(k.startswith("head/") or ".ravan_H." in k or ".ravan_s." in k for keys in seen for k in keys)
    fedit = run_tiny("fedit", *DPSGD)
    assert [r["dpsgd_epsilon"] for r in sim.history] == [r["dpsgd_epsilon"] for r in fedit.history]


def test_export_needs_a_rank_and_is_exact_at_h_times_r(tmp_path):
    from fedlowrank.export import export_run, load_peft

    run_dir = tmp_path / "run"
    sim = Simulation(tiny_config("method.name=ravan", "run.checkpoint_every=1", "train.lr=0.02"), task=tiny_task(),
                     run_dir=run_dir)
    sim.run()
    with pytest.raises(ValueError, match="RavanLinear.*--rank"):
        export_run(run_dir, tmp_path / "x", "peft", task=tiny_task())
    full = sim.method.heads * sim.cfg.lora.rank
    report = export_run(run_dir, tmp_path / "peft", "peft", rank=full, task=tiny_task())
    assert report["rel_error_overall"] < 1e-5
    net = load_peft(tiny_task().build_model().net, tmp_path / "peft").eval()
    sim.method.load_global(sim.model, sim.server)
    task = tiny_task()
    with torch.no_grad():
        batch = dict(input_ids=task.test_ids[:8], attention_mask=task.test_mask[:8])
        torch.testing.assert_close(net(**batch).logits, sim.model.net.eval()(**batch).logits, rtol=1e-4, atol=1e-5)


def test_refusals_name_the_field_and_the_reason():
    with pytest.raises(ConfigError, match=r"lora.ranks: method 'ravan' does not support heterogeneous ranks: every "
                                          r"head has rank lora.rank"):
        sim_of("ravan", "lora.ranks=[1,2]")
    with pytest.raises(ValueError, match="method.correction"):
        get_method("ravan", correction="scaffold")
    with pytest.raises(ValueError, match="method.bases_init"):
        get_method("ravan", bases_init="uniform")


def test_head_subsets_refuse_central_dp_and_robust_aggregation_at_config_time():
    for setting, field in (("privacy.mode=central", "privacy.mode = 'central'"),
                           ("server.aggregate=median", "server.aggregate = 'median'")):
        with pytest.raises(ConfigError, match=f"^{field}.*method 'ravan' differ: with method.client_heads each client"):
            tiny_config("method.name=ravan", "method.client_heads=[1, 4]", "server.weighting=uniform", setting)
        tiny_config("method.name=ravan", "server.weighting=uniform", setting)              # every head: accepted
    sim = run_tiny("ravan", "method.client_heads=[1, 4]", "privacy.mode=local", "privacy.clip=0.5",
                   "privacy.noise_multiplier=0.1")
    assert not any(r.get("rejected") for r in sim.history) and all(r["epsilon"] > 0 for r in sim.history)


def test_joint_output_of_cohort_members_equals_each_members_own():
    members = [_layer(seed=s) for s in range(3)]
    for m in members[1:]:                                      # one shared frozen base, as cohort views share it
        m.base = members[0].base
    x = torch.randn(3 * 4, 5, 5, generator=torch.Generator().manual_seed(2))
    joint = RavanLinear.joint_adapter_output(members, x)
    own = torch.cat([m.adapter_output(x[4 * k:4 * (k + 1)]) for k, m in enumerate(members)])
    torch.testing.assert_close(joint, own, rtol=1e-5, atol=1e-6)


def test_flower_with_head_subsets_equals_the_simulator(monkeypatch):
    """Each client's own downlink (its heads) and its shorter upload go through Flower as through the simulator."""
    pytest.importorskip("flwr")
    import test_flower as harness
    from flwr.supercore.task_identity import TaskIdentity

    import fedlowrank.runtime.run as run_module
    from fedlowrank.runtime.flower import client_app

    for name in ("run_id", "node_id", "task_id"):                  # as test_flower's flower_process fixture
        monkeypatch.setattr(TaskIdentity, f"_{name}", 7)
    monkeypatch.setattr(run_module, "build_task", lambda cfg, cohorts=False: tiny_task())
    client_app._runs.clear()
    sets = ("method.client_heads=[1, 3]", "run.clients_per_round=3")
    ref = run_tiny("ravan", *sets)
    sim, _, _ = harness.run_flower("method.name=ravan", *sets)
    client_app._runs.clear()
    harness.assert_same_state(sim.server, ref.server)
    assert sim.ledger.rows == ref.ledger.rows and len({r["up"] for r in ref.ledger.rows}) > 1   # uploads differ


def test_a_convolution_target_adapts_its_kernel_matrix():
    conv = torch.nn.Conv2d(3, 6, 3, padding=1)
    g = torch.Generator().manual_seed(4)
    B, A = ravan_bases(6, 27, 2, 2, "orthonormal", g)
    mod = RavanLinear(conv, B, A)
    with torch.no_grad():
        for core in mod.cores:
            core.copy_(torch.randn(2, 2, generator=g))
    x = torch.randn(2, 3, 5, 5, generator=g)
    kernel = (conv.weight.reshape(6, -1) + mod.adapter_delta()).reshape(conv.weight.shape)
    dense = torch.nn.functional.conv2d(x, kernel, conv.bias, padding=1)
    torch.testing.assert_close(mod(x), dense, rtol=1e-5, atol=1e-5)

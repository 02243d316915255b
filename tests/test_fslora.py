"""FSLoRA (arXiv:2501.19389): the sketched model is unbiased (Monte Carlo), the client's rank-k blocks at scale s·r/k
are the sketched model exactly, the server's step is the masked pseudo-gradient (not renormalised by coverage; SGD or
Adam), with k = r and SGD at 1 it is FedIT, each client uploads exactly its k_i(in+out) numbers and the directions
outside its sketch stay unchanged, DP and refusals."""

from __future__ import annotations

import pytest
import torch
from test_lora_baselines import play_round, sim_of, weights_of

from fedlowrank.adapters.lora import lora_modules, lora_scale
from fedlowrank.cli import main
from fedlowrank.config import ConfigError
from fedlowrank.methods import get_method
from fedlowrank.methods.fslora import FSLoRA, sketch_indices

from helpers import assert_client_level_dp, run_tiny, run_with_dpsgd, tiny_config

SKETCHED = ("lora.ranks=[1,2]", "lora.server_rank=4")   # clients of sketch sizes 1 and 2 of a rank-4 global LoRA


@pytest.mark.parametrize("scaled, uniform", [(True, True), (False, True), (True, False)])
def test_the_sketched_product_is_unbiased(scaled, uniform):
    """Over 10⁴ draws of J with k = r/4, the mean of ``(r/k) B_J A_J`` (= B S A) is BA to 2 % relative. Without the
    r/k factor (mean (k/r)·BA) or with the leading k directions instead of a uniform draw, it is not."""
    g = torch.Generator().manual_seed(0)
    r, k = 8, 2
    B, A = torch.randn(6, r, generator=g, dtype=torch.float64), torch.randn(r, 5, generator=g, dtype=torch.float64)
    total = torch.zeros(6, 5, dtype=torch.float64)
    draws = 10_000
    for t in range(draws):
        J = sketch_indices(0, 3, t, 1, r, k) if uniform else torch.arange(k)
        total += (r / k if scaled else 1.0) * B[:, J] @ A[J]
    error = float((total / draws - B @ A).norm() / (B @ A).norm())
    assert (error < 0.02) == (scaled and uniform), error
    J = sketch_indices(0, 3, 1, 1, r, k)
    assert J.tolist() == sorted(set(J.tolist())) and len(J) == k and torch.equal(J, sketch_indices(0, 3, 1, 1, r, k))


def test_a_clients_blocks_at_scale_s_r_over_k_are_the_sketched_model():
    """Client 0 (k = 1) loads its blocks: each module's update is ``s B S A`` of the global factors with
    ``S = (r/k) diag(1[j ∈ J])``, and only the sketch blocks went down."""
    sim = sim_of("fslora", *SKETCHED)
    g = torch.Generator().manual_seed(1)
    for key in sim.method.lora_keys(sim.server):
        sim.server[key] = torch.randn(sim.server[key].shape, generator=g)
    msg = sim.method.broadcast(sim.server, 0, 1)
    sim.method.load_message(sim.model, msg)
    info = sim.method.info
    s = lora_scale(info.alpha, info.rank, info.scaling)
    for name, mod in lora_modules(sim.model).items():
        J = sim.method.sketch(0, 1)[name]
        S = torch.zeros(info.rank, info.rank)
        S[J, J] = info.rank / len(J)
        expected = s * sim.server[f"{name}.lora_B"] @ S @ sim.server[f"{name}.lora_A"]
        torch.testing.assert_close(mod.adapter_delta().detach(), expected, rtol=1e-5, atol=1e-6)
        assert msg[f"{name}.lora_A"].shape == (1, mod.in_features)
        assert msg[f"{name}.lora_B"].shape == (mod.out_features, 1)
    other = sim.method.sketch(2, 1)                                   # another client of the same size
    assert any(not torch.equal(J, other[name]) for name, J in sim.method.sketch(0, 1).items())


@pytest.mark.parametrize("server_lr", [1.0, 0.5])
def test_the_server_steps_on_the_masked_pseudo_gradient_not_renormalised(server_lr):
    """``θ⁺ = θ − η_s Σᵢ pᵢ Mᵢ ⊙ (θ − θᵢ)`` to 1e-7 for overlapping sketches of sizes 1 and 2. Dividing each entry by
    the weight of the clients that cover it (coverage renormalisation) fails where coverage is partial."""
    sim = sim_of("fslora", *SKETCHED, f"server.lr={server_lr}")
    before = {k: sim.server[k].clone() for k in sim.method.lora_keys(sim.server)}
    out = play_round(sim, [0, 1, 2], 1)
    p = weights_of(out)
    partial = False
    for key, theta in before.items():
        name, factor = key.rsplit(".", 1)
        g = torch.zeros_like(theta, dtype=torch.float64)
        covered = torch.zeros_like(g)
        for pk, (_, rep, _) in zip(p.tolist(), out):
            J = sim.method.sketch(rep.client, 1)[name]
            view = (lambda t: t[J]) if factor == "lora_A" else (lambda t: t[:, J])
            delta = view(theta.double()) - rep.message[key].double()
            if factor == "lora_A":
                g[J] += pk * delta
                covered[J] += pk
            else:
                g[:, J] += pk * delta
                covered[:, J] += pk
        torch.testing.assert_close(sim.server[key].double(), theta.double() - server_lr * g, rtol=0, atol=1e-7)
        partial |= bool(((covered > 0) & (covered < 1 - 1e-12)).any())
    assert partial


def test_directions_outside_the_sketch_stay_and_the_upload_is_k_times_in_plus_out():
    sim = sim_of("fslora", *SKETCHED)
    before = {k: sim.server[k].clone() for k in sim.method.lora_keys(sim.server)}
    (msg, reply, _), = play_round(sim, [1], 1)                      # client 1: k = 2 of r = 4
    for name, mod in lora_modules(sim.model).items():
        J = sim.method.sketch(1, 1)[name]
        out_J = [j for j in range(4) if j not in J.tolist()]
        assert torch.equal(sim.server[f"{name}.lora_A"][out_J], before[f"{name}.lora_A"][out_J])
        assert torch.equal(sim.server[f"{name}.lora_B"][:, out_J], before[f"{name}.lora_B"][:, out_J])
        sent = reply.message[f"{name}.lora_A"].numel() + reply.message[f"{name}.lora_B"].numel()
        assert sent == 2 * (mod.in_features + mod.out_features)
    assert sorted(reply.message.tensors()) == sorted(msg.tensors())


def test_with_every_sketch_full_and_sgd_at_1_it_is_fedit():
    """k_i = r for every client: two real rounds give FedIT's server state to 1e-6."""
    fedit, fslora = run_tiny("fedit"), run_tiny("fslora")
    assert set(fslora.server) == set(fedit.server)
    for key, value in fedit.server.items():
        torch.testing.assert_close(fslora.server[key], value, rtol=0, atol=1e-6)


def test_the_adam_server_step_equals_torch_adam_on_the_pseudo_gradient():
    """Two rounds: the server's factors follow ``torch.optim.Adam`` (no weight decay, the same lr and moments) fed
    the masked pseudo-gradient; its moments live in the server state."""
    sim = sim_of("fslora", *SKETCHED, 'method.server_opt="adam"', "method.server_adam_lr=0.01")
    keys = sim.method.lora_keys(sim.server)
    params = {k: torch.nn.Parameter(sim.server[k].double().clone()) for k in keys}
    opt = torch.optim.Adam(params.values(), lr=0.01, betas=(0.9, 0.999), eps=1e-8)
    for rnd, clients in ((1, [0, 1, 2]), (2, [1, 3])):
        start = {k: sim.server[k].double() for k in keys}
        out = play_round(sim, clients, rnd)
        p = weights_of(out)
        for key in keys:
            name, factor = key.rsplit(".", 1)
            g = torch.zeros_like(start[key])
            for pk, (_, rep, _) in zip(p.tolist(), out):
                J = sim.method.sketch(rep.client, rnd)[name]
                if factor == "lora_A":
                    g[J] += pk * (start[key][J] - rep.message[key].double())
                else:
                    g[:, J] += pk * (start[key][:, J] - rep.message[key].double())
            params[key].grad = g
        opt.step()
        for key in keys:
            torch.testing.assert_close(sim.server[key].double(), params[key].detach(), rtol=1e-5, atol=1e-6)
    assert sim.server["fslora.step"] == 2 and any(k.startswith("fslora.m/") for k in sim.server)


def test_privacy_modes_and_refusals(monkeypatch):
    sim, seen = run_with_dpsgd(monkeypatch, "fslora", *SKETCHED)
    assert seen and all(k.endswith((".lora_A", ".lora_B")) or k.startswith("head/") for keys in seen for k in keys)
    assert_client_level_dp("fslora", "local", *SKETCHED)
    with pytest.raises(ConfigError, match="'central' is not supported by method 'fslora': each reply holds the blocks"):
        tiny_config("method.name=fslora", "privacy.mode=central", "privacy.clip=0.5", "privacy.noise_multiplier=1.0",
                    "server.weighting=uniform")
    with pytest.raises(ConfigError, match="server.aggregate"):
        tiny_config("method.name=fslora", "server.aggregate=median")
    with pytest.raises(ValueError, match="lora.ranks: a client's sketch size must be at most the global rank r = 2"):
        sim_of("fslora", "lora.ranks=[4]", "lora.server_rank=2")
    with pytest.raises(ValueError, match="method.correction"):
        get_method("fslora", correction="scaffold")
    assert FSLoRA.supports_heterogeneous_ranks and FSLoRA.per_client_downlink and FSLoRA.supports_cohorts


def test_methods_name_lists_fslora(capsys):
    assert main(["methods", "fslora"]) == 0
    out = capsys.readouterr().out
    assert "arXiv:2501.19389" in out and "method.server_opt" in out and "privacy: local" in out

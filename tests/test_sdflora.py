"""SDFLoRA (arXiv:2601.11219): the dual-module adapter against a dense reference, the local module, gates and head
never leave the client and persist across rounds, without a local module and with fixed gates and a shared head it
is FedIT, sdflora-svd's global product is the truncated SVD of the weighted products and each client gets its own
rank, DP-SGD noises every trained tensor, refusals."""

from __future__ import annotations

import pytest
import torch
from test_lora_baselines import play_round, sim_of, weights_of

from fedlowrank.adapters.dual import DualLoRALinear, dual_modules
from fedlowrank.adapters.lora import lora_scale
from fedlowrank.cli import main
from fedlowrank.config import ConfigError
from fedlowrank.methods import get_method
from fedlowrank.methods.sdflora import SDFLoRA, SDFLoRASVD, gate_keys, local_keys

from helpers import DPSGD, assert_client_level_dp, run_tiny, run_with_dpsgd, tiny_config

PRIVATE = (".local_A", ".local_B", ".gate_g", ".gate_l")


@pytest.mark.parametrize("local_rank, learned", [(3, True), (0, True), (2, False)])
def test_dual_module_equals_the_dense_reference(local_rank, learned):
    g = torch.Generator().manual_seed(0)
    mod = DualLoRALinear(torch.nn.Linear(5, 6), 2, local_rank, 4.0, "standard", 0.0, learned)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    mod.set_factors(rnd(2, 5), rnd(6, 2))
    mod.set_local(rnd(local_rank, 5) if local_rank else None, rnd(6, local_rank) if local_rank else None,
                  rnd(()) if learned else None, rnd(()) if learned and local_rank else None)
    gg = torch.sigmoid(mod.gate_g) if learned else 1.0
    dense = gg * (4.0 / 2) * mod.lora_B @ mod.lora_A
    if local_rank:
        gl = torch.sigmoid(mod.gate_l) if learned else 1.0
        dense = dense + gl * (4.0 / local_rank) * mod.local_B @ mod.local_A
    x = rnd(3, 5)
    with torch.no_grad():
        torch.testing.assert_close(mod(x), mod.base(x) + x @ dense.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mod.adapter_delta(), dense, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="dual LoRA local_A"):
        mod.set_local(rnd(local_rank + 1, 5), None, None, None)


def test_the_local_module_gates_and_head_never_travel_and_persist_on_the_client():
    """Uplink keys are exactly the global factors; what client 1 starts round 2 from is what it kept from round 1
    (a method that uploaded or reset its local module fails)."""
    sim = sim_of("sdflora")
    first = play_round(sim, [0, 1, 2], 1)
    second = play_round(sim, [1, 3], 2)
    (_, _, t1), (_, _, t3) = second
    init3 = sim.method.init_client(3)
    for key, value in t1.params.items():
        if key.endswith(PRIVATE) or key.startswith("head/"):
            after_round_1 = first[1][2].params[key] + _noise(first[1][2], key)
            torch.testing.assert_close(value, after_round_1, rtol=0, atol=0)
            assert torch.equal(t3.params[key], init3[key])
    for msg, reply, _ in first + second:
        assert sorted(reply.message.tensors()) == sorted(msg.tensors())
        assert all(k.endswith((".lora_A", ".lora_B")) for k in msg.tensors())
    assert not any(k.endswith(PRIVATE) or k.startswith("head/") for k in sim.server)
    assert any(k.endswith(".local_A") for k in sim.store[1]) and any(k.startswith("head/") for k in sim.store[1])
    state = sim.method.init_client(0)
    name = next(iter(sim.model.adapters()))
    assert [float(state[k]) for k in gate_keys(name)] == pytest.approx([0.7, 0.3])
    assert torch.equal(state[local_keys(name)[1]], torch.zeros_like(state[local_keys(name)[1]]))


def _noise(trainer, key):
    """The seeded noise the fake trainer added to ``key`` (test_lora_baselines.FakeTrainer)."""
    g = torch.Generator().manual_seed(1000 * trainer.rnd + trainer.client)
    for k, p in trainer.params.items():
        noise = 0.05 * torch.randn(p.shape, generator=g)
        if k == key:
            return noise
    raise KeyError(key)


def test_without_a_local_module_with_fixed_gates_and_a_shared_head_it_is_fedit():
    """r_l = 0, σ(γ) = 1 and normalised fedavg: the server state after two real rounds equals FedIT's to 1e-6. With
    the learned gates (σ(0.7) ≈ 0.67 scales the global module) it does not."""
    limit = ("method.local_rank=0", "method.learned_gates=false", "method.shared_head=true")
    fedit = run_tiny("fedit")
    same = run_tiny("sdflora", *limit)
    assert set(same.server) == set(fedit.server)
    for key, value in fedit.server.items():
        torch.testing.assert_close(same.server[key], value, rtol=0, atol=1e-6)
    gated = run_tiny("sdflora", "method.local_rank=0", "method.shared_head=true")
    assert not all(torch.allclose(gated.server[k], v, atol=1e-6) for k, v in fedit.server.items())


def test_fedavg_weights_are_normalised_or_the_codes_fixed_unnormalised_ones():
    sim = sim_of("sdflora", "method.fixed_weight=0.1")
    out = play_round(sim, [0, 1, 2], 1)
    for key in (k for k in sim.server if k.endswith((".lora_A", ".lora_B"))):
        expected = sum(0.1 * r.message[key].double() for _, r, _ in out)
        torch.testing.assert_close(sim.server[key].double(), expected, rtol=0, atol=1e-7)
    sim = sim_of("sdflora")
    out = play_round(sim, [0, 1, 2], 1)
    p = weights_of(out)
    for key in (k for k in sim.server if k.endswith((".lora_A", ".lora_B"))):
        expected = sum(pk * r.message[key].double() for pk, (_, r, _) in zip(p.tolist(), out))
        torch.testing.assert_close(sim.server[key].double(), expected, rtol=0, atol=1e-7)


def test_stack_svd_is_the_truncated_svd_of_the_weighted_products_and_each_client_gets_its_rank():
    """Global ranks 2 and 1: ``s B A = [Σₖ pₖ sₖ Bₖ Aₖ]_r`` (dense SVD reference, 1e-5) and client k's download has
    rank r_k with ``s_k B_k A_k`` the leading r_k directions of it. A plain (zero-padded) mean fails."""
    sim = sim_of("sdflora-svd", "lora.ranks=[2,1]")
    out = play_round(sim, [0, 1, 2, 3], 1)
    p = weights_of(out)
    info, r = sim.method.info, sim.method.info.rank
    s = lora_scale(info.alpha, r, info.scaling)
    for name in dual_modules(sim.model):
        dense = sum(pk * lora_scale(info.alpha, info.client_ranks[rep.client], info.scaling)
                    * rep.message[f"{name}.lora_B"].double() @ rep.message[f"{name}.lora_A"].double()
                    for pk, (_, rep, _) in zip(p.tolist(), out))
        U, S, Vh = torch.linalg.svd(dense)
        best = U[:, :r] @ torch.diag(S[:r]) @ Vh[:r]
        got = s * sim.server[f"{name}.lora_B"].double() @ sim.server[f"{name}.lora_A"].double()
        torch.testing.assert_close(got, best, rtol=0, atol=1e-5)
        for k in (0, 1):
            msg = sim.method.broadcast(sim.server, k, 2)
            rk = info.client_ranks[k]
            assert msg[f"{name}.lora_A"].shape[0] == rk and msg[f"{name}.lora_B"].shape[1] == rk
            sk = lora_scale(info.alpha, rk, info.scaling)
            leading = U[:, :rk] @ torch.diag(S[:rk]) @ Vh[:rk]
            torch.testing.assert_close(sk * msg[f"{name}.lora_B"].double() @ msg[f"{name}.lora_A"].double(), leading,
                                       rtol=0, atol=1e-5)
    assert "truncation_err" in sim.method.pop_metrics()


def test_the_personal_model_is_the_global_module_with_the_clients_own_parts():
    sim = run_tiny("sdflora")
    k = sorted(sim.store)[0]
    sim.method.load_personal(sim.model, sim.server, sim.store[k])
    for name, mod in dual_modules(sim.model).items():
        assert torch.equal(mod.lora_A.detach(), sim.server[f"{name}.lora_A"])
        assert torch.equal(mod.local_A.detach(), sim.store[k][local_keys(name)[0]])
        assert torch.equal(mod.gate_g.detach(), sim.store[k][gate_keys(name)[0]])
    for n, p in sim.model.head_parameters().items():
        assert torch.equal(p.detach(), sim.store[k][f"head/{n}"])
    assert sim.history[-1]["per_client"] and "accuracy" in sim.history[-1]


def test_dpsgd_clips_and_noises_every_trained_tensor(monkeypatch):
    """Per-example clipping and noise see the global and local modules, the gates and the head (the local module
    shapes every later global gradient, so noising the global one alone would not be sample-level DP)."""
    sim, seen = run_with_dpsgd(monkeypatch, "sdflora")
    names = {k.rsplit(".", 1)[-1] for keys in seen for k in keys if "/" not in k}
    assert names == {"lora_A", "lora_B", "local_A", "local_B", "gate_g", "gate_l"}
    assert all(any(k.startswith("head/") for k in keys) for keys in seen)
    assert [r["dpsgd_epsilon"] for r in sim.history] == [r["dpsgd_epsilon"] for r in run_tiny("fedit", *DPSGD).history]


def test_client_level_dp_modes_and_refusals():
    assert_client_level_dp("sdflora", "central")
    assert_client_level_dp("sdflora-svd", "local")
    with pytest.raises(ConfigError, match="'central' is not supported by method 'sdflora-svd'"):
        tiny_config("method.name=sdflora-svd", "privacy.mode=central", "privacy.clip=0.5",
                    "privacy.noise_multiplier=1.0", "server.weighting=uniform")
    with pytest.raises(ConfigError, match="lora.ranks: method 'sdflora' does not support heterogeneous ranks: the "
                                          "factor-wise mean needs one global rank"):
        sim_of("sdflora", "lora.ranks=[1,2]")
    with pytest.raises(ValueError, match="method.correction"):
        get_method("sdflora", correction="fedprox")
    with pytest.raises(ValueError, match="method.local_rank"):
        get_method("sdflora", local_rank=-1)
    assert SDFLoRA.personalized and SDFLoRASVD.supports_heterogeneous_ranks and not SDFLoRA.needs_individual_replies


def test_methods_name_lists_both(capsys):
    for name in ("sdflora", "sdflora-svd"):
        assert main(["methods", name]) == 0
        out = capsys.readouterr().out
        assert "arXiv:2601.11219" in out and "method.local_rank" in out
    assert "method.fixed_weight" not in out

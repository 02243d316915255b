"""FedALT (arXiv:2503.11880): the routed two-expert adapter against a dense reference, each client's Rest-of-World
is the leave-one-out mean of the others' latest uploads (full and partial participation), the own LoRA, router and
head persist in the client state and never travel (messages, server state, ledger), DP-SGD on what is trained,
central DP and mixed ranks refused with the reason, tampered replies rejected."""

from __future__ import annotations

import pytest
import torch
from test_lora_baselines import play_round, sim_of
from test_new_methods import TAMPER, test_a_tampered_reply_is_rejected_and_the_round_aggregates_without_it

from fedlowrank.adapters.routed import RoutedLoRALinear, routed_modules
from fedlowrank.cli import main
from fedlowrank.config import ConfigError
from fedlowrank.message import Message
from fedlowrank.methods.fedalt import upload_key
from fedlowrank.runtime.simulator import Simulation

from helpers import run_tiny, run_with_dpsgd, tiny_config, tiny_task


def _routed(slots, top_k, bias, experts, seed=0, rank=2, out=6, inp=5):
    g = torch.Generator().manual_seed(seed)
    mod = RoutedLoRALinear(torch.nn.Linear(inp, out), rank, 4.0, "standard", 0.0, slots, top_k, bias)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    mod.set_experts(rnd(rank, inp), rnd(out, rank), rnd(experts - 1, rank, inp), rnd(experts - 1, out, rank),
                    rnd(len(slots), inp), rnd(len(slots)) if bias else None)
    return mod, g


@pytest.mark.parametrize("slots, top_k, bias", [([0, 1], 2, False), ([0, 0, 0, 1, 2], 3, True), ([0, 1, 2], 1, True)])
def test_routed_mixture_equals_the_per_token_dense_reference(slots, top_k, bias):
    experts = max(slots) + 1
    mod, g = _routed(slots, top_k, bias, experts)
    x = torch.randn(3, 4, 5, generator=g)
    A = torch.cat([mod.lora_A[None], mod.others_A]).detach()
    B = torch.cat([mod.lora_B[None], mod.others_B]).detach()
    with torch.no_grad():
        y = mod(x)
        ys = []
        for t in x.reshape(-1, 5):
            p = torch.softmax(mod.router @ t + (mod.router_bias if bias else 0), -1)
            gate = torch.zeros(experts)
            for j in p.argsort(descending=True)[:top_k].tolist():
                gate[slots[j]] += p[j]
            ys.append(mod.base(t) + mod.scale * sum(gate[e] * B[e] @ A[e] @ t for e in range(experts)))
    torch.testing.assert_close(y.reshape(-1, 6), torch.stack(ys), rtol=1e-5, atol=1e-5)
    assert mod.gates(x).sum(-1).le(1 + 1e-6).all()
    with pytest.raises(ValueError, match="linear layers only"):
        RoutedLoRALinear(torch.nn.Conv2d(2, 3, 3), 1, 1.0, "standard", 0.0, [0, 1], 2)
    with pytest.raises(ValueError, match="router"):
        mod.set_experts(mod.lora_A, mod.lora_B, mod.others_A, mod.others_B, torch.zeros(9, 5), None)


def test_router_row_0_gates_the_own_lora_and_row_1_the_rest_of_world():
    """The documented convention (docs/methods/fedalt.md, "The router's rows"): with router row 0 far above row 1
    for every token, each adapted layer of a client's model adds its own LoRA's update alone; the other way round,
    the Rest-of-World's. The official layout (row 0 for the Rest-of-World) fails both assertions."""
    sim = sim_of("fedalt")
    state = sim.method.init_client(0)
    g = torch.Generator().manual_seed(3)
    for key in state.tensors():
        if ".lora_" in key:
            state[key] = torch.randn(state[key].shape, generator=g)
    row = Message({k: torch.randn(state[k].shape, generator=g) for k in state.tensors() if ".lora_" in k})
    for own_row, expected in ((0, "own"), (1, "rest-of-world")):
        for name in routed_modules(sim.model):
            router = torch.zeros_like(state[f"{name}.router"])
            router[own_row, 0] = 1e4          # every token below has x₀ = 1: softmax puts all weight on that row
            state[f"{name}.router"] = router
        sim.method.load(sim.model, row, state)
        for name, mod in routed_modules(sim.model).items():
            x = torch.randn(4, mod.in_features, generator=g)
            x[:, 0] = 1.0
            A, B = (state, row)[expected != "own"][f"{name}.lora_A"], (state, row)[expected != "own"][f"{name}.lora_B"]
            with torch.no_grad():
                torch.testing.assert_close(mod(x), mod.base(x) + mod.scale * x @ A.T @ B.T, rtol=1e-4, atol=1e-4)


def _mean(tensors):
    return torch.stack([t.double() for t in tensors]).mean(0).float()


def _assert_rest_of_world(sim, clients_known):
    for k in range(sim.info.num_clients):
        msg = sim.method.broadcast(sim.server, k, sim.round + 1)
        others = [i for i in clients_known if i != k]
        assert sorted(msg.tensors()) == sorted(key for key in sim.store[others[0]] if ".lora_" in key)
        for key, row in msg.tensors().items():
            torch.testing.assert_close(row, _mean(sim.store[i][key] for i in others), rtol=0, atol=1e-7)


def test_rest_of_world_is_the_leave_one_out_mean_with_every_client():
    sim = run_tiny("fedalt", "run.clients_per_round=4", rounds=2)
    assert sorted(sim.store) == [0, 1, 2, 3] and float(sim.server["uploaded"].sum()) == 4
    _assert_rest_of_world(sim, range(4))


def test_with_partial_participation_it_is_the_mean_of_every_other_clients_latest_upload():
    sim = run_tiny("fedalt", "run.clients_per_round=2", rounds=3)
    known = sorted(sim.store)
    assert 2 < len(known) and [i for i in range(4) if float(sim.server["uploaded"][i])] == known
    for k in known:   # the server's copy of a client's latest upload is what the client holds
        for key, value in sim.store[k].tensors().items():
            if ".lora_" in key:
                assert torch.equal(sim.server[upload_key(k, key)], value)
    _assert_rest_of_world(sim, known)


def test_own_lora_router_and_head_persist_on_the_client_and_never_travel():
    sim = sim_of("fedalt")
    first = play_round(sim, [0, 1, 2], 1)
    second = play_round(sim, [1, 3], 2)
    (_, _, t1), (msg3, _, t3) = second
    init3 = sim.method.init_client(3)
    for key, p in t1.params.items():               # client 1 resumes from its own state, client 3 from its init
        assert torch.equal(p, _trained(first[1][2], key)), key
        assert torch.equal(t3.params[key], init3[key]), key
    assert any(".router" in k for k in t1.params) and any(k.startswith("head/") for k in t1.params)
    for msg, reply, trainer in first + second:
        assert all(k.endswith((".lora_A", ".lora_B")) for k in msg.tensors())
        assert sorted(reply.message.tensors()) == sorted(k for k in trainer.params if ".lora_" in k)
        assert all(v.dtype == torch.float32 for v in reply.message.tensors().values())
    for key, row in msg3.tensors().items():       # client 3's RoW in round 2: the round-1 uploads of 0, 1, 2
        torch.testing.assert_close(row, _mean(r.message[key] for _, r, _ in first), rtol=0, atol=1e-7)
    assert not any(".router" in k or k.startswith("head/") for k in sim.server)


def _trained(trainer, key):
    """What the fake trainer left in ``key`` (its start plus its seeded noise)."""
    g = torch.Generator().manual_seed(1000 * trainer.rnd + trainer.client)
    out = None
    for k, p in trainer.params.items():
        noise = 0.05 * torch.randn(p.shape, generator=g)
        if k == key:
            out = p + noise
    return out


def test_the_ledger_counts_the_rest_of_world_down_and_the_lora_up_only():
    sent, replied = {}, {}
    sim = Simulation(tiny_config("method.name=fedalt", "run.rounds=2"), task=tiny_task(),
                     tamper=lambda rnd, k, reply: replied.setdefault((rnd, k), reply) or reply)
    real = sim.method.broadcast
    sim.method.broadcast = lambda server, k, rnd: sent.setdefault((rnd, k), real(server, k, rnd))
    sim.run()
    assert len(sim.ledger.rows) == 4
    for row in sim.ledger.rows:
        down, up = sent[row["round"], row["client"]], replied[row["round"], row["client"]]
        assert set(down.tensors()) == set(up.tensors())
        assert all(k.endswith((".lora_A", ".lora_B")) for k in up.tensors())
        assert (row["down"], row["up"]) == (down.nbytes(), Message(up).nbytes())


def test_personal_model_is_the_clients_own_lora_router_and_head_with_its_rest_of_world():
    sim = run_tiny("fedalt", rounds=2)
    k = sorted(sim.store)[0]
    sim.method.load_personal(sim.model, sim.server, sim.store[k])
    row = sim.method.broadcast(sim.server, k, 3)
    for name, mod in routed_modules(sim.model).items():
        assert torch.equal(mod.lora_A.detach(), sim.store[k][f"{name}.lora_A"])
        assert torch.equal(mod.router.detach(), sim.store[k][f"{name}.router"])
        assert torch.equal(mod.others_B[0], row[f"{name}.lora_B"])
    for n, p in sim.model.head_parameters().items():
        assert torch.equal(p.detach(), sim.store[k][f"head/{n}"])
    assert len(sim.history[-1]["per_client"]) and "accuracy" in sim.history[-1]


def test_dpsgd_clips_and_noises_the_own_lora_router_and_head(monkeypatch):
    sim, seen = run_with_dpsgd(monkeypatch, "fedalt")
    assert seen and all({k.rsplit(".", 1)[-1] for k in keys if "/" not in k} == {"lora_A", "lora_B", "router"}
                        for keys in seen)
    assert 0 < sim.history[-1]["dpsgd_epsilon"] < float("inf")


def test_local_dp_noises_the_upload_not_the_clients_own_lora():
    sim = run_tiny("fedalt", "privacy.mode=local", "privacy.clip=0.5", "privacy.noise_multiplier=1.0", rounds=1)
    k = sorted(sim.store)[0]
    key = next(x for x in sim.store[k].tensors() if x.endswith(".lora_A"))
    assert not torch.equal(sim.server[upload_key(k, key)], sim.store[k][key])
    assert 0 < sim.history[-1]["epsilon"] < float("inf")


def test_refusals_name_the_field_and_the_reason():
    with pytest.raises(ConfigError, match="lora.ranks: method 'fedalt' does not support heterogeneous ranks: the "
                                          "Rest-of-World is a mean of factors"):
        sim_of("fedalt", "lora.ranks=[1,2]")
    with pytest.raises(ConfigError, match="'central' is not supported by method 'fedalt': its server step needs individual "
                                          "replies"):
        tiny_config("method.name=fedalt", "privacy.mode=central", "privacy.clip=0.5",
                    "privacy.noise_multiplier=1.0")


def test_methods_name_lists_the_personalised_method(capsys):
    assert main(["methods", "fedalt"]) == 0
    out = capsys.readouterr().out
    assert "arXiv:2503.11880" in out and "privacy: local" in out and "Rest-of-World is a mean of factors" in out
    assert 'train.optimizer="adamw" train.weight_decay=0.05' in out


@pytest.mark.parametrize("tamper", sorted(TAMPER))
def test_a_tampered_reply_is_rejected(tamper):
    test_a_tampered_reply_is_rejected_and_the_round_aggregates_without_it("fedalt", tamper)


@pytest.mark.parametrize("fmt, rank", [("peft", None), ("peft", 2), ("merged", None)])
def test_export_refuses_a_routed_mixture_with_the_reason(tmp_path, fmt, rank):
    from fedlowrank.export import export_run

    run_dir = tmp_path / "run"
    Simulation(tiny_config("method.name=fedalt", "run.rounds=1", "run.checkpoint_every=1"), task=tiny_task(),
               run_dir=run_dir).run()
    with pytest.raises(ValueError, match="routed mixture of LoRA experts whose update depends on each token"):
        export_run(run_dir, tmp_path / "x", fmt, rank, task=tiny_task())
    assert not (tmp_path / "x").exists()

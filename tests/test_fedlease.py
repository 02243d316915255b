"""FedLEASE (arXiv:2509.15087): the warm-up waits for every client and clusters their trained B once, a planted
3-group problem gives three experts holding the groups' mean uploads, experts then equal per-cluster FedIT over the
sampled members only, the (2M−1)-slot top-M router always keeps the own expert, the other experts are frozen and
nothing else travels, DP-SGD on what is trained, refusals, tampered replies rejected."""

from __future__ import annotations

import pytest
import torch
from test_lora_baselines import play_round, sim_of
from test_new_methods import TAMPER, test_a_tampered_reply_is_rejected_and_the_round_aggregates_without_it

from fedlowrank.adapters.routed import RoutedLoRALinear
from fedlowrank.config import ConfigError
from fedlowrank.message import Message, Reply
from fedlowrank.methods import get_method
from fedlowrank.methods.fedlease import slots_of

from helpers import run_tiny, run_with_dpsgd


def _planted_replies(sim, groups, seed=0):
    """Warm-up replies whose B are a group's direction (scaled per client) plus small noise."""
    g = torch.Generator().manual_seed(seed)
    down = sim.method.broadcast(sim.server, 0, 1)
    centres = {key: [torch.randn(v.shape, generator=g) for _ in set(groups)] for key, v in down.tensors().items()}
    replies = []
    for k, c in enumerate(groups):
        msg = Message({key: (1 + k) * (centres[key][c] + 0.01 * torch.randn(v.shape, generator=g))
                       for key, v in down.tensors().items()})
        msg.update(num_examples=10 * (k + 1), train_loss=0.0)
        replies.append(Reply(k, 10 * (k + 1), msg))
    return replies


def test_a_planted_three_group_warm_up_gives_three_experts_of_the_groups_mean_uploads():
    groups = [0, 1, 0, 2, 1, 2, 0]
    sim = sim_of("fedlease", "partition.num_clients=7")
    replies = _planted_replies(sim, groups)
    sim.server = sim.method.aggregate(sim.server, replies[:4], 1)       # not every client yet: still warming up
    assert sim.method.experts(sim.server) == 0
    sim.server = sim.method.aggregate(sim.server, replies[4:], 2)
    labels = [int(c) for c in sim.server["cluster"]]
    assert sim.method.experts(sim.server) == 3
    assert all((labels[i] == labels[j]) == (groups[i] == groups[j]) for i in range(7) for j in range(7))
    for c in range(3):
        members = [r for r in replies if labels[r.client] == c]
        for key in replies[0].message.tensors():           # A, B and the head: the uniform mean of the members
            ref = torch.stack([r.message[key].double() for r in members]).mean(0).float()
            torch.testing.assert_close(sim.server[f"expert.{c}/{key}"], ref, rtol=0, atol=1e-6)
    assert not any(k.startswith("upload.") for k in sim.server)


def test_after_the_clustering_experts_are_per_cluster_fedit_over_the_sampled_members():
    sim = sim_of("fedlease", "run.clients_per_round=4")
    play_round(sim, [0, 1, 2, 3], 1)                                   # warm-up, then the clustering
    M = sim.method.experts(sim.server)
    labels = [int(c) for c in sim.server["cluster"]]
    assert M >= 1
    before = dict(sim.server)
    sampled = [0, 2, 3]
    out = play_round(sim, sampled, 2)
    for c in range(M):
        members = [(msg, r) for msg, r, _ in out if labels[r.client] == c]
        for key in [k for k in before if k.startswith(f"expert.{c}/")]:
            if not members:                                            # no sampled member: unchanged
                assert torch.equal(sim.server[key], before[key]), key
                continue
            n = torch.tensor([float(r.num_examples) for _, r in members], dtype=torch.float64)
            ref = sum(w * r.message[key.split("/", 1)[1]].double() for w, (_, r) in zip(n / n.sum(), members))
            torch.testing.assert_close(sim.server[key], ref.float(), rtol=0, atol=1e-6)
    for msg, reply, trainer in out:                                    # others frozen: never trained, never sent up
        assert not any(".others_" in k for k in trainer.params) and not any(".others_" in k for k in reply.message)
        assert all(v.dtype == torch.float32 for v in reply.message.tensors().values())
        if M > 1:
            name = next(k for k in msg.tensors() if k.endswith(".others_A")).rsplit(".", 1)[0]
            c = labels[reply.client]
            others = [e for e in range(M) if e != c]
            assert torch.equal(msg[f"{name}.others_A"], torch.stack([before[f"expert.{e}/{name}.lora_A"]
                                                                     for e in others]))
            assert msg[f"{name}.router"].shape[0] == 2 * M - 1


@pytest.mark.parametrize("M", [1, 2, 3, 5])
def test_top_m_of_2m_minus_1_slots_always_keeps_the_own_expert(M):
    g = torch.Generator().manual_seed(M)
    mod = RoutedLoRALinear(torch.nn.Linear(6, 4), 2, 2.0, "standard", 0.0, slots_of(M), M, bias=True)
    with torch.no_grad():
        mod.router.copy_(5 * torch.randn(mod.router.shape, generator=g))
        mod.router_bias.copy_(torch.randn(mod.router_bias.shape, generator=g))
    gates = mod.gates(torch.randn(200, 6, generator=g))                # [tokens, M]
    assert slots_of(M)[:M] == [0] * M and sorted(slots_of(M)[M:]) == list(range(1, M))
    assert bool((gates[:, 0] > 0).all())                               # the own expert is always selected
    used = (gates > 0).sum(-1)
    assert int(used.min()) >= 1 and int(used.max()) <= M


def test_dpsgd_clips_and_noises_what_is_trained(monkeypatch):
    sim, seen = run_with_dpsgd(monkeypatch, "fedlease", "run.clients_per_round=4")
    suffixes = [{k.rsplit(".", 1)[-1] for k in keys if "/" not in k} for keys in seen]
    assert suffixes[0] == {"lora_A", "lora_B"} and suffixes[-1] == {"lora_A", "lora_B", "router", "router_bias"}
    assert 0 < sim.history[-1]["dpsgd_epsilon"] < float("inf")


def test_refusals_name_the_field_and_the_reason():
    with pytest.raises(ConfigError, match="lora.ranks: method 'fedlease' does not support heterogeneous ranks: an "
                                          "expert is a mean"):
        sim_of("fedlease", "lora.ranks=[1,2]")
    with pytest.raises(ConfigError, match="'central' is not supported by method 'fedlease'"):
        sim_of("fedlease", "privacy.mode=central", "privacy.clip=0.5", "privacy.noise_multiplier=1.0")
    with pytest.raises(ValueError, match="method.warmup_rounds"):
        get_method("fedlease", warmup_rounds=0)


@pytest.mark.parametrize("tamper", sorted(TAMPER))
def test_a_tampered_reply_is_rejected(tamper):
    test_a_tampered_reply_is_rejected_and_the_round_aggregates_without_it("fedlease", tamper)


def test_export_refuses_the_routed_experts(tmp_path):
    from fedlowrank.export import export_run
    from fedlowrank.runtime.simulator import Simulation

    from helpers import tiny_config, tiny_task

    run_dir = tmp_path / "run"
    Simulation(tiny_config("method.name=fedlease", "run.rounds=2", "run.clients_per_round=4",
                           "run.checkpoint_every=1"), task=tiny_task(), run_dir=run_dir).run()
    with pytest.raises(ValueError, match="routed mixture of LoRA experts"):
        export_run(run_dir, tmp_path / "x", "peft", task=tiny_task())


def test_methods_name_lists_every_option_and_the_refusals(capsys):
    import json

    from fedlowrank.cli import main
    from fedlowrank.methods import available_methods
    from fedlowrank.schema import declared

    assert main(["methods", "fedlease"]) == 0
    out = capsys.readouterr().out
    assert "arXiv:2509.15087" in out and "privacy: local" in out and "an expert is a mean" in out
    for key, d in declared(available_methods()["fedlease"]).items():
        assert f"    method.{key} = {json.dumps(d.default)}\n        {d.meaning}\n" in out, key

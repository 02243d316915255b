"""Fed-SB (arXiv:2502.15436): averaging the r×r cores is exact (the global update is the weighted mean of the
clients' updates), the uplink is r² numbers per module whatever its shape (FedIT's × r/(in+out)), the gradient
initialisation is the rank-r SVD of −η·sign(ΣG) at W0 and the random one starts at W0, DP-SGD on what is trained,
malformed replies rejected, refusals."""

from __future__ import annotations

import pytest
import torch
from test_lora_baselines import play_round, sim_of, weights_of

from fedlowrank.adapters.ravan import CoreLinear, ravan_modules
from fedlowrank.cli import main
from fedlowrank.config import ConfigError
from fedlowrank.message import State
from fedlowrank.methods import get_method
from fedlowrank.methods.fed_sb import FedSB, GradientSum, bases_keys, core_key, gradient_key, initial_core
from fedlowrank.runtime.engine import check_reply, sample_clients
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.seeding import derive_seed
from fedlowrank.training.local import LocalTrainer

from helpers import DPSGD, assert_client_level_dp, run_tiny, run_with_dpsgd, tiny_config, tiny_task

RANDOM = 'method.init="random"'


def _delta(sim) -> dict[str, torch.Tensor]:
    """The global model's update ``B R A`` per target (float64)."""
    sim.method.load_global(sim.model, sim.server)
    return {n: m.adapter_delta().detach().double() for n, m in sim.model.adapters().items()}


def test_core_linear_is_b_r_a_and_its_probe_adds_a_dense_term_with_the_weight_gradient():
    g = torch.Generator().manual_seed(0)
    mod = CoreLinear(torch.nn.Linear(5, 6), 2)
    B, A, R = torch.randn(6, 2, generator=g), torch.randn(2, 5, generator=g), torch.randn(2, 2, generator=g)
    mod.set_bases(B, A)
    mod.set_heads([R])
    x = torch.randn(3, 5, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(mod(x), mod.base(x) + x @ (B @ R @ A).T, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mod.adapter_delta(), B @ R @ A, rtol=1e-5, atol=1e-6)
    probe = mod.start_probe()
    assert CoreLinear.joint_adapter_output([mod], x) is None          # probing members run on their own rows
    mod.base.weight.requires_grad_(True)
    mod(x).pow(2).sum().backward()
    torch.testing.assert_close(probe.grad, mod.base.weight.grad)       # ∇ probe = ∇_W at the current model
    mod.stop_probe()
    assert mod.probe is None and "probe" not in dict(mod.named_parameters())
    with pytest.raises(ValueError, match="bases"):
        mod.set_bases(B.T, A)
    with pytest.raises(ValueError, match="lora.rank"):
        CoreLinear(torch.nn.Linear(5, 3), 4)


@pytest.mark.parametrize("init", ["gradient", "random"])
def test_averaging_the_cores_is_exact_the_global_update_is_the_mean_of_the_clients(init):
    """``B (Σ pₖ Rₖ) A = Σ pₖ B Rₖ A`` to 1e-6 over three rounds of unequal clients (pₖ ∝ nₖ). A server that took a
    uniform mean (or averaged every earlier round's uploads, the official multi-round script's bug) fails: the
    clients' sizes differ and the third round's mean is not the second's."""
    sim = sim_of("fed-sb", f'method.init="{init}"')
    schedule = [[0, 1, 2], [1, 3], [0, 2, 3]]
    if init == "gradient":
        sim.run_round()                              # the initialisation exchange (real gradients): no training
        schedule = schedule[1:]
    for rnd, clients in enumerate(schedule, start=2 if init == "gradient" else 1):
        before = _delta(sim)
        out = play_round(sim, clients, rnd)
        after, p = _delta(sim), weights_of(out)
        base = {n: m.frozen_weight().detach().double() for n, m in sim.model.adapters().items()}
        for name in after:
            mean = sum(pk * (t.end[name] - base[name]) for pk, (_, _, t) in zip(p.tolist(), out))
            torch.testing.assert_close(after[name], mean, rtol=0, atol=1e-6)
            assert not torch.allclose(after[name], before[name])
        for name in sim.model.adapters():             # the server's core is the weighted mean of the uploads
            expected = sum(pk * r.message[core_key(name)].double() for pk, (_, r, _) in zip(p.tolist(), out))
            torch.testing.assert_close(sim.server[core_key(name)].double(), expected, rtol=0, atol=1e-7)


def test_the_uplink_is_r_squared_per_module_whatever_its_shape():
    """With targets of two shapes (32×32 and 64×32), every reply holds exactly one r×r float32 core per module and
    the head, so its size is FedIT's factors × r/(in+out) per module; the bases never go up."""
    targets = 'lora.targets=["query", "intermediate.dense"]'
    sim = Simulation(tiny_config("method.name=fed-sb", RANDOM, targets, "lora.rank=4"))
    fedit = Simulation(tiny_config("method.name=fedit", targets, "lora.rank=4"))
    assert len({tuple(m.base.weight.shape) for m in sim.model.adapters().values()}) == 2
    (msg, reply, _), = play_round(sim, [0], 1)
    (fmsg, freply, _), = play_round(fedit, [0], 1)
    r = 4
    head = {k: t for k, t in reply.message.tensors().items() if k.startswith("head/")}
    cores = {k: t for k, t in reply.message.tensors().items() if not k.startswith("head/")}
    assert set(cores) == {core_key(n) for n in sim.model.adapters()}
    assert all(t.shape == (r, r) and t.dtype == torch.float32 for t in cores.values())
    for name, mod in sim.model.adapters().items():
        out_f, in_f = mod.base.weight.shape
        factors = freply.message[f"{name}.lora_A"].numel() + freply.message[f"{name}.lora_B"].numel()
        assert cores[core_key(name)].numel() == factors * r / (in_f + out_f)
    assert sum(t.numel() for t in cores.values()) * 4 == 4 * r * r * len(sim.model.adapters())
    assert head.keys() == {k for k in freply.message.tensors() if k.startswith("head/")}
    assert not any("fedsb_B" in k or "fedsb_A" in k for k in msg.tensors())          # random bases: from the seed


def test_the_ledger_counts_the_cores_and_the_head_up_and_the_bases_down_with_gradient_init():
    sim = run_tiny("fed-sb", rounds=2)
    r = sim.cfg.lora.rank
    modules = sim.model.adapters()
    head = sum(p.numel() * 4 for p in sim.model.head_parameters().values())
    dense = sum(m.base.weight.numel() * 4 for m in modules.values())
    bases = sum((m.out_features + m.in_features) * r * 4 for m in modules.values())
    first, second = ([row for row in sim.ledger.rows if row["round"] == rnd] for rnd in (1, 2))
    for row in first:                                # initialisation: the head down, the dense gradients up
        assert head <= row["down"] < head + 4096 and dense <= row["up"] < dense + 4096
    for row in second:                               # cores and head up, plus the bases down
        assert len(modules) * r * r * 4 + head <= row["up"] < len(modules) * r * r * 4 + head + 4096
        assert bases + len(modules) * r * r * 4 + head <= row["down"] < bases + len(modules) * r * r * 4 + head + 4096


def _reference_gradient(sim, clients) -> dict[str, torch.Tensor]:
    """Σ over ``clients`` and their round-1 steps of ``∇_W L`` at W0 (the model before the first round), by plain
    autograd on the frozen weights, with the batches and dropout stream LocalTrainer gives those clients
    (float64)."""
    cfg, task, model = sim.cfg, sim.task, sim.model
    sim.method.load_global(model, sim.server)
    weights = {n: m.base.weight for n, m in model.adapters().items()}
    total = {n: torch.zeros_like(w, dtype=torch.float64) for n, w in weights.items()}
    for k in clients:
        trainer = LocalTrainer(task, sim.parts[k], cfg.train, k, 1, cfg.run.rounds, cfg.run.seed)
        torch.manual_seed(derive_seed(cfg.run.seed, "dropout", k, 1))
        batches = trainer.batches()
        model.net.train()
        for _ in range(trainer.num_steps):
            batch = task.device_batch(next(batches), torch.device("cpu"))
            for w in weights.values():
                w.requires_grad_(True)
            grads = torch.autograd.grad(task.loss(model.net, batch), list(weights.values()))
            for (n, _), g in zip(weights.items(), grads):
                total[n] += g.double()
        for w in weights.values():
            w.requires_grad_(False)
    model.net.eval()
    return total


def test_gradient_init_is_the_rank_r_svd_of_the_negated_sign_step_of_the_summed_gradient():
    """After the first round, ``B R⁰ A = [−η·sign(Σₖ Gₖ)]_r`` to 1e-4 relative, with ``Gₖ`` recomputed by plain
    autograd over the same batches, B with orthonormal columns and A with orthonormal rows. Without the minus
    (a step up the loss), with ``sign`` dropped, or with the gradient taken anywhere but W0, this fails."""
    sim = Simulation(tiny_config("method.name=fed-sb", "method.init_step=0.01"), task=tiny_task())
    cfg = sim.cfg
    reference = _reference_gradient(sim, sample_clients(cfg.run.seed, 1, cfg.partition.num_clients,
                                                        cfg.run.clients_per_round))
    sim.run_round()
    r = sim.cfg.lora.rank
    for name, mod in ravan_modules(sim.model).items():
        kb, ka = bases_keys(name)
        B, R0, A = (sim.server[k].double() for k in (kb, core_key(name), ka))
        U, S, Vh = torch.linalg.svd(-0.01 * torch.sign(reference[name]), full_matrices=False)
        expected = U[:, :r] @ torch.diag(S[:r]) @ Vh[:r]
        torch.testing.assert_close(B @ R0 @ A, expected, rtol=0, atol=1e-4 * float(expected.norm()))
        torch.testing.assert_close(B.T @ B, torch.eye(r, dtype=torch.float64), rtol=0, atol=1e-6)
        torch.testing.assert_close(A @ A.T, torch.eye(r, dtype=torch.float64), rtol=0, atol=1e-6)
        assert torch.equal(R0, torch.diag(R0.diagonal()))
    assert "init_core_norm" in sim.history[-1]["diagnostics"]
    assert all(m.probe is None for m in ravan_modules(sim.model).values())      # the probes are gone


def test_initial_core_is_the_truncated_svd_and_the_gradient_round_moves_nothing():
    g = torch.Generator().manual_seed(1)
    G = torch.randn(7, 5, generator=g, dtype=torch.float64)
    B, R0, A = initial_core(G, 3, 0.5)
    U, S, Vh = torch.linalg.svd(-0.5 * torch.sign(G))
    torch.testing.assert_close(B @ R0 @ A, U[:, :3] @ torch.diag(S[:3]) @ Vh[:3], rtol=0, atol=1e-12)
    p = torch.nn.Parameter(torch.ones(3))
    opt = GradientSum([p])
    for step in range(3):
        p.grad = torch.full((3,), float(step + 1))
        opt.step()
    assert torch.equal(p.detach(), torch.ones(3)) and torch.equal(opt.total(p), torch.full((3,), 6.0))


def test_random_init_starts_at_w0_with_orthonormal_seeded_bases_that_never_travel():
    sim = Simulation(tiny_config("method.name=fed-sb", RANDOM), task=tiny_task())
    other = Simulation(tiny_config("method.name=fed-sb", RANDOM), task=tiny_task())
    for name, delta in _delta(sim).items():
        assert torch.equal(delta, torch.zeros_like(delta))                    # the round-1 model is W0
        B, A = (sim.server[k].double() for k in bases_keys(name))
        torch.testing.assert_close(B.T @ B, torch.eye(B.shape[1], dtype=torch.float64), rtol=0, atol=1e-6)
        torch.testing.assert_close(A @ A.T, torch.eye(A.shape[0], dtype=torch.float64), rtol=0, atol=1e-6)
        assert all(torch.equal(sim.server[k], other.server[k]) for k in bases_keys(name))
    assert not any(k.endswith((".fedsb_B", ".fedsb_A")) for k in sim.method.broadcast(sim.server, 0, 1).tensors())


def test_dpsgd_clips_and_noises_the_probes_then_the_cores_and_head(monkeypatch):
    """The initialisation round's per-example gradients are the probes' (its release is DP-SGD's like any round's,
    and the accountant counts it), then only the cores and the head; never the bases."""
    sim, seen = run_with_dpsgd(monkeypatch, "fed-sb")
    steps = sim.cfg.train.local_steps * sim.cfg.run.clients_per_round
    assert all(keys == {gradient_key(n) for n in sim.model.adapters()} for keys in seen[:steps])
    assert seen[steps:] and all(all(k.endswith(".fedsb_R") or k.startswith("head/") for k in keys)
                                for keys in seen[steps:])
    fedit = run_tiny("fedit", *DPSGD)
    assert [r["dpsgd_epsilon"] for r in sim.history] == [r["dpsgd_epsilon"] for r in fedit.history]


def test_client_level_dp_clips_and_noises_the_gradients_and_the_cores():
    assert_client_level_dp("fed-sb", "central")
    assert_client_level_dp("fed-sb", "local")


def test_a_reply_of_the_wrong_round_kind_is_rejected():
    sent, replied = {}, {}
    sim = Simulation(tiny_config("method.name=fed-sb"), task=tiny_task(),
                     tamper=lambda rnd, k, reply: replied.setdefault(rnd, reply) or reply)
    real = sim.method.broadcast
    sim.method.broadcast = lambda server, k, rnd: sent.setdefault(rnd, real(server, k, rnd))
    sim.run()
    (msg0, reply0), (msg1, reply1) = ((sent[rnd], replied[rnd]) for rnd in (1, 2))
    assert check_reply(sim.method, msg0, reply0, 1) is None and check_reply(sim.method, msg1, reply1, 2) is None
    assert check_reply(sim.method, msg0, reply1, 1) and check_reply(sim.method, msg1, reply0, 2)
    wrong = State(reply1)
    name = next(iter(sim.model.adapters()))
    wrong[bases_keys(name)[0]] = msg1[bases_keys(name)[0]]             # sending a basis back
    assert "unexpected" in check_reply(sim.method, msg1, wrong, 2)
    wrong = State(reply1)
    wrong[core_key(name)] = wrong[core_key(name)].double()
    assert "expected torch.float32" in check_reply(sim.method, msg1, wrong, 2)


def test_refusals_and_declarations():
    with pytest.raises(ConfigError, match=r"lora.ranks: method 'fed-sb' does not support heterogeneous ranks: every "
                                          r"client trains an r×r core"):
        sim_of("fed-sb", "lora.ranks=[1,2]")
    with pytest.raises(ValueError, match="method.init"):
        get_method("fed-sb", init="pretrained")
    with pytest.raises(ValueError, match="method.init_step"):
        get_method("fed-sb", init_step=0.0)
    assert FedSB.supported_privacy_modes() == ("central", "local") and FedSB.supports_cohorts


def test_methods_name_lists_fed_sb(capsys):
    assert main(["methods", "fed-sb"]) == 0
    out = capsys.readouterr().out
    assert "arXiv:2502.15436" in out and "method.init_step" in out and "privacy: central, local" in out

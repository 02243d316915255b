"""Privacy (``fedlowrank.privacy``): clipping bounds, noise scale, exact no-op at σ = 0 and C = ∞, the accountant
against Opacus's values, target ε → σ, refusals of unsupported combinations, DP-SGD's per-example bound."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import run_tiny, tiny_simulation, tiny_task
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlowrank.config import ConfigError, from_dict, load_config
from fedlowrank.message import Message, Reply
from fedlowrank.privacy.accountant import ORDERS, epsilon, noise_for_epsilon
from fedlowrank.privacy.dpsgd import clip_factors, per_example_gradients, private_step_gradients, DPSGD
from fedlowrank.privacy.mechanisms import clip_update, gaussian_noise, update_norm
from fedlowrank.privacy.runtime import central_replies, local_reply
from fedlowrank.runtime.simulator import Simulation

UNIFORM = "server.weighting=uniform"

# ε of the Poisson-subsampled Gaussian at integer orders 2..256, computed with Opacus 1.6.0:
#   opacus.accountants.analysis.rdp.get_privacy_spent(orders=o, rdp=compute_rdp(q=q, noise_multiplier=σ,
#   steps=T, orders=o), delta=δ) with o = [2.0, 3.0, ..., 256.0]. (q, σ, T, δ) -> ε
OPACUS_REFERENCE = [
    ((0.01, 1.1, 10000, 1e-5), 5.654308000149469),   # the Abadi et al. 2016 / Opacus MNIST-style setting
    ((0.1, 1.0, 100, 1e-5), 7.972921510380547),
    ((1.0, 5.0, 10, 1e-3), 2.040877605156862),        # no subsampling: closed form α·T/(2σ²)
    ((0.5, 0.8, 30, 0.01), 23.140980607515417),
]


def _message(draw_tensors: dict[str, torch.Tensor]) -> Message:
    return Message({**draw_tensors, "num_examples": 3, "train_loss": 0.5})


tensors = st.lists(st.floats(-100, 100, allow_nan=False, width=32), min_size=6, max_size=6)


@settings(max_examples=60, deadline=None)
@given(down=tensors, reply=tensors, extra=st.lists(st.floats(-100, 100, width=32), min_size=3, max_size=3),
       clip=st.floats(1e-3, 1e3))
def test_clipping_bounds_every_update_and_keeps_small_ones(down, reply, extra, clip):
    d = _message({"w": torch.tensor(down).view(2, 3)})
    r = _message({"w": torch.tensor(reply).view(2, 3), "dc/w": torch.tensor(extra)})  # "dc/w": not broadcast
    out, norm = clip_update(r, d, clip)
    assert norm == pytest.approx(math.sqrt(sum((a - b) ** 2 for a, b in zip(reply, down)) + sum(x * x for x in extra)))
    assert update_norm(out, d) <= clip * (1 + 1e-5) + 1e-5
    if norm <= clip:
        assert out is r
    assert out["num_examples"] == 3 and out["train_loss"] == 0.5


def test_noise_has_the_configured_scale():
    like = _message({"a": torch.zeros(300, 400), "b": torch.zeros(50, dtype=torch.float64)})
    noise = gaussian_noise(like, 0.7, torch.Generator().manual_seed(0))
    z = noise["a"].to(torch.float64).flatten()
    assert abs(float(z.std()) / 0.7 - 1) < 0.01 and abs(float(z.mean())) < 0.01
    assert noise["b"].dtype == torch.float64


def test_local_and_central_noise_scales():
    cfg = load_config("tiny", ["privacy.mode=local", "privacy.clip=2.0", "privacy.noise_multiplier=1.5"])
    down = _message({"w": torch.zeros(200, 200)})
    reply = _message({"w": torch.full((200, 200), 1e-4)})  # norm 0.02 < C: not clipped
    noised = local_reply(cfg, reply, down, client=1, rnd=1)
    assert abs(float((noised["w"] - reply["w"]).std()) / 3.0 - 1) < 0.02              # σ·C = 3
    cfg = load_config("tiny", ["privacy.mode=central", UNIFORM, "privacy.clip=2.0", "privacy.noise_multiplier=1.5"])
    replies = [Reply(k, 3, _message({"w": torch.full((200, 200), 1e-4 * k)})) for k in (0, 1)]
    out, row = central_replies(cfg, replies, {0: down, 1: down}, rnd=1, history=[])
    assert row["noise_std"] == pytest.approx(1.5)                                       # σ·C/n, n = 2
    z0, z1 = out[0].message["w"] - replies[0].message["w"], out[1].message["w"] - replies[1].message["w"]
    torch.testing.assert_close(z0, z1, rtol=0, atol=1e-6)  # one draw on the sum: every reply gets the same z
    assert abs(float(z0.std()) / 1.5 - 1) < 0.02


def _assert_same_state(a, b):
    assert sorted(a.tensors()) == sorted(b.tensors())
    for k in a.tensors():
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("mode", ["central", "local"])
def test_sigma_zero_and_infinite_clip_reproduce_the_plain_run_bit_for_bit(mode):
    plain = run_tiny("fedit", UNIFORM, "method.correction=scaffold")
    private = run_tiny("fedit", UNIFORM, "method.correction=scaffold", f"privacy.mode={mode}", "privacy.clip=inf",
                       "privacy.noise_multiplier=0.0")
    _assert_same_state(plain.server, private.server)
    assert all(row["epsilon"] == math.inf for row in private.history)


@pytest.mark.parametrize(("setting", "reference"), OPACUS_REFERENCE)
def test_accountant_matches_opacus(setting, reference):
    assert epsilon(*setting) == pytest.approx(reference, rel=1e-9)


def test_accountant_matches_live_opacus():
    rdp = pytest.importorskip("opacus.accountants.analysis.rdp")
    orders = [float(a) for a in ORDERS]
    for q, sigma, steps, delta in [(0.02, 0.9, 500, 1e-5)]:  # (Opacus's integer-order RDP takes seconds)
        ref, _ = rdp.get_privacy_spent(orders=orders, delta=delta,
                                       rdp=rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=orders))
        assert epsilon(q, sigma, steps, delta) == pytest.approx(ref, rel=1e-9)


@pytest.mark.parametrize(("target", "q", "steps", "delta"), [(1.0, 0.1, 100, 1e-2), (8.0, 0.5, 20, 0.25),
                                                             (3.0, 1.0, 10, 1e-3)])
def test_target_epsilon_round_trip(target, q, steps, delta):
    sigma = noise_for_epsilon(target, q, steps, delta)
    assert epsilon(q, sigma, steps, delta) <= target < epsilon(q, sigma * (1 - 1e-3), steps, delta)


def test_run_reaches_its_target_epsilon_and_writes_it(tmp_path):
    cfg = load_config("tiny", ["privacy.mode=central", UNIFORM, "privacy.clip=1.0", "privacy.target_epsilon=8",
                               "run.rounds=2"])
    sim = Simulation(cfg, task=tiny_task(), run_dir=tmp_path)
    summary = sim.run()
    eps = [row["epsilon"] for row in sim.history]
    assert eps[0] < eps[1] <= 8.0 and eps[1] == pytest.approx(8.0, rel=1e-3)
    assert summary["epsilon"] == eps[1] and '"epsilon"' in (tmp_path / "metrics.jsonl").read_text()


def test_adaptive_clip_moves_to_the_target_quantile():
    sim = run_tiny("fedit", UNIFORM, "privacy.mode=central", "privacy.clip=10.0", "privacy.clipping=adaptive",
                   "privacy.noise_multiplier=0.0", "privacy.clip_lr=0.2")
    first, second = (row["privacy"] for row in sim.history)
    assert first["clipped"] == 0                          # every update below C = 10: b̄ = 1 > γ = 0.5, C shrinks
    assert first["next_clip"] == pytest.approx(10.0 * math.exp(-0.2 * 0.5)) == second["clip"]


@pytest.mark.parametrize(("sets", "words"), [
    (["method.name=flexlora", "privacy.mode=central", UNIFORM], ["'flexlora'", "individual replies", "local"]),
    (["method.name=hetlora", "privacy.mode=central", UNIFORM], ["'hetlora'", "rank", "local"]),
    (["privacy.mode=central"], ["server.weighting"]),
    (["privacy.mode=local", "privacy.clip=1.0", "privacy.clipping=adaptive"], ["privacy.clipping", "central"]),
    (["privacy.mode=secret"], ["privacy.mode"]),
])
def test_unsupported_combinations_are_refused_in_one_line(sets, words):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", sets)
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words)


def test_secagg_refuses_methods_that_need_individual_replies():
    settings_mod = pytest.importorskip("fedlowrank.runtime.flower.settings")
    with pytest.raises(ConfigError, match="'florg' cannot run under secure aggregation: its server step needs "
                                          "individual replies"):
        settings_mod.load_run_config({"config": "tiny", "flower.secagg": True, "method.name": "florg",
                                      "set": UNIFORM})
    cfg, settings = settings_mod.load_run_config({"config": "tiny", "flower.secagg": True, "method.name": "ffa-lora",
                                                  "set": UNIFORM})
    assert settings.secagg and cfg.method_name == "ffa-lora"


def _matrix_regression():
    cfg = from_dict({"task": {"kind": "matrix-regression", "options": {"num_clients": 2, "dim": 6, "outputs": 3,
                                                                        "samples": 8}},
                     "partition": {"kind": "natural", "num_clients": 2}, "run": {"clients_per_round": 2},
                     "lora": {"rank": 2, "alpha": 2.0}, "method": {"name": "fedit"}})
    return Simulation(cfg)


@pytest.mark.parametrize("task", ["matrix-regression (vmap)", "tiny BERT (one backward per example)"])
def test_dpsgd_per_example_gradients_are_exact_and_clipped(task):
    sim = _matrix_regression() if task.startswith("matrix") else tiny_simulation("fedit")
    sim.method.load_global(sim.model, sim.server)
    params = sim.method.trainable(sim.model, ("A", "B"))
    batch = sim.task.batch(sim.parts[0][:4])
    sim.model.net.eval()
    grads, losses = per_example_gradients(sim.model.net, sim.task, params, batch)
    for p in params.values():
        p.grad = None
    sim.task.loss(sim.model.net, batch).backward()              # the batch gradient = mean of per-example ones
    for k, p in params.items():
        ref = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(grads[k].mean(0), ref, rtol=1e-4, atol=1e-6)
    norms, _ = clip_factors(grads, 1.0)
    clip = 0.5 * float(norms.min())                              # every example is clipped
    _, factors = clip_factors(grads, clip)
    clipped = {k: g * factors.to(g.dtype).view(-1, *[1] * (g.dim() - 1)) for k, g in grads.items()}
    assert bool((clip_factors(clipped, clip)[0] <= clip * (1 + 1e-6)).all())  # per-example norms ≤ C before noise
    dp = DPSGD(clip=1e12, noise_multiplier=0.0, generator=torch.Generator().manual_seed(0))
    loss = private_step_gradients(sim.model.net, sim.task, params, batch, dp)  # C = ∞, σ = 0: the plain mean
    for k, p in params.items():
        torch.testing.assert_close(p.grad, grads[k].mean(0), rtol=1e-5, atol=1e-7)
    assert float(loss) == pytest.approx(float(losses.mean()))


def test_dpsgd_run_reports_record_level_epsilon():
    sim = run_tiny("fedit", "privacy.dpsgd=true", "privacy.dpsgd_clip=1.0", "privacy.dpsgd_noise=1.0")
    eps = [row["dpsgd_epsilon"] for row in sim.history]
    assert 0 < eps[0] <= eps[1] < math.inf and "epsilon" not in sim.history[0]


@pytest.mark.parametrize("mode", ["central", "local"])
def test_privacy_on_flower_equals_the_simulator(mode, monkeypatch):
    """Both runtimes go through the same hooks and seeded streams: same clipped, noised global model."""
    pytest.importorskip("flwr")
    import test_flower as harness
    from flwr.supercore.task_identity import TaskIdentity

    import fedlowrank.runtime.run as run_module
    from fedlowrank.runtime.flower import client_app

    for name in ("run_id", "node_id", "task_id"):                  # as test_flower's flower_process fixture
        monkeypatch.setattr(TaskIdentity, f"_{name}", 7)
    monkeypatch.setattr(run_module, "build_task", lambda cfg, cohorts=False: tiny_task())
    client_app._runs.clear()
    sets = (UNIFORM, f"privacy.mode={mode}", "privacy.clip=0.05", "privacy.noise_multiplier=0.5")
    ref = run_tiny("fedit", *sets)
    sim, _, _ = harness.run_flower("method.name=fedit", *sets)
    client_app._runs.clear()
    harness.assert_same_state(sim.server, ref.server)
    assert [r["epsilon"] for r in sim.history] == [r["epsilon"] for r in ref.history]
    assert [r.get("privacy") for r in sim.history] == [r.get("privacy") for r in ref.history]

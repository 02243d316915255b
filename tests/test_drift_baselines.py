"""Drift-control and server-side baselines: fedprox, scaffold, moon, task-arithmetic, ties.

Runs use a tiny MLP task (an AdaptedModel around nn.Sequential) with the real LocalTrainer, the method
contract (broadcast / train / aggregate) and the runtime's wire format, with label-skewed clients.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedlowrank.adapters.model import AdaptedModel
from fedlowrank.message import Message, Reply, State
from fedlowrank.methods import available_methods, get_method
from fedlowrank.methods.base import LoRAMethod, SetupInfo
from fedlowrank.methods.moon import ModelContrastive
from fedlowrank.methods.ties import magnitude_threshold, ties_merge
from fedlowrank.runtime.engine import check_reply, sample_clients, wire
from fedlowrank.tasks.base import Task
from fedlowrank.training.local import LocalTrainer, TrainConfig


RANK = 2
# trained tensors of the tiny model: LoRA on "0" (6->8) and "2" (8->8), head "4" (8->3)
NUM_TRAINED = RANK * (6 + 8) + RANK * (8 + 8) + (8 * 3 + 3)
SGD1 = TrainConfig(local_steps=1, batch_size=8, optimizer="sgd", lr=0.2)
ADAMW = TrainConfig(local_steps=3, batch_size=8, optimizer="adamw", lr=0.05, weight_decay=0.1)


class TinyTask(Task):
    """3-class classification of 6-d Gaussian inputs with an MLP; the representation is the input of the head."""

    name = "tiny"

    def __init__(self, n: int = 48):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 6, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.train_labels = self.y.numpy()

    @property
    def num_train(self) -> int:
        return len(self.y)

    def build_model(self) -> AdaptedModel:
        g = torch.Generator().manual_seed(1)
        net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        return AdaptedModel(net, ["0", "2"], ["4.weight", "4.bias"])

    def batch(self, indices):
        return self.x[indices], self.y[indices]

    def loss(self, net, batch):
        return F.cross_entropy(net(batch[0]), batch[1])

    def features(self, net, batch):
        return net[:4](batch[0])


class FirstReplyLoRA(LoRAMethod):
    """A LoRA method that exists only in this test: trains A and B, the server keeps the first reply's tensors."""

    name = "test-first-reply"

    def broadcast(self, server, client, rnd):
        msg = self.global_tensors(server, self.lora_keys(server) + self.head_keys(server))
        return self.correction_broadcast(server, msg)

    def train(self, model, msg, state, trainer):
        params, extra, state, loss = self.local_train(model, msg, state, trainer, ("A", "B"))
        return self.reply(params, params, extra, trainer, loss), state

    def aggregate(self, server, replies, rnd):
        server = State(server)
        for k in self.lora_keys(server) + self.head_keys(server):
            server[k] = replies[0].message[k]
        self.aggregate_corrections(server, replies)
        return server


def client_parts(task: TinyTask, num_clients: int, uneven: bool = False) -> list[np.ndarray]:
    order = np.argsort(task.y.numpy(), kind="stable")  # label skew
    if not uneven:
        return np.array_split(order, num_clients)
    cuts = np.cumsum(np.arange(1, num_clients) + 3)
    return np.split(order, cuts)


def make_info(parts, weighting="uniform", server_lr=1.0, rounds=3) -> SetupInfo:
    n = len(parts)
    return SetupInfo(num_clients=n, client_sizes=[len(p) for p in parts], client_ranks=[RANK] * n, rank=RANK,
                     alpha=2.0 * RANK, weighting=weighting, server_lr=server_lr, rounds=rounds)


def run(method, rounds=2, num_clients=4, per_round=0, cfg=ADAMW, weighting="uniform", uneven=False):
    """Run ``rounds`` rounds; returns (final server, history of (chosen, broadcasts, replies, server, states))."""
    task = TinyTask()
    parts = client_parts(task, num_clients, uneven)
    model = task.build_model()
    server = method.setup(model, make_info(parts, weighting, rounds=rounds))
    states = {k: method.init_client(k) for k in range(num_clients)}
    history = []
    for rnd in range(1, rounds + 1):
        chosen = sample_clients(0, rnd, num_clients, per_round) if per_round else list(range(num_clients))
        down, replies = [], []
        for k in chosen:
            msg = wire(method.broadcast(server, k, rnd))
            trainer = LocalTrainer(task, parts[k], cfg, k, rnd, rounds, 0)
            reply, states[k] = method.train(model, msg, states[k], trainer)
            assert check_reply(method, msg, wire(reply), rnd, len(parts[k])) is None
            down.append(msg)
            replies.append(Reply(k, trainer.num_examples, wire(reply)))
        server = method.aggregate(server, replies, rnd)
        history.append((chosen, down, replies, server, dict(states)))
    return server, history


def model_keys(server: State) -> list[str]:
    return sorted(k for k in server if (k.endswith((".lora_A", ".lora_B")) and "/" not in k) or k.startswith("head/"))


def assert_same_model(a: State, b: State, **tol) -> None:
    assert model_keys(a) == model_keys(b)
    for k in model_keys(a):
        torch.testing.assert_close(a[k], b[k], **tol, msg=lambda m, k=k: f"{k}: {m}")


def tensor_numel(msg: Message) -> int:
    return sum(t.numel() for t in msg.tensors().values())


def control_mean_invariant(history, num_clients: int) -> None:
    """Server c == (1/N) Σ over all N clients of cᵢ (zero for a client that never trained), after every round."""
    for _, _, _, server, states in history:
        keys = [k[len("scaffold.c/"):] for k in server if k.startswith("scaffold.c/")]
        assert len(keys) == len(model_keys(server))
        for key in keys:
            cis = [states[i].get(f"scaffold.ci/{key}", torch.zeros_like(server["scaffold.c/" + key]))
                   for i in range(num_clients)]
            torch.testing.assert_close(server["scaffold.c/" + key], torch.stack(cis).mean(0), atol=1e-6, rtol=1e-5)


# -- registry and options ----------------------------------------------------------------------------
NAMES = ("fedprox", "scaffold", "moon", "task-arithmetic", "ties")


def test_registered_with_descriptions():
    methods = available_methods()
    for name in NAMES:
        cls = methods[name]
        for attr in ("name", "description", "paper", "uplink", "downlink"):
            assert getattr(cls, attr), f"{name}.{attr} is empty"
        assert cls.supports_heterogeneous_ranks is False
        assert cls.needs_individual_replies is (name == "ties")


@pytest.mark.parametrize("name, options, field", [
    ("fedprox", {"correction": "none"}, "correction"),
    ("fedprox", {"mu": -1.0}, "mu"),
    ("scaffold", {"correction": "fedprox"}, "correction"),
    ("moon", {"moon_mu": -0.1}, "moon_mu"),
    ("moon", {"temperature": 0.0}, "temperature"),
    ("task-arithmetic", {"beta": 0.0}, "beta"),
    ("ties", {"keep_fraction": 0.0}, "keep_fraction"),
    ("ties", {"keep_fraction": 1.5}, "keep_fraction"),
    ("ties", {"trim_scope": "layer"}, "trim_scope"),
])
def test_bad_options_name_the_option(name, options, field):
    with pytest.raises(ValueError, match=f"method.{field}"):
        get_method(name, **options)


def test_task_arithmetic_refuses_a_second_server_step():
    task = TinyTask()
    with pytest.raises(ValueError, match="method.beta"):
        get_method("task-arithmetic").setup(task.build_model(), make_info(client_parts(task, 2), server_lr=2.0))


# -- ledger: payload per method against its formula ----------------------------------------------------
@pytest.mark.parametrize("name, factor", [("fedprox", 1), ("scaffold", 2), ("moon", 1), ("task-arithmetic", 1),
                                          ("ties", 1)])
def test_payload_matches_formula(name, factor):
    """Down and up carry the model (A, B per module + head: P floats); SCAFFOLD adds c down and Δcᵢ up."""
    _, history = run(get_method(name), rounds=2, num_clients=3)
    for _, down, replies, server, _ in history:
        for msg, reply in zip(down, (r.message for r in replies)):
            assert tensor_numel(msg) == factor * NUM_TRAINED
            assert tensor_numel(reply) == factor * NUM_TRAINED
            assert sum(t.numel() * t.element_size() for t in msg.tensors().values()) == 4 * factor * NUM_TRAINED
            assert set(reply.scalars()) == {"num_examples", "train_loss"}
            if name == "scaffold":
                keys = model_keys(server)
                assert {k for k in msg if k.startswith("scaffold.c/")} == {f"scaffold.c/{k}" for k in keys}
                assert {k for k in reply if k.startswith("scaffold.dc/")} == {f"scaffold.dc/{k}" for k in keys}
            assert msg.nbytes() == len(msg.to_bytes())


# -- FedProx -----------------------------------------------------------------------------------------
def test_fedprox_with_mu_zero_equals_fedit():
    fedit, _ = run(get_method("fedit"), rounds=2)
    prox, _ = run(get_method("fedprox", mu=0.0), rounds=2)
    assert_same_model(fedit, prox)


def test_fedprox_shrinks_the_client_update():
    cfg = TrainConfig(local_steps=4, batch_size=8, optimizer="sgd", lr=0.2)
    sizes = []
    for mu in (0.0, 2.0):
        _, history = run(get_method("fedprox", mu=mu), rounds=1, num_clients=2, cfg=cfg)
        _, down, replies, _, _ = history[0]
        sizes.append(sum(float((replies[0].message[k] - down[0][k]).norm() ** 2) for k in model_keys(down[0])))
    assert sizes[1] < 0.9 * sizes[0]


# -- SCAFFOLD ----------------------------------------------------------------------------------------
def test_scaffold_global_control_is_mean_of_client_controls_under_partial_participation():
    _, history = run(get_method("scaffold"), rounds=5, num_clients=6, per_round=2, weighting="num_examples",
                     uneven=True)
    seen = set().union(*(set(h[0]) for h in history))
    assert len(seen) < 6 or any(len(set(h[0])) < 6 for h in history)  # some clients sit out each round
    assert float(history[-1][3]["scaffold.c/head/4.weight"].abs().max()) > 1e-3
    control_mean_invariant(history, 6)


def test_scaffold_with_zero_controls_equals_fedavg_in_the_first_round():
    fedit, _ = run(get_method("fedit"), rounds=1)
    scaffold, _ = run(get_method("scaffold"), rounds=1)
    assert_same_model(fedit, scaffold)


def test_scaffold_one_sgd_step_full_participation_equals_fedavg():
    """K = 1 SGD step: yᵢ = x − η(gᵢ − cᵢ + c); the mean over all clients cancels the controls (c = mean cᵢ)."""
    fedit, _ = run(get_method("fedit"), rounds=3, cfg=SGD1)
    scaffold, history = run(get_method("scaffold"), rounds=3, cfg=SGD1)
    assert float(history[0][3]["scaffold.c/0.lora_B"].abs().max()) > 1e-4  # controls are not zero after round 1
    assert_same_model(fedit, scaffold, atol=1e-6, rtol=1e-5)


def local_gradients(method, msg: Message, client: int, rnd: int, cfg: TrainConfig, rounds: int, num_clients: int):
    """{key: ∂loss/∂key} at the broadcast model on the client's first batch of round ``rnd``."""
    task = TinyTask()
    parts = client_parts(task, num_clients)
    model = task.build_model()
    method.setup(model, make_info(parts))
    method.load_message(model, msg)
    params = method.trainable(model, ("A", "B"))
    model.set_trainable(params)
    batch = next(LocalTrainer(task, parts[client], cfg, client, rnd, rounds, 0).batches())
    return dict(zip(params, torch.autograd.grad(task.loss(model.net, batch), list(params.values()))))


def test_scaffold_one_sgd_step_follows_the_corrected_gradient_and_option_two():
    """K = 1 SGD step: yᵢ = x − η(gᵢ(x) − cᵢ + c), and option II gives cᵢ⁺ = cᵢ − c + (x − yᵢ)/η = gᵢ(x)."""
    method = get_method("scaffold")
    _, history = run(method, rounds=2, num_clients=2, cfg=SGD1)
    for rnd, (chosen, down, replies, _, states) in enumerate(history, start=1):
        for k, msg, reply in zip(chosen, down, replies):
            for key, g in local_gradients(method, msg, k, rnd, SGD1, 2, 2).items():
                ci_old = history[0][4][k][f"scaffold.ci/{key}"] if rnd == 2 else torch.zeros_like(g)
                step = g - ci_old + msg[f"scaffold.c/{key}"]
                torch.testing.assert_close(reply.message[key], msg[key] - SGD1.lr * step, atol=1e-6, rtol=1e-5)
                torch.testing.assert_close(states[k][f"scaffold.ci/{key}"], g, atol=1e-5, rtol=1e-4)
    assert float(history[0][3]["scaffold.c/2.lora_B"].abs().max()) > 1e-4  # round 2 ran with non-zero controls


def test_scaffold_option_two_uses_the_heads_own_learning_rate():
    cfg = TrainConfig(local_steps=1, batch_size=8, optimizer="sgd", lr=0.2, head_lr=0.05)
    method = get_method("scaffold")
    _, history = run(method, rounds=1, num_clients=2, cfg=cfg)
    (chosen, down, _, _, states) = history[0]
    for key, g in local_gradients(method, down[0], chosen[0], 1, cfg, 1, 2).items():
        torch.testing.assert_close(states[chosen[0]][f"scaffold.ci/{key}"], g, atol=1e-5, rtol=1e-4)


def test_scaffold_mean_gradient_refresh_is_option_two_under_plain_sgd():
    """x − yᵢ = η Σₖ (gₖ + c − cᵢ), so option II's cᵢ⁺ is the mean raw gradient of the K steps."""
    cfg = TrainConfig(local_steps=3, batch_size=8, optimizer="sgd", lr=0.2, momentum=0.0)
    _, mean = run(get_method("scaffold", cv_grad="mean"), rounds=3, num_clients=3, per_round=2, cfg=cfg)
    _, literal = run(get_method("scaffold", cv_grad="option2"), rounds=3, num_clients=3, per_round=2, cfg=cfg)
    assert float(mean[-1][3]["scaffold.c/0.lora_A"].abs().max()) > 1e-4
    for (_, _, _, server_m, states_m), (_, _, _, server_l, states_l) in zip(mean, literal):
        for key in server_m:
            torch.testing.assert_close(server_m[key], server_l[key], atol=1e-5, rtol=1e-4)
        for k in states_m:
            for key in states_m[k]:
                torch.testing.assert_close(states_m[k][key], states_l[k][key], atol=1e-5, rtol=1e-4)


def test_scaffold_with_clipping_clips_the_raw_gradient_and_mean_stays_option_two():
    """With ``max_grad_norm`` on, the step is ``clip(g) + c − cᵢ`` (the correction is not clipped), so the mean of
    the clipped gradients is still exactly option II under plain SGD (clipping the corrected gradient would make the two
    refreshes diverge)."""
    cfg = TrainConfig(local_steps=3, batch_size=8, optimizer="sgd", lr=0.2, momentum=0.0, max_grad_norm=0.2)
    _, mean = run(get_method("scaffold", cv_grad="mean"), rounds=3, num_clients=3, per_round=2, cfg=cfg)
    _, literal = run(get_method("scaffold", cv_grad="option2"), rounds=3, num_clients=3, per_round=2, cfg=cfg)
    assert max(float(v.abs().max()) for k, v in mean[-1][3].items() if k.startswith("scaffold.c/")) > 1e-2
    for (_, _, _, server_m, states_m), (_, _, _, server_l, states_l) in zip(mean, literal):
        for key in server_m:                   # clipping c − cᵢ too makes these differ by up to 0.27
            torch.testing.assert_close(server_m[key], server_l[key], atol=1e-6, rtol=1e-4)
        for k in states_m:
            for key in states_m[k]:
                torch.testing.assert_close(states_m[k][key], states_l[k][key], atol=1e-6, rtol=1e-4)
    # one step: yᵢ = x − η·clip(gᵢ) in round 1 (c = cᵢ = 0), and the clipping is active
    one_step = TrainConfig(local_steps=1, batch_size=8, optimizer="sgd", lr=0.2, max_grad_norm=0.05)
    _, history = run(get_method("scaffold"), rounds=1, num_clients=3, per_round=2, cfg=one_step)
    chosen, down, replies, _, _ = history[0]
    grads = local_gradients(get_method("scaffold"), down[0], chosen[0], 1, one_step, 1, 3)
    norm = math.sqrt(sum(float(g.square().sum()) for g in grads.values()))
    assert norm > 2 * one_step.max_grad_norm
    for key, g in grads.items():
        expected = down[0][key] - one_step.lr * g * one_step.max_grad_norm / norm
        torch.testing.assert_close(replies[0].message[key], expected, atol=1e-6, rtol=1e-5)


def test_scaffold_under_adam_keeps_control_variates_on_the_gradient_scale():
    """One Adam step moves every coordinate by ≈ η·sign(g): option II's (x − y)/η is ≈ sign(g), not g."""
    cfg = TrainConfig(local_steps=1, batch_size=8, optimizer="adam", lr=0.01)
    for cv_grad in ("mean", "option2"):
        method = get_method("scaffold", cv_grad=cv_grad)
        _, history = run(method, rounds=1, num_clients=2, cfg=cfg)
        chosen, down, _, _, states = history[0]
        for key, g in local_gradients(method, down[0], chosen[0], 1, cfg, 1, 2).items():
            ci = states[chosen[0]][f"scaffold.ci/{key}"]
            expected = g if cv_grad == "mean" else torch.sign(g)
            torch.testing.assert_close(ci, expected, atol=2e-3, rtol=2e-3)


def test_scaffold_refuses_an_unknown_refresh():
    with pytest.raises(ValueError, match="method.cv_grad must be one of"):
        get_method("scaffold", cv_grad="option1")


# -- composition with another LoRA method ------------------------------------------------------------------
def test_scaffold_composes_with_another_lora_method():
    _, history = run(FirstReplyLoRA(correction="scaffold"), rounds=4, num_clients=5, per_round=3)
    control_mean_invariant(history, 5)
    _, plain = run(FirstReplyLoRA(), rounds=2, num_clients=5, per_round=3)
    _, corrected = run(FirstReplyLoRA(correction="scaffold"), rounds=2, num_clients=5, per_round=3)
    assert not torch.allclose(plain[-1][3]["0.lora_B"], corrected[-1][3]["0.lora_B"])  # round 2 uses c − cᵢ


def test_fedprox_composes_with_another_lora_method():
    plain, _ = run(FirstReplyLoRA(), rounds=2)
    zero, _ = run(FirstReplyLoRA(correction="fedprox", mu=0.0), rounds=2)
    assert_same_model(plain, zero)
    prox, _ = run(FirstReplyLoRA(correction="fedprox", mu=5.0), rounds=2)
    assert not torch.allclose(prox["2.lora_B"], plain["2.lora_B"])


def test_fedprox_and_scaffold_compose_together():
    _, history = run(get_method("scaffold", correction="fedprox+scaffold", mu=1.0), rounds=3, num_clients=4,
                     per_round=2)
    control_mean_invariant(history, 4)
    scaffold_only, _ = run(get_method("scaffold"), rounds=3, num_clients=4, per_round=2)
    assert not torch.allclose(history[-1][3]["2.lora_B"], scaffold_only["2.lora_B"])


# -- MOON ---------------------------------------------------------------------------------------------
def test_moon_with_mu_zero_equals_fedit():
    fedit, _ = run(get_method("fedit"), rounds=2)
    moon, _ = run(get_method("moon", moon_mu=0.0), rounds=2)
    assert_same_model(fedit, moon)


def test_moon_first_round_has_no_gradient_then_uses_the_previous_local_model():
    """Without a previous model z_prev = z_glob, so ℓ_con = log 2 with zero gradient: round 1 equals FedIT."""
    _, fedit = run(get_method("fedit"), rounds=2)
    _, moon = run(get_method("moon", moon_mu=1.0), rounds=2)
    assert_same_model(fedit[0][3], moon[0][3], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(fedit[1][3]["0.lora_A"], moon[1][3]["0.lora_A"], atol=1e-5)
    for (_, _, replies, _, states) in moon[:1]:
        for r in replies:
            for k in model_keys(r.message):
                torch.testing.assert_close(states[r.client][f"moon.prev/{k}"], r.message[k], atol=0, rtol=0)


def _moon_setup(prev_noise: float):
    task = TinyTask()
    method = get_method("moon")
    model = task.build_model()
    server = method.setup(model, make_info(client_parts(task, 2)))
    g = torch.Generator().manual_seed(3)
    server = State({k: v + 0.3 * torch.randn(v.shape, generator=g) if k.endswith("lora_B") else v
                    for k, v in server.items()})
    msg = wire(method.broadcast(server, 0, 1))
    method.load_message(model, msg)
    params = method.trainable(model, ("A", "B"))
    state = State({f"moon.prev/{k}": msg[k] + prev_noise * torch.randn(msg[k].shape, generator=g) for k in params}
                  if prev_noise else {})
    corr = ModelContrastive(mu=0.7, temperature=0.5)
    corr.start(msg, state, params)
    with torch.no_grad():  # the local model moves away from the global one
        for p in params.values():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    model.set_trainable(params)
    model.net.train()
    return task, model, msg, state, params, corr


def test_moon_loss_without_previous_model_is_log_two():
    task, model, _, _, params, corr = _moon_setup(prev_noise=0.0)
    loss = corr.loss(params, model.net, task.batch(np.arange(10)), task)
    assert abs(float(loss.detach()) - 0.7 * math.log(2)) < 1e-6


def test_moon_loss_matches_a_reference_with_model_copies():
    task, model, msg, state, params, corr = _moon_setup(prev_noise=0.5)
    batch = task.batch(np.arange(12))
    before = {k: p.detach().clone() for k, p in params.items()}
    loss = corr.loss(params, model.net, batch, task)

    def features_with(tensors):
        net = copy.deepcopy(model.net)
        names = {id(p): n for n, p in model.net.named_parameters()}
        copied = dict(net.named_parameters())
        with torch.no_grad():
            for k, p in params.items():
                copied[names[id(p)]].copy_(tensors[k])
        return task.features(net, batch).detach()

    z = task.features(model.net, batch).detach()
    z_glob = features_with({k: msg[k] for k in params})
    z_prev = features_with({k: state[f"moon.prev/{k}"] for k in params})
    pos = F.cosine_similarity(z, z_glob, dim=-1) / 0.5
    neg = F.cosine_similarity(z, z_prev, dim=-1) / 0.5
    expected = 0.7 * (-(pos.exp() / (pos.exp() + neg.exp())).log()).mean()
    torch.testing.assert_close(loss.detach(), expected, atol=1e-6, rtol=1e-5)
    loss.backward()
    assert params["0.lora_A"].grad is not None and float(params["0.lora_A"].grad.abs().max()) > 0
    for k, p in params.items():  # the reference forwards left the model as it was
        assert torch.equal(p.detach(), before[k])
    assert model.net.training


# -- Task Arithmetic ---------------------------------------------------------------------------------------
def test_task_arithmetic_with_beta_one_equals_fedavg():
    fedit, _ = run(get_method("fedit"), rounds=2, weighting="num_examples", uneven=True)
    ta, _ = run(get_method("task-arithmetic", beta=1.0), rounds=2, weighting="num_examples", uneven=True)
    assert_same_model(fedit, ta)


def _fake_replies(server: State, sizes, scale=0.1, seed=5, keys=None) -> list[Reply]:
    g = torch.Generator().manual_seed(seed)
    replies = []
    for i, n in enumerate(sizes):
        msg = Message({k: server[k] + scale * torch.randn(server[k].shape, generator=g) for k in model_keys(server)})
        msg.update(num_examples=n, train_loss=1.0)
        replies.append(Reply(i, n, msg))
    return replies


def _server_for(method, weighting="num_examples"):
    task = TinyTask()
    return method.setup(task.build_model(), make_info(client_parts(task, 3), weighting))


def test_task_arithmetic_scales_the_mean_update_by_beta():
    fedit, ta = get_method("fedit"), get_method("task-arithmetic", beta=2.5)
    server = _server_for(fedit)
    _server_for(ta)
    replies = _fake_replies(server, [5, 10, 25])
    avg, scaled = fedit.aggregate(server, replies, 1), ta.aggregate(server, replies, 1)
    for k in model_keys(server):
        torch.testing.assert_close(scaled[k] - server[k], 2.5 * (avg[k] - server[k]), atol=1e-6, rtol=1e-5)


# -- TIES ---------------------------------------------------------------------------------------------------
def test_ties_merge_by_hand():
    u = torch.tensor([[1.0, -2.0, 0.5, 0.0], [3.0, 1.0, -0.5, 0.2], [-1.0, 1.5, -0.1, 0.0]], dtype=torch.float64)
    thr = torch.stack([magnitude_threshold(x, 0.5, "paper") for x in u])  # ⌈K·d⌉ = 2 kept per client
    torch.testing.assert_close(thr, torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64))
    uniform = torch.full((3,), 1 / 3, dtype=torch.float64)
    # trimmed: [1,-2,0,0], [3,1,0,0], [-1,1.5,0,0]; signs +,+; agreeing means (1+3)/2, (1+1.5)/2
    torch.testing.assert_close(ties_merge(u, uniform, thr), torch.tensor([2.0, 1.25, 0, 0], dtype=torch.float64))
    # weighted: sign mass .5·1+.25·3−.25·1 > 0 → (.5+.75)/.75; .5·(−2)+.25+.375 < 0 → −2
    weights = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    torch.testing.assert_close(ties_merge(u, weights, thr), torch.tensor([5 / 3, -2.0, 0, 0], dtype=torch.float64))


def test_magnitude_threshold_counts():
    x = torch.tensor([3.0, -1.0, 2.0, 0.5])
    assert float(magnitude_threshold(x, 0.5, "paper")) == 2.0
    assert float(magnitude_threshold(x, 1.0, "paper")) == 0.5
    assert float(magnitude_threshold(x, 0.01, "paper")) == 3.0
    assert float(magnitude_threshold(x, 0.3, "paper")) == 2.0  # ⌈0.3·4⌉ = 2 kept


@pytest.mark.parametrize("scope", ["global", "tensor"])
def test_ties_one_client_without_trimming_is_that_clients_update(scope):
    method = get_method("ties", keep_fraction=1.0, trim_scope=scope)
    server = _server_for(method)
    (reply,) = _fake_replies(server, [7])
    new = method.aggregate(server, [reply], 1)
    for k in model_keys(server):
        torch.testing.assert_close(new[k], reply.message[k], atol=1e-7, rtol=1e-6)


def test_ties_without_trimming_and_sign_agreement_is_the_weighted_mean():
    method, fedit = get_method("ties", keep_fraction=1.0), get_method("fedit")
    server = _server_for(method)
    _server_for(fedit)
    g = torch.Generator().manual_seed(2)
    direction = {k: torch.randn(server[k].shape, generator=g) for k in model_keys(server)}
    replies = []
    for i, (n, s) in enumerate([(4, 0.1), (9, 0.3), (20, 0.7)]):
        msg = Message({k: server[k] + s * direction[k] for k in model_keys(server)})
        msg.update(num_examples=n, train_loss=0.0)
        replies.append(Reply(i, n, msg))
    assert_same_model(method.aggregate(server, replies, 1), fedit.aggregate(server, replies, 1), atol=1e-6, rtol=1e-5)


def test_ties_trim_scope_global_ranks_across_tensors():
    """One tensor moves 1000× less than the others: global trimming drops it, per-tensor trimming keeps some."""
    results = {}
    for scope in ("global", "tensor"):
        method = get_method("ties", keep_fraction=0.3, trim_scope=scope)
        server = _server_for(method)
        replies = _fake_replies(server, [3, 4, 5])
        for r in replies:
            r.message["0.lora_A"] = server["0.lora_A"] + 1e-3 * (r.message["0.lora_A"] - server["0.lora_A"])
        results[scope] = (server, method.aggregate(server, replies, 1), replies, method)
    server, new, replies, method = results["global"]
    assert torch.equal(new["0.lora_A"], server["0.lora_A"])
    assert not torch.equal(new["2.lora_A"], server["2.lora_A"])
    server, new, _, _ = results["tensor"]
    assert not torch.equal(new["0.lora_A"], server["0.lora_A"])
    weights = method.client_weights(replies)
    for k in ("head/4.weight", "head/4.bias"):  # the head is averaged, not merged
        expected = sum(w * r.message[k] for w, r in zip(weights.tolist(), replies))
        torch.testing.assert_close(results["global"][1][k], expected, atol=1e-6, rtol=1e-5)


# -- end to end on the tiny BERT through the simulator ---------------------------------------------------------
@pytest.mark.parametrize("name, factor", [("fedprox", 1), ("scaffold", 2), ("moon", 1), ("task-arithmetic", 1),
                                          ("ties", 1)])
def test_simulated_run_ledger_and_state(name, factor):
    from helpers import run_tiny

    sim = run_tiny(name, rounds=3)
    lora = [k for k in model_keys(sim.server) if not k.startswith("head/")]
    assert len(lora) == 8  # query/value of 2 layers, A and B
    P = sum(sim.server[k].numel() for k in model_keys(sim.server))
    head = sim.server["head/classifier.weight"].numel() + sim.server["head/classifier.bias"].numel()
    assert P == 4 * 2 * (32 + 32) + head
    entries = factor * len(model_keys(sim.server))
    for row in sim.ledger.rows:  # bytes = raw fp32 tensors + the safetensors header (< 200 bytes per entry)
        assert 4 * factor * P < row["down"] < 4 * factor * P + 200 * entries
        assert 4 * factor * P < row["up"] < 4 * factor * P + 200 * (entries + 1)
    assert math.isfinite(sim.history[-1]["accuracy"])
    if name == "scaffold":
        for key in model_keys(sim.server):
            cis = [sim.store.get(i, State()).get(f"scaffold.ci/{key}", torch.zeros_like(sim.server[key]))
                   for i in range(4)]
            torch.testing.assert_close(sim.server[f"scaffold.c/{key}"], torch.stack(cis).mean(0), atol=1e-6, rtol=1e-5)
    if name == "moon":
        assert all(f"moon.prev/{k}" in state for state in sim.store.values() for k in model_keys(sim.server))


def test_scaffold_control_mean_survives_a_skipped_round():
    from helpers import run_tiny

    sim = run_tiny("scaffold", "run.min_replies=2", "run.dropout_schedule=[[1, 1]]", rounds=1)
    assert sim.history[0].get("skipped")
    for key in model_keys(sim.server):
        cis = [sim.store.get(i, State()).get(f"scaffold.ci/{key}", torch.zeros_like(sim.server[key])) for i in range(4)]
        torch.testing.assert_close(sim.server[f"scaffold.c/{key}"], torch.stack(cis).mean(0), atol=1e-6, rtol=1e-5)


def test_scaffold_full_is_fedavg_full_with_scaffold_bit_for_bit():
    """``scaffold-full`` (SSF's Full-SCAFFOLD under its own name) runs exactly ``fedavg-full`` with
    ``method.correction = "scaffold"``: same global state and bytes."""
    from fedlowrank.runtime.simulator import Simulation

    from helpers import tiny_config, tiny_task

    sims = [Simulation(tiny_config(*sets, "run.rounds=2"), task=tiny_task()) for sets in
            (["method.name=scaffold-full"], ["method.name=fedavg-full", "method.correction=scaffold"])]
    for sim in sims:
        sim.run()
    a, b = (sim.server.tensors() for sim in sims)
    assert a.keys() == b.keys() and any(k.startswith("scaffold.c/") for k in a)  # the server control variate
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["up"] for r in sims[0].ledger.rows] == [r["up"] for r in sims[1].ledger.rows]

"""FLoRG as a federated method: set-up, client round, server step, communication, end-to-end tiny runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedlowrank.adapters.gram import GramLinear, gram_modules
from fedlowrank.adapters.model import AdaptedModel
from fedlowrank.linalg.gram import aggregate_gram
from fedlowrank.message import Message, Reply, State
from fedlowrank.methods import get_method
from fedlowrank.methods.base import SetupInfo
from fedlowrank.training.local import FitResult

D = torch.float64


def tiny_model(dims=(6, 6, 6), classes=2, seed=0) -> AdaptedModel:
    """``Linear(d0,d1) → tanh → Linear(d1,d2) → head Linear(d2, classes)``; targets "0" and "2"."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(dims[0], dims[1]), nn.Tanh(), nn.Linear(dims[1], dims[2]),
                        nn.Linear(dims[2], classes)).to(D)
    return AdaptedModel(net, ["0", "2"], ["3.weight", "3.bias"])


class FakeTrainer:
    """Stands in for LocalTrainer: full-batch regression on (X, Y), ``steps`` steps of SGD or AdamW."""

    def __init__(self, X, Y, steps=3, lr=0.05, optimizer="sgd"):
        self.X, self.Y, self.steps, self.lr, self.optimizer = X, Y, steps, lr, optimizer
        self.num_examples = len(X)

    def fit(self, model, params, corrections=(), optimizer=None):
        cls = torch.optim.SGD if self.optimizer == "sgd" else torch.optim.AdamW
        opt = cls(list(params.values()), lr=self.lr)
        losses = []
        for _ in range(self.steps):
            opt.zero_grad()
            loss = (model(self.X) - self.Y).square().mean()
            total = loss
            for c in corrections:
                extra = c.loss(params, model.net, None, None)
                total = total if extra is None else total + extra
            total.backward()
            for c in corrections:
                c.grad(params)
            opt.step()
            losses.append(float(loss.detach()))
        return FitResult(loss=sum(losses) / len(losses), steps=self.steps, lr=self.lr)


def data(n=10, d=6, classes=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=D), torch.randn(n, classes, generator=g, dtype=D)


def info(num_clients=2, rank=2, **kw) -> SetupInfo:
    kw.setdefault("alpha", 4.0)
    return SetupInfo(num_clients=num_clients, client_sizes=[10] * num_clients, client_ranks=[rank] * num_clients,
                     rank=rank, **kw)


def one_round(method, model, server, trainers, rnd=1):
    replies = []
    for k, trainer in enumerate(trainers):
        reply, _ = method.train(model, method.broadcast(server, k, rnd), State(), trainer)
        replies.append(Reply(k, trainer.num_examples, Message.from_bytes(reply.to_bytes())))
    return method.aggregate(server, replies, rnd), replies


# -- set-up ---------------------------------------------------------------------------------------------------

def test_setup_is_seeded_and_shapes_follow_k():
    dims = (6, 8, 5)                                           # layer "0": 8×6 (k=6), layer "2": 5×8 (k=5)
    m1, m2, m3 = tiny_model(dims), tiny_model(dims), tiny_model(dims)
    s1 = get_method("florg").setup(m1, info(rank=2, seed=3))
    s2 = get_method("florg").setup(m2, info(rank=2, seed=3))
    s3 = get_method("florg").setup(m3, info(rank=2, seed=4))
    assert s1["0.gram_A"].shape == (2, 6) and s1["2.gram_A"].shape == (2, 5)
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert not torch.equal(s1["0.gram_A"], s3["0.gram_A"])
    g1, g2, g3 = gram_modules(m1), gram_modules(m2), gram_modules(m3)
    assert torch.equal(g1["2"].L, g2["2"].L) and torch.equal(g1["2"].R, g2["2"].R)   # clients regenerate L, R
    assert not torch.equal(g1["2"].L, g3["2"].L)
    assert not torch.equal(g1["0"].L[:5, :5], g1["2"].L[:5, :5])                     # per-layer streams


def test_compensate_init_starts_from_the_pretrained_model():
    X, _ = data()
    ref = tiny_model()(X)
    for compensate, same in ((True, True), (False, False)):
        model = tiny_model()
        method = get_method("florg", compensate_init=compensate)
        method.load_global(model, method.setup(model, info()))
        assert torch.allclose(model(X), ref, atol=1e-12, rtol=0) == same


@pytest.mark.parametrize("option,value", [("server_decomp", "qr"), ("bases_init", "nndsvd"), ("a_init", "zeros"),
                                          ("correction", "moon"), ("eig_tol", 0.0)])
def test_bad_options_are_refused(option, value):
    with pytest.raises(ValueError, match=f"method.{option}"):
        get_method("florg", **{option: value})


def test_bad_run_settings_are_refused():
    with pytest.raises(ValueError, match="method.server_decomp"):
        get_method("florg", server_decomp="closed_form", procrustes=False)
    # server.lr > 1 and mixed ranks: refused at config time from FLoRG's declarations (tests/test_contract.py)


# -- rounds ---------------------------------------------------------------------------------------------------

def test_server_step_is_the_gram_kernel_and_the_head_average():
    model = tiny_model()
    method = get_method("florg", server_decomp="eigh")
    server = method.setup(model, info(weighting="num_examples"))
    trainers = [FakeTrainer(*data(n=4 + 8 * k, seed=k)) for k in range(2)]
    new, replies = one_round(method, model, server, trainers)
    w = torch.tensor([4.0, 12.0], dtype=D) / 16
    for key in ("0.gram_A", "2.gram_A"):
        expected, _ = aggregate_gram(server[key], [r.message[key] for r in replies], w.tolist(), "eigh")
        torch.testing.assert_close(new[key], expected, atol=1e-12, rtol=0)
        assert not torch.allclose(new[key], server[key])
    for key in ("head/3.weight", "head/3.bias"):
        torch.testing.assert_close(new[key], sum(wk * r.message[key] for wk, r in zip(w, replies)), atol=1e-14, rtol=0)
    diag = method.pop_metrics()
    assert diag["florg_rank"] == 4 and diag["florg_drift"] > 0 and 0 < diag["florg_trunc_err"] < 1


def test_server_lr_blends_the_gram_matrices():
    """β = 0.5, one client returning 2·Aᵗ: Q = 0.5·AᵗᵀAᵗ + 0.5·4·AᵗᵀAᵗ, so Aᵗ⁺¹ = √2.5·Aᵗ."""
    model = tiny_model()
    method = get_method("florg")
    server = method.setup(model, info(num_clients=1, server_lr=0.5))
    reply = Message({k: 2 * v if k.endswith("gram_A") else v for k, v in server.items()})
    new = method.aggregate(server, [Reply(0, 10, reply)], 1)
    torch.testing.assert_close(new["0.gram_A"], 2.5**0.5 * server["0.gram_A"], atol=1e-12, rtol=0)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_one_client_procrustes_changes_nothing_under_sgd(optimizer):
    """Spec appendix 8: N = 1 ⇒ r' = r; under SGD, with and without Procrustes give the same model every
    round (rotation equivariance), with different A; AdamW is not rotation-equivariant, so they may differ."""
    X, Y = data()
    runs = {}
    for align in (True, False):
        model = tiny_model()
        method = get_method("florg", procrustes=align, a_init="kaiming")
        server = method.setup(model, info(num_clients=1))
        outs, As = [], []
        for rnd in range(1, 4):
            server, _ = one_round(method, model, server, [FakeTrainer(X, Y, lr=0.05, optimizer=optimizer)], rnd)
            method.load_global(model, server)
            outs.append(model(X).detach())
            As.append(server["0.gram_A"])
        runs[align] = outs, As
    gap = max(float((a - b).abs().max()) for a, b in zip(runs[True][0], runs[False][0]))
    assert not torch.allclose(runs[True][1][-1], runs[False][1][-1], atol=1e-3)
    if optimizer == "sgd":
        assert gap < 1e-10
        for A, B in zip(runs[True][1], runs[False][1]):
            torch.testing.assert_close(A.T @ A, B.T @ B, atol=1e-10, rtol=0)
    else:
        assert gap > 1e-6


@pytest.mark.parametrize("correction", ["fedprox", "scaffold"])
def test_corrections_compose(correction):
    model = tiny_model()
    method = get_method("florg", correction=correction, mu=0.1)
    server = method.setup(model, info())
    new, replies = one_round(method, model, server, [FakeTrainer(*data(seed=k)) for k in range(2)])
    down = method.broadcast(server, 0, 1)
    spec = method.upload_spec(down, 1)
    assert {k: (tuple(t.shape), t.dtype) for k, t in replies[0].message.tensors().items()} == \
        {k: (s.shape, s.dtype) for k, s in spec.items()}
    if correction == "scaffold":
        assert "scaffold.dc/0.gram_A" in replies[0].message
        assert new["scaffold.c/0.gram_A"].abs().sum() > 0
    assert torch.isfinite(new["0.gram_A"]).all()


# -- communication --------------------------------------------------------------------------------------------

def adapter_bytes(msg: Message) -> tuple[int, int]:
    """(serialised bytes the adapter entries add to the message, raw tensor bytes of those entries)."""
    adapter = [k for k in msg if k.endswith(("gram_A", "lora_A", "lora_B"))]
    rest = Message({k: v for k, v in msg.items() if k not in adapter})
    return msg.nbytes() - rest.nbytes(), sum(msg[k].numel() * msg[k].element_size() for k in adapter)


def test_uplink_is_half_of_fedit_on_square_layers():
    d, r = 64, 4
    X, Y = data(d=d)
    replies = {}
    for name in ("florg", "fedit"):
        model = tiny_model((d, d, d))
        method = get_method(name)
        server = method.setup(model, info(rank=r))
        replies[name], _ = method.train(model, method.broadcast(server, 0, 1), State(), FakeTrainer(X, Y, steps=1))
    (f_ser, f_raw), (i_ser, i_raw) = adapter_bytes(replies["florg"]), adapter_bytes(replies["fedit"])
    assert f_raw * 2 == i_raw == 2 * r * (d + d) * 8             # 2 layers, r(in+out) float64 values for FedIT
    assert abs(f_ser / i_ser - 0.5) < 0.02                       # with the safetensors header entries
    assert replies["florg"].nbytes() < replies["fedit"].nbytes()


def test_payload_matches_the_per_round_formula_on_rectangular_layers():
    """§8.1: r·k values per layer each way, k = min(in, out); nothing else but the head and two scalars."""
    dims, r = (6, 8, 5), 2
    model = tiny_model(dims)
    method = get_method("florg")
    server = method.setup(model, info(rank=r))
    down = method.broadcast(server, 0, 1)
    up, _ = method.train(model, down, State(), FakeTrainer(*data(d=6)))
    head = {k for k in down if k.startswith("head/")}
    for msg in (down, up):
        assert {k for k in msg if isinstance(msg[k], torch.Tensor)} == {"0.gram_A", "2.gram_A"} | head
        assert adapter_bytes(msg)[1] == 8 * r * (6 + 5)            # float64 model: 8 bytes a value


# -- end to end (simulator, tiny BERT) -----------------------------------------------------------------------

def test_tiny_run_end_to_end_and_ledger():
    from helpers import run_tiny

    florg = run_tiny("florg", rounds=2)
    fedit = run_tiny("fedit", rounds=2)
    last = florg.history[-1]
    assert all(isinstance(m, GramLinear) for m in florg.model.adapters().values())
    assert torch.isfinite(torch.stack([v for k, v in florg.server.items() if k.endswith("gram_A")])).all()
    assert last["diagnostics"]["florg_rank"] == 4                # r' = 2 clients × rank 2 < k = 32
    assert last["diagnostics"]["florg_drift"] > 0 and 0 < last["diagnostics"]["florg_trunc_err"] < 1
    # query/value are 32×32, rank 2, 4 targets: FLoRG sends r·k = 64 fp32 values per target, FedIT 128
    saving = 4 * 2 * 32 * 4
    for direction in ("up", "down"):
        f = [row[direction] for row in florg.ledger.rows]
        i = [row[direction] for row in fedit.ledger.rows]
        assert len(f) == len(i) and all(a <= b - saving for a, b in zip(f, i))


@pytest.mark.parametrize("sets", [("method.procrustes=false",), ("method.procrustes=false", "method.truncate=false"),
                                  ("method.server_decomp=closed_form",),
                                  ("method.bases_init=svd", "method.correction=scaffold")])
def test_tiny_run_options(sets):
    from helpers import run_tiny

    sim = run_tiny("florg", *sets, rounds=2)
    assert all(torch.isfinite(v).all() for v in sim.server.values() if isinstance(v, torch.Tensor))


# -- without Procrustes: the paper's ablation (Table 3) and the truncated reading ----------------------------------

def test_no_procrustes_keeps_all_rprime_rows_and_the_exact_gram_matrix():
    """Table 3's "w/o Procrustes" sets Aᵗ⁺¹ := Ãᵗ⁺¹: r' = rank(Q) rows (here N·r = 4 > r = 2) with
    Aᵗ⁺¹ᵀAᵗ⁺¹ = Q exactly, and the clients then train that [r', k] factor; ``florg-top-rows`` keeps r rows."""
    X, Y = data()
    shapes, grams = {}, {}
    for name in ("florg-no-procrustes", "florg-top-rows"):
        model = tiny_model()
        method = get_method(name)
        server = method.setup(model, info(num_clients=2, rank=2))
        trainers = [FakeTrainer(X[:5], Y[:5]), FakeTrainer(X[5:], Y[5:])]
        new, replies = one_round(method, model, server, trainers, 1)
        Q = sum(0.5 * r.message["0.gram_A"].T @ r.message["0.gram_A"] for r in replies)
        shapes[name], grams[name] = tuple(new["0.gram_A"].shape), (new["0.gram_A"].T @ new["0.gram_A"], Q)
        newer, replies = one_round(method, model, new, trainers, 2)   # clients train the grown factor
        assert all(r.message["0.gram_A"].shape == new["0.gram_A"].shape for r in replies)
        assert torch.isfinite(newer["0.gram_A"]).all()
    assert shapes["florg-no-procrustes"] == (4, 6) and shapes["florg-top-rows"] == (2, 6)
    torch.testing.assert_close(*grams["florg-no-procrustes"], atol=1e-12, rtol=0)
    assert float((grams["florg-top-rows"][0] - grams["florg-top-rows"][1]).norm()) > 1e-6


def test_no_procrustes_model_equals_the_aggregated_gram_model():
    """With r' rows the global model is exactly W0 + s·L Q R (no truncation error), unlike the top-r reading."""
    X, Y = data()
    model = tiny_model()
    method = get_method("florg-no-procrustes")
    server = method.setup(model, info(num_clients=2, rank=2))
    new, replies = one_round(method, model, server, [FakeTrainer(X[:5], Y[:5]), FakeTrainer(X[5:], Y[5:])], 1)
    method.load_global(model, new)
    mod = gram_modules(model)["0"]
    Q = sum(0.5 * r.message["0.gram_A"].T @ r.message["0.gram_A"] for r in replies)
    torch.testing.assert_close(mod.adapter_delta(), mod.scale * mod.L @ Q @ mod.R, atol=1e-12, rtol=0)


def test_truncated_variant_is_todays_procrustes_false():
    model_a, model_b = tiny_model(), tiny_model()
    a, b = get_method("florg-top-rows"), get_method("florg", procrustes=False)
    sa, sb = a.setup(model_a, info()), b.setup(model_b, info())
    X, Y = data()
    na, _ = one_round(a, model_a, sa, [FakeTrainer(X, Y)], 1)
    nb, _ = one_round(b, model_b, sb, [FakeTrainer(X, Y)], 1)
    torch.testing.assert_close(na["0.gram_A"], nb["0.gram_A"], atol=0, rtol=0)


def test_no_procrustes_refuses_control_variates():
    with pytest.raises(ValueError, match="method.correction"):
        get_method("florg-no-procrustes", correction="scaffold")

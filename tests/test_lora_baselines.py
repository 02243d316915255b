"""LoRA-family baselines: exact aggregation, equal-rank reductions, FFA's frozen A, FedSA's private B,
ledger payloads against the papers' formulas, refusals, and an end-to-end smoke run of each method.

Rounds are played by hand on the tiny task's model with a fake trainer (seeded noise on every trainable
parameter), through serialised messages and a per-client store, as the simulator does."""

from __future__ import annotations

import math

import pytest
import torch

from fedlowrank.adapters.lora import lora_modules, lora_scale
from fedlowrank.message import Message, Reply
from fedlowrank.methods import available_methods, get_method
from fedlowrank.methods.base import weighted_sum
from fedlowrank.methods.ffa_lora import frozen_A
from fedlowrank.methods.lora_fair import fair_correction, fair_loss_grad
from fedlowrank.runtime.engine import check_reply, wire
from fedlowrank.training.local import FitResult

from helpers import run_tiny, tiny_simulation

LORA = ["ffa-lora", "fedsa-lora", "fedex-lora", "flora", "flexlora", "federa", "hetlora", "lora-fair", "rolora"]
HETERO = ["ffa-lora", "fedex-lora", "flora", "flexlora", "hetlora", "lora-fair"]
ROUNDS = [[0, 1, 2], [1, 3], [0, 1, 3]]          # partial participation; client 0 skips round 2


def sim_of(method: str, *sets: str):
    return tiny_simulation(method, f'compare.methods=["{method}"]', *sets)


def effective(model) -> dict[str, torch.Tensor]:
    """Effective target weights ``W0 + base_delta + s B A`` (float64)."""
    return {n: (m.frozen_weight() + m.adapter_delta()).detach().to(torch.float64) for n, m in model.adapters().items()}


class FakeTrainer:
    """Stands in for LocalTrainer: adds seeded noise to every trainable parameter and records the model."""

    def __init__(self, client: int, rnd: int):
        self.client, self.rnd, self.num_examples = client, rnd, 10 * (client + 1)
        self.compute_seconds = 0.0

    def fit(self, model, params, corrections=(), optimizer=None):
        self.start, self.params = effective(model), {k: p.detach().clone() for k, p in params.items()}
        g = torch.Generator().manual_seed(1000 * self.rnd + self.client)
        with torch.no_grad():
            for p in params.values():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        self.end = effective(model)
        return FitResult(loss=0.0, steps=1, lr=0.1)


def play_round(sim, clients, rnd):
    """Broadcast → (wire) → train → (wire) → aggregate, like the simulator; returns [(msg, reply, trainer)]."""
    out = []
    for k in clients:
        msg = wire(sim.method.broadcast(sim.server, k, rnd))
        for mod in sim.model.adapters().values():
            mod.set_base_delta(None)
        state = sim.store[k] if k in sim.store else sim.method.init_client(k)
        trainer = FakeTrainer(k, rnd)
        reply, sim.store[k] = sim.method.train(sim.model, msg, state, trainer)
        reply = wire(reply)
        assert check_reply(sim.method, msg, reply, rnd) is None          # the runtime would accept it
        out.append((msg, Reply(k, trainer.num_examples, reply), trainer))
    sim.server = sim.method.aggregate(sim.server, [r for _, r, _ in out], rnd)
    return out


def global_weights(sim) -> dict[str, torch.Tensor]:
    sim.method.load_global(sim.model, sim.server)
    return effective(sim.model)


def weights_of(out) -> torch.Tensor:
    n = torch.tensor([float(r.num_examples) for _, r, _ in out], dtype=torch.float64)
    return n / n.sum()


def hand_replies(sim, clients, seed=0, scale=0.1):
    """Random rank-r_k factors for the given clients (and the head), as wired replies."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in clients:
        r = sim.info.client_ranks[k]
        msg = Message()
        for name, mod in lora_modules(sim.model).items():
            msg[f"{name}.lora_A"] = scale * torch.randn(r, mod.in_features, generator=g)
            msg[f"{name}.lora_B"] = scale * torch.randn(mod.out_features, r, generator=g)
        msg.update({k_: torch.randn(v.shape, generator=g) for k_, v in sim.server.items() if k_.startswith("head/")})
        msg.update(num_examples=10 * (k + 1), train_loss=0.0)
        out.append(Reply(k, 10 * (k + 1), msg))
    return out


def product(sim, msg, name, r_scale=None):
    """``s_r B A`` of a message's factors for one module (dense, float64)."""
    A, B = msg[f"{name}.lora_A"].to(torch.float64), msg[f"{name}.lora_B"].to(torch.float64)
    return lora_scale(sim.info.alpha, A.shape[0], sim.info.scaling) * (B @ A)


# -- exact aggregation ---------------------------------------------------------------------------------------
EXACT = [
    ("fedex-lora", ()), ("fedex-lora", ("lora.ranks=[1,2]",)),
    ("fedex-lora", ("lora.ranks=[1,2]", "lora.scaling=rslora")),
    ("flora", ()), ("flora", ("lora.ranks=[1,2]",)),
    ("flexlora", ("lora.rank=32",)), ("flexlora", ("lora.ranks=[32,3]",)), ("federa", ("lora.rank=32",)),
    ("ffa-lora", ()), ("ffa-lora", ("lora.ranks=[1,2]",)), ("rolora", ()),
]


@pytest.mark.parametrize("method,sets", EXACT)
def test_exact_methods_reproduce_the_average_of_client_models(method, sets):
    """Global model after aggregation = Σ pₖ (client k's trained model): round 1 = W0 + Σ pₖ sₖ Bₖ Aₖ."""
    sim = sim_of(method, *sets)
    for rnd, clients in enumerate(ROUNDS, 1):
        before = global_weights(sim)
        out = play_round(sim, clients, rnd)
        p = weights_of(out)
        after = global_weights(sim)
        for name in after:
            expect = sum(pk * t.end[name] for pk, (_, _, t) in zip(p.tolist(), out))
            assert torch.allclose(after[name], expect, atol=2e-5), (method, sets, rnd, name)
            if method in ("fedex-lora", "flora") or (method in ("ffa-lora", "rolora") and not sets):
                # every client starts from the global model (a lower-rank FFA client from its leading directions)
                for _, _, t in out:
                    assert torch.allclose(t.start[name], before[name], atol=2e-5), (method, rnd, t.client)


def test_exactness_test_can_fail_for_fedit_and_hetlora():
    """The same check catches the product-of-averages bias of factor averaging."""
    for method in ("fedit", "hetlora"):
        sim = sim_of(method)
        play_round(sim, [0, 1], 1)                  # round 1 starts from B = 0, so the bias shows in round 2
        out = play_round(sim, [0, 1], 2)
        p = weights_of(out)
        after = global_weights(sim)
        name = next(iter(after))
        expect = sum(pk * t.end[name] for pk, (_, _, t) in zip(p.tolist(), out))
        assert not torch.allclose(after[name], expect, atol=1e-4)


# -- equal ranks: the heterogeneous code equals the homogeneous rules ---------------------------------------------
def test_hetlora_with_equal_ranks_is_fedit_bit_for_bit():
    het, fed = sim_of("hetlora", "lora.ranks=[2,2]"), sim_of("fedit")
    replies = hand_replies(fed, [0, 2, 3])
    new_het, new_fed = het.method.aggregate(het.server, replies, 1), fed.method.aggregate(fed.server, replies, 1)
    assert set(new_het) == set(new_fed)
    for key in new_fed:
        assert torch.equal(new_het[key], new_fed[key]), key
    for key, t in het.method.broadcast(new_het, 1, 2).items():
        assert torch.equal(t, new_fed[key])


def test_ffa_equal_ranks_average_B_exactly_like_plain_fedavg():
    sim = sim_of("ffa-lora")
    replies = hand_replies(sim, [0, 1, 3])
    new = sim.method.aggregate(sim.server, replies, 1)
    p = sim.method.client_weights(replies)
    for key in (k for k in new if k.endswith("lora_B")):
        assert torch.equal(new[key], weighted_sum((r.message[key] for r in replies), p))
    for key in (k for k in new if k.endswith("lora_A")):
        assert torch.equal(new[key], sim.server[key])


def test_fedex_base_delta_is_the_scaled_residual_of_the_paper():
    """Equal ranks, round 1 from B = 0: base delta = s (Σ pₖ Bₖ Aₖ − B̄ Ā), laid out [out, in]."""
    sim = sim_of("fedex-lora", "lora.alpha=6.0")
    replies = hand_replies(sim, [0, 1, 2])
    new = sim.method.aggregate(sim.server, replies, 1)
    p = sim.method.client_weights(replies).tolist()
    s = lora_scale(6.0, 2)
    msg = sim.method.broadcast(new, 3, 2)
    for name in lora_modules(sim.model):
        ka, kb = f"{name}.lora_A", f"{name}.lora_B"
        prod = sum(pk * r.message[kb].double() @ r.message[ka].double() for pk, r in zip(p, replies))
        residual = s * (prod - new[kb].double() @ new[ka].double())
        assert torch.allclose(msg[f"{name}.base_delta"].double(), residual, atol=1e-6)
        assert torch.equal(msg[ka], new[ka]) and torch.equal(msg[kb], new[kb])


def test_flexlora_equal_ranks_equals_federa_and_lora_fair_without_steps_equals_fedit():
    flex, fed = sim_of("flexlora", "lora.ranks=[2,2]", "method.split=even"), sim_of("federa")
    replies = hand_replies(fed, [0, 1, 3])
    a, b = flex.method.aggregate(flex.server, replies, 1), fed.method.aggregate(fed.server, replies, 1)
    assert all(torch.equal(a[k], b[k]) for k in b)
    fair, fedit = sim_of("lora-fair", "method.steps=0"), sim_of("fedit")
    a, b = fair.method.aggregate(fair.server, replies, 1), fedit.method.aggregate(fedit.server, replies, 1)
    assert all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.parametrize("method", ["hetlora", "fedex-lora", "flexlora", "lora-fair", "ffa-lora"])
def test_heterogeneous_downloads_are_the_servers_leading_directions(method):
    """Client k at rank r_k (its own scale s_k) gets s_k B_k A_k = s B̄[:, :r_k] Ā[:r_k]."""
    sim = sim_of(method, "lora.ranks=[1,3,2]", "lora.rank=3")
    server = sim.method.aggregate(sim.server, hand_replies(sim, [0, 1, 2]), 1)
    s = lora_scale(sim.info.alpha, 3)
    for k, r in [(0, 1), (2, 2), (1, 3)]:
        msg = sim.method.broadcast(server, k, 2)
        for name in lora_modules(sim.model):
            A = frozen_A(sim.model, sim.info)[name][:r] if method == "ffa-lora" else msg[f"{name}.lora_A"]
            got = lora_scale(sim.info.alpha, r) * msg[f"{name}.lora_B"].double() @ A.double()
            want = s * server[f"{name}.lora_B"][:, :r].double() @ server[f"{name}.lora_A"][:r].double()
            assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6), (method, k, name)


def test_flexlora_redistributes_the_truncated_svd_of_the_average():
    """Each client's s_k B_k A_k is the dense rank-r_k truncated SVD of Σ pₖ sₖ Bₖ Aₖ; error reported."""
    sim = sim_of("flexlora", "lora.ranks=[4,2]")
    replies = hand_replies(sim, [0, 1, 3])
    server = sim.method.aggregate(sim.server, replies, 1)
    err = sim.method.pop_metrics()["truncation_err"]
    p = sim.method.client_weights(replies).tolist()
    errs = []
    for name in lora_modules(sim.model):
        dW = sum(pk * product(sim, r.message, name) for pk, r in zip(p, replies))
        U, S, Vh = torch.linalg.svd(dW)
        errs.append(float(S[4:].pow(2).sum().sqrt() / S.pow(2).sum().sqrt()))
        for k, r in [(0, 4), (1, 2)]:
            got = product(sim, sim.method.broadcast(server, k, 2), name)
            assert torch.allclose(got, (U[:, :r] * S[:r]) @ Vh[:r], atol=1e-5)
    assert math.isclose(err, sum(errs) / len(errs), rel_tol=1e-6)


def test_flexlora_official_split_puts_the_singular_values_in_B_and_equal_ranks_fedavg_is_fedit():
    """The public code's split B = U_r S_r / s, A = V_rᵀ (default) has the even split's product and orthonormal
    rows of A; ``equal_ranks = "fedavg"`` is the public code's factor-wise FedAvg when all ranks are equal, and
    leaves heterogeneous ranks to the SVD."""
    official, even = sim_of("flexlora", "lora.ranks=[2,2]"), sim_of("flexlora", "lora.ranks=[2,2]", "method.split=even")
    assert official.method.split == "official" and sim_of("federa").method.split == "even"
    replies = hand_replies(even, [0, 1, 3])
    a = official.method.aggregate(official.server, replies, 1)
    b = even.method.aggregate(even.server, replies, 1)
    for name in lora_modules(official.model):
        A = a[f"{name}.lora_A"].double()
        torch.testing.assert_close(A @ A.T, torch.eye(A.shape[0], dtype=torch.float64), atol=1e-6, rtol=0)
        torch.testing.assert_close(product(official, a, name), product(even, b, name), atol=1e-6, rtol=0)
        assert not torch.allclose(a[f"{name}.lora_A"], b[f"{name}.lora_A"], atol=1e-3)
    fedavg, fedit = sim_of("flexlora", "lora.ranks=[2,2]", "method.equal_ranks=fedavg"), sim_of("fedit")
    a, b = fedavg.method.aggregate(fedavg.server, replies, 1), fedit.method.aggregate(fedit.server, replies, 1)
    assert all(torch.equal(a[k], b[k]) for k in b)
    hetero = sim_of("flexlora", "lora.ranks=[4,2]", "method.equal_ranks=fedavg")
    svd = sim_of("flexlora", "lora.ranks=[4,2]")
    replies = hand_replies(svd, [0, 1, 3])
    a, b = hetero.method.aggregate(hetero.server, replies, 1), svd.method.aggregate(svd.server, replies, 1)
    assert all(torch.equal(a[k], b[k]) for k in b)
    for option in ("split", "equal_ranks"):
        with pytest.raises(ValueError, match=f"method.{option}"):
            get_method("flexlora", **{option: "half"})


# -- FFA-LoRA and FedSA-LoRA invariants -------------------------------------------------------------------------
@pytest.mark.parametrize("sets", [(), ("lora.ranks=[1,2]",)])
def test_ffa_lora_never_changes_A(sets):
    sim = sim_of("ffa-lora", *sets)
    A0 = frozen_A(sim.model, sim.info)
    sim.run()                                                   # real local training, 2 rounds
    for name, mod in lora_modules(sim.model).items():
        assert torch.equal(sim.server[f"{name}.lora_A"], A0[name])
        assert torch.equal(mod.lora_A.detach(), A0[name][: mod.rank])  # the last client's model
        assert not torch.equal(sim.server[f"{name}.lora_B"], torch.zeros_like(sim.server[f"{name}.lora_B"]))


def test_fedsa_lora_never_sends_B_and_keeps_each_clients_own():
    sim = sim_of("fedsa-lora", "method.correction=fedprox")
    assert not any("lora_B" in k for k in sim.server)
    names = list(lora_modules(sim.model))
    kb = f"{names[0]}.lora_B"
    history = {}
    for rnd, clients in enumerate(ROUNDS, 1):
        for msg, reply, trainer in play_round(sim, clients, rnd):
            assert not any("lora_B" in k for k in list(msg) + list(reply.message))
            k = trainer.client
            start = trainer.params[kb]
            if k in history:          # starts from its own B of its last round, whoever trained in between
                assert torch.equal(start, history[k])
            else:                     # a new client starts from LoRA's B = 0, not from the previous client's
                assert torch.equal(start, torch.zeros_like(start))
            history[k] = sim.store[k][kb]
            assert not torch.equal(history[k], start)
        assert not any("lora_B" in k for k in sim.server)
    assert not torch.equal(history[0], history[1])
    sim.method.load_personal(sim.model, sim.server, sim.store[1])
    assert torch.equal(lora_modules(sim.model)[names[0]].lora_B.detach(), history[1])
    p_A = f"{names[0]}.lora_A"
    assert torch.equal(lora_modules(sim.model)[names[0]].lora_A.detach(), sim.server[p_A])


def test_fedsa_lora_reports_the_mean_of_the_clients_personalised_models():
    sim = sim_of("fedsa-lora")
    sim.run()
    assert sim.method.personalized and len(sim.store) >= 2
    rows = []
    for k in sorted(sim.store):
        sim.method.load_personal(sim.model, sim.server, sim.store[k])
        rows.append(sim.task.evaluate(sim.model.net))
    reported = sim.evaluate()
    assert reported["loss"] == pytest.approx(sum(r["loss"] for r in rows) / len(rows))
    sim.method.load_global(sim.model, sim.server)
    assert reported["loss"] != sim.task.evaluate(sim.model.net)["loss"]  # not the shared model with B = 0


def test_rolora_alternates_factors():
    sim = sim_of("rolora")
    server0 = dict(sim.server)
    for rnd in (1, 2):
        trained, frozen = ("lora_B", "lora_A") if rnd == 1 else ("lora_A", "lora_B")
        out = play_round(sim, [0, 1], rnd)
        for msg, reply, _ in out:
            assert msg["rolora.factor"] == trained[-1]
            keys = list(reply.message)
            assert any(k.endswith(trained) for k in keys) and not any(k.endswith(frozen) for k in keys)
        for key in (k for k in sim.server if k.endswith(frozen)):
            assert torch.equal(sim.server[key], server0[key])
        server0 = dict(sim.server)


# -- LoRA-FAIR --------------------------------------------------------------------------------------------------
def test_lora_fair_gradient_matches_autograd_and_correction_raises_the_cosine():
    g = torch.Generator().manual_seed(3)
    Bs = [0.1 * torch.randn(12, 2, generator=g, dtype=torch.float64) for _ in range(3)]
    As = [torch.randn(2, 10, generator=g, dtype=torch.float64) for _ in range(3)]
    B0, A = sum(Bs) / 3, sum(As) / 3
    B_s, A_s = torch.cat(Bs, 1), torch.cat(As, 0) / 3
    T = B_s @ A_s
    X = (B0 + 0.01 * torch.randn(12, 2, generator=g, dtype=torch.float64)).requires_grad_(True)
    M = X @ A
    loss = 1 - (M * T).sum() / (M.norm() * T.norm()) + 0.01 * (X - B0).norm()
    loss.backward()
    val, _, grad = fair_loss_grad(X.detach(), B0, B_s @ (A_s @ A.T), A @ A.T, float(T.norm()), 0.01)
    assert math.isclose(val, float(loss.detach()), rel_tol=1e-10) and torch.allclose(grad, X.grad, atol=1e-10)
    B1, before, after = fair_correction(B0, A, B_s, A_s, 0.01, 200, 0.01)
    dense = lambda B: float(((B @ A) * T).sum() / ((B @ A).norm() * T.norm()))  # noqa: E731
    assert math.isclose(before, dense(B0), rel_tol=1e-9) and math.isclose(after, dense(B1), rel_tol=1e-9)
    assert after > before + 1e-3


def test_lora_fair_reports_improved_cosine_in_a_round():
    sim = sim_of("lora-fair")
    sim.method.aggregate(sim.server, hand_replies(sim, [0, 1, 2]), 1)
    m = sim.method.pop_metrics()
    assert m["cos_after"] > m["cos_before"]


# -- ledger: each method's payload as its paper states -------------------------------------------------------------
def payload(msg) -> int:
    return sum(t.numel() * t.element_size() for t in msg.tensors().values())


@pytest.mark.parametrize("method", LORA)
def test_ledger_payload_matches_the_formula(method):
    sets = ("lora.ranks=[1,2]",) if method in HETERO else ()
    sim = sim_of(method, *sets)
    mods = list(lora_modules(sim.model).values())
    M, d_out, d_in = len(mods), mods[0].out_features, mods[0].in_features
    H = sum(p.numel() for p in sim.model.head_parameters().values())
    r_g = sim.info.rank
    last: dict[int, int] = {}
    prev_R = 0
    for rnd, clients in enumerate(ROUNDS, 1):
        out = play_round(sim, clients, rnd)
        for msg, reply, t in out:
            k = t.client
            r = sim.info.client_ranks[k]
            both = M * r * (d_in + d_out)
            if method == "ffa-lora":
                down = up = M * d_out * r + H
            elif method == "fedsa-lora":
                down = up = M * r * d_in + H
            elif method == "fedex-lora":
                down, up = both + H + (M * d_out * d_in if rnd > 1 else 0), both + H
            elif method == "flora":
                behind = (rnd - 1) - (last[k] - 1 if k in last else 0)
                extra = 0 if rnd == 1 else M * prev_R * (d_in + d_out) if behind == 1 else M * d_out * d_in
                down, up = H + extra, both + H
            elif method == "rolora":
                down, up = M * r_g * (d_in + d_out) + H, (M * d_out * r if rnd % 2 else M * r * d_in) + H
            else:                                                   # flexlora, federa, hetlora, lora-fair
                down = up = both + H
            assert payload(msg) == 4 * down, (method, rnd, k, "down")
            assert payload(reply.message) == 4 * up, (method, rnd, k, "up")
            for m in (msg, reply.message):
                assert 0 < m.nbytes() - payload(m) < 4096 and m.nbytes() == len(m.to_bytes())
        prev_R = sum(sim.info.client_ranks[k] for k in clients)
        last.update({k: rnd for k in clients})


def test_flora_sends_the_stack_in_sync_and_the_dense_base_when_behind():
    sim = sim_of("flora")
    play_round(sim, [0, 1], 1)
    play_round(sim, [1, 2], 2)
    in_sync, behind = sim.method.broadcast(sim.server, 1, 3), sim.method.broadcast(sim.server, 0, 3)
    assert any(k.endswith("merge_B") for k in in_sync) and not any(k.endswith("base_delta") for k in in_sync)
    assert any(k.endswith("base_delta") for k in behind) and not any(k.endswith("merge_B") for k in behind)
    bases = {k: v for k, v in sim.server.items() if k.endswith("base_delta")}
    play_round(sim, [0, 1, 3], 3)            # 0 and 3 get the dense base, 1 merges the stack itself
    for k in (0, 1, 3):
        assert all(torch.equal(sim.store[k][key], base) for key, base in bases.items())   # bit-identical bases


# -- registry, refusals, options --------------------------------------------------------------------------------
def test_registered_with_filled_attributes():
    methods = available_methods()
    for name in LORA:
        cls = methods[name]
        assert all(getattr(cls, a) for a in ("name", "description", "paper", "uplink", "downlink"))
        assert cls.supports_heterogeneous_ranks == (name in HETERO)


@pytest.mark.parametrize("method", sorted(set(LORA) - set(HETERO)))
def test_homogeneous_methods_refuse_heterogeneous_ranks(method):
    with pytest.raises(ValueError, match="lora.ranks"):
        sim_of(method, "lora.ranks=[1,2]")


def test_bad_options_and_corrections_are_refused():
    for method in ("fedsa-lora", "flora", "rolora"):
        with pytest.raises(ValueError, match="method.correction"):
            get_method(method, correction="scaffold")
    with pytest.raises(ValueError, match="method.correction"):
        sim_of("flexlora", "lora.ranks=[1,2]", "method.correction=scaffold")
    with pytest.raises(ValueError, match="method.aggregation"):
        get_method("hetlora", aggregation="mean")
    with pytest.raises(ValueError, match="method.lam"):
        get_method("lora-fair", lam=-1.0)


# -- end to end on the tiny task ------------------------------------------------------------------------------------
SMOKE = ([(m, ()) for m in LORA] + [(m, ("lora.ranks=[1,2]",)) for m in HETERO]
         + [("hetlora", ("lora.ranks=[1,2]", "method.aggregation=sparsity"))]
         + [(m, ("method.correction=fedprox+scaffold",)) for m in ("fedex-lora", "flexlora", "lora-fair", "hetlora")]
         + [("ffa-lora", ("method.correction=scaffold",))]
         + [(m, ("method.correction=fedprox",)) for m in ("fedsa-lora", "flora", "rolora")])


@pytest.mark.parametrize("method,sets", SMOKE)
def test_end_to_end_smoke(method, sets):
    sim = run_tiny(method, f'compare.methods=["{method}"]', *sets, rounds=2)
    assert len(sim.history) == 2 and math.isfinite(sim.history[-1]["accuracy"])
    assert all(torch.isfinite(v).all() for v in sim.server.tensors().values())
    assert len(sim.ledger.rows) == 4 and all(r["up"] > 0 and r["down"] > 0 for r in sim.ledger.rows)

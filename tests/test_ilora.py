"""ILoRA, ILoRA-S and FedIT+QR (methods/ilora.py, methods/fedit_qr.py): exact concatenated aggregation,
equal-rank reductions, the QR initialisation, control variates and the heterogeneous base."""

import numpy as np
import pytest
import torch

from fedlowrank.adapters.lora import lora_modules
from fedlowrank.linalg.lowrank import normalize_qr_signs
from fedlowrank.message import Message, Reply, State
from fedlowrank.methods import get_method
from fedlowrank.methods.base import SetupInfo
from fedlowrank.methods.ilora import RankAwareControlVariates, zero_pad
from fedlowrank.runtime.engine import wire

from helpers import run_tiny, tiny_simulation, tiny_task


def make(name, ranks, r_s, sizes=None, server_lr=1.0, **options):
    """A fresh tiny model (4 target modules of 32×32) with ``name`` set up for clients of ``ranks``."""
    model = tiny_task().build_model()
    method = get_method(name, **options)
    sizes = sizes or [10 * (k + 1) for k in range(len(ranks))]
    info = SetupInfo(num_clients=len(ranks), client_sizes=sizes, client_ranks=list(ranks), rank=r_s, alpha=4.0,
                     server_lr=server_lr)
    return method, model, method.setup(model, info)


def random_replies(method, server, clients, seed=0):
    g = torch.Generator().manual_seed(seed)
    replies = []
    for k in clients:
        r, n = method.info.client_ranks[k], method.info.client_sizes[k]
        msg = Message({key: torch.randn(v.shape, generator=g) for key, v in server.items() if key.startswith("head/")})
        for name in method._qr0:
            A, B = server[f"{name}.lora_A"], server[f"{name}.lora_B"]
            msg[f"{name}.lora_A"] = torch.randn(r, A.shape[1], generator=g)
            msg[f"{name}.lora_B"] = torch.randn(B.shape[0], r, generator=g)
        msg.update(num_examples=n, train_loss=0.0)
        replies.append(Reply(k, n, msg))
    return replies


def noop_replies(method, model, server, clients):
    """What clients that do not train send back: the factors they loaded (through the client code path)."""
    replies = []
    for k in clients:
        msg = wire(method.broadcast(server, k, 1))
        method.load_message(model, msg)
        out = Message({f"{n}.lora_{f}": getattr(m, f"lora_{f}").detach().clone()
                       for n, m in lora_modules(model).items() for f in "AB"})
        out.update({key: msg[key] for key in msg if key.startswith("head/")})
        replies.append(Reply(k, method.info.client_sizes[k], out))
    return replies


def weighted_products(method, replies, name):
    p = method.client_weights(replies).tolist()
    return sum(w * r.message[f"{name}.lora_B"].double() @ r.message[f"{name}.lora_A"].double()
               for w, r in zip(p, replies))


def effective_weights(model):
    return {n: (m.frozen_weight() + m.adapter_delta()).detach() for n, m in lora_modules(model).items()}


def pretrained_weights(model):
    return {n: m.base.weight.detach() for n, m in lora_modules(model).items()}


def rel_err(a, b):
    return max(float(torch.linalg.norm(a[k].double() - b[k].double()) / torch.linalg.norm(b[k].double())) for k in b)


def logits(net):
    batch = tiny_task().batch(np.arange(16))
    net.eval()
    with torch.no_grad():
        return net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


# -- aggregation (Alg. 2 on the clients' factors alone: the per_client base) --------------------------
@pytest.mark.parametrize("ranks", [[1, 2, 3], [2, 2, 2], [1, 5], [4]])
def test_concatenation_reproduces_weighted_sum_for_any_ranks(ranks):
    method, _, server = make("ilora", ranks, r_s=sum(ranks), hetero_base="per_client")
    replies = random_replies(method, server, range(len(ranks)))
    new = method.aggregate(server, replies, 1)
    assert method.pop_metrics()["trunc_err"] < 1e-5
    for name in method._qr0:
        B_s, A_s = new[f"{name}.lora_B"], new[f"{name}.lora_A"]
        target = weighted_products(method, replies, name)
        assert float(torch.linalg.norm(B_s.double() @ A_s.double() - target) / torch.linalg.norm(target)) < 1e-6
        torch.testing.assert_close(B_s.T @ B_s, torch.eye(B_s.shape[1]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("decomp", ["qr", "svd"])
def test_truncation_error_equals_trailing_block_of_R(decomp):
    method, _, server = make("ilora", [2, 3, 4], r_s=4, decomp=decomp, hetero_base="per_client")
    replies = random_replies(method, server, [0, 1, 2], seed=1)
    new = method.aggregate(server, replies, 1)
    err2 = total2 = 0.0
    for name in method._qr0:
        dW = weighted_products(method, replies, name)
        Qd, Rd = normalize_qr_signs(*torch.linalg.qr(dW))
        B_s, A_s = new[f"{name}.lora_B"].double(), new[f"{name}.lora_A"].double()
        err2 += float(torch.linalg.norm(dW - B_s @ A_s) ** 2)
        total2 += float(torch.linalg.norm(dW) ** 2)
        if decomp == "qr":  # the unpivoted QR's kept block is the dense QR's (factored route == dense route)
            torch.testing.assert_close(B_s, Qd[:, :4], atol=1e-5, rtol=0)
            assert abs(float(torch.linalg.norm(dW - B_s @ A_s)) - float(torch.linalg.norm(Rd[4:]))) < 1e-4
        else:               # Eckart–Young: the error is the tail of the singular values
            S = torch.linalg.svdvals(dW)
            assert abs(float(torch.linalg.norm(dW - B_s @ A_s)) - float(torch.linalg.norm(S[4:]))) < 1e-4
    m = method.pop_metrics()
    assert err2 > 1.0 and abs(m["trunc_err"] - err2 ** 0.5) < 1e-4 * err2 ** 0.5
    assert abs(m["trunc_err_rel"] - (err2 / total2) ** 0.5) < 1e-6


def test_svd_truncation_error_is_at_most_qr():
    errs = {}
    for decomp in ("qr", "svd"):
        method, _, server = make("ilora", [2, 3, 4], r_s=4, decomp=decomp, hetero_base="per_client")
        method.aggregate(server, random_replies(method, server, [0, 1, 2], seed=2), 1)
        errs[decomp] = method.pop_metrics()["trunc_err"]
    assert errs["svd"] < errs["qr"]


def test_personalised_slices_are_nested_and_sized_by_client_rank():
    method, _, server = make("ilora", [1, 2, 6], r_s=4, hetero_base="per_client")
    assert server[next(k for k in server if k.endswith("lora_A"))].shape[0] == 6      # r_max = max(r_s, r_k)
    new = method.aggregate(server, random_replies(method, server, [0, 1, 2]), 1)
    msgs = [method.broadcast(new, k, 2) for k in range(3)]
    for name in method._qr0:
        for k, r in enumerate([1, 2, 6]):
            assert msgs[k][f"{name}.lora_A"].shape[0] == r and msgs[k][f"{name}.lora_B"].shape[1] == r
            assert f"{name}.frozen_A" not in msgs[k]
        B1, B6 = msgs[1][f"{name}.lora_B"], msgs[2][f"{name}.lora_B"]
        assert torch.equal(B6[:, :2], B1)
    # downlink bytes depend on the client's rank only, not on how many clients there are
    big, _, big_server = make("ilora", [1, 2, 6] * 3, r_s=4, hetero_base="per_client")
    assert method.broadcast(server, 1, 1).nbytes() == big.broadcast(big_server, 4, 1).nbytes()


def test_server_lr_mixes_with_previous_global_adapter():
    method, _, server = make("ilora", [2, 3], r_s=3, server_lr=0.5, hetero_base="per_client")
    replies = random_replies(method, server, [0, 1], seed=3)
    new = method.aggregate(server, replies, 1)
    for name in method._qr0:
        old = server[f"{name}.lora_B"][:, :3].double() @ server[f"{name}.lora_A"][:3].double()
        mix = 0.5 * weighted_products(method, replies, name) + 0.5 * old
        B_s, A_s = new[f"{name}.lora_B"].double(), new[f"{name}.lora_A"].double()
        torch.testing.assert_close(B_s @ A_s, B_s @ B_s.T @ mix, atol=1e-4, rtol=0)   # projection of the mixture


# -- initialisation and the global model -------------------------------------------------------------
@pytest.mark.parametrize("hetero_base", ["per_client", "residual"])
def test_qr_init_leaves_outputs_unchanged(hetero_base):
    reference = logits(tiny_task().build_model().net)
    method, model, server = make("ilora", [1, 2, 3], r_s=3, hetero_base=hetero_base)
    method.load_global(model, server)
    torch.testing.assert_close(logits(model.net), reference, atol=1e-5, rtol=1e-5)
    Bs = []
    for k, r in enumerate([1, 2, 3]):
        method.load_message(model, wire(method.broadcast(server, k, 1)))
        assert all(m.rank == r and m.scale == 4.0 / 3 for m in lora_modules(model).values())   # constant s
        torch.testing.assert_close(logits(model.net), reference, atol=1e-5, rtol=1e-5)
        Bs.append(next(iter(lora_modules(model).values())).lora_B.detach().clone())
    # nested orthonormal starts: B_i^T B_j = [I | 0]
    torch.testing.assert_close(Bs[0].T @ Bs[2], torch.eye(3)[:1], atol=1e-6, rtol=0)
    torch.testing.assert_close(Bs[1].T @ Bs[2], torch.eye(3)[:2], atol=1e-6, rtol=0)


@pytest.mark.parametrize("hetero_base", ["per_client", "residual"])
def test_round_without_training_keeps_the_pretrained_global_model(hetero_base):
    method, model, server = make("ilora", [2, 4, 6], r_s=6, hetero_base=hetero_base)
    new = method.aggregate(server, noop_replies(method, model, server, [0, 1, 2]), 1)
    method.load_global(model, new)
    assert rel_err(effective_weights(model), pretrained_weights(model)) < 1e-5


def test_fedit_qr_zero_padding_damages_the_pretrained_weights():
    method, model, server = make("fedit-qr", [2, 4, 6], r_s=6)
    new = method.aggregate(server, noop_replies(method, model, server, [0, 1, 2]), 1)
    assert method.pop_metrics()["aggregation_err"] > 0.1
    method.load_global(model, new)
    assert rel_err(effective_weights(model), pretrained_weights(model)) > 0.05
    # homogeneous ranks: averaging identical factors is exact, the model stays pretrained
    method, model, server = make("fedit-qr", [4, 4, 4], r_s=4)
    new = method.aggregate(server, noop_replies(method, model, server, [0, 1, 2]), 1)
    assert method.pop_metrics()["aggregation_err"] < 1e-5
    method.load_global(model, new)
    assert rel_err(effective_weights(model), pretrained_weights(model)) < 1e-5


def test_fedit_qr_averages_zero_padded_factors_and_reports_its_bias():
    method, _, server = make("fedit-qr", [1, 3], r_s=3)
    replies = random_replies(method, server, [0, 1], seed=4)
    new = method.aggregate(server, replies, 1)
    p = method.client_weights(replies).tolist()
    err2 = 0.0
    for name in method._qr0:
        A = sum(w * zero_pad(r.message[f"{name}.lora_A"], (3, 32)) for w, r in zip(p, replies))
        B = sum(w * zero_pad(r.message[f"{name}.lora_B"], (32, 3)) for w, r in zip(p, replies))
        torch.testing.assert_close(new[f"{name}.lora_A"], A)
        torch.testing.assert_close(new[f"{name}.lora_B"], B)
        err2 += float(torch.linalg.norm(B.double() @ A.double() - weighted_products(method, replies, name)) ** 2)
    assert abs(method.pop_metrics()["aggregation_err"] - err2 ** 0.5) < 1e-4 * err2 ** 0.5


def test_residual_base_equals_per_client_with_equal_ranks():
    servers = []
    for base in ("per_client", "residual"):
        method, _, server = make("ilora", [3, 3, 3], r_s=3, hetero_base=base)
        msg = method.broadcast(server, 1, 1)
        assert not any(k.endswith("frozen_A") for k in msg)
        servers.append(method.aggregate(server, random_replies(method, server, [0, 1, 2], seed=5), 1))
    for key, v in servers[0].items():
        if isinstance(v, torch.Tensor):
            torch.testing.assert_close(servers[1][key], v, atol=1e-6, rtol=0)


def test_residual_client_starts_from_the_global_model():
    sim = run_tiny("ilora", "lora.ranks=[1,2,3]", "method.hetero_base=residual", rounds=1)
    assert not sim.history[0].get("rejected")
    method, model = sim.method, sim.model
    method.load_global(model, sim.server)
    glob = effective_weights(model)
    name = next(iter(method._qr0))
    for k, r in enumerate([1, 2, 3]):
        msg = wire(method.broadcast(sim.server, k, 2))
        assert msg[f"{name}.lora_A"].shape[0] == r and msg.get(f"{name}.frozen_A", torch.zeros(0, 1)).shape[0] == 3 - r
        method.load_message(model, msg)
        assert next(iter(lora_modules(model).values())).rank == r
        assert rel_err(effective_weights(model), glob) < 1e-5


# -- ILoRA-S ---------------------------------------------------------------------------------------------
def test_ilora_s_round_one_equals_ilora_then_differs():
    sets = ("lora.ranks=[1,2,3]", "run.clients_per_round=4", "train.lr=0.05")
    a = run_tiny("ilora", *sets, rounds=1)
    b = run_tiny("ilora-s", *sets, rounds=1)
    for key, v in a.server.items():
        assert torch.equal(v, b.server[key]) if isinstance(v, torch.Tensor) else v == b.server[key]
    a2, b2 = run_tiny("ilora", *sets, rounds=2), run_tiny("ilora-s", *sets, rounds=2)
    key = next(k for k in a2.server if k.endswith("lora_A"))
    assert not torch.allclose(a2.server[key], b2.server[key], atol=1e-4)
    # full participation: the server variate is the mean of the zero-padded client variates (Eqs. 16–17)
    for ckey in [k for k in b2.server if k.startswith("ilora_cv.c/")]:
        name = ckey[len("ilora_cv.c/"):]
        mean = torch.stack([zero_pad(b2.store[k]["ilora_cv.ci/" + name], b2.server[ckey].shape)
                            for k in range(4)]).mean(0)
        assert float(mean.abs().max()) > 0
        torch.testing.assert_close(b2.server[ckey], mean, atol=1e-6, rtol=1e-5)


def test_ilora_s_messages_carry_rank_sliced_control_variates():
    sim = run_tiny("ilora-s", "lora.ranks=[1,2,3]", rounds=1)
    for k, r in enumerate([1, 2, 3, 1]):
        msg = sim.method.broadcast(sim.server, k, 2)
        cv = {key: v for key, v in msg.items() if key.startswith("ilora_cv.c/")}
        assert len(cv) == 8
        assert all(v.shape[0 if key.endswith("lora_A") else 1] == r for key, v in cv.items())
    plain = run_tiny("ilora", "lora.ranks=[1,2,3]", rounds=1)
    for row, base in zip(sim.ledger.rows, plain.ledger.rows):   # uplink = ILoRA's + Δc_A, Δc_B (4 modules 32×32)
        dc_bytes = 4 * [1, 2, 3, 1][row["client"]] * (32 + 32) * 4
        assert dc_bytes < row["up"] - base["up"] < dc_bytes + 1024


def test_rank_aware_control_variates_mechanics():
    cv = RankAwareControlVariates("mean")
    server = State()
    cv.init_server(server, {"m.lora_A": (3, 2), "m.lora_B": (2, 3)})
    server["ilora_cv.c/m.lora_A"] = torch.arange(6.0).reshape(3, 2)
    server["ilora_cv.c/m.lora_B"] = torch.ones(2, 3)
    msg = Message({k: (v[:2] if k.endswith("lora_A") else v[:, :2]) for k, v in cv.broadcast(server).items()})
    A, B, head = (torch.nn.Parameter(torch.zeros(s)) for s in ((2, 2), (2, 2), (4,)))
    params = {"m.lora_A": A, "m.lora_B": B, "head/w": head}
    state = State({"ilora_cv.ci/m.lora_A": torch.full((2, 2), 0.5)})
    cv.start(msg, state, params)
    raw = [torch.full((2, 2), 1.0), torch.full((2, 2), 3.0)]
    for g in raw:
        for p in params.values():
            p.grad = g.clone() if p.dim() == 2 else torch.ones(4)
        cv.grad(params)
        torch.testing.assert_close(A.grad, g + torch.arange(4.0).reshape(2, 2) - 0.5)   # g + c[:r] − c_k
        torch.testing.assert_close(B.grad, g + 1.0)                                      # c_k starts at 0
        assert torch.equal(head.grad, torch.ones(4))                                     # no variate on the head
    out = cv.finish(params, state, None)
    torch.testing.assert_close(out["ilora_cv.dc/m.lora_A"], torch.full((2, 2), 2.0 - 0.5))
    torch.testing.assert_close(state["ilora_cv.ci/m.lora_A"], torch.full((2, 2), 2.0))
    other = Message({"ilora_cv.dc/m.lora_A": torch.ones(3, 2), "ilora_cv.dc/m.lora_B": torch.ones(2, 3)})
    before = server["ilora_cv.c/m.lora_A"].clone()
    cv.aggregate(server, [Reply(0, 5, Message(out)), Reply(1, 500, other)], num_clients=10)
    expect = before + 0.5 * (zero_pad(out["ilora_cv.dc/m.lora_A"], (3, 2)) + torch.ones(3, 2))   # unweighted mean
    torch.testing.assert_close(server["ilora_cv.c/m.lora_A"], expect)


# -- options ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,options,match", [
    ("ilora", {"decomp": "lu"}, "method.decomp"),
    ("ilora", {"hetero_base": "shared"}, "method.hetero_base"),
    ("ilora-s", {"cv_grad": "full"}, "method.cv_grad"),
    ("ilora", {"correction": "scaffold"}, "method.correction"),
    ("fedit-qr", {"correction": "fedprox+scaffold"}, "method.correction"),
])
def test_bad_options_raise(name, options, match):
    with pytest.raises(ValueError, match=match):
        get_method(name, **options)


def test_residual_base_needs_client_ranks_at_most_server_rank():
    with pytest.raises(ValueError, match="method.hetero_base"):
        make("ilora", [1, 4], r_s=2, hetero_base="residual")


@pytest.mark.parametrize("name,sets", [("ilora", ()), ("ilora-s", ("method.hetero_base=residual",)), ("fedit-qr", ())])
def test_tiny_run_with_fedprox_trains_and_replies_pass_the_runtime_checks(name, sets):
    sim = tiny_simulation(name, "lora.ranks=[1,2]", "method.correction=fedprox",
                          "train.lr=0.05", *sets, rounds=2)
    sim.run()
    assert all(np.isfinite(row["train_loss"]) and "accuracy" in row and not row.get("rejected") for row in sim.history)
    assert sim.history[0]["train_loss"] != sim.history[1]["train_loss"]


# -- the heterogeneous base -------------------------------------------------------------------------------
def client_start_weights(method, model, server, k):
    method.load_message(model, wire(method.broadcast(server, k, 2)))
    return effective_weights(model)


def test_default_base_starts_every_client_from_the_pretrained_model_after_a_round_without_training():
    """Eq. 7 keeps each client's local model at θ0 + (its adapter); with the default ``residual`` base a round
    without training leaves every client's next start at W0 exactly, at any mix of ranks."""
    assert get_method("ilora").hetero_base == "residual" and get_method("ilora-s").hetero_base == "residual"
    method, model, server = make("ilora", [2, 4, 6], r_s=6)
    new = method.aggregate(server, noop_replies(method, model, server, [0, 1, 2]), 1)
    for k in range(3):
        assert rel_err(client_start_weights(method, model, new, k), pretrained_weights(model)) < 1e-5


def test_per_client_base_scales_w0_directions_by_one_minus_s_times_missing_share():
    """Alg. 1 read literally: after a round without training, client k's j-th QR direction of W0 is scaled by
    1 − s(1 − w_j), w_j = Σ_{k: r_k > j} π_k (the measured sign flips on MiniLM when s(1 − w_j) > 1)."""
    method, model, server = make("ilora", [2, 4, 6], r_s=6, hetero_base="per_client")
    new = method.aggregate(server, noop_replies(method, model, server, [0, 1, 2]), 1)
    s, w = method.scale, method.direction_share
    weights = client_start_weights(method, model, new, 2)                     # the rank-6 client
    for name, (Q0, R0) in method._qr0.items():
        W0 = lora_modules(model)[name].base.weight.double()
        expected = W0 - s * (Q0 * (1 - w)) @ R0
        torch.testing.assert_close(weights[name].double(), expected, atol=1e-5, rtol=0)
    assert float((1 - s * (1 - w)).min()) < 1 - 1e-3   # the directions beyond rank 2 are scaled

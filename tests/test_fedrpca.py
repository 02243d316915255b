"""FedRPCA server step (methods/fedrpca.py) on a hand-built model with hand-made replies, and end to end."""

import math

import pytest
import torch
from torch import nn

from fedlowrank.adapters.model import AdaptedModel
from fedlowrank.linalg.rpca import robust_pca_reference
from fedlowrank.message import Message, Reply
from fedlowrank.methods import get_method
from fedlowrank.methods.base import SetupInfo

F64 = torch.float64


def setup(name="fedrpca", in_f=40, out_f=30, rank=4, K=8, weighting="uniform", **opts):
    """A 2-target model (``0``, ``2``) with a head (``4``), set up by the method; returns (method, server). FedRPCA
    runs the paper's solver unless told otherwise: these tests hold it to the paper's reference iterates."""
    torch.manual_seed(0)
    if name == "fedrpca":
        opts.setdefault("rpca_solver", "admm")
    net = nn.Sequential(nn.Linear(in_f, out_f), nn.ReLU(), nn.Linear(out_f, out_f), nn.ReLU(), nn.Linear(out_f, 3))
    model = AdaptedModel(net, ["0", "2"], ["4.weight", "4.bias"])
    method = get_method(name, **opts)
    info = SetupInfo(num_clients=K, client_sizes=[10 + 3 * k for k in range(K)], client_ranks=[rank] * K,
                     rank=rank, alpha=2.0 * rank, weighting=weighting)
    return method, method.setup(model, info)


def trained(server):
    return [k for k in server if k.endswith((".lora_A", ".lora_B")) or k.startswith("head/")]


def replies(server, deltas):
    """Replies carrying ``server[key] + delta[key]`` for every trained key (missing keys: no change)."""
    out = []
    for k, d in enumerate(deltas):
        msg = Message({key: server[key] + d.get(key, torch.zeros_like(server[key])) for key in trained(server)})
        msg.update(num_examples=10 + 3 * k, train_loss=1.0)
        out.append(Reply(k, 10 + 3 * k, msg))
    return out


def common_plus_noise(server, K, seed, noise=0.7, scale=1e-2):
    """Client updates sharing a direction per key: ``scale·(c·u + noise·zᵢ)``."""
    g = torch.Generator().manual_seed(seed)
    base = {key: torch.randn(server[key].shape, generator=g) for key in trained(server)}
    return [{key: scale * ((0.5 + torch.rand(1, generator=g)) * u + noise * torch.randn(u.shape, generator=g))
             for key, u in base.items()} for _ in range(K)]


def update(old, new, key):
    return (new[key] - old[key]).to(F64)


def test_beta_one_with_folded_residual_is_fedavg_bit_for_bit():
    fedit, server = setup("fedit", weighting="num_examples")
    rpca, server2 = setup(beta=1.0, fold_residual=True, weighting="num_examples")
    reps = replies(server, common_plus_noise(server, 8, seed=1))
    a, b = fedit.aggregate(server, reps, 1), rpca.aggregate(server2, reps, 1)
    for key in trained(server):
        assert torch.equal(a[key], b[key]), key


def test_beta_one_is_fedavg_up_to_the_admm_tolerance():
    fedit, server = setup("fedit")
    rpca, _ = setup(beta=1)
    reps = replies(server, common_plus_noise(server, 8, seed=2))
    a, b = fedit.aggregate(server, reps, 1), rpca.aggregate(server, reps, 1)
    for key in trained(server):
        ua, ub = update(server, a, key), update(server, b, key)
        assert float((ua - ub).norm()) <= 1e-6 * float(ua.norm()), key


def test_adaptive_update_is_mean_L_plus_beta_mean_S_of_the_reference_rpca():
    method, server = setup(beta_scope="per_matrix")
    deltas = common_plus_noise(server, 8, seed=3)
    reps = replies(server, deltas)
    new = method.aggregate(server, reps, 1)
    diag = method.pop_metrics()
    for key in method.lora_keys(server):
        X = torch.stack([(r.message[key] - server[key]).to(F64).flatten() for r in reps], dim=1)   # M_X [numel, K]
        ref = robust_pca_reference(X)
        Mbar, Lbar, Sbar = X.mean(1), ref.L.mean(1), ref.S.mean(1)
        beta = float(Mbar.norm() / Sbar.norm())
        expected = (Lbar + beta * Sbar).view(server[key].shape)
        assert float((update(server, new, key) - expected).norm()) <= 2e-6 * float(expected.norm()), key
        assert float((beta * Sbar).norm()) == pytest.approx(float(Mbar.norm()))        # β = 1/E ⇒ ‖β·S̄‖ = ‖M̄‖
        assert diag[f"rpca/{key}/beta"] == pytest.approx(beta, rel=1e-6)
        assert diag[f"rpca/{key}/iterations"] == int(ref.iterations)
    # the head is plainly averaged
    head = "head/4.weight"
    assert torch.allclose(new[head], torch.stack([r.message[head] for r in reps]).mean(0), atol=1e-7)


def test_identical_clients_give_fedavg_without_nan():
    method, server = setup()
    d = common_plus_noise(server, 1, seed=4)[0]
    reps = replies(server, [d] * 6)
    new = method.aggregate(server, reps, 1)
    diag = method.pop_metrics()
    for key in trained(server):
        assert torch.isfinite(new[key]).all()
        assert torch.allclose(new[key], server[key] + d[key], rtol=1e-6, atol=1e-7), key
    assert diag["rpca/beta_mean"] == 1.0 and diag["rpca/nnz_S_mean"] == 0.0 and diag["rpca/E_mean"] == 0.0


def test_one_client_and_zero_updates_give_fedavg():
    method, server = setup()
    d = common_plus_noise(server, 1, seed=5)[0]
    one = method.aggregate(server, replies(server, [d]), 1)
    for key in trained(server):
        assert torch.allclose(one[key], server[key] + d[key], atol=1e-7)
    # A frozen on every client (FFA-LoRA-like): M_A = 0 must leave A unchanged, without NaN
    deltas = [{k: v for k, v in dk.items() if not k.endswith(".lora_A")} for dk in common_plus_noise(server, 5, seed=6)]
    new = method.aggregate(server, replies(server, deltas), 1)
    diag = method.pop_metrics()
    for key in method.lora_keys(server, ("A",)):
        assert torch.equal(new[key], server[key])
        assert diag[f"rpca/{key}/iterations"] == 0 and diag[f"rpca/{key}/beta"] == 1.0
    assert all(math.isfinite(v) for v in diag.values())


def test_structure_diagnostics_on_common_plus_noise_updates():
    """Paper Fig. 1: L's columns are more alike than the raw updates, S's are nearly orthogonal; E < 1."""
    method, server = setup(in_f=384, out_f=64, K=10)
    method.aggregate(server, replies(server, common_plus_noise(server, 10, seed=7, noise=1.0)), 1)
    diag = method.pop_metrics()
    assert diag["rpca/cos_L_mean"] > diag["rpca/cos_M_mean"] + 0.2
    assert diag["rpca/cos_M_mean"] > 0.2 and abs(diag["rpca/cos_S_mean"]) < 0.15
    assert 0 < diag["rpca/E_mean"] < 1 and diag["rpca/beta_A_mean"] > 1
    assert diag["rpca/not_converged"] == 0 and diag["rpca/residual_max"] <= 1e-7
    key = "0.lora_A"
    E_A = [diag[f"rpca/{k}/E"] for k in ("0.lora_A", "2.lora_A")]
    assert diag[f"rpca/{key}/beta"] == pytest.approx(len(E_A) / sum(E_A))      # β_A = 1/E_A (per factor type)
    assert 1 <= diag[f"rpca/{key}/rank_L"] <= 10 and 0 < diag[f"rpca/{key}/nnz_S"] <= 1


def test_toy_example_beta_M_recovers_the_sum_of_client_specific_parts():
    """Spec §2.8 test 7: ΔXᵢ = τ_P + τᵢ (τᵢ sparse, disjoint): FedRPCA with β = M ≈ τ_P + Σ τᵢ, FedAvg is not."""
    K = 10
    method, server = setup(in_f=384, out_f=16, K=K, beta=float(K))
    key = "0.lora_A"
    shape = server[key].shape                                 # [4, 384]: 1536 entries
    g = torch.Generator().manual_seed(8)
    tau_p = 0.01 * torch.randn(shape, generator=g)
    owner = torch.randint(0, 4 * K, shape, generator=g)      # each entry belongs to ≤ 1 client: 2.5% each
    spikes = 0.05 * torch.sign(torch.randn(shape, generator=g))
    taus = [torch.where(owner == k, spikes, 0.0) for k in range(K)]
    new = method.aggregate(server, replies(server, [{key: tau_p + t} for t in taus]), 1)
    ideal = (tau_p + sum(taus)).to(F64)
    fedavg = (tau_p + sum(taus) / K).to(F64)
    err_rpca = float((update(server, new, key) - ideal).norm() / ideal.norm())
    err_avg = float((fedavg - ideal).norm() / ideal.norm())
    assert err_rpca < 0.1 < 0.5 < err_avg


@pytest.mark.parametrize("granularity,groups", [("per_module_concat", {"0", "2"}), ("global", {"global"})])
def test_granularities(granularity, groups):
    fedit, server = setup("fedit")
    reps = replies(server, common_plus_noise(server, 6, seed=9))
    folded, _ = setup(granularity=granularity, beta=1.0, fold_residual=True)
    a, b = fedit.aggregate(server, reps, 1), folded.aggregate(server, reps, 1)
    assert all(torch.equal(a[k], b[k]) for k in trained(server))
    adaptive, _ = setup(granularity=granularity, head_agg="rpca")
    new = adaptive.aggregate(server, reps, 1)
    diag = adaptive.pop_metrics()
    names = {k[len("rpca/"):].rsplit("/", 1)[0] for k in diag if k.rsplit("/", 1)[0] != "rpca"}
    assert names == groups | {"head/4.weight", "head/4.bias"}
    assert not torch.allclose(new["head/4.weight"], a["head/4.weight"])      # the head went through RPCA


def test_global_beta_scope_and_clipping():
    method, server = setup(beta_scope="global")
    reps = replies(server, common_plus_noise(server, 8, seed=10))
    method.aggregate(server, reps, 1)
    diag = method.pop_metrics()
    betas = [v for k, v in diag.items() if k.endswith("/beta")]
    assert len(betas) == 4 and max(betas) == min(betas) == pytest.approx(1 / diag["rpca/E_mean"])
    clipped, _ = setup(beta_max=1.5, beta_min=1.2)
    clipped.aggregate(server, reps, 1)
    betas = [v for k, v in clipped.pop_metrics().items() if k.endswith("/beta")]
    assert all(1.2 <= b <= 1.5 for b in betas) and max(betas) == 1.5


@pytest.mark.parametrize("opts,option", [({"beta": "fixed"}, "method.beta"), ({"beta": 0}, "method.beta"),
                                          ({"beta": True}, "method.beta"),
                                          ({"granularity": "layer"}, "method.granularity"),
                                          ({"beta_scope": "module"}, "method.beta_scope"),
                                          ({"head_agg": "frozen"}, "method.head_agg"),
                                          ({"beta_min": 2.0, "beta_max": 1.0}, "method.beta_min"),
                                          ({"rpca_max_iter": 0}, "method.rpca_max_iter"),
                                          ({"rpca_solver": "ialm"}, "method.rpca_solver"),
                                          ({"rpca_device": "gpu"}, "method.rpca_device"),
                                          ({"correction": "moon"}, "method.correction")])
def test_bad_options_name_the_option(opts, option):
    with pytest.raises(ValueError, match=option):
        get_method("fedrpca", **opts)


def test_end_to_end_with_scaffold_on_the_tiny_task():
    from helpers import run_tiny

    sim = run_tiny("fedrpca", "method.correction=scaffold", "partition.num_clients=4", "run.clients_per_round=3",
                   rounds=2)
    diag = sim.history[-1]["diagnostics"]
    assert 0 < diag["rpca/beta_mean"] < math.inf and diag["rpca/iterations_mean"] >= 1
    assert all(math.isfinite(v) for v in diag.values())
    control = [v for k, v in sim.server.items() if k.startswith("scaffold.c/")]
    assert control and any(float(c.abs().max()) > 0 for c in control)        # aggregate_corrections ran
    assert all(torch.isfinite(v).all() for k, v in sim.server.items() if isinstance(v, torch.Tensor))


def test_default_beta_is_per_factor_type():
    """App. B.3: β_A = 1/E_A and β_B = 1/E_B, E of a factor type averaged across the layers (Fig. 7); the update
    of each matrix is then FedAvg + (β_type − 1)·S·p of its own RPCA."""
    method, server = setup()
    assert method.beta_scope == "per_factor"
    reps = replies(server, common_plus_noise(server, 8, seed=12))
    new = method.aggregate(server, reps, 1)
    diag = method.pop_metrics()
    per_matrix, _ = setup(beta_scope="per_matrix")
    per_matrix.aggregate(server, reps, 1)
    own = per_matrix.pop_metrics()
    for factor in ("A", "B"):
        keys = [k for k in method.lora_keys(server) if k.endswith(f".lora_{factor}")]
        E = [diag[f"rpca/{k}/E"] for k in keys]
        assert len(set(E)) == len(E) == 2                                 # the layers' E differ ...
        for k in keys:                                                    # ... and share one β
            assert diag[f"rpca/{k}/beta"] == pytest.approx(len(E) / sum(E), rel=1e-12)
            assert own[f"rpca/{k}/beta"] == pytest.approx(1 / diag[f"rpca/{k}/E"], rel=1e-12)
    for k in method.lora_keys(server):
        X = torch.stack([(r.message[k] - server[k]).to(F64).flatten() for r in reps], dim=1)
        ref = robust_pca_reference(X)
        expected = (X.mean(1) + (diag[f"rpca/{k}/beta"] - 1) * ref.S.mean(1)).view(server[k].shape)
        assert float((update(server, new, k) - expected).norm()) <= 2e-6 * float(expected.norm()), k


def test_rpca_solver_and_device_errors_list_the_allowed_values(monkeypatch):
    with pytest.raises(ValueError, match="method.rpca_solver must be one of admm, adaptive; got 'ialm'"):
        get_method("fedrpca", rpca_solver="ialm")
    with pytest.raises(ValueError, match="method.rpca_device must be one of auto, cpu, cuda, cuda:N; got 'gpu'"):
        get_method("fedrpca", rpca_device="gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    method, server = setup(rpca_device="cuda")                  # the syntax is fine; the hardware is checked in use
    with pytest.raises(ValueError, match="method.rpca_device = 'cuda' but CUDA is not available"):
        method.aggregate(server, replies(server, common_plus_noise(server, 4, seed=13)), 1)
    auto, _ = setup(rpca_device="auto")                         # no CUDA: auto is the CPU
    auto.aggregate(server, replies(server, common_plus_noise(server, 4, seed=13)), 1)


def test_adaptive_solver_gives_the_exact_admm_update_at_tight_tolerance():
    """``rpca_solver = "adaptive"`` (the default) changes the solver, not the decomposition: at tol 1e-12 the
    FedRPCA update, β and the diagnostics agree with the paper's ADMM."""
    assert get_method("fedrpca").rpca_solver == "adaptive"
    tight = dict(rpca_tol=1e-12, rpca_max_iter=20000)
    exact, server = setup(**tight)
    fast, _ = setup(rpca_solver="adaptive", **tight)
    reps = replies(server, common_plus_noise(server, 8, seed=14))
    a, b = exact.aggregate(server, reps, 1), fast.aggregate(server, reps, 1)
    da, db = exact.pop_metrics(), fast.pop_metrics()
    for key in trained(server):
        ua, ub = update(server, a, key), update(server, b, key)
        assert float((ua - ub).norm()) <= 1e-6 * float(ua.norm()), key
    for key in exact.lora_keys(server):
        assert db[f"rpca/{key}/beta"] == pytest.approx(da[f"rpca/{key}/beta"], rel=1e-6)
        assert db[f"rpca/{key}/rank_L"] == da[f"rpca/{key}/rank_L"]
        assert db[f"rpca/{key}/iterations"] < da[f"rpca/{key}/iterations"]
    assert db["rpca/not_converged"] == 0 and db["rpca/residual_max"] <= 1e-12


def test_end_to_end_with_the_default_adaptive_solver_on_the_tiny_task():
    from helpers import run_tiny

    sim = run_tiny("fedrpca", "partition.num_clients=4", "run.clients_per_round=3", rounds=2)
    diag = sim.history[-1]["diagnostics"]
    assert 0 < diag["rpca/beta_mean"] < math.inf and diag["rpca/iterations_mean"] >= 1
    assert diag["rpca/not_converged"] == 0 and diag["rpca/residual_max"] <= 1e-7
    assert all(math.isfinite(v) for v in diag.values())
    assert all(torch.isfinite(v).all() for k, v in sim.server.items() if isinstance(v, torch.Tensor))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("solver", ["admm", "adaptive"])
def test_rpca_on_cuda_gives_the_cpu_update(solver):
    tight = dict(rpca_tol=1e-10, rpca_max_iter=5000, rpca_solver=solver)
    cpu, server = setup(**tight)
    gpu, _ = setup(rpca_device="cuda", **tight)
    reps = replies(server, common_plus_noise(server, 8, seed=15))
    a, b = cpu.aggregate(server, reps, 1), gpu.aggregate(server, reps, 1)
    for key in trained(server):
        assert b[key].device.type == "cpu"                     # the server state stays on the CPU
        ua, ub = update(server, a, key), update(server, b, key)
        assert float((ua - ub).norm()) <= 1e-6 * float(ua.norm()), key

"""Robust PCA kernel (linalg/rpca.py): the fast batched ADMM against the paper's plain loop, the adaptive solver
against the exact ADMM at tight tolerance, PCP invariants, and the device path."""

import pytest
import torch

from fedlowrank.linalg.rpca import SOLVERS, pcp_parameters, robust_pca, robust_pca_reference

F64 = torch.float64
TIGHT = dict(tol=1e-12, max_iter=20000)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def common_plus_noise(n: int, m: int, seed: int, noise: float = 0.7) -> torch.Tensor:
    """Client updates with a shared direction: ``u·vᵀ + noise``, ``[n, m]`` (columns = clients)."""
    g = gen(seed)
    u = torch.randn(n, 1, dtype=F64, generator=g)
    return u * (0.5 + torch.rand(1, m, dtype=F64, generator=g)) + noise * torch.randn(n, m, dtype=F64, generator=g)


def planted(n: int, m: int, seed: int, rank: int = 1, frac: float = 0.05) -> torch.Tensor:
    """Candès-style low rank + sparse: a random rank-``rank`` matrix plus ±5 spikes on a ``frac`` random support."""
    g = gen(seed)
    L0 = torch.randn(n, rank, dtype=F64, generator=g) @ torch.randn(rank, m, dtype=F64, generator=g)
    support = torch.rand(n, m, generator=g) < frac
    return L0 + torch.where(support, 5.0 * torch.sign(torch.randn(n, m, dtype=F64, generator=g)), 0.0)


def gaussian(n: int, m: int, seed: int) -> torch.Tensor:
    return torch.randn(n, m, dtype=F64, generator=gen(seed))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


@pytest.mark.parametrize("shape,seed", [((300, 8), 0), ((120, 16), 1), ((7, 40), 2), ((25, 25), 3)])
def test_matches_plain_reference(shape, seed):
    M = common_plus_noise(*shape, seed=seed)
    fast, ref = robust_pca(M), robust_pca_reference(M)
    assert int(fast.iterations) == int(ref.iterations) > 1
    assert rel(fast.L, ref.L) < 1e-6 and rel(fast.S, ref.S) < 1e-6
    assert int(fast.rank) == int(ref.rank)
    assert bool(fast.converged) and float(fast.residual) <= 1e-7
    assert float(fast.residual) == pytest.approx(float(ref.residual), rel=1e-4)


def test_batch_equals_one_by_one_with_own_stopping():
    """Matrices of one batch with different scales, iteration counts and an all-zero one."""
    Ms = [common_plus_noise(200, 10, seed=s, noise=z) for s, z in ((4, 0.3), (5, 1.0), (6, 0.5))]
    Ms = [Ms[0], 1e-4 * Ms[1], torch.zeros(200, 10, dtype=F64), Ms[2]]
    batch = robust_pca(torch.stack(Ms), chunk_bytes=2 * 200 * 10 * 8)      # two chunks of two
    iters = set()
    for i, M in enumerate(Ms):
        ref = robust_pca_reference(M)
        assert int(batch.iterations[i]) == int(ref.iterations)
        if i == 2:
            assert int(batch.iterations[i]) == 0 and batch.L[i].abs().max() == 0 and batch.S[i].abs().max() == 0
            continue
        iters.add(int(ref.iterations))
        assert rel(batch.L[i], ref.L) < 1e-6 and rel(batch.S[i], ref.S) < 1e-6
    assert len(iters) == 3                           # they did stop at different iterations


def test_not_converged_returns_last_iterate():
    M = common_plus_noise(150, 6, seed=7)
    fast, ref = robust_pca(M, max_iter=5), robust_pca_reference(M, max_iter=5)
    assert int(fast.iterations) == 5 and not bool(fast.converged) and not bool(ref.converged)
    assert float(fast.residual) > 1e-7
    assert rel(fast.L, ref.L) < 1e-9 and rel(fast.S, ref.S) < 1e-9


@pytest.mark.parametrize("solver", SOLVERS)
def test_planted_low_rank_plus_sparse_is_recovered(solver):
    g = gen(1)
    n, m = 800, 20
    L0 = torch.randn(n, 1, dtype=F64, generator=g) * (0.5 + torch.rand(1, m, dtype=F64, generator=g))
    support = torch.rand(n, m, generator=g) < 0.05
    S0 = torch.where(support, 5.0 * torch.sign(torch.randn(n, m, dtype=F64, generator=g)), 0.0)
    out = robust_pca(L0 + S0, solver=solver)
    assert rel(out.L, L0) < 1e-5 and rel(out.S, S0) < 1e-5
    assert torch.equal(out.S != 0, support)
    assert int(out.rank) == 1


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("c", [1e-3, 37.0])
def test_positive_homogeneity(c, solver):
    """Exact for the paper's ADMM; for the adaptive solver up to its float32 warm-up's rounding, which moves the
    starting point of its float64 phase by ~1e-7 and its result by less than its tolerance."""
    M = common_plus_noise(250, 12, seed=8)
    base, scaled = robust_pca(M, solver=solver), robust_pca(c * M, solver=solver)
    eps = 1e-10 if solver == "admm" else 1e-6
    if solver == "admm":
        assert int(scaled.iterations) == int(base.iterations)
    assert rel(scaled.L, c * base.L) < eps and rel(scaled.S, c * base.S) < eps


@pytest.mark.parametrize("solver", SOLVERS)
def test_row_permutation_and_transpose_equivariance(solver):
    M = common_plus_noise(250, 12, seed=9)
    perm = torch.randperm(250, generator=gen(10))
    base, permuted, transposed = (robust_pca(X, solver=solver) for X in (M, M[perm], M.T.contiguous()))
    eps = 1e-10 if solver == "admm" else 1e-6          # see test_positive_homogeneity
    assert rel(permuted.L, base.L[perm]) < eps and rel(permuted.S, base.S[perm]) < eps
    assert rel(transposed.L, base.L.T) < eps and rel(transposed.S, base.S.T) < eps


def test_identical_columns_give_zero_sparse_part():
    """``c·1ᵀ`` is its own PCP optimum (S = 0) when ``max|c_j| ≤ λ√K·‖c‖``, which holds here."""
    c = 1.0 + torch.rand(500, 1, dtype=F64, generator=gen(11))
    M = c.expand(500, 10).contiguous()
    assert float(c.abs().max()) <= (10 / 500) ** 0.5 * float(c.norm())
    out = robust_pca(M)
    assert bool((out.S == 0).all())
    assert rel(out.L, M) < 1e-12
    assert int(out.rank) == 1 and bool(out.converged)


def test_zero_matrix_and_defaults():
    out = robust_pca(torch.zeros(30, 4))
    assert out.L.dtype == F64 and int(out.iterations) == 0 and bool(out.converged)
    assert out.L.abs().max() == 0 and out.S.abs().max() == 0
    lam, mu = pcp_parameters(torch.ones(2, 30, 4))
    assert lam == pytest.approx(30 ** -0.5) and torch.allclose(mu, torch.full((2,), 30 * 4 / (4 * 120.0)))


@pytest.mark.parametrize("kwargs", [dict(M=torch.zeros(3)), dict(M=torch.zeros(2, 0)),
                                    dict(M=torch.ones(3, 3), tol=0.0), dict(M=torch.ones(3, 3), max_iter=0),
                                    dict(M=torch.ones(3, 3), solver="ialm")])
def test_bad_input_raises(kwargs):
    with pytest.raises(ValueError):
        robust_pca(**kwargs)


# -- the adaptive solver (over-relaxed ADMM, residual-balanced penalty) ------------------------------------------

@pytest.mark.parametrize("kind,shape,seed", [("lora", (1536, 20), 12), ("lora", (1536, 10), 13), ("lora", (384, 4), 14),
                                             ("gauss", (1536, 20), 15), ("gauss", (20, 1536), 16),
                                             ("gauss", (1536, 50), 17), ("planted", (1536, 20), 18),
                                             ("planted", (20, 1536), 19), ("planted", (384, 4), 20)])
def test_adaptive_solver_matches_exact_admm_at_tight_tolerance(kind, shape, seed):
    """Both run to ‖M − L − S‖ ≤ 1e-12‖M‖ (the adaptive one also the dual residual): same PCP optimum."""
    M = {"lora": common_plus_noise, "gauss": gaussian, "planted": planted}[kind](*shape, seed=seed)
    exact, fast = robust_pca(M, **TIGHT), robust_pca(M, solver="adaptive", **TIGHT)
    assert bool(exact.converged) and bool(fast.converged)
    assert rel(fast.L, exact.L) < 1e-6 and rel(fast.S, exact.S) < 1e-6
    assert int(fast.rank) == int(exact.rank)


def test_adaptive_solver_at_default_tolerance_is_nearer_the_optimum_in_fewer_iterations():
    """At tol 1e-7 the paper's primal-only rule stops ~1e-4 from the optimum on LoRA-like updates; the adaptive
    solver's primal + dual rule stops nearer, in well under half the iterations."""
    M = torch.stack([common_plus_noise(1536, 20, seed=s) for s in (21, 22)])
    opt = robust_pca(M, **TIGHT)
    exact, fast = robust_pca(M), robust_pca(M, solver="adaptive")
    assert bool(fast.converged.all()) and float(fast.residual.max()) <= 1e-7
    for i in range(2):
        assert rel(fast.L[i], opt.L[i]) < 0.2 * rel(exact.L[i], opt.L[i])
        assert rel(fast.S[i], opt.S[i]) < 0.2 * rel(exact.S[i], opt.S[i])
    assert 2 * int(fast.iterations.sum()) < int(exact.iterations.sum())


def test_adaptive_batch_equals_one_by_one_with_own_penalty_and_stopping():
    """Up to the float32 warm-up's rounding (batched and single products round differently, and differently again
    with each CPU's kernels: on AVX-512 MKL one problem stops 12 iterations apart in 328, on AVX2 none does)."""
    Ms = [common_plus_noise(200, 10, seed=s, noise=z) for s, z in ((23, 0.3), (24, 1.0))] + [planted(200, 10, seed=25)]
    Ms = [Ms[0], 1e-4 * Ms[1], torch.zeros(200, 10, dtype=F64), Ms[2]]
    batch = robust_pca(torch.stack(Ms), solver="adaptive", chunk_bytes=2 * 200 * 10 * 8)     # two chunks of two
    iters = set()
    for i, M in enumerate(Ms):
        one = robust_pca(M, solver="adaptive")
        assert abs(int(batch.iterations[i]) - int(one.iterations)) <= max(4, 0.05 * int(one.iterations))
        if i == 2:
            assert int(one.iterations) == 0 and batch.L[i].abs().max() == 0 and batch.S[i].abs().max() == 0
            continue
        iters.add(int(one.iterations))
        assert bool(batch.converged[i]) and rel(batch.L[i], one.L) < 1e-6 and rel(batch.S[i], one.S) < 1e-6
    assert len(iters) == 3


def test_adaptive_not_converged_returns_last_iterate():
    M = common_plus_noise(150, 6, seed=26)
    out = robust_pca(M, solver="adaptive", max_iter=5)
    assert int(out.iterations) == 5 and not bool(out.converged) and float(out.residual) > 1e-7
    assert torch.isfinite(out.L).all() and torch.isfinite(out.S).all()


# -- device path ----------------------------------------------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("solver", SOLVERS)
def test_runs_on_the_device_of_its_input(solver):
    M = torch.stack([common_plus_noise(1536, 20, seed=s) for s in (27, 28)] + [torch.zeros(1536, 20, dtype=F64)])
    cpu = robust_pca(M, tol=1e-10, max_iter=5000, solver=solver)
    gpu = robust_pca(M.cuda(), tol=1e-10, max_iter=5000, solver=solver)
    for name in ("L", "S", "iterations", "residual", "rank", "converged"):
        assert getattr(gpu, name).is_cuda, name
    assert gpu.L.dtype == F64 and bool(gpu.converged.all())
    assert torch.equal(gpu.rank.cpu(), cpu.rank)
    for i in range(2):
        assert rel(gpu.L[i].cpu(), cpu.L[i]) < 1e-6 and rel(gpu.S[i].cpu(), cpu.S[i]) < 1e-6
    assert gpu.L[2].abs().max() == 0 and int(gpu.iterations[2]) == 0

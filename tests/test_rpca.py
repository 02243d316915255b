"""Robust PCA kernel (linalg/rpca.py): the fast batched ADMM against the paper's plain loop, and PCP invariants."""

import pytest
import torch

from fedlowrank.linalg.rpca import pcp_parameters, robust_pca, robust_pca_reference

F64 = torch.float64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def common_plus_noise(n: int, m: int, seed: int, noise: float = 0.7) -> torch.Tensor:
    """Client updates with a shared direction: ``u·vᵀ + noise``, ``[n, m]`` (columns = clients)."""
    g = gen(seed)
    u = torch.randn(n, 1, dtype=F64, generator=g)
    return u * (0.5 + torch.rand(1, m, dtype=F64, generator=g)) + noise * torch.randn(n, m, dtype=F64, generator=g)


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


def test_planted_low_rank_plus_sparse_is_recovered():
    g = gen(1)
    n, m = 800, 20
    L0 = torch.randn(n, 1, dtype=F64, generator=g) * (0.5 + torch.rand(1, m, dtype=F64, generator=g))
    support = torch.rand(n, m, generator=g) < 0.05
    S0 = torch.where(support, 5.0 * torch.sign(torch.randn(n, m, dtype=F64, generator=g)), 0.0)
    out = robust_pca(L0 + S0)
    assert rel(out.L, L0) < 1e-5 and rel(out.S, S0) < 1e-5
    assert torch.equal(out.S != 0, support)
    assert int(out.rank) == 1


@pytest.mark.parametrize("c", [1e-3, 37.0])
def test_positive_homogeneity(c):
    M = common_plus_noise(250, 12, seed=8)
    base, scaled = robust_pca(M), robust_pca(c * M)
    assert int(scaled.iterations) == int(base.iterations)
    assert rel(scaled.L, c * base.L) < 1e-10 and rel(scaled.S, c * base.S) < 1e-10


def test_row_permutation_and_transpose_equivariance():
    M = common_plus_noise(250, 12, seed=9)
    perm = torch.randperm(250, generator=gen(10))
    base, permuted, transposed = robust_pca(M), robust_pca(M[perm]), robust_pca(M.T.contiguous())
    assert rel(permuted.L, base.L[perm]) < 1e-10 and rel(permuted.S, base.S[perm]) < 1e-10
    assert rel(transposed.L, base.L.T) < 1e-10 and rel(transposed.S, base.S.T) < 1e-10


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
                                    dict(M=torch.ones(3, 3), tol=0.0), dict(M=torch.ones(3, 3), max_iter=0)])
def test_bad_input_raises(kwargs):
    with pytest.raises(ValueError):
        robust_pca(**kwargs)

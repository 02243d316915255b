"""Gram adapter and Gram kernels (FLoRG): dense references, exact Gram aggregation (eq. 4), Procrustes (Theorem 1) and its
invariants."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedlowrank.adapters.gram import GramLinear, gram_bases, init_gram_A
from fedlowrank.linalg.gram import (aggregate_gram, canonical_rows, gram_distance, gram_factor, gram_sum,
                                    procrustes, procrustes_closed_form, stack_gram_factors, stacked_gram_factor)

D = torch.float64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_orthogonal(n: int, g: torch.Generator) -> torch.Tensor:
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=D))
    return Q


def clients(k=12, r=3, N=4, eps=0.1, seed=0):
    """A previous global factor A [r, k], N client factors A + eps·noise, and normalised random weights."""
    g = gen(seed)
    A = torch.randn(r, k, generator=g, dtype=D)
    As = [A + eps * torch.randn(r, k, generator=g, dtype=D) for _ in range(N)]
    w = torch.rand(N, generator=g, dtype=D) + 0.1
    return A, As, (w / w.sum()).tolist()


# -- adapter -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(8, 8), (10, 6), (6, 10)])
@pytest.mark.parametrize("init", ["semi_orthogonal", "svd"])
def test_bases_are_semi_orthogonal(shape, init):
    W = torch.randn(*shape, generator=gen(1), dtype=D)
    L, R = gram_bases(W, init, gen(2))
    k = min(shape)
    assert L.shape == (shape[0], k) and R.shape == (k, shape[1])
    torch.testing.assert_close(L.T @ L, torch.eye(k, dtype=D), atol=1e-10, rtol=0)
    torch.testing.assert_close(R @ R.T, torch.eye(k, dtype=D), atol=1e-10, rtol=0)


def test_bases_are_seeded():
    W = torch.randn(10, 6, generator=gen(1))
    for init in ("semi_orthogonal", "kaiming"):
        L1, R1 = gram_bases(W, init, gen(5))
        L2, R2 = gram_bases(W, init, gen(5))
        L3, _ = gram_bases(W, init, gen(6))
        assert torch.equal(L1, L2) and torch.equal(R1, R2) and not torch.equal(L1, L3)
    with pytest.raises(ValueError, match="method.bases_init"):
        gram_bases(W, "nndsvd", gen(0))


def gram_layer(out_f=7, in_f=5, r=2, scale=1.5, seed=0, A_ref=None):
    torch.manual_seed(seed)
    lin = nn.Linear(in_f, out_f).to(D)
    L, R = gram_bases(lin.weight, "semi_orthogonal", gen(seed + 1))
    mod = GramLinear(lin, L, R, r, scale, A_ref=A_ref)
    mod.set_A(torch.randn(r, min(in_f, out_f), generator=gen(seed + 2), dtype=D))
    return mod


@pytest.mark.parametrize("shape", [(7, 5), (5, 7), (6, 6)])
def test_factored_forward_equals_dense(shape):
    ref = torch.randn(2, min(shape), generator=gen(9), dtype=D)
    for A_ref in (None, ref):
        mod = gram_layer(*shape, A_ref=A_ref)
        x = torch.randn(4, shape[1], generator=gen(3), dtype=D)
        A = mod.gram_A.detach()
        dense = A.T @ A if A_ref is None else A.T @ A - A_ref.T @ A_ref
        W = mod.base.weight + mod.scale * mod.L @ dense @ mod.R
        torch.testing.assert_close(mod(x), x @ W.T + mod.base.bias, atol=1e-12, rtol=0)
        torch.testing.assert_close(mod.adapter_delta(), W - mod.base.weight, atol=1e-12, rtol=0)


@pytest.mark.parametrize("shape", [(7, 5), (5, 7)])
def test_autograd_gradient_matches_eq2(shape):
    """∇_A = s·A(H + Hᵀ), H = Lᵀ G Rᵀ, G = ∂loss/∂W (eq. 2), through the factored forward."""
    mod = gram_layer(*shape)
    x = torch.randn(6, shape[1], generator=gen(4), dtype=D)
    upstream = torch.randn(6, shape[0], generator=gen(5), dtype=D)
    (mod(x) * upstream).sum().backward()
    G = upstream.T @ x                                 # ∂/∂W of Σ upstream ⊙ (x Wᵀ)
    H = mod.L.T @ G @ mod.R.T
    expected = mod.scale * mod.gram_A.detach() @ (H + H.T)
    torch.testing.assert_close(mod.gram_A.grad, expected, atol=1e-12, rtol=1e-10)


def test_zero_A_has_zero_gradient_and_is_refused_at_init():
    mod = gram_layer()
    mod.set_A(torch.zeros_like(mod.gram_A))
    mod(torch.randn(3, 5, generator=gen(1), dtype=D)).square().sum().backward()
    assert torch.count_nonzero(mod.gram_A.grad) == 0
    with pytest.raises(ValueError, match="method.init_perturbation"):
        init_gram_A(2, 5, 1.0, "gaussian", 0.0, gen(0))
    with pytest.raises(ValueError, match="method.a_init"):
        init_gram_A(2, 5, 1.0, "zeros", 1e-2, gen(0))


def test_gaussian_init_scale():
    """s·σ²·k = perturbation: ‖s AᵀA‖₂ ≈ perturbation for k ≫ r."""
    A = init_gram_A(4, 400, 4.0, "gaussian", 1e-2, gen(0), D)
    assert 0.5e-2 < 4.0 * torch.linalg.matrix_norm(A @ A.T, ord=2) < 2e-2


def test_wrong_shapes_are_refused():
    mod = gram_layer()
    with pytest.raises(ValueError, match="does not fit"):
        mod.set_A(torch.zeros(3, 5, dtype=D))
    lin = nn.Linear(5, 7)
    with pytest.raises(ValueError, match="lora.rank"):
        GramLinear(lin, torch.zeros(7, 5), torch.zeros(5, 5), 6, 1.0)


# -- aggregation ----------------------------------------------------------------------------------------------

def test_gram_sum_is_the_weighted_sum_of_client_grams():
    _, As, w = clients(k=9, r=2, N=5)
    Q = gram_sum(As, w)
    ref = sum(wn * A.T @ A for wn, A in zip(w, As))
    torch.testing.assert_close(Q, ref, atol=1e-14, rtol=0)
    torch.testing.assert_close(Q, Q.T, atol=1e-14, rtol=0)
    assert torch.linalg.eigvalsh(Q).min() > -1e-12
    M = stack_gram_factors(As, w)
    torch.testing.assert_close(M.T @ M, Q, atol=1e-14, rtol=0)
    # the model-level claim: L Q R is the weighted average of the clients' updates L AₙᵀAₙ R
    L, R = gram_bases(torch.randn(11, 9, generator=gen(3), dtype=D), "semi_orthogonal", gen(4))
    torch.testing.assert_close(L @ Q @ R, sum(wn * L @ A.T @ A @ R for wn, A in zip(w, As)), atol=1e-13, rtol=0)
    with pytest.raises(ValueError, match=">= 0"):
        gram_sum(As, [-1.0] + w[1:])


@pytest.mark.parametrize("factor", ["eigh", "stacked"])
def test_canonical_factor_reproduces_Q(factor):
    _, As, w = clients(k=10, r=2, N=3)
    M = stack_gram_factors(As, w)
    Q = M.T @ M
    At = gram_factor(Q) if factor == "eigh" else stacked_gram_factor(M)
    assert At.shape == (6, 10)                                 # r' = N·r < k
    torch.testing.assert_close(At.T @ At, Q, atol=1e-12, rtol=0)
    norms = At.norm(dim=1)
    assert torch.all(norms[:-1] >= norms[1:])                  # eigenvalues descending


@pytest.mark.parametrize("route", ["eigh", "stacked_svd", "closed_form"])
def test_gram_preserved_when_rank_at_most_r(route):
    """Prop-2: r' ≤ r ⇒ Gram(A⁺) = Q (here one client of rank 2 under a rank-3 global factor's row count)."""
    g = gen(7)
    A_prev = torch.randn(3, 8, generator=g, dtype=D)
    As = [torch.randn(2, 8, generator=g, dtype=D), torch.randn(1, 8, generator=g, dtype=D)]
    A_next, r_prime = aggregate_gram(A_prev, As, [0.3, 0.7], route)
    assert r_prime in (3, None)
    torch.testing.assert_close(A_next.T @ A_next, gram_sum(As, [0.3, 0.7]), atol=1e-11, rtol=0)


@pytest.mark.parametrize("r,N", [(3, 4), (3, 1), (2, 6), (3, 6)])   # (3, 6): N·r > k, r' = k
def test_three_routes_agree(r, N):
    A, As, w = clients(k=14, r=r, N=N, eps=0.3, seed=r + N)
    out = {route: aggregate_gram(A, As, w, route)[0] for route in ("eigh", "stacked_svd", "closed_form")}
    torch.testing.assert_close(out["stacked_svd"], out["eigh"], atol=1e-8, rtol=0)
    torch.testing.assert_close(out["closed_form"], out["eigh"], atol=1e-8, rtol=0)


def test_result_independent_of_eigenvector_sign_and_rotation():
    """Prop-1: Ã → OÃ (signs, order, rotations) leaves S*Ã unchanged."""
    A, As, w = clients(k=12, r=3, N=4)
    At = stacked_gram_factor(stack_gram_factors(As, w))
    base = procrustes(A, At) @ At
    g = gen(11)
    signs = torch.diag(torch.where(torch.rand(At.shape[0], generator=g) < 0.5, -1.0, 1.0).to(D))
    for O in (signs, torch.eye(At.shape[0], dtype=D).flip(0), random_orthogonal(At.shape[0], g)):
        OAt = O @ At
        torch.testing.assert_close(procrustes(A, OAt) @ OAt, base, atol=1e-11, rtol=0)


@pytest.mark.parametrize("r,N", [(3, 4), (4, 1)])
def test_procrustes_optimality(r, N):
    """S* is feasible and maximises Tr(A Ãᵀ Sᵀ); it minimises ‖SÃ − A‖ too when r' ≤ r (not asserted otherwise)."""
    A, As, w = clients(k=12, r=r, N=N, eps=0.5, seed=3)
    At = stacked_gram_factor(stack_gram_factors(As, w))
    rp = At.shape[0]
    S = procrustes(A, At)
    assert S.shape == (r, rp)
    small = S @ S.T if rp >= r else S.T @ S
    torch.testing.assert_close(small, torch.eye(min(r, rp), dtype=D), atol=1e-12, rtol=0)
    X = A @ At.T
    best_tr, best_dist = torch.trace(X @ S.T), (S @ At - A).norm()
    g = gen(13)
    for _ in range(100):
        O = random_orthogonal(max(r, rp), g)
        S_rand = O[:r, :rp]                                    # orthonormal rows (rp ≥ r) or columns (rp ≤ r)
        assert torch.trace(X @ S_rand.T) <= best_tr + 1e-10
        if rp <= r:
            assert (S_rand @ At - A).norm() >= best_dist - 1e-10


def test_procrustes_is_a_noop_when_the_factor_already_equals_A():
    A = torch.randn(3, 9, generator=gen(2), dtype=D)
    torch.testing.assert_close(procrustes(A, A), torch.eye(3, dtype=D), atol=1e-12, rtol=0)
    # fixed point: every client returns Aᵗ ⇒ Aᵗ⁺¹ = Aᵗ, whatever the decomposition route
    for route in ("eigh", "stacked_svd", "closed_form"):
        A_next, _ = aggregate_gram(A, [A.clone(), A.clone()], [0.4, 0.6], route)
        torch.testing.assert_close(A_next, A, atol=1e-10, rtol=0)


def test_truncation_and_ablation():
    """r' > r: Gram(A⁺) ⪯ Q, not equal (Prop-3); w/o Procrustes = canonical top-r rows, zero-padded if r' < r."""
    A, As, w = clients(k=12, r=2, N=4, eps=0.3)
    M = stack_gram_factors(As, w)
    A_next, r_prime = aggregate_gram(A, As, w, "stacked_svd")
    assert A_next.shape == (2, 12) and r_prime == 8
    gap = torch.linalg.eigvalsh(M.T @ M - A_next.T @ A_next)
    assert gap.min() > -1e-10 and gap.max() > 1e-3
    no_align, _ = aggregate_gram(A, As, w, "eigh", align=False)
    torch.testing.assert_close(no_align, gram_factor(M.T @ M)[:2], atol=0, rtol=0)
    padded = canonical_rows(torch.ones(1, 4, dtype=D), 3)
    assert torch.equal(padded, torch.tensor([[1.0] * 4, [0.0] * 4, [0.0] * 4], dtype=D))
    with pytest.raises(ValueError, match="method.server_decomp"):
        aggregate_gram(A, As, w, "closed_form", align=False)
    with pytest.raises(ValueError, match="method.server_decomp"):
        aggregate_gram(A, As, w, "qr")


def test_closed_form_pseudo_inverse_when_rank_deficient():
    """rank(A Ãᵀ) < r: the pseudo-inverse root still returns a factor whose Gram is ⪯ Q and finite."""
    A = torch.zeros(3, 8, dtype=D)
    A[0] = torch.randn(8, generator=gen(1), dtype=D)
    As = [torch.randn(3, 8, generator=gen(2), dtype=D)]
    out = procrustes_closed_form(A, stack_gram_factors(As, [1.0]))
    assert torch.isfinite(out).all() and out[1:].abs().max() < 1e-12


def test_gram_distance_matches_dense():
    g = gen(4)
    F1, F2 = torch.randn(3, 10, generator=g, dtype=D), torch.randn(5, 10, generator=g, dtype=D)
    dense = (F1.T @ F1 - F2.T @ F2).norm()
    assert abs(gram_distance(F1, F2) - float(dense)) < 1e-10 * float(dense)

"""Factored SVD / QR of stacked low-rank factors against dense references (linalg/lowrank.py)."""

import pytest
import torch

from fedlowrank.linalg.lowrank import (factored_basis, factored_qr, factored_svd, normalize_qr_signs,
                                       normalize_svd_signs, pad_basis, stack_factors, truncated_svd)


def random_factors(out, inp, ranks, seed=0):
    g = torch.Generator().manual_seed(seed)
    Bs = [torch.randn(out, r, generator=g) for r in ranks]
    As = [torch.randn(r, inp, generator=g) for r in ranks]
    w = torch.rand(len(ranks), generator=g, dtype=torch.float64)
    return Bs, As, w / w.sum()


def dense_sum(Bs, As, w):
    return sum(wk * B.double() @ A.double() for wk, B, A in zip(w.tolist(), Bs, As))


@pytest.mark.parametrize("ranks", [(2,), (2, 4, 6), (1, 8, 3, 3), (5, 5)])
def test_stacking_reproduces_weighted_sum_for_any_ranks(ranks):
    Bs, As, w = random_factors(12, 9, ranks)
    B_c, A_c = stack_factors(Bs, As, w)
    assert B_c.shape == (12, sum(ranks)) and A_c.shape == (sum(ranks), 9)
    torch.testing.assert_close(B_c @ A_c, dense_sum(Bs, As, w), rtol=0, atol=1e-12)


def test_stack_factors_rejects_mismatched_lists():
    with pytest.raises(ValueError):
        stack_factors([torch.zeros(3, 1)], [])


@pytest.mark.parametrize("out,inp,ranks", [(20, 15, (2, 3)), (16, 24, (1, 4, 2)), (10, 12, (6, 7)), (9, 7, (3, 5))])
def test_factored_qr_equals_dense_qr_up_to_signs(out, inp, ranks):
    Bs, As, w = random_factors(out, inp, ranks, seed=1)
    dW = dense_sum(Bs, As, w)
    Q, R = factored_qr(*stack_factors(Bs, As, w))
    Qd, Rd = normalize_qr_signs(*torch.linalg.qr(dW))
    m = min(sum(ranks), out, inp)                   # the unique part: rank(ΔW) generic = m
    assert Q.shape == (out, m) and R.shape == (m, inp)
    torch.testing.assert_close(Q, Qd[:, :m], rtol=0, atol=1e-9)
    torch.testing.assert_close(R, Rd[:m], rtol=0, atol=1e-9)
    torch.testing.assert_close(Q @ R, dW, rtol=0, atol=1e-10)
    assert torch.all(torch.diagonal(R) >= 0)
    assert torch.allclose(torch.triu(R), R)


def test_raw_qr_differs_in_signs_so_normalisation_matters():
    dW = dense_sum(*random_factors(8, 8, (8,), seed=3))
    Q, R = torch.linalg.qr(dW)
    Qn, Rn = normalize_qr_signs(Q, R)
    torch.testing.assert_close(Qn @ Rn, Q @ R)
    assert torch.all(torch.diagonal(Rn) >= 0)
    flipped = normalize_qr_signs(-Q, -R)            # a sign flip of the whole factorisation is undone
    torch.testing.assert_close(flipped[0], Qn)


@pytest.mark.parametrize("method", ["qr", "svd"])
def test_truncation_error_is_trailing_block_of_R(method):
    Bs, As, w = random_factors(14, 11, (2, 3, 4), seed=2)
    dW = dense_sum(Bs, As, w)
    Q, R = factored_basis(*stack_factors(Bs, As, w), method=method)
    torch.testing.assert_close(Q.T @ Q, torch.eye(Q.shape[1], dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(Q @ R, dW, rtol=0, atol=1e-10)
    for r in (1, 3, 6, 9):
        err = torch.linalg.norm(dW - Q[:, :r] @ R[:r])
        assert abs(float(err) - float(torch.linalg.norm(R[r:]))) < 1e-10
        # the truncation is the projection of ΔW on the kept columns (Property 3)
        torch.testing.assert_close(Q[:, :r] @ R[:r], Q[:, :r] @ Q[:, :r].T @ dW, rtol=0, atol=1e-10)


def test_svd_truncation_is_never_worse_than_qr():
    Bs, As, w = random_factors(14, 11, (2, 3, 4), seed=4)
    B_c, A_c = stack_factors(Bs, As, w)
    _, Rq = factored_basis(B_c, A_c, "qr")
    _, Rs = factored_basis(B_c, A_c, "svd")
    errs = [(float(torch.linalg.norm(Rs[r:])), float(torch.linalg.norm(Rq[r:]))) for r in range(1, 9)]
    assert all(s <= q + 1e-12 for s, q in errs)
    assert any(s < q - 1e-6 for s, q in errs)     # unpivoted QR is not Eckart–Young optimal


def test_factored_basis_rejects_unknown_method():
    with pytest.raises(ValueError, match="qr"):
        factored_basis(torch.ones(3, 1), torch.ones(1, 3), "lu")


def test_factored_svd_matches_dense_svd():
    Bs, As, w = random_factors(13, 10, (2, 2, 3), seed=5)
    dW = dense_sum(Bs, As, w)
    U, S, Vh = factored_svd(*stack_factors(Bs, As, w))
    torch.testing.assert_close(S[:7], torch.linalg.svdvals(dW)[:7], rtol=0, atol=1e-10)
    torch.testing.assert_close(U @ torch.diag(S) @ Vh, dW, rtol=0, atol=1e-10)
    Ur, Sr, Vhr = truncated_svd(*stack_factors(Bs, As, w), 3)
    err = torch.linalg.norm(dW - Ur @ torch.diag(Sr) @ Vhr)
    assert abs(float(err) - float(torch.linalg.norm(S[3:]))) < 1e-10


def test_normalize_svd_signs_is_deterministic():
    U, S, Vh = torch.linalg.svd(torch.randn(6, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64),
                                full_matrices=False)
    U1, V1 = normalize_svd_signs(U, Vh)
    U2, V2 = normalize_svd_signs(-U, -Vh)
    torch.testing.assert_close(U1, U2)
    torch.testing.assert_close(U1 * S @ V1, U * S @ Vh)


def test_pad_basis_completes_orthonormally_and_keeps_the_product():
    Bs, As, w = random_factors(10, 8, (2,), seed=6)
    Q, R = factored_qr(*stack_factors(Bs, As, w))
    Qp, Rp = pad_basis(Q, R, 5)
    assert Qp.shape == (10, 5) and Rp.shape == (5, 8)
    torch.testing.assert_close(Qp.T @ Qp, torch.eye(5, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(Qp @ Rp, Q @ R, rtol=0, atol=1e-12)
    assert torch.equal(Qp[:, :2], Q) and torch.count_nonzero(Rp[2:]) == 0
    Qt, Rt = pad_basis(Q, R, 1)
    assert torch.equal(Qt, Q[:, :1]) and torch.equal(Rt, R[:1])
    with pytest.raises(ValueError):
        pad_basis(Q, R, 11)

"""AJIVE kernel: planted recovery, rank selection, identifiability, compact = dense path, dense reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedlowrank.linalg.ajive import _identifiable, ajive, ajive_combine
from fedlowrank.seeding import torch_generator


def _orth(rows, cols, g):
    return torch.linalg.qr(torch.randn(rows, cols, generator=g, dtype=torch.float64))[0]


def _centered_orth(rows, cols, g):
    Z = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    return torch.linalg.qr(Z - Z.mean(0))[0]


def planted_views(n_views=4, N=80, dims=(12, 15, 10, 14), joint=2, indiv=2, noise=0.01, seed=0):
    """X_i = U_J D W_iᵀ + U_i E V_iᵀ + noise + column offsets; scores U_J [N, joint] shared and U_i individual
    (both with zero column means, so that centring keeps them)."""
    g = torch_generator(seed, "planted")
    U_J = _centered_orth(N, joint, g)
    views = []
    for i in range(n_views):
        d = dims[i % len(dims)]
        U_i = _centered_orth(N, indiv, g)
        X = 10 * U_J @ _orth(d, joint, g).T + 6 * U_i @ _orth(d, indiv, g).T
        X = X + noise * torch.randn(N, d, generator=g, dtype=torch.float64) + torch.randn(d, generator=g, dtype=torch.float64)
        views.append(X)
    return views, U_J


def max_principal_angle_deg(A, B):
    s = torch.linalg.svdvals(torch.linalg.qr(A)[0].T @ torch.linalg.qr(B)[0]).clamp(max=1.0)
    return float(torch.rad2deg(torch.arccos(s.min())))


def test_planted_joint_component_recovered_with_fixed_and_estimated_rank():
    views, U_J = planted_views()
    res = ajive(views, 4, joint_rank=2)
    assert res.joint_rank == 2 and max_principal_angle_deg(res.joint_basis, U_J) < 5
    est = ajive(views, 4, joint_rank=None, generator=torch_generator(0, "ajive"), n_wedin_samples=200,
                n_randdir_samples=200)
    assert est.selected_rank == 2 and est.cutoff is not None
    assert max_principal_angle_deg(est.joint_basis, U_J) < 5
    # the individual parts come back with their planted rank, and J + I + E = Xc
    full = ajive(views, 4, joint_rank=2, individual=True)
    for X, mu, (U, D, Vh) in zip(views, full.means, full.individual):
        assert U.shape[1] == 2
        resid = X - mu - full.joint(X - mu) - U @ torch.diag(D) @ Vh
        assert float(torch.linalg.norm(resid)) < 0.02 * float(torch.linalg.norm(X - mu))


def test_identifiability_removes_non_joint_columns():
    """Asking for more joint columns than exist: the check drops those too weak in some view (with 6 views a
    mixture of individual directions carries ≈ σ/√6 < θ = σ/2 of each view)."""
    views, U_J = planted_views(n_views=6, joint=1)
    assert ajive(views, 3, joint_rank=3, identifiability="off").joint_rank == 3
    kept = ajive(views, 3, joint_rank=3, identifiability="all")
    assert kept.joint_rank == 1 and kept.removed == [1, 2]
    assert max_principal_angle_deg(kept.joint_basis, U_J) < 5


def test_mvlearn_quirk_removes_at_most_one_column_per_view():
    U = torch.eye(4, dtype=torch.float64)[:, :3]
    Xc = torch.diag(torch.tensor([5.0, 0.1, 0.2, 3.0], dtype=torch.float64))  # columns 1 and 2 fail view 0
    other = torch.diag(torch.tensor([5.0, 5.0, 5.0, 5.0], dtype=torch.float64))
    assert _identifiable([Xc, other], [1.0, 1.0], U, "all") == [1, 2]
    assert _identifiable([Xc, other], [1.0, 1.0], U, "mvlearn") == [1]
    assert _identifiable([Xc, other], [1.0, 1.0], U, "off") == []


def test_compact_path_equals_dense_path():
    """Views S_i Qᵀ with a shared orthonormal Q [d_p, r]: AJIVE on S_i [N, r] gives the same state (QᵀQ = I)."""
    g = torch_generator(3, "compact")
    N, r, d_p = 40, 4, 25
    Q = _orth(d_p, r, g)
    shared = torch.rand(N, 2, generator=g, dtype=torch.float64) @ torch.rand(2, r, generator=g, dtype=torch.float64)
    S = [shared + 0.3 * torch.rand(N, r, generator=g, dtype=torch.float64) for _ in range(5)]
    w = torch.tensor([0.1, 0.3, 0.2, 0.25, 0.15], dtype=torch.float64)
    compact, rc = ajive_combine(S, w, r, r)
    dense, rd = ajive_combine([s @ Q.T for s in S], w, r, r)
    assert rc.joint_rank == rd.joint_rank
    torch.testing.assert_close(dense, compact @ Q.T, atol=1e-10, rtol=1e-9)
    randomized, _ = ajive_combine([s @ Q.T for s in S], w, r, r, svd="randomized", generator=torch_generator(0, "r"))
    torch.testing.assert_close(randomized, dense, atol=1e-9, rtol=1e-8)


def _numpy_reference(views, weights, signal_rank, joint_rank):
    """Textbook fixed-rank AJIVE + weighted joint parts with means restored (numpy, dense SVDs)."""
    views = [v.numpy() for v in views]
    centered, thresholds, scores = [], [], []
    for X in views:
        Xc = X - X.mean(axis=0)
        U, s, _ = np.linalg.svd(Xc, full_matrices=False)
        s = np.concatenate([s, np.zeros(1)])
        centered.append(Xc)
        thresholds.append((s[signal_rank - 1] + s[signal_rank]) / 2)
        scores.append(U[:, :signal_rank])
    UM = np.linalg.svd(np.concatenate(scores, axis=1), full_matrices=False)[0][:, :joint_rank]
    keep = [j for j in range(joint_rank)
            if all(np.linalg.norm(Xc.T @ UM[:, j]) >= th for Xc, th in zip(centered, thresholds))]
    UJ = UM[:, keep]
    return sum(w * (UJ @ UJ.T @ Xc + X.mean(axis=0)) for w, Xc, X in zip(weights, centered, views))


def test_matches_dense_numpy_reference():
    views, _ = planted_views(n_views=3, N=30, dims=(6, 6, 6), joint=2, indiv=1, noise=0.05, seed=4)
    w = [0.5, 0.3, 0.2]
    got, _ = ajive_combine(views, w, 3, 2)
    np.testing.assert_allclose(got.numpy(), _numpy_reference(views, w, 3, 2), atol=1e-9)


def test_no_joint_column_left_gives_weighted_means():
    g = torch_generator(7, "indep")
    views = [_orth(30, 2, g) @ torch.randn(2, 5, generator=g, dtype=torch.float64) + i for i in range(3)]
    out, res = ajive_combine(views, [0.2, 0.3, 0.5], 2, 1)
    assert res.joint_rank == 0
    means = sum(w * v.mean(0) for w, v in zip([0.2, 0.3, 0.5], views))
    torch.testing.assert_close(out, means.expand(30, 5))
    literal, _ = ajive_combine(views, [0.2, 0.3, 0.5], 2, 1, restore_means=False)
    assert float(literal.abs().max()) == 0.0


def test_one_view_is_returned_unchanged():
    g = torch_generator(8, "one")
    S = torch.rand(20, 4, generator=g, dtype=torch.float64)
    out, res = ajive_combine([S], [1.0], 4, 4)
    assert res.joint_rank == 4
    torch.testing.assert_close(out, S)


def test_bad_input():
    with pytest.raises(ValueError, match="same number of rows"):
        ajive([torch.zeros(3, 2), torch.zeros(4, 2)], 1, 1)
    with pytest.raises(ValueError, match="identifiability"):
        ajive([torch.zeros(3, 2)], 1, 1, identifiability="some")
    with pytest.raises(ValueError, match="generator"):
        ajive([torch.ones(3, 2)], 1, None)

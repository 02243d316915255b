"""GaLore optimiser and projectors: reduction to torch's optimisers, re-projection, seeded bases."""

from __future__ import annotations

import math

import pytest
import torch

from fedlowrank.linalg.projectors import canonical, projection_side, random_basis, rsvd_basis, svd_basis
from fedlowrank.seeding import torch_generator
from fedlowrank.training.galore import GaLore, seeded_basis

TORCH_OPT = {
    "sgd": lambda ps, wd: torch.optim.SGD(ps, lr=0.05, weight_decay=wd),
    "momentum": lambda ps, wd: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=wd),
    "adam": lambda ps, wd: torch.optim.Adam(ps, lr=0.05, weight_decay=wd),
    "adamw": lambda ps, wd: torch.optim.AdamW(ps, lr=0.05, weight_decay=wd),
}


def _grads(shape, steps, seed=0):
    g = torch_generator(seed, "test-grads")
    return [torch.randn(*shape, generator=g) for _ in range(steps)]


def _run(opt, p, grads):
    for G in grads:
        p.grad = G.clone()
        opt.step()
    return p.detach().clone()


@pytest.mark.parametrize("operator", list(TORCH_OPT))
@pytest.mark.parametrize("shape", [(6, 6), (7, 4), (3, 5)])
def test_full_rank_identity_projector_equals_torch(operator, shape):
    """r = min(m, n), Q = I, no refresh: every operator equals its torch.optim counterpart (with weight decay)."""
    W0 = torch.randn(*shape, generator=torch_generator(1, "w"))
    grads = _grads(shape, 6)
    ref = torch.nn.Parameter(W0.clone())
    expected = _run(TORCH_OPT[operator]([ref], 0.1), ref, grads)

    p = torch.nn.Parameter(W0.clone())
    m, n = shape
    d_p, d_u = (n, m) if projection_side(m, n) == "right" else (m, n)
    opt = GaLore([p], lr=0.05, operator=operator, weight_decay=0.1, rank=min(shape), tau=10_000, scale=1.0)
    opt.load_block(p, torch.eye(d_p), torch.zeros(d_u, d_p), refresh_at_start=False, warm=False)
    got = _run(opt, p, grads)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)

    q = torch.nn.Parameter(W0.clone())  # a dense group (the head) is the plain operator too
    dense = _run(GaLore([q], lr=0.05, operator=operator, weight_decay=0.1), q, grads)
    torch.testing.assert_close(dense, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("shape", [(8, 5), (4, 9)])
def test_projection_shapes_and_project_back(shape):
    """Buffers are [d_u, r]; one SGD step moves W by exactly −η α_g uncanon(G_c Q Qᵀ)."""
    m, n = shape
    side = projection_side(m, n)
    d_u, d_p = (m, n) if side == "right" else (n, m)
    W0 = torch.randn(*shape, generator=torch_generator(2, "w"))
    G = torch.randn(*shape, generator=torch_generator(3, "g"))
    p = torch.nn.Parameter(W0.clone())
    opt = GaLore([p], lr=0.1, operator="adamw", rank=2, tau=5, svd_refreshes=0, scale=2.0, seed=7)
    p.grad = G
    opt.step()
    st = opt.block_state(p)
    assert st["Q"].shape == (d_p, 2) and st["exp_avg"].shape == (d_u, 2) and st["exp_avg_sq"].shape == (d_u, 2)
    torch.testing.assert_close(st["Q"].T @ st["Q"], torch.eye(2), atol=1e-6, rtol=0)

    q = torch.nn.Parameter(W0.clone())
    sgd = GaLore([q], lr=0.1, operator="sgd", rank=2, tau=5, svd_refreshes=0, scale=2.0, seed=7)
    q.grad = G
    sgd.step()
    Q = seeded_basis(7, 0, 0, d_p, 2)
    expected = W0 - 0.1 * 2.0 * canonical(canonical(G, side) @ Q @ Q.T, side)
    torch.testing.assert_close(q.detach(), expected, rtol=1e-6, atol=1e-6)


def test_reprojection_keeps_v_nonnegative_and_literal_reading_does_not():
    """Refreshing to new random bases re-projects ṽ by ṽC: clamped (default) or squared stays ≥ 0, unclamped not."""
    shape, grads = (12, 10), _grads((12, 10), 8)
    results = {}
    for mode, clamp in (("linear", True), ("squared", False), ("linear", False)):
        p = torch.nn.Parameter(torch.zeros(shape))
        opt = GaLore([p], lr=1e-3, rank=3, tau=1, svd_refreshes=0, seed=3, v_reproject=mode, clamp_v=clamp)
        mins = []
        for G in grads:
            p.grad = G
            opt.step()
            mins.append(float(opt.block_state(p)["exp_avg_sq"].min()))
        results[(mode, clamp)] = (min(mins), opt.block_state(p))
    assert results[("linear", True)][0] >= 0 and results[("squared", False)][0] >= 0
    assert results[("linear", True)][1]["clamped"] > 0
    p = torch.nn.Parameter(torch.zeros(shape))  # the unclamped linear rule does produce negative entries before the update
    opt = GaLore([p], lr=1e-3, rank=3, tau=1, svd_refreshes=0, seed=3, clamp_v=False)
    negative = False
    for G in grads:
        p.grad = G
        st = opt.block_state(p)
        if st:
            C = st["Q"].T @ seeded_basis(3, 0, st["step"], 10, 3)
            negative |= bool(((st["exp_avg_sq"] @ C) < 0).any())
        opt.step()
    assert negative


def test_refresh_to_same_basis_changes_nothing():
    """Re-projection with Q_new = Q_old leaves the buffers unchanged."""
    grads = _grads((9, 6), 5)
    Q = seeded_basis(11, 0, 1, 6, 2)
    v0 = torch.rand(9, 2, generator=torch_generator(0, "v"))
    out = []
    for tau in (1, 100):  # with tau = 1 and S = 0 the refresh at t = 1 rebuilds exactly Q; tau = 100: no refresh
        p = torch.nn.Parameter(torch.ones(9, 6))
        opt = GaLore([p], lr=0.01, rank=2, tau=tau, svd_refreshes=0, seed=11)
        opt.load_block(p, Q, v0, refresh_at_start=False)
        _run(opt, p, grads[:2])
        out.append((p.detach().clone(), opt.block_state(p)["exp_avg_sq"]))
    torch.testing.assert_close(out[0][0], out[1][0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out[0][1], out[1][1], rtol=1e-6, atol=1e-9)


def test_seeded_projector_identical_on_server_and_client():
    """The client's basis after a random refresh is bit-identical to the server's rebuild from (s_k, b, j)."""
    p0, p1 = torch.nn.Parameter(torch.zeros(5, 8)), torch.nn.Parameter(torch.zeros(10, 6))
    opt = GaLore([p0, p1], lr=1e-3, rank=3, tau=2, svd_refreshes=1, seed=123456789, block_ids=[4, 7])
    for G0, G1 in zip(_grads((5, 8), 5, 1), _grads((10, 6), 5, 2)):
        p0.grad, p1.grad = G0, G1
        opt.step()
    for p, block, d_p in ((p0, 4, 5), (p1, 7, 6)):
        st = opt.block_state(p)
        assert st["basis"] == 2
        assert torch.equal(st["Q"], seeded_basis(123456789, block, 2, d_p, 3))
    assert not torch.equal(seeded_basis(1, 0, 2, 6, 3), seeded_basis(1, 0, 3, 6, 3))
    assert not torch.equal(seeded_basis(1, 0, 2, 6, 3), seeded_basis(1, 1, 2, 6, 3))


def test_svd_and_rsvd_bases_span_the_top_singular_space():
    """G = U Σ Vᵀ [30, 20]: the right block G and the left block Gᵀ both project onto span(V) (20-dim side)."""
    g = torch_generator(5, "lowrank")
    U = torch.linalg.qr(torch.randn(30, 3, generator=g))[0]
    V = torch.linalg.qr(torch.randn(20, 3, generator=g))[0]
    G = U @ torch.diag(torch.tensor([5.0, 3.0, 2.0])) @ V.T
    for W in (G, G.T):
        side = projection_side(*W.shape)
        for Q in (svd_basis(W, 3, side), rsvd_basis(W, 3, side, torch_generator(0, "rsvd"))):
            assert Q.shape == (20, 3)
            torch.testing.assert_close(Q @ Q.T, V @ V.T, atol=1e-5, rtol=0)
    Q = random_basis(7, 7, torch_generator(0, "r"))
    torch.testing.assert_close(Q.T @ Q, torch.eye(7, dtype=Q.dtype), atol=1e-6, rtol=0)


def test_warm_start_disables_v_bias_correction():
    """With a warm ṽ the first Adam step uses c₂ = 1; the literal reading keeps 1 − β₂."""
    G = torch.randn(4, 4, generator=torch_generator(9, "g"))
    v0 = torch.full((4, 4), 0.5)
    steps = {}
    for literal in (False, True):
        p = torch.nn.Parameter(torch.zeros(4, 4))
        opt = GaLore([p], lr=1.0, operator="adam", rank=4, tau=100, warm_bias_correction=literal, eps=0.0)
        opt.load_block(p, torch.eye(4), v0, refresh_at_start=False)
        p.grad = G
        opt.step()
        steps[literal] = -p.detach()
    m = 0.1 * G / 0.1
    v = 0.999 * v0 + 0.001 * G * G
    torch.testing.assert_close(steps[False], m / v.sqrt(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(steps[True], m / (v / 0.001).sqrt(), rtol=1e-5, atol=1e-6)


def test_bad_options_name_the_option():
    p = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="galore.operator"):
        GaLore([p], lr=0.1, operator="lion")
    with pytest.raises(ValueError, match="galore.v_reproject"):
        GaLore([p], lr=0.1, v_reproject="cubic")


def test_linear_reprojection_blows_up_the_adam_ratio_and_squared_does_not():
    """Why ``squared`` is the default: the paper's ṽ ← max(ṽC, 0) zeroes entries whose m̃C is not zero, so
    |m̃|/√ṽ explodes at random refreshes; ṽ(C⊙C) keeps it within √r of its value before (Cauchy–Schwarz)."""
    worst = {}
    for mode in ("linear", "squared"):
        g = torch_generator(0, "drift")
        p = torch.nn.Parameter(torch.zeros(10, 100))
        opt = GaLore([p], lr=0.01, rank=4, tau=5, svd_refreshes=1, v_reproject=mode)
        ratios = []
        for _ in range(40):
            p.grad = torch.randn(10, 100, generator=g) + 3
            opt.step()
            st = opt.block_state(p)
            ratios.append(float((st["exp_avg"].abs() / (st["exp_avg_sq"].sqrt() + 1e-8)).max()))
        worst[mode] = max(ratios)
    assert worst["linear"] > 1000 and worst["squared"] < 20


def _first_step_after_sync(v_sync: str, T: int = 5, beta2: float = 0.999) -> tuple[float, float]:
    """Constant gradient G: a cold client runs T steps and syncs ṽ (raw or bias-corrected); the next round loads it
    warm with m̃ = 0. Returns (‖first step of the cold round‖, ‖first step after the sync‖) in units of lr."""
    G = torch.randn(4, 4, generator=torch_generator(3, "g"))
    p = torch.nn.Parameter(torch.zeros(4, 4))
    opt = GaLore([p], lr=1.0, operator="adamw", rank=4, tau=100, eps=0.0, betas=(0.9, beta2))
    steps = []
    for _ in range(T):
        before = p.detach().clone()
        p.grad = G.clone()
        opt.step()
        steps.append(float((p.detach() - before).norm()))
    st = opt.block_state(p)
    v = opt.second_moment(p) if v_sync == "bias_corrected" else st["exp_avg_sq"]
    q = torch.nn.Parameter(torch.zeros(4, 4))
    warm = GaLore([q], lr=1.0, operator="adamw", rank=4, tau=100, eps=0.0, betas=(0.9, beta2))
    warm.load_block(q, st["Q"], v, refresh_at_start=False)
    q.grad = G.clone()
    warm.step()
    return steps[0], float(q.detach().norm())


def test_synced_second_moment_gives_warm_adamw_sized_first_steps():
    """The bias-corrected ṽ/(1 − β₂ᵀ) makes the first step after a sync the size of a warm AdamW
    step (|ũ| = 1 per coordinate under a constant gradient, as the cold round's); the raw EMA makes it
    1/√(β₂(1 − β₂ᵀ) + 1 − β₂) ≈ 1/√((T + 1)(1 − β₂)) ≈ 12.9× larger at T = 5."""
    cold, fixed = _first_step_after_sync("bias_corrected")
    _, raw = _first_step_after_sync("raw")
    assert cold == pytest.approx(4.0, rel=1e-5)          # 16 coordinates of size 1
    assert fixed == pytest.approx(cold, rel=1e-5)
    assert raw / cold == pytest.approx(1 / math.sqrt(0.999 * (1 - 0.999**5) + 0.001), rel=1e-4)


def test_second_moment_of_a_warm_block_is_its_buffer():
    p = torch.nn.Parameter(torch.zeros(4, 4))
    opt = GaLore([p], lr=0.1, operator="adam", rank=4, tau=100)
    opt.load_block(p, torch.eye(4), torch.full((4, 4), 0.5), refresh_at_start=False)
    _run(opt, p, _grads((4, 4), 3))
    assert torch.equal(opt.second_moment(p), opt.block_state(p)["exp_avg_sq"])


@pytest.mark.parametrize("mode", ["reproject", "keep"])
def test_moments_at_refresh(mode):
    """At a refresh to a new basis, ``reproject`` (default, FedGaLore App. A.1) maps m̃ ← m̃C and ṽ ← ṽ(C⊙C); ``keep``
    (galore-torch) leaves both buffers as they are in the new basis."""
    p = torch.nn.Parameter(torch.zeros(6, 6))
    opt = GaLore([p], lr=0.1, operator="adam", rank=2, tau=2, svd_refreshes=0, moments_at_refresh=mode)
    grads = _grads((6, 6), 3)
    _run(opt, p, grads[:2])
    before = {k: opt.block_state(p)[k].clone() for k in ("Q", "exp_avg", "exp_avg_sq")}
    p.grad = grads[2].clone()
    opt._refresh(opt.param_groups[0], 0, p, p.grad, opt.state[p])   # the refresh the next step starts with
    after = opt.block_state(p)
    C = before["Q"].T @ after["Q"]
    assert not torch.allclose(after["Q"], before["Q"])
    if mode == "keep":
        assert torch.equal(after["exp_avg"], before["exp_avg"]) and torch.equal(after["exp_avg_sq"], before["exp_avg_sq"])
    else:
        torch.testing.assert_close(after["exp_avg"], before["exp_avg"] @ C)
        torch.testing.assert_close(after["exp_avg_sq"], before["exp_avg_sq"] @ (C * C))
    with pytest.raises(ValueError, match="galore.moments_at_refresh"):
        GaLore([p], lr=0.1, moments_at_refresh="zero")

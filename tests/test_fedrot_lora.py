"""FedRot-LoRA (arXiv:2602.23638): the r×r Procrustes and soft SO(r) rotation kernels against dense references, the
client's rotation keeps B A (1e-5 in fp32), round 0 unrotated, the A/B alternation, FedIT's server step, DP, and
the refusals."""

from __future__ import annotations

import math

import pytest
import torch
from test_lora_baselines import FakeTrainer, play_round, sim_of, weights_of

from fedlowrank.config import ConfigError
from fedlowrank.linalg.rotation import align_factors, procrustes_rotation, soft_rotation
from fedlowrank.methods import get_method

from helpers import run_tiny


def _orthogonal(r: int, seed: int, special: bool = True) -> torch.Tensor:
    Q, _ = torch.linalg.qr(torch.randn(r, r, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    if special and torch.linalg.det(Q) < 0:
        Q[:, 0] = -Q[:, 0]
    return Q


def _is_rotation(R: torch.Tensor, tol: float = 1e-10) -> bool:
    eye = torch.eye(R.shape[0], dtype=R.dtype)
    return bool(torch.allclose(R.T @ R, eye, atol=tol)) and abs(float(torch.linalg.det(R)) - 1.0) < tol


# -- kernels -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("factor", ["A", "B"])
def test_procrustes_recovers_a_planted_rotation_of_either_factor(factor):
    g = torch.Generator().manual_seed(0)
    B_ref = torch.randn(9, 4, generator=g, dtype=torch.float64)
    A_ref = torch.randn(4, 7, generator=g, dtype=torch.float64)
    Q = _orthogonal(4, 1)
    B, A = B_ref @ Q.T, Q @ A_ref                         # the same product in a rotated frame: B A = B_ref A_ref
    B_al, A_al, R = align_factors(B, A, B_ref, A_ref, factor, lam=1.0)
    torch.testing.assert_close(R, Q, rtol=0, atol=1e-10)
    torch.testing.assert_close(A_al, A_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(B_al, B_ref, rtol=0, atol=1e-10)


def test_procrustes_is_the_optimum_over_rotations_and_reflections():
    """tr(RᵀM) at R* is at least its value at 500 random orthogonal matrices; over SO(r) at 500 rotations, and the
    SO(r) optimum is a rotation even when the O(r) one is a reflection."""
    M = torch.randn(5, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    M = M if torch.linalg.det(M) < 0 else -M              # the unconstrained optimum U Vᵀ is a reflection
    R_o, R_so = procrustes_rotation(M, special=False), procrustes_rotation(M, special=True)
    assert float(torch.linalg.det(R_o)) == pytest.approx(-1.0) and _is_rotation(R_so)
    best_o, best_so = float(torch.trace(R_o.T @ M)), float(torch.trace(R_so.T @ M))
    for seed in range(500):
        assert float(torch.trace(_orthogonal(5, seed, special=False).T @ M)) <= best_o + 1e-12
        assert float(torch.trace(_orthogonal(5, seed).T @ M)) <= best_so + 1e-12


def test_soft_rotation_stays_in_so_r_and_interpolates_from_identity_to_r_star():
    R_star = _orthogonal(4, 5)
    assert torch.equal(soft_rotation(R_star, 1.0), R_star)
    torch.testing.assert_close(soft_rotation(R_star, 0.0), torch.eye(4, dtype=torch.float64), rtol=0, atol=1e-12)
    prev = 0.0
    for lam in (0.2, 0.4, 0.6, 0.8):
        R = soft_rotation(R_star, lam)
        assert _is_rotation(R)
        dist = float(torch.linalg.matrix_norm(R - torch.eye(4, dtype=torch.float64)))
        assert dist > prev                                  # moves monotonically away from I towards R*
        prev = dist
    half_turn = torch.diag(torch.tensor([-1.0, -1.0, 1.0], dtype=torch.float64))   # (1−λ)I + λR* singular at 0.5
    assert _is_rotation(soft_rotation(half_turn, 0.5))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        soft_rotation(R_star, 1.5)


def test_a_diverged_client_is_not_rotated():
    B, A = torch.ones(5, 2), torch.ones(2, 4)
    A[0, 0] = float("nan")
    B_al, A_al, R = align_factors(B, A, torch.ones(5, 2), torch.ones(2, 4), "A", 0.4)
    assert torch.equal(R, torch.eye(2, dtype=torch.float64)) and torch.isnan(A_al[0, 0])


# -- the method ----------------------------------------------------------------------------------------------
class KeepTrained(FakeTrainer):
    """FakeTrainer that also keeps the trained (unrotated) parameters."""

    def fit(self, model, params, corrections=(), optimizer=None):
        result = super().fit(model, params, corrections, optimizer)
        self.trained = {k: p.detach().clone() for k, p in params.items()}
        return result


def _play(sim, clients, rnd, monkeypatch):
    import test_lora_baselines

    monkeypatch.setattr(test_lora_baselines, "FakeTrainer", KeepTrained)
    return play_round(sim, clients, rnd)


def _names(sim):
    return list(sim.model.adapters())


def test_round_zero_is_unrotated_and_later_rounds_keep_each_clients_product(monkeypatch):
    sim = sim_of("fedrot-lora", "method.align_lambda=0.5")
    for rnd, clients in enumerate([[0, 1, 2], [1, 3], [0, 2, 3], [0, 1]], start=1):
        out = _play(sim, clients, rnd, monkeypatch)
        for msg, reply, trainer in out:
            up = reply.message
            assert msg["fedrot.align"] == ("" if rnd == 1 else "A" if rnd % 2 == 0 else "B")
            assert all(up[k].dtype == torch.float32 for k in up.tensors())
            for name in _names(sim):
                ka, kb = f"{name}.lora_A", f"{name}.lora_B"
                A, B = trainer.trained[ka], trainer.trained[kb]
                if rnd == 1:
                    assert torch.equal(up[ka], A) and torch.equal(up[kb], B)
                    continue
                torch.testing.assert_close(up[kb] @ up[ka], B @ A, rtol=0, atol=1e-5)   # B̃Ã = BA, fp32
                R = torch.linalg.lstsq(A.T.double(), up[ka].T.double()).solution       # Ã = RᵀA
                assert _is_rotation(R, tol=1e-5)


def test_the_aligned_factor_alternates_and_matches_the_kernel(monkeypatch):
    sim = sim_of("fedrot-lora")
    method = sim.method
    assert [method.aligned_factor(r) for r in range(1, 6)] == ["", "A", "B", "A", "B"]
    assert [get_method("fedrot-lora", align_first="B").aligned_factor(r) for r in (2, 3)] == ["B", "A"]
    assert {get_method("fedrot-lora", align_schedule="B").aligned_factor(r) for r in (2, 3, 4)} == {"B"}
    _play(sim, [0, 1], 1, monkeypatch)
    for rnd, factor in ((2, "A"), (3, "B")):
        for msg, reply, trainer in _play(sim, [0, 1, 2], rnd, monkeypatch):
            for name in _names(sim):
                ka, kb = f"{name}.lora_A", f"{name}.lora_B"
                B_al, A_al, R = align_factors(trainer.trained[kb], trainer.trained[ka], msg[kb], msg[ka], factor, 0.4)
                torch.testing.assert_close(reply.message[ka], A_al.float(), rtol=0, atol=1e-6)
                torch.testing.assert_close(reply.message[kb], B_al.float(), rtol=0, atol=1e-6)


def test_server_averages_the_aligned_factors_and_lambda_zero_is_fedit(monkeypatch):
    sim = sim_of("fedrot-lora")
    _play(sim, [0, 1], 1, monkeypatch)
    before = {k: v.clone() for k, v in sim.server.items() if isinstance(v, torch.Tensor)}
    out = _play(sim, [0, 2, 3], 2, monkeypatch)
    p = weights_of(out)
    for key, old in before.items():
        expected = sum(pk * r.message[key].double() for pk, (_, r, _) in zip(p.tolist(), out))
        torch.testing.assert_close(sim.server[key].double(), expected, rtol=1e-6, atol=1e-7)
    none = sim_of("fedrot-lora", "method.align_lambda=0")
    fedit = sim_of("fedit")
    for rnd, clients in enumerate([[0, 1], [1, 2], [0, 3]], start=1):
        _play(none, clients, rnd, monkeypatch)
        _play(fedit, clients, rnd, monkeypatch)
    for key, v in fedit.server.items():
        assert torch.allclose(none.server[key], v, atol=1e-6), key


def test_hard_rotation_allows_reflections(monkeypatch):
    sim = sim_of("fedrot-lora", "method.rotation=hard")
    _play(sim, [0, 1], 1, monkeypatch)
    for _, reply, trainer in _play(sim, [0, 1, 2], 2, monkeypatch):
        for name in _names(sim):
            ka, kb = f"{name}.lora_A", f"{name}.lora_B"
            A = trainer.trained[ka]
            product = reply.message[kb] @ reply.message[ka]
            torch.testing.assert_close(product, trainer.trained[kb] @ A, rtol=0, atol=1e-5)
            R = torch.linalg.lstsq(A.T.double(), reply.message[ka].T.double()).solution
            torch.testing.assert_close(R.T @ R, torch.eye(R.shape[0], dtype=torch.float64), rtol=0, atol=1e-5)


def test_dpsgd_and_client_level_dp_compose():
    """The rotation is post-processing of DP-SGD's output with public factors: the record-level ε is FedIT's; under
    local client-level DP the noise is added to the rotated reply (the runtime noises whatever ``train`` returns)."""
    dp = ("privacy.dpsgd=true", "privacy.dpsgd_clip=1.0", "privacy.dpsgd_noise=1.0")
    rot, fedit = run_tiny("fedrot-lora", *dp, rounds=3), run_tiny("fedit", *dp, rounds=3)
    assert [r["dpsgd_epsilon"] for r in rot.history] == [r["dpsgd_epsilon"] for r in fedit.history]
    local = run_tiny("fedrot-lora", "privacy.mode=local", "privacy.clip=0.5", "privacy.noise_multiplier=0.1", rounds=3)
    assert all(math.isfinite(r["epsilon"]) for r in local.history)


def test_refusals_name_the_field_and_the_reason():
    with pytest.raises(ConfigError, match=r"lora.ranks: method 'fedrot-lora' does not support heterogeneous ranks: "
                                          r"the Procrustes rotation"):
        sim_of("fedrot-lora", "lora.ranks=[1,2]")
    with pytest.raises(ValueError, match="method.correction"):
        get_method("fedrot-lora", correction="scaffold")
    with pytest.raises(ValueError, match="method.align_lambda"):
        get_method("fedrot-lora", align_lambda=1.5)
    with pytest.raises(ValueError, match="method.rotation"):
        get_method("fedrot-lora", rotation="reflect")

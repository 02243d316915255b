"""FedSVD (arXiv:2505.12805): the O(d·r²) re-factorisation against a dense SVD, B⁺A⁺ = B̄A with orthonormal rows in
A⁺, B-only clients, exact aggregation, the SVD schedule, DP-SGD on what is trained only, and the refusals."""

from __future__ import annotations

import pytest
import torch
from test_lora_baselines import effective, play_round, sim_of, weights_of

from fedlowrank.config import ConfigError
from fedlowrank.linalg.lowrank import normalize_svd_signs, orthonormal_refactor
from fedlowrank.message import Reply, State
from fedlowrank.methods import get_method

from helpers import DPSGD, run_tiny, run_with_dpsgd


def _factors(out: int, r: int, inp: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(out, r, generator=g, dtype=torch.float64),
            torch.randn(r, inp, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("shape", [(7, 3, 11), (12, 4, 5), (6, 6, 6)])
def test_refactor_equals_the_dense_svd_and_keeps_the_product(shape):
    out, r, inp = shape
    B, A = _factors(out, r, inp)
    B_new, A_new = orthonormal_refactor(B, A)
    assert B_new.shape == (out, r) and A_new.shape == (r, inp) and B_new.dtype == torch.float64
    torch.testing.assert_close(B_new @ A_new, B @ A, rtol=0, atol=1e-10)
    torch.testing.assert_close(A_new @ A_new.T, torch.eye(r, dtype=torch.float64), rtol=0, atol=1e-12)
    U, S, Vh = torch.linalg.svd(B @ A, full_matrices=False)                   # dense [out, in] reference
    U, Vh = normalize_svd_signs(U[:, :r], Vh[:r])
    torch.testing.assert_close(B_new, U * S[:r], rtol=0, atol=1e-10)
    torch.testing.assert_close(A_new, Vh, rtol=0, atol=1e-10)


def test_refactor_of_a_rank_deficient_product_still_gives_orthonormal_rows():
    B, A = _factors(8, 3, 9, seed=1)
    B[:, 2] = 0                                                               # rank 2 < r = 3
    B_new, A_new = orthonormal_refactor(B, A)
    torch.testing.assert_close(B_new @ A_new, B @ A, rtol=0, atol=1e-10)
    torch.testing.assert_close(A_new @ A_new.T, torch.eye(3, dtype=torch.float64), rtol=0, atol=1e-12)
    assert float(B_new[:, 2].abs().max()) < 1e-12                            # the trailing singular value is 0
    with pytest.raises(ValueError, match=r"r <= in"):
        orthonormal_refactor(torch.zeros(4, 5), torch.zeros(5, 3))


def test_server_step_is_bbar_times_a_refactorised_in_float64():
    """``B⁺A⁺ = (Σ pₖ Bₖ) A`` to 1e-10 and ``A⁺A⁺ᵀ = I``, on a float64 server state and float64 uploads."""
    sim = sim_of("fedsvd")
    method, server = sim.method, State({k: v.to(torch.float64) for k, v in sim.server.tensors().items()})
    names = [k[:-len(".lora_A")] for k in server if k.endswith(".lora_A")]
    replies, sizes = [], [10, 30, 20]
    for k, n in enumerate(sizes):
        msg = method.broadcast(server, k, 1)
        up = {key: torch.randn(v.shape, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
              for key, v in msg.tensors().items() if key in method.upload_spec(msg, 1)}
        replies.append(Reply(k, n, State({**up, "num_examples": n, "train_loss": 0.0})))
    new = method.aggregate(server, replies, 1)
    p = torch.tensor(sizes, dtype=torch.float64) / sum(sizes)
    for name in names:
        B_bar = sum(pk * r.message[f"{name}.lora_B"] for pk, r in zip(p.tolist(), replies))
        A_new = new[f"{name}.lora_A"]
        torch.testing.assert_close(new[f"{name}.lora_B"] @ A_new, B_bar @ server[f"{name}.lora_A"], rtol=0, atol=1e-10)
        torch.testing.assert_close(A_new @ A_new.T, torch.eye(A_new.shape[0], dtype=torch.float64), rtol=0, atol=1e-12)


def test_clients_train_and_send_b_only_and_the_global_model_is_the_average_of_theirs():
    sim = sim_of("fedsvd")
    for rnd, clients in enumerate([[0, 1, 2], [1, 3], [0, 2, 3]], start=1):
        out = play_round(sim, clients, rnd)
        for msg, reply, trainer in out:
            assert not any(k.endswith("lora_A") for k in trainer.params)       # A frozen on the client
            assert set(reply.message.tensors()) == {k for k in msg.tensors() if not k.endswith("lora_A")}
            assert all(v.dtype == torch.float32 for v in reply.message.tensors().values())
        sim.method.load_global(sim.model, sim.server)
        glob, p = effective(sim.model), weights_of(out)
        for name, w in glob.items():                                          # exact: A is shared in the round
            torch.testing.assert_close(w, sum(pk * t.end[name] for pk, (_, _, t) in zip(p.tolist(), out)),
                                       rtol=1e-5, atol=1e-6)
        for name in sim.model.adapters():
            A = sim.server[f"{name}.lora_A"].to(torch.float64)
            torch.testing.assert_close(A @ A.T, torch.eye(A.shape[0], dtype=torch.float64), rtol=0, atol=1e-5)


def official_refactor_rounds(period: int, warmup: int, rounds: int) -> list[int]:
    """The rounds (from 1) after which the official server (``fedmm/fedavg/server.py``, 0-based ``curr_rnd``)
    re-runs the SVD: ``(curr_rnd+1) % recalculate_svd_period == 0 and (curr_rnd+1) > svd_warmup_steps``."""
    return [curr_rnd + 1 for curr_rnd in range(rounds)
            if (curr_rnd + 1) % period == 0 and (curr_rnd + 1) > warmup]


@pytest.mark.parametrize("period", range(1, 6))
@pytest.mark.parametrize("warmup", range(0, 6))
def test_refactor_schedule_is_the_official_rule(period, warmup):
    """Every (period, warm-up) pair up to 5: a schedule counted from the end of the warm-up (re-factorising after
    rounds 3, 5, 7 for period 2, warm-up 1, instead of 2, 4, 6) fails every pair whose warm-up is not a multiple
    of the period."""
    method = get_method("fedsvd", svd_warmup=warmup, svd_every=period)
    assert [r for r in range(1, 31) if method.refactor_due(r)] == official_refactor_rounds(period, warmup, 30)


def test_warmup_and_period_schedule_the_refactorisation():
    method = get_method("fedsvd", svd_warmup=1, svd_every=2)
    assert [r for r in range(1, 8) if method.refactor_due(r)] == [2, 4, 6]
    sim = sim_of("fedsvd", "method.svd_warmup=1")
    A0 = {k: v.clone() for k, v in sim.server.items() if k.endswith("lora_A")}
    play_round(sim, [0, 1], 1)
    assert all(torch.equal(sim.server[k], v) for k, v in A0.items())         # round 1: plain B averaging
    play_round(sim, [0, 1], 2)
    assert not any(torch.equal(sim.server[k], v) for k, v in A0.items())


def test_dpsgd_clips_and_noises_only_what_is_trained(monkeypatch):
    """Per-example clipping and noise see B and the head, never A; the record-level ε is the accountant's for
    those steps (the same as FFA-LoRA's, which trains the same tensors): the SVD is post-processing."""
    sim, seen = run_with_dpsgd(monkeypatch, "fedsvd")
    assert seen and all(keys and all(k.endswith("lora_B") or k.startswith("head/") for k in keys) for keys in seen)
    ffa = run_tiny("ffa-lora", *DPSGD)
    assert [r["dpsgd_epsilon"] for r in sim.history] == [r["dpsgd_epsilon"] for r in ffa.history]
    assert 0 < sim.history[-1]["dpsgd_epsilon"] < float("inf")


def test_refusals_name_the_field_and_the_reason():
    with pytest.raises(ConfigError, match=r"lora.ranks: method 'fedsvd' does not support heterogeneous ranks: the "
                                          r"re-factorisation"):
        sim_of("fedsvd", "lora.ranks=[1,2]")
    with pytest.raises(ValueError, match="method.correction"):
        get_method("fedsvd", correction="scaffold")
    with pytest.raises(ValueError, match="method.svd_every"):
        get_method("fedsvd", svd_every=0)


def test_a_reply_that_sends_a_or_a_wrong_dtype_is_rejected():
    from fedlowrank.runtime.engine import check_reply

    sim = sim_of("fedsvd")
    (msg, reply, _), = play_round(sim, [0], 1)
    with_a = State(reply.message)
    key = next(k for k in msg.tensors() if k.endswith("lora_A"))
    with_a[key] = msg[key]
    assert "unexpected" in check_reply(sim.method, msg, with_a, 1)
    doubled = State(reply.message)
    key = next(k for k in doubled.tensors() if k.endswith("lora_B"))
    doubled[key] = doubled[key].double()
    assert "expected" in check_reply(sim.method, msg, doubled, 1)


def test_client_level_dp_noises_b_before_the_svd():
    """Central DP clips and noises the B uploads (the server step's input); the SVD after it keeps A orthonormal."""
    sim = run_tiny("fedsvd", "privacy.mode=central", "privacy.clip=0.05", "privacy.noise_multiplier=1.0",
                   "server.weighting=uniform")
    assert all(0 < r["epsilon"] < float("inf") and r["privacy"]["noise_std"] > 0 for r in sim.history)
    for key, A in sim.server.tensors().items():
        if key.endswith("lora_A"):
            A = A.double()
            torch.testing.assert_close(A @ A.T, torch.eye(A.shape[0], dtype=torch.float64), rtol=0, atol=1e-5)

"""Fidelity to the official code of two baselines' server steps, each checked against a transcription of the
official maths written here (not imported, not the product's code):

* TIES-Merging (Yadav et al., NeurIPS 2023; github.com/prateeksha/TIES-Merging): ``topk_values_mask`` keeps, per
  task vector of d entries, every entry whose magnitude is at least the ``(d − int(d·K))``-th smallest one, i.e.
  ⌊K·d⌋ + 1 entries; ``resolve_sign`` elects ``sign(Σ τ̂)`` (a 0 takes the sign of the sum of all elected signs);
  ``disjoint_merge`` ("dis-mean") averages the entries that agree with the elected sign over their count.
* FlexLoRA (Bai et al., NeurIPS 2024; github.com/alibaba/FederatedScope, branch FlexLoRA, ``fed_utils``):
  ``FlexLoRA`` sums ``p_k · (α / r_k) · B_k A_k`` with ``p_k`` the clients' data shares, and
  ``distribute_weight_fast`` gives the client of rank r ``A = V_rᵀ`` and ``B = U_r S_r / (α / r)`` from the SVD of
  that sum.
"""

from __future__ import annotations

import math

import pytest
import torch

from fedlowrank.adapters.lora import lora_modules
from fedlowrank.message import Message, Reply
from fedlowrank.methods import get_method
from fedlowrank.methods.ties import kept_count, magnitude_threshold

from helpers import tiny_simulation


# -- the official maths, transcribed -----------------------------------------------------------------------------
def official_trim(M: torch.Tensor, K: float) -> torch.Tensor:
    """``M [n, d]`` with each row's entries below its ``(d − int(d·K))``-th smallest magnitude zeroed."""
    d = M.shape[1]
    kth = M.abs().kthvalue(d - int(d * K), dim=1, keepdim=True).values
    return M * (M.abs() >= kth)


def official_ties(M: torch.Tensor, K: float) -> torch.Tensor:
    """Trim, elect sign (zeros to the majority sign), disjoint mean of ``M [n tasks, d]`` → ``[d]``."""
    trimmed = official_trim(M, K)
    signs = torch.sign(trimmed.sum(0))
    signs[signs == 0] = torch.sign(signs.sum())
    keep = torch.where(signs.unsqueeze(0) > 0, trimmed > 0, trimmed < 0)
    selected = trimmed * keep
    return selected.sum(0) / (selected != 0).sum(0).clamp(min=1)


def official_flexlora(factors: list[tuple[torch.Tensor, torch.Tensor]], shares: list[float], alpha: float,
                      rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, A)`` for a client of ``rank`` from the clients' ``(B_k [out, r_k], A_k [r_k, in])``."""
    dW = sum(p * (alpha / A.shape[0]) * (B @ A) for p, (B, A) in zip(shares, factors))
    U, S, Vh = torch.linalg.svd(dW, full_matrices=False)
    return U[:, :rank] @ torch.diag(S[:rank]) / (alpha / rank), Vh[:rank]


# -- TIES ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [8, 10, 20, 40, 41])
def test_ties_trim_keeps_what_the_official_topk_values_mask_keeps(d):
    """At K = 0.25, K·d = 2, 5, 10 are integers (one more entry than K·d kept) and 2.5, 10.25 are not (⌈K·d⌉)."""
    M = torch.randn(3, d, generator=torch.Generator().manual_seed(d), dtype=torch.float64)
    official = official_trim(M, 0.25) != 0
    ours = torch.stack([row.abs() >= magnitude_threshold(row, 0.25) for row in M])
    assert torch.equal(ours, official)
    assert (official.sum(1) == int(0.25 * d) + 1).all() and kept_count(d, 0.25) == int(0.25 * d) + 1
    paper = torch.stack([row.abs() >= magnitude_threshold(row, 0.25, "paper") for row in M]).sum(1)
    assert (paper == math.ceil(0.25 * d)).all()
    assert (paper == official.sum(1)).all() == (0.25 * d != int(0.25 * d))  # they differ exactly when K·d ∈ ℕ


def test_kept_count_bounds():
    assert kept_count(4, 1.0) == kept_count(4, 1.0, "paper") == 4  # K = 1: no trimming
    assert kept_count(4, 0.01) == kept_count(4, 0.01, "paper") == 1
    assert kept_count(4, 0.5) == 3 and kept_count(4, 0.5, "paper") == 2


def _ties_round(keep_fraction: float, **options):
    """The server step of ``ties`` (uniform weights, server.lr = 1) on random client updates, and the official
    merge of the same updates as flat task vectors."""
    sim = tiny_simulation("ties", f"method.keep_fraction={keep_fraction}", "server.weighting=uniform",
                          *(f"method.{k}={v}" for k, v in options.items()))
    server = sim.server
    keys = sim.method.lora_keys(server)
    g = torch.Generator().manual_seed(7)
    replies = []
    for i in range(3):
        msg = Message({k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in server.items()
                       if k in keys or k.startswith("head/")})
        msg.update(num_examples=10 + i, train_loss=0.0)
        replies.append(Reply(i, 10 + i, msg))
    flat = torch.stack([torch.cat([(r.message[k].double() - server[k].double()).flatten() for k in keys])
                        for r in replies])
    merged, start, expected = official_ties(flat, keep_fraction), 0, {}
    for k in keys:
        n = server[k].numel()
        expected[k] = (server[k].double() + merged[start:start + n].view(server[k].shape)).to(server[k].dtype)
        start += n
    return sim.method.aggregate(server, replies, 1), expected, flat.shape[1]


def test_ties_server_step_equals_the_official_merge():
    new, expected, d = _ties_round(0.25)
    assert d % 4 == 0  # K·d is an integer: the case where the two counts differ
    for k, want in expected.items():
        torch.testing.assert_close(new[k], want, rtol=0, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")
    paper, _, _ = _ties_round(0.25, trim_count="paper")
    assert any(not torch.allclose(paper[k], want, rtol=0, atol=1e-7) for k, want in expected.items())
    with pytest.raises(ValueError, match="method.trim_count"):
        get_method("ties", trim_count="ceil")


# -- FlexLoRA ------------------------------------------------------------------------------------------------------
def test_flexlora_clients_get_the_official_factors_at_mixed_ranks():
    """Ranks {4, 2}: each client's download is A = V_rᵀ, B = U_r S_r / (α/r) of Σ p_k (α/r_k) B_k A_k (up to the
    sign of each singular pair), for the default split; the even split has the same product, other factors."""
    sims = {split: tiny_simulation("flexlora", "lora.ranks=[4,2]", f"method.split={split}")
            for split in ("official", "even")}
    sim = sims["official"]
    g = torch.Generator().manual_seed(3)
    replies = []
    for k in (0, 1, 3):
        r = sim.info.client_ranks[k]
        msg = Message()
        for name, mod in lora_modules(sim.model).items():
            msg[f"{name}.lora_A"] = 0.1 * torch.randn(r, mod.in_features, generator=g)
            msg[f"{name}.lora_B"] = 0.1 * torch.randn(mod.out_features, r, generator=g)
        msg.update({key: v.clone() for key, v in sim.server.items() if key.startswith("head/")})
        msg.update(num_examples=10 * (k + 1), train_loss=0.0)
        replies.append(Reply(k, 10 * (k + 1), msg))
    total = sum(r.num_examples for r in replies)
    shares = [r.num_examples / total for r in replies]
    servers = {split: s.method.aggregate(s.server, replies, 1) for split, s in sims.items()}
    for client in (0, 1):
        rank = sim.info.client_ranks[client]
        got = sim.method.broadcast(servers["official"], client, 2)
        even = sims["even"].method.broadcast(servers["even"], client, 2)
        for name in lora_modules(sim.model):
            factors = [(r.message[f"{name}.lora_B"].double(), r.message[f"{name}.lora_A"].double()) for r in replies]
            B, A = official_flexlora(factors, shares, sim.info.alpha, rank)
            gA, gB = got[f"{name}.lora_A"].double(), got[f"{name}.lora_B"].double()
            assert gA.shape == A.shape and gB.shape == B.shape
            flip = torch.sign((gA * A).sum(1))  # a singular pair's sign is arbitrary; it flips both factors
            torch.testing.assert_close(gA, flip[:, None] * A, rtol=0, atol=1e-5)
            torch.testing.assert_close(gB, B * flip, rtol=0, atol=1e-5)
            eA, eB = even[f"{name}.lora_A"].double(), even[f"{name}.lora_B"].double()
            torch.testing.assert_close(eB @ eA, B @ A, rtol=0, atol=1e-6)
            assert not torch.allclose(eA.abs(), A.abs(), atol=1e-3)

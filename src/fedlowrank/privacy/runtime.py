"""Where privacy enters a run; every function here is called by both runtimes (simulator and Flower).

* :func:`local_reply` — client side, in :func:`~fedlowrank.runtime.engine.client_update`: local DP clips the
  reply's update to C and adds N(0, σ²C²) to each coordinate before the reply leaves the client.
* :func:`central_replies` — server side, just before ``method.aggregate``: central DP clips each reply's update
  to C (relative to what that client was sent) and adds *the same* draw z ~ N(0, (σC/n)²) to every one of the
  n replies. A method whose server step is a uniform average ``Σ_k r_k/n`` (or a plain sum ``Σ_k r_k`` scaled by
  a public constant, as SCAFFOLD's control variates) then computes ``mean of the clipped replies + z``, i.e. the
  noisy sum ``Σ clip(Δ_k) + N(0, σ²C²)`` divided by n — the DP-FedAvg mechanism (the scaling Flower's
  ``DifferentialPrivacyServerSideFixedClipping`` uses). This is why central DP needs ``server.weighting =
  "uniform"`` and is offered only to methods whose ``supported_privacy_modes()`` include it.
* :func:`accounting` — the (ε, δ) after each round, written into the round's row (``epsilon``, and
  ``dpsgd_epsilon`` for record-level DP-SGD).

Randomness: ``derive_seed(run.seed, "privacy-central", round)`` and ``(..., "privacy-local", client, round)``.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from ..message import Message, Reply
from ..seeding import torch_generator
from .accountant import epsilon, noise_for_epsilon
from .mechanisms import add_noise, clip_update, gaussian_noise

# the ε each kind of DP writes into a round's row (:func:`accounting`), the run's summary and compare's rows,
# with the name compare's table gives it
PRIVACY_KEYS = {"epsilon": "ε (client-level DP)", "dpsgd_epsilon": "ε (record-level DP-SGD)"}


def delta(cfg) -> float:
    """δ of the client-level guarantee: ``privacy.delta``, or 1/``partition.num_clients``."""
    return cfg.privacy.delta or 1.0 / cfg.partition.num_clients


def sampling_rate(cfg) -> float:
    """The per-round probability that a given client's update is released: K/M (central), 1 (local: the server
    sees every reply of a client)."""
    return cfg.run.clients_per_round / cfg.partition.num_clients if cfg.privacy.mode == "central" else 1.0


@lru_cache(maxsize=64)
def _noise_for_target(target: float, q: float, rounds: int, d: float) -> float:
    return noise_for_epsilon(target, q, rounds, d)


def noise_multiplier(cfg) -> float:
    """σ: ``privacy.noise_multiplier``, or the smallest σ reaching ``privacy.target_epsilon`` after ``run.rounds``."""
    p = cfg.privacy
    if p.target_epsilon > 0:
        return _noise_for_target(p.target_epsilon, sampling_rate(cfg), cfg.run.rounds, delta(cfg))
    return p.noise_multiplier


def clip_count_noise(cfg) -> float:
    """σ_b of adaptive clipping: ``privacy.clip_noise``, or K/20 (Andrew et al. 2021, §3)."""
    return cfg.privacy.clip_noise or cfg.run.clients_per_round / 20.0


def update_noise_multiplier(cfg) -> float:
    """The noise multiplier of the update sum: σ with fixed clipping; with adaptive clipping
    σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2), so that update and count together are accounted as σ (Andrew et al. 2021, Thm 1)."""
    sigma = noise_multiplier(cfg)
    if cfg.privacy.clipping == "fixed" or sigma == 0:
        return sigma
    sb = clip_count_noise(cfg)
    if 2 * sb <= sigma:
        raise ValueError(f"privacy.clip_noise: adaptive clipping with noise multiplier {sigma:.4g} needs "
                         f"clip_noise > {sigma / 2:.4g} (σ_b > σ/2), got {sb:.4g}")
    return (sigma**-2 - (2 * sb) ** -2) ** -0.5


def local_reply(cfg, reply: Message, down: Message, client: int, rnd: int) -> Message:
    """Local DP (client side): ``reply`` with its update clipped to C and N(0, σ²C²) added; as is otherwise."""
    p = cfg.privacy
    if p.mode != "local":
        return reply
    clipped, _ = clip_update(reply, down, p.clip)
    sigma = noise_multiplier(cfg)
    if sigma == 0:
        return clipped
    std = sigma * p.clip
    return add_noise(clipped, gaussian_noise(clipped, std, torch_generator(cfg.run.seed, "privacy-local", client, rnd)))


def current_clip(cfg, history: list[dict[str, Any]]) -> float:
    """C for the next round: ``privacy.clip``, or where adaptive clipping left it (the last row's ``next_clip``)."""
    for row in reversed(history):
        if "next_clip" in row.get("privacy", {}):
            return float(row["privacy"]["next_clip"])
    return cfg.privacy.clip


def central_replies(cfg, replies: list[Reply], downs: dict[int, Message], rnd: int,
                    history: list[dict[str, Any]]) -> tuple[list[Reply], dict[str, Any]]:
    """Central DP (server side): the replies clipped and noised as in the module docstring, and what to log
    (``clip``, ``clipped``: how many were scaled down, ``noise_std`` per coordinate of the mean, ``next_clip``).
    ``downs[k]`` is what client k was sent this round. As is when central DP is off or there is no reply."""
    p = cfg.privacy
    if p.mode != "central" or not replies:
        return replies, {}
    clip = current_clip(cfg, history)
    clipped, norms = [], []
    for r in replies:
        msg, norm = clip_update(r.message, downs[r.client], clip)
        clipped.append(msg)
        norms.append(norm)
    shapes = {k: tuple(t.shape) for k, t in clipped[0].tensors().items()}
    for r, msg in zip(replies, clipped):
        other = {k: tuple(t.shape) for k, t in msg.tensors().items()}
        if other != shapes:
            raise ValueError(f"privacy.mode = 'central': the reply of client {r.client} differs in tensors or shapes "
                             "from the others; central noise needs equally shaped replies")
    n = len(replies)
    sigma = update_noise_multiplier(cfg)
    std = sigma * clip / n if sigma > 0 else 0.0
    gen = torch_generator(cfg.run.seed, "privacy-central", rnd)
    noise = gaussian_noise(clipped[0], std, gen) if std > 0 else {}
    out = [Reply(r.client, r.num_examples, add_noise(msg, noise)) for r, msg in zip(replies, clipped)]
    unclipped = sum(norm <= clip for norm in norms)
    row: dict[str, Any] = {"clip": clip, "clipped": n - unclipped, "noise_std": std,
                           "mean_update_norm": float(np.mean(norms))}
    if p.clipping == "adaptive":
        sb = clip_count_noise(cfg) if noise_multiplier(cfg) > 0 else 0.0
        count = unclipped + sb * float(torch.randn((), generator=gen, dtype=torch.float64))
        row["next_clip"] = clip * math.exp(-p.clip_lr * (count / n - p.target_quantile))
    return out, row


def _participations(history: list[dict[str, Any]], row: dict[str, Any]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for r in [*history, row]:
        if not r.get("skipped"):
            for k in r.get("replied", []):
                counts[k] = counts.get(k, 0) + 1
    return counts


def local_steps(cfg, n_examples: int) -> int:
    """Optimizer steps of a client with ``n_examples`` examples in one round (as ``LocalTrainer.num_steps``)."""
    t = cfg.train
    return max(1, math.ceil(t.local_epochs * n_examples / t.batch_size)) if t.local_epochs > 0 else t.local_steps


def accounting(cfg, client_sizes: list[int], history: list[dict[str, Any]], row: dict[str, Any]) -> dict[str, Any]:
    """Entries of the round's row: ``epsilon`` (client level, at ``delta``) and ``dpsgd_epsilon`` (record level,
    the largest over clients, each at δ = 1/its data size), counting the rounds up to and including ``row``."""
    p, out = cfg.privacy, {}
    if p.mode:
        counts = _participations(history, row)
        if p.mode == "central":
            steps = sum(1 for r in [*history, row] if not r.get("skipped"))
        else:
            steps = max(counts.values(), default=0)
        out["epsilon"] = epsilon(sampling_rate(cfg), noise_multiplier(cfg), steps, delta(cfg))
        out["delta"] = delta(cfg)
    if p.dpsgd:
        eps = 0.0
        for k, times in _participations(history, row).items():
            n = client_sizes[k]
            q = min(cfg.train.batch_size, n) / n
            eps = max(eps, epsilon(q, p.dpsgd_noise, times * local_steps(cfg, n), min(1.0 / n, 0.5)))
        out["dpsgd_epsilon"] = eps
    return out

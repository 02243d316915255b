"""The ``[privacy]`` config section and its checks (see ``docs/privacy.md``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

MODES = ("", "central", "local")
CLIPPING = ("fixed", "adaptive")


@dataclass
class PrivacySection:
    """Client-level differential privacy (DP-FedAvg) and record-level DP-SGD.

    Attributes:
        mode: ``""`` (off), ``"central"`` (the server clips each reply's update and adds N(0, σ²C²) to their sum)
            or ``"local"`` (each client clips its update and adds N(0, σ²C²) to its own reply before sending).
        clip: C, the L2 bound of a client's update (``inf`` = no clipping); the initial C when adaptive.
        noise_multiplier: σ (noise std = σ·C); ignored when ``target_epsilon`` > 0.
        target_epsilon: > 0: σ is the smallest noise multiplier whose ε after ``run.rounds`` rounds is at most this.
        delta: δ of the reported (ε, δ); 0 = 1/``partition.num_clients``.
        clipping: ``"fixed"`` or ``"adaptive"`` (Andrew et al. 2021: C tracks the ``target_quantile`` of the
            update norms, ``C ← C·exp(−clip_lr·(b̄ − target_quantile))`` with b̄ the noisy fraction of unclipped
            updates; central mode only).
        target_quantile, clip_lr: γ and η_C of adaptive clipping.
        clip_noise: σ_b, std of the noise on the count of unclipped updates; 0 = ``run.clients_per_round``/20.
        dpsgd: record-level DP-SGD in every client's local training (per-example clipping + noise per step).
        dpsgd_clip, dpsgd_noise: its per-example clipping norm and noise multiplier.
    """

    mode: str = ""
    clip: float = math.inf
    noise_multiplier: float = 0.0
    target_epsilon: float = 0.0
    delta: float = 0.0
    clipping: str = "fixed"
    target_quantile: float = 0.5
    clip_lr: float = 0.2
    clip_noise: float = 0.0
    dpsgd: bool = False
    dpsgd_clip: float = 1.0
    dpsgd_noise: float = 1.0


def check_privacy(cfg, method_cls) -> None:
    """Raise ``ValueError`` (one line naming the field) for an invalid or unsupported ``[privacy]`` section."""
    p = cfg.privacy

    def need(cond: bool, message: str) -> None:
        if not cond:
            raise ValueError(message)

    need(p.mode in MODES, f"privacy.mode must be one of '', central, local; got {p.mode!r}")
    need(p.clipping in CLIPPING, f"privacy.clipping must be one of {', '.join(CLIPPING)}; got {p.clipping!r}")
    need(p.clip > 0, f"privacy.clip must be > 0 (inf = no clipping), got {p.clip}")
    need(p.noise_multiplier >= 0, f"privacy.noise_multiplier must be >= 0, got {p.noise_multiplier}")
    need(p.target_epsilon >= 0, f"privacy.target_epsilon must be >= 0 (0 = use privacy.noise_multiplier), "
                                f"got {p.target_epsilon}")
    need(0 <= p.delta < 1, f"privacy.delta must be in [0, 1) (0 = 1/partition.num_clients), got {p.delta}")
    need(0 < p.target_quantile < 1, f"privacy.target_quantile must be in (0, 1), got {p.target_quantile}")
    need(p.clip_lr > 0, f"privacy.clip_lr must be > 0, got {p.clip_lr}")
    need(p.clip_noise >= 0, f"privacy.clip_noise must be >= 0 (0 = run.clients_per_round/20), got {p.clip_noise}")
    need(p.dpsgd_clip > 0 and math.isfinite(p.dpsgd_clip), f"privacy.dpsgd_clip must be finite and > 0, got {p.dpsgd_clip}")
    need(p.dpsgd_noise >= 0, f"privacy.dpsgd_noise must be >= 0, got {p.dpsgd_noise}")
    if not p.mode:
        return
    modes = method_cls.supported_privacy_modes()
    if p.mode not in modes:
        why = ("its server step needs individual replies (needs_individual_replies)" if method_cls.needs_individual_replies
               else method_cls.privacy_refusal or "its server step is not a fixed-weight sum of the replies")
        raise ValueError(f"privacy.mode = {p.mode!r} is not supported by method {method_cls.name!r}: {why}; "
                         f"it supports: {', '.join(modes) or 'none'}")
    need((p.target_epsilon == 0 and p.noise_multiplier == 0) or math.isfinite(p.clip),
         "privacy.clip must be finite when privacy.noise_multiplier or privacy.target_epsilon is set (noise is σ·C)")
    need(p.clipping == "fixed" or (p.mode == "central" and math.isfinite(p.clip)),
         "privacy.clipping = 'adaptive' needs privacy.mode = 'central' and a finite initial privacy.clip")
    if p.mode == "central":
        need(cfg.server.weighting == "uniform",
             "privacy.mode = 'central' needs server.weighting = 'uniform' (with num_examples weights one client's "
             "update can weigh more than 1/K, and the noise σ·C/K would not cover it)")
        need(len(set(cfg.client_ranks())) == 1,
             "privacy.mode = 'central' needs equal client ranks (lora.ranks): the noise is added to sums of "
             "equally shaped updates")

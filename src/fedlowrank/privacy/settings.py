"""The ``[privacy]`` config section and its checks (see ``docs/privacy.md``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..schema import Schema, setting

MODES = ("", "central", "local")
CLIPPING = ("fixed", "adaptive")


@dataclass
class PrivacySection(Schema):
    """Client-level differential privacy (DP-FedAvg) and record-level DP-SGD (config section ``[privacy]``).

    ``central``: the server clips each reply's update and adds N(0, σ²C²) to their sum; ``local``: each client
    clips its update and adds N(0, σ²C²) to its own reply before sending. Adaptive clipping (Andrew et al. 2021):
    ``C ← C·exp(−clip_lr·(b̄ − target_quantile))`` with b̄ the noisy fraction of unclipped updates.
    """

    prefix = "privacy"

    mode: str = setting("", "client-level DP: '' (off), central (server clips each update, noise on the sum) or "
                        "local (each client noises its own reply)", choices=MODES)
    clip: float = setting(math.inf, "C, the L2 bound of a client's update (inf = no clipping); the initial C when "
                          "adaptive", gt=0, allow_inf=True)
    noise_multiplier: float = setting(0.0, "σ: noise std σ·C (ignored when privacy.target_epsilon > 0)", ge=0)
    target_epsilon: float = setting(0.0, "> 0: σ is the smallest noise multiplier whose ε after run.rounds rounds is "
                                    "at most this (0 = use privacy.noise_multiplier)", ge=0)
    delta: float = setting(0.0, "δ of the reported (ε, δ); 0 = 1/partition.num_clients", ge=0, lt=1)
    clipping: str = setting("fixed", "fixed, or adaptive (C tracks privacy.target_quantile of the update norms; "
                            "central only)", choices=CLIPPING)
    target_quantile: float = setting(0.5, "adaptive clipping: the quantile of update norms C tracks", gt=0, lt=1)
    clip_lr: float = setting(0.2, "adaptive clipping: learning rate of log C", gt=0)
    clip_noise: float = setting(0.0, "adaptive clipping: noise std on the count of unclipped updates (0 = "
                                "run.clients_per_round/20)", ge=0)
    dpsgd: bool = setting(False, "record-level DP-SGD in every client's local training (per-example clipping, "
                          "noise per step)")
    dpsgd_clip: float = setting(1.0, "DP-SGD per-example clipping norm", gt=0)
    dpsgd_noise: float = setting(1.0, "DP-SGD noise multiplier", ge=0)


def check_privacy(cfg, method_cls) -> None:
    """Raise ``ValueError`` (one line naming the fields) for a ``[privacy]`` section that its run cannot have:
    the rules between fields and the method's support (each field's own bounds are declared)."""
    p = cfg.privacy

    def need(cond: bool, message: str) -> None:
        if not cond:
            raise ValueError(message)

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

"""FedRot-LoRA (Zhang, Kim, Cha, Vikalo, "FedRot-LoRA: Mitigating Rotational Misalignment in Federated LoRA",
arXiv:2602.23638, ICML 2026).

Clients train ``A: [r, in]`` and ``B: [out, r]`` as in FedIT; before upload, from the second round on, each client
rotates its factors into the frame of the global factors it received
(:func:`~fedlowrank.linalg.rotation.align_factors`):
``Ã = Rᵀ A``, ``B̃ = B R`` with ``R: [r, r]`` orthogonal, so ``B̃ Ã = B A`` and the client's model is unchanged.
``R`` solves an r×r orthogonal Procrustes problem on one factor, alternating by round: ``M = A Agᵀ``
(``min ‖Rᵀ A − Ag‖``) or ``M = Bᵀ Bg`` (``min ‖B R − Bg‖``), ``M = U Σ Vᵀ``, ``R* = U Vᵀ``. The soft rotation (the
default) keeps ``R* ∈ SO(r)`` and takes the rotation nearest to ``(1−λ) I + λ R*``; the hard one (the official
configs' λ > 1) is ``R*`` over O(r), reflections allowed. The server averages the aligned factors as FedIT does.

Rounds: the paper's round t counts from 0, ours from 1, so t = rnd − 1; round t = 0 is not rotated (the global B
is zero, there is no frame to match). With ``align_first = "A"`` (the official yamls) odd t aligns A and even t
aligns B; ``align_schedule`` pins one factor (the official ablation).

The default λ = 0.4 is the peak of the paper's λ-sensitivity figure (MNLI, QQP); the official configs run the hard
path (λ = 1.5), which that figure shows as the weakest aligned setting (docs/methods/fedrot_lora.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..linalg.rotation import align_factors
from ..message import Message, State
from ..schema import setting
from . import register
from .base import correction_option, on_host
from .fedit import FedIT
from .ranks import module_names

ROTATIONS = ("soft", "hard")
FACTORS = ("A", "B")
SCHEDULES = ("alternate", "A", "B")


@register
@dataclass
class FedRotLoRA(FedIT):
    name = "fedrot-lora"
    description = "FedIT whose clients rotate A, B into the global frame (r×r Procrustes) before upload; exact BA"
    paper = ("Zhang, Kim, Cha, Vikalo, FedRot-LoRA: Mitigating Rotational Misalignment in Federated LoRA "
             "(arXiv:2602.23638, ICML 2026)")
    uplink = "Ã = RᵀA [r,in] and B̃ = BR [out,r] per target module, head"
    downlink = "Ā, B̄ per target module, which factor to align this round, head"
    needs_individual_replies = False
    heterogeneous_ranks_refusal = "the Procrustes rotation aligns r×r frames of one rank"

    correction: str = correction_option("none", ("none", "fedprox"),
                                        "the upload is rotated into the global frame, SCAFFOLD's control variates "
                                        "are not")
    align_lambda: float = setting(0.4, "λ of the soft rotation: 0 = no alignment (FedIT), 1 = the full Procrustes "
                                  "rotation; the paper's sensitivity figure peaks near 0.4", ge=0, le=1)
    rotation: str = setting("soft", "soft: the rotation nearest to (1−λ)I + λR* with R* in SO(r); hard: R* over "
                            "O(r), reflections allowed and λ unused (the official configs, λ > 1)", choices=ROTATIONS)
    align_first: str = setting("A", "the factor aligned in the paper's round t = 1 (odd t), the other in even t",
                               choices=FACTORS)
    align_schedule: str = setting("alternate", "alternate the aligned factor by round, or always align A or B",
                                  choices=SCHEDULES)

    def aligned_factor(self, rnd: int) -> str:
        """``"A"``, ``"B"`` or ``""`` (no alignment in the first round): the factor round ``rnd`` (from 1) matches."""
        t = rnd - 1
        if t == 0:
            return ""
        if self.align_schedule != "alternate":
            return self.align_schedule
        other = "B" if self.align_first == "A" else "A"
        return self.align_first if t % 2 == 1 else other

    def broadcast(self, server: State, client: int, rnd: int) -> Message:
        msg = super().broadcast(server, client, rnd)
        msg["fedrot.align"] = self.aligned_factor(rnd)
        return msg

    def finish_fit(self, fit, result, trainer):
        params, extra, state, loss = self.local_result(fit, result)
        msg = fit.msg
        factor = msg["fedrot.align"]
        up = {k: on_host(p) for k, p in params.items()}
        if factor:
            for name in module_names(up):
                ka, kb = f"{name}.lora_A", f"{name}.lora_B"
                B, A, _ = align_factors(up[kb], up[ka], msg[kb], msg[ka], factor, self.align_lambda,
                                        hard=self.rotation == "hard")
                up[ka], up[kb] = A.to(up[ka].dtype), B.to(up[kb].dtype)
        return self.reply(up, up, extra, trainer, loss), state


__all__ = ["FedRotLoRA"]

"""FedIT+QR: the ILoRA paper's aggregation ablation (Zhou, Liu, Shang, arXiv:2511.16069, Tables 4, 5, 11).

ILoRA's QR initialisation and per-client QR offset (:class:`~fedlowrank.methods.ilora.QRInitLoRA`), the
trainer's optimizer (AdamW by default), no control variates, and FedIT's factor-wise averaging with zero padding
instead of the concatenated QR: ``Ā = Σ p_k pad(A_k): [r_max, in]``, ``B̄ = Σ p_k pad(B_k): [out, r_max]``
(optional server step β); client k receives ``(B̄[:, :r_k], Ā[:r_k])``. With the QR init the padded average
weights direction j by ``w_j = Σ_{k: r_k > j} p_k`` on both factors, so the part of W0 moved into the adapter
comes back scaled by about ``w_j²``. Global model: ``W0 − s·Q0 diag(w) R0 + s·B̄ Ā`` (all r_max directions,
``w_j = Σ_{k: r_k > j} π_k`` over all clients; the pretrained model before the first aggregation).
Reports ``aggregation_err = ‖B̄Ā − Σ p_k B_k A_k‖_F`` summed in squares over modules (FedIT's bias, Eq. 4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..linalg.lowrank import factored_qr, stack_factors
from ..message import State
from . import register
from .base import weighted_sum
from .ilora import QRInitLoRA
from .ranks import zero_pad


@register
@dataclass
class FedITQR(QRInitLoRA):
    name = "fedit-qr"
    description = "FedIT (zero-padded factor averaging) with ILoRA's QR initialisation; ILoRA's ablation"
    paper = ("Zhou, Liu, Shang, ILoRA: Federated Learning with Low-Rank Adaptation for Heterogeneous Client "
             "Aggregation (ablation baseline)")
    uplink = "A_k [r_k,in] and B_k [out,r_k] per target module, head"
    downlink = "Ā[:r_k] [r_k,in], B̄[:, :r_k] [out,r_k] per target module, head"
    needs_individual_replies = False

    def global_rank(self) -> int:
        return self.r_max

    def global_base(self) -> torch.Tensor:
        return self.direction_share

    def aggregate(self, server, replies, rnd):
        server = State(server)
        p = self.client_weights(replies)
        err2 = 0.0
        for name in self._qr0:
            ka, kb = f"{name}.lora_A", f"{name}.lora_B"
            A_bar = weighted_sum((zero_pad(r.message[ka], server[ka].shape) for r in replies), p)
            B_bar = weighted_sum((zero_pad(r.message[kb], server[kb].shape) for r in replies), p)
            B_c, A_c = stack_factors([r.message[kb] for r in replies], [r.message[ka] for r in replies], p)
            _, R = factored_qr(torch.cat([B_bar.to(torch.float64), B_c], 1),
                               torch.cat([A_bar.to(torch.float64), -A_c], 0))
            err2 += float(R.pow(2).sum())                      # ‖B̄Ā − B_c A_c‖²_F
            server[ka] = self.server_step(server[ka], A_bar)
            server[kb] = self.server_step(server[kb], B_bar)
        self.average_into(server, replies, self.head_keys(server), p)
        self.aggregate_corrections(server, replies)
        server["qr_init"] = 0
        self.report(aggregation_err=math.sqrt(err2))
        return server

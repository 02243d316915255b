"""CCVR, classifier calibration with virtual representations (Luo et al., "No fear of heterogeneity: classifier
calibration for federated learning with non-IID data", arXiv:2106.05001, Algorithm 1), after the last round.

With ``task.options.ccvr_samples = M`` > 0, the last round's aggregated global model is calibrated before it is
evaluated and committed:

1. every client (all ``partition.num_clients``, as in the paper) loads the global model and sends, per class it
   holds, the count, mean ``[d]`` and unbiased covariance ``[d, d]`` of the features its training examples give the
   classifier (the input of the head's last linear layer), float32 (eq. 2;
   :func:`fedlowrank.linalg.class_moments.class_moments`);
2. the server pools them exactly (eqs. 3–4), draws ``M`` virtual features per class present from
   ``N(μ_c, Σ_c)`` (seeded) and trains the classifier (weights and bias, from the aggregated ones) on them with
   plain cross-entropy: ``task.options.ccvr_epochs`` epochs of SGD (momentum 0.9, batches of 64, shuffled) at
   ``task.options.ccvr_lr``; the rest of the global model is unchanged.

The exchange is counted: each client's ledger row of the last round with ``"phase": "ccvr"`` (down: the method's
broadcast of the aggregated state to it, the global model it loads; up: its statistics message), and the round's
``bytes_up``/``bytes_down`` include it. The round's row gets ``ccvr``: the clients, classes, virtual features,
bytes, seconds (also in ``time.aggregation``) and ``before``, the uncalibrated model's metrics.

Privacy: the statistics reveal each client's label counts and the first two moments of its features per class; no
accountant of the library covers them, so CCVR is refused with any privacy setting. It needs the clients' data
where the server step runs (the simulator and ``run.devices``, whose rank 0 computes every client's statistics);
a Flower run refuses it (its nodes send no statistics).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..linalg.class_moments import class_moments, gaussian_samples, pooled_class_moments
from ..message import Message, State
from ..seeding import torch_generator
from ..tasks.base import classifier_parameters
from .engine import wire

FEATURE_BATCH = 64  # examples per forward pass when a client computes its statistics
CALIBRATION_BATCH = 64  # virtual features per SGD step
MOMENTUM = 0.9


class ClassifierCalibration:
    """CCVR's calibration (module docstring) of a run's global classifier; ``server_run`` supplies the task, the
    clients' data and the method (see :meth:`~.server_run.ServerRun.close_round`)."""

    def __init__(self, samples: int, epochs: int, lr: float, classifier: str, seed: int):
        self.samples, self.epochs, self.lr, self.classifier, self.seed = samples, epochs, lr, classifier, seed

    @classmethod
    def of_run(cls, run) -> "ClassifierCalibration | None":
        """The calibration ``run`` (a :class:`~.run.Run`) asks for, ``None`` without ``task.options.ccvr_samples``;
        ``ValueError`` (one line) for a method whose server state holds no global classifier."""
        options = getattr(run.task, "remedies", None)
        if options is None or not options.ccvr_samples:
            return None
        names = classifier_parameters(run.model.net, tuple(run.task.loaded.output_modules))
        missing = [n for n in names if f"head/{n}" not in run.server]
        name = run.method.name
        if run.method.personalized:
            raise ValueError(f"task.options.ccvr_samples: method {name!r} is personalised (each client is evaluated "
                             "with its own model) and CCVR calibrates the one global classifier; set it to 0")
        if missing:
            raise ValueError(f"task.options.ccvr_samples: method {name!r} holds no head/{missing[0]} in its server "
                             "state (its classifier is kept in a form of its own) and CCVR calibrates that entry; "
                             "set it to 0")
        module = names[0].rsplit(".", 1)[0]
        return cls(options.ccvr_samples, options.ccvr_epochs, options.ccvr_lr, module, run.cfg.run.seed)

    # -- a client -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def client_statistics(self, task, model, indices: np.ndarray, device: torch.device) -> Message:
        """The message of a client holding training examples ``indices``, the global model loaded on ``model``:
        ``ccvr/count`` ``[C]`` int64, ``ccvr/mean`` ``[C, d]`` and ``ccvr/cov`` ``[C, d, d]`` float32."""
        net = model.net
        net.eval()
        seen: list[torch.Tensor] = []
        hook = net.get_submodule(self.classifier).register_forward_pre_hook(
            lambda _, inputs: seen.append(inputs[0].detach().float().cpu()))
        labels = []
        try:
            for start in range(0, len(indices), FEATURE_BATCH):
                batch = task.batch(np.asarray(indices[start:start + FEATURE_BATCH]))
                labels.append(batch["labels"])
                task.output(net, task.device_batch(batch, device))
        finally:
            hook.remove()
        counts, means, covs = class_moments(torch.cat(seen), torch.cat(labels), task.num_labels)
        return Message({"ccvr/count": counts, "ccvr/mean": means.float(), "ccvr/cov": covs.float()})

    # -- the server --------------------------------------------------------------------------------------------
    def calibrated_head(self, weight: torch.Tensor, bias: torch.Tensor | None,
                        statistics: list[Message]) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]:
        """The classifier ``weight`` ``[C, d]`` and ``bias`` ``[C]`` (``None``: it has none) trained on virtual
        features drawn from the pooled ``statistics`` (the clients' messages), and what was done (classes present,
        virtual features)."""
        total, mu, cov = pooled_class_moments(torch.stack([m["ccvr/count"] for m in statistics]),
                                              torch.stack([m["ccvr/mean"] for m in statistics]),
                                              torch.stack([m["ccvr/cov"] for m in statistics]))
        draws = torch_generator(self.seed, "ccvr-virtual")
        present = [c for c in range(len(total)) if total[c] > 0]
        features = torch.cat([gaussian_samples(mu[c], cov[c], self.samples, draws) for c in present])
        labels = torch.tensor(present).repeat_interleave(self.samples)
        w = weight.detach().clone().float().requires_grad_(True)
        b = (torch.zeros(len(w)) if bias is None else bias.detach().clone().float()).requires_grad_(bias is not None)
        opt = torch.optim.SGD([w, b] if bias is not None else [w], lr=self.lr, momentum=MOMENTUM)
        order = torch_generator(self.seed, "ccvr-order")
        x = features.float()
        for _ in range(self.epochs):
            perm = torch.randperm(len(labels), generator=order)
            for start in range(0, len(perm), CALIBRATION_BATCH):
                sel = perm[start:start + CALIBRATION_BATCH]
                loss = F.cross_entropy(x[sel] @ w.T + b, labels[sel])
                opt.zero_grad()
                loss.backward()
                opt.step()
        info = {"classes": len(present), "virtual_features": len(labels)}
        return w.detach().to(weight.dtype), None if bias is None else b.detach().to(bias.dtype), info

    def calibrate(self, run, server: State, rnd: int) -> tuple[State, list[dict[str, Any]], dict[str, Any]]:
        """``(calibrated server state, ledger rows, info)`` of round ``rnd``'s aggregated ``server`` state, every
        client's statistics computed on ``run``'s model from its data (``run.parts``)."""
        started = time.perf_counter()
        method = run.method
        method.load_global(run.model, server)
        statistics, ledger = [], []
        for k, indices in enumerate(run.parts):
            sent = self.client_statistics(run.task, run.model, indices, run.device)
            statistics.append(wire(sent))
            ledger.append({"round": rnd, "client": k, "down": method.broadcast(server, k, rnd).nbytes(),
                           "up": sent.nbytes(), "phase": "ccvr"})
        w_key, b_key = f"head/{self.classifier}.weight", f"head/{self.classifier}.bias"
        weight, bias, info = self.calibrated_head(server[w_key], server.get(b_key), statistics)
        calibrated = State(server)
        calibrated[w_key] = weight
        if bias is not None:
            calibrated[b_key] = bias
        info.update({"clients": len(statistics), "bytes_up": sum(r["up"] for r in ledger),
                     "bytes_down": sum(r["down"] for r in ledger), "seconds": time.perf_counter() - started})
        return calibrated, ledger, info


__all__ = ["ClassifierCalibration"]

"""Synthetic federated matrix regression (Zhu et al., "Subspace Optimization for Efficient Federated Learning under
Heterogeneous Data", arXiv:2604.25467, §5.1, eq. 130–136; the paper publishes no generator, so the recipe below is
ours and reproduces its magnitudes).

Client i holds ``A_i: [n, d]`` and ``B_i: [n, m]``; its loss is
``f_i(X) = 1/(2n)·‖A_i X − B_i‖²_F + λ/2·‖X‖²_F`` and the global objective is ``F = (1/N) Σ_i f_i``.
Heterogeneity is a per-client feature-mean shift: rows ``a_ij = μ_i + z_ij`` with ``μ_i ~ N(0, het²·I_d)``,
``z_ij ~ N(0, I_d)``; labels ``B_i = A_i X_true + noise·N(0, 1)`` with one shared ``X_true ~ N(0, 1)^{d×m}``.
``X*`` is the closed-form minimiser of F and the metric is ``RelErr(X) = ‖X − X*‖_F / ‖X*‖_F``.

The model is an :class:`AdaptedModel` around one bias-free ``nn.Linear(d, m)`` (target ``"linear"``, no head)
whose weight is ``Xᵀ: [m, d]`` (layout ``[out, in]``), initialised to 0 (so RelErr(X⁰) = 1). Every method of
the project therefore trains X through the ordinary contract. The training set is the N·n rows in client
order; :attr:`natural_partition` gives each row's client, so ``partition.kind = "natural"`` reproduces the
paper's clients. For tasks like this one whose gradients are closed-form, :meth:`batched_examples` and
:meth:`batched_grad` serve :mod:`fedlowrank.runtime.vectorized` with NumPy arrays (the task's tensors' memory),
whose BLAS multiplies these small stacks two to three times faster than torch's per call.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ..adapters.model import AdaptedLinear, AdaptedModel
from ..device import module_device
from ..schema import ConfigError, Schema, setting
from . import register_task
from .base import Task

TARGET = "linear"


class _Linear(nn.Module):
    def __init__(self, d: int, m: int, dtype: torch.dtype):
        super().__init__()
        self.linear = nn.Linear(d, m, bias=False, dtype=dtype)
        nn.init.zeros_(self.linear.weight)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return self.linear(a)


def make_problem(seed: int, num_clients: int, dim: int, outputs: int, samples: int, het: float,
                 ridge: float, noise: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Data and minimiser of the problem above (numpy, float64): ``A [N, n, d]``, ``B [N, n, m]``, ``X* [d, m]``."""
    rng = np.random.default_rng(seed)
    x_true = rng.standard_normal((dim, outputs))
    mu = het * rng.standard_normal((num_clients, dim))
    A = rng.standard_normal((num_clients, samples, dim)) + mu[:, None, :]
    B = A @ x_true + noise * rng.standard_normal((num_clients, samples, outputs))
    H = np.einsum("inj,ink->jk", A, A) / (samples * num_clients) + ridge * np.eye(dim)
    rhs = np.einsum("inj,ink->jk", A, B) / (samples * num_clients)
    return A, B, np.linalg.solve(H, rhs)


MAX_SIZE = 10**8  # entries of A = N·n·d


@dataclass
class MatrixRegressionOptions(Schema):
    """``task.options`` of ``task.kind = "matrix-regression"`` (the module docstring's problem)."""

    prefix = "task.options"

    num_clients: int = setting(20, "N, the clients (partition.kind = natural deals one to each)", ge=1)
    dim: int = setting(100, "d, the input dimension", ge=1)
    outputs: int = setting(10, "m, the outputs", ge=1)
    samples: int = setting(50, "n, the rows of each client", ge=1)
    het: float = setting(2.0, "std of each client's feature-mean shift (0.1 / 0.5 / 2.0 in the paper)", ge=0)
    ridge: float = setting(0.1, "λ of the ridge term", ge=0)
    noise: float = setting(0.01, "observation-noise std", ge=0)
    data_seed: int = setting(0, "seed of the data (keep it fixed across the methods of a comparison so that X* is "
                             "shared)")
    dtype: str = setting("float64", "precision of the data and the model (float64 is needed for the 1e-10 exactness "
                         "checks)", choices=("float64", "float32"))
    objective: bool = setting(False, "also report objective F(X) − F(X*) at each evaluation (F costs more than a "
                              "round of the vectorised runner)")

    def __post_init__(self) -> None:
        super().__post_init__()
        size = self.num_clients * self.samples * (self.dim + self.outputs)
        if size > MAX_SIZE:
            raise ConfigError(f"task.options.num_clients × samples × (dim + outputs) = {size:.3g} data entries, more "
                              f"than {MAX_SIZE:.0e} (≈ {MAX_SIZE * 8 / 2**30:.1f} GiB in float64, held in memory "
                              f"with its copies)")


@register_task
class MatrixRegression(Task):
    """The federated matrix-regression task (config ``task.kind = "matrix-regression"``, options
    :class:`MatrixRegressionOptions`).

    Metrics (:meth:`evaluate`): ``rel_error`` (NaN once X is non-finite) and, with ``objective = true``,
    ``objective`` F(X) − F(X*);
    on held-out rows (:meth:`evaluate_examples`): ``loss`` = mean of ``½‖a_j X − b_j‖²``.
    Divergence: stop a run with ``run.stop_metric = "rel_error"``, ``run.stop_above = 1e6`` (the paper's "NaN (diverged)").
    """

    name = "matrix-regression"
    metrics = ("rel_error", "objective")  # objective only with task.options.objective = true
    primary_metric = "rel_error"
    batched = True
    Options = MatrixRegressionOptions

    @classmethod
    def own_data(cls, cfg) -> tuple[str, str]:
        return ("synthetic matrix regression",
                "synthetic (" + ", ".join(f"{k} = {v}" for k, v in cfg.task.options.items()) + ")")

    @classmethod
    def from_config(cls, cfg, cohorts: bool = False) -> "MatrixRegression":
        return cls(**cfg.task.options)

    def __init__(self, **options):
        o = MatrixRegressionOptions(**options)
        self.options = dataclasses.asdict(o)
        self.report_objective = o.objective
        self.dtype = getattr(torch, o.dtype)
        self.ridge = o.ridge
        A, B, x_star = make_problem(o.data_seed, o.num_clients, o.dim, o.outputs, o.samples, o.het, o.ridge, o.noise)
        self.A = torch.from_numpy(A.reshape(o.num_clients * o.samples, o.dim)).to(self.dtype)    # [N·n, d]
        self.B = torch.from_numpy(B.reshape(o.num_clients * o.samples, o.outputs)).to(self.dtype)  # [N·n, m]
        self.x_star = torch.from_numpy(x_star)                                                  # [d, m] float64
        self.natural_partition = np.repeat(np.arange(o.num_clients), o.samples)
        self._A_np, self._B_np = self.A.numpy(), self.B.numpy()                                 # the same memory
        self._eye = torch.eye(o.dim, dtype=self.dtype)                                         # [d, d]: net(I) = X
        self._x_star_norm = float(self.x_star.norm())
        self._f_star = self.objective(self.x_star)

    @property
    def num_train(self) -> int:
        return self.A.shape[0]

    def build_model(self) -> AdaptedModel:
        return AdaptedModel(_Linear(self.A.shape[1], self.B.shape[1], self.dtype), [TARGET], [])

    def batch(self, indices: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(indices), dtype=torch.long)

    def loss(self, net: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        """``1/(2b)·‖A_b X − B_b‖² + λ/2·‖X‖²``; X is read through the net (``net(I_d) = X``), so any adapter works."""
        d, b = self.A.shape[1], len(batch)
        rows, device = batch.to(self.A.device), module_device(net)
        out = net(torch.cat([self.A[rows], torch.eye(d, dtype=self.dtype)]).to(device))
        return 0.5 * ((out[:b] - self.B[rows].to(device)) ** 2).sum() / b + 0.5 * self.ridge * (out[b:] ** 2).sum()

    def batched_examples(self, batches: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """The rows of a round's minibatches, gathered once: ``batches [K, S, b]`` → per step ``k`` the pair
        ``(A_b [S, b, d], B_b [S, b, m])`` (NumPy) that :meth:`batched_grad` takes."""
        rows = np.asarray(batches)
        return list(zip(np.take(self._A_np, rows, axis=0), np.take(self._B_np, rows, axis=0)))

    def batched_grad(self, weights: dict[str, np.ndarray],
                     examples: tuple[np.ndarray, np.ndarray]) -> dict[str, np.ndarray]:
        """Minibatch gradients of S clients at once: ``W [S, m, d]`` and one step of :meth:`batched_examples`
        ``(A_b [S, b, d], B_b [S, b, m])`` → ``∇_W [S, m, d]``, NumPy arrays.

        ``g = (A_b Wᵀ − B_b)ᵀ A_b / b + λ W`` (the gradient of :meth:`loss` in the ``[out, in]`` layout).
        """
        W = weights[TARGET]
        A, B = examples
        R = A @ W.transpose(0, 2, 1)                                   # A Wᵀ: [S, b, m]
        R -= B
        G = R.transpose(0, 2, 1) @ A                                   # [S, m, d]
        G *= 1.0 / A.shape[1]
        G += self.ridge * W
        return {TARGET: G}

    def weight(self, net: nn.Module) -> torch.Tensor:
        """The model's X ``[d, m]`` (float64), the values of ``net(I_d)`` whatever adapter is attached: the frozen
        path ``I_d Wᵀ`` is read directly as ``Wᵀ`` (a product with the identity is exact, without TF32) and only an
        adapter's own path runs on ``I_d``."""
        lin = net.linear
        with torch.no_grad():
            if isinstance(lin, AdaptedLinear):
                x = lin.frozen_weight().T.contiguous()
                extra = lin.adapter_output(self._eye.to(x.device))
            else:
                x, extra = lin.weight.T.contiguous(), None
            return (x if extra is None else x + extra).to(device="cpu", dtype=torch.float64)

    def objective(self, x: torch.Tensor) -> float:
        """F(X) for ``X [d, m]``."""
        A, B = self.A.to(torch.float64), self.B.to(torch.float64)
        # every client has n rows, so the mean over all rows is (1/N) Σ_i (1/n) Σ_j
        return float(0.5 * ((A @ x - B) ** 2).sum(1).mean() + 0.5 * self.ridge * (x ** 2).sum())

    def evaluate(self, net: nn.Module) -> dict[str, float]:
        x = self.weight(net)
        error = float((x - self.x_star).norm())
        finite = math.isfinite(error) or bool(torch.isfinite(x).all())   # a finite norm implies a finite X
        metrics = {"rel_error": error / self._x_star_norm if finite else math.nan}
        if self.report_objective:
            metrics["objective"] = self.objective(x) - self._f_star if finite else math.nan
        return metrics

    def evaluate_examples(self, net: nn.Module, indices: np.ndarray) -> dict[str, float]:
        x = self.weight(net)
        rows = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        if not bool(torch.isfinite(x).all()):
            return {"loss": math.nan}
        A, B = self.A[rows].to(torch.float64), self.B[rows].to(torch.float64)
        return {"loss": float(0.5 * ((A @ x - B) ** 2).sum(1).mean())}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "num_train": self.num_train, **self.options, "x_star_norm": self._x_star_norm}

"""The task contract: data, model, loss and metrics bundled (DESIGN §6).

A task exposes its training labels (for partitioners), builds the :class:`AdaptedModel`, turns example indices
into a batch, computes the training loss, and evaluates a model on its global test set, or on training examples
held out as a validation split (:meth:`Task.evaluate_examples`, :meth:`Task.validation`; used by
``fedlowrank tune``, which never looks at the test set).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..adapters.model import AdaptedModel, Routing
from ..device import to_device
from ..adapters.targets import default_targets, resolve_targets


def adapted_copy(loaded, targets: list[str] | str | None, train_outputs: bool) -> AdaptedModel:
    """A fresh copy of ``loaded.net`` (a :class:`~fedlowrank.models.loading.LoadedModel`) with its adapter targets resolved:
    ``targets`` (``lora.targets``) or the architecture's default, never the output modules
    (``loaded.output_modules``: a classifier, ``lm_head``), whose parameters are the trained head when
    ``train_outputs`` and stay frozen otherwise."""
    net = copy.deepcopy(loaded.net)
    net.eval()
    outputs = tuple(loaded.output_modules)
    names = resolve_targets(net, targets or default_targets(loaded.model_type), outputs)
    head = [n for n, _ in net.named_parameters() if n.startswith(tuple(f"{m}." for m in outputs))] if train_outputs else []
    return AdaptedModel(net, names, head)


def join_padded(batches: list[dict[str, Tensor]], pad: dict[str, int]) -> tuple[dict[str, Tensor], Routing]:
    """Dict batches as one: each key's tensors ``[n_k, T_k, ...]`` padded at the end of dimension 1 to the longest
    ``T`` with ``pad[key]`` (keys not in ``pad`` are concatenated as they are), then concatenated along dimension
    0. Returns ``(batch [Σ n_k, T, ...], routing)``, batch k's rows ``routing.rows[k]``."""
    joint = {}
    for key in batches[0]:
        parts = [b[key] for b in batches]
        if key in pad:
            width = max(t.shape[1] for t in parts)
            parts = [t if t.shape[1] == width else F.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1]),
                                                         value=pad[key]) for t in parts]
        joint[key] = torch.cat(parts)
    ends = np.cumsum([len(b[next(iter(b))]) for b in batches]).tolist()
    return joint, Routing(rows=[slice(a, b) for a, b in zip([0, *ends[:-1]], ends)])


def padded_length(longest: int, buckets: list[int], max_length: int) -> int:
    """The length a training batch whose longest example has ``longest`` tokens is padded to: the smallest of
    ``buckets`` (``task.length_buckets``, increasing) that holds it, ``max_length`` beyond the largest, ``longest``
    without buckets (so that a compiled step sees a few shapes, each compiled once)."""
    if not buckets:
        return longest
    return next((b for b in buckets if b >= longest), max(max_length, longest))


def mean_by_member(values: Tensor, routing: Routing) -> Tensor:
    """``[K]`` the mean of ``values: [B]`` over each member's rows (row routing)."""
    sums = values.new_zeros(routing.size).index_add(0, routing.member_of_rows(values.device), values)
    return sums / torch.tensor([s.stop - s.start for s in routing.rows], dtype=values.dtype, device=values.device)


class Task:
    """Base class of tasks.

    Attributes:
        name: short name, e.g. ``"text-classification"``.
        train_labels: ``[N_train]`` integer labels of the training set (for label-based partitioners), or
            ``None`` when the task has no labels (partition with ``iid``/``quantity`` or natural ids).
        num_train: N_train.
        natural_partition: optional ``[N_train]`` client ids for tasks whose data come already split
            (e.g. the federated matrix regression); ``None`` otherwise.
        validation_metric: the key of :meth:`evaluate_examples` that learning-rate tuning selects on
            (``"accuracy"`` is maximised, any other key minimised).
        metrics: the names :meth:`evaluate` returns (``run.stop_metric`` must be one of them).
        supports_cohorts: whether :meth:`join_batches`, :meth:`output` and :meth:`output_loss` are defined, so
            that several clients' steps can share one forward pass (:mod:`fedlowrank.runtime.cohort`).
    """

    name: str = ""
    metrics: tuple[str, ...] = ()
    validation_metric: str = "loss"
    train_labels: np.ndarray | None = None
    natural_partition: np.ndarray | None = None
    supports_cohorts: bool = False

    @property
    def num_train(self) -> int:
        raise NotImplementedError

    def build_model(self) -> AdaptedModel:
        """A fresh model (pretrained backbone + head) with targets resolved; deterministic."""
        raise NotImplementedError

    def batch(self, indices: np.ndarray) -> Any:
        """The training examples at ``indices`` as one batch."""
        raise NotImplementedError

    def probe_batch(self, rows: int) -> Any:
        """A training batch of ``rows`` rows as large as training batches get (the longest examples at the longest
        padded length), for the cohort memory planner. Default: the first ``rows`` examples."""
        return self.batch(np.arange(rows) % self.num_train)

    def rows_per_step(self, batch_size: int) -> float:
        """Rows of a client's training batch of ``batch_size`` examples at most (the memory planner's unit)."""
        return batch_size

    def device_batch(self, batch: Any, device: torch.device) -> Any:
        """``batch`` as a training step on ``device`` uses it: every tensor moved there (default). A task may keep
        on the host what only the host reads, so that a step never waits for the device to read it back."""
        return to_device(batch, device)

    def loss(self, net: nn.Module, batch: Any) -> Tensor:
        """Scalar training loss of ``net`` on ``batch`` (with autograd)."""
        raise NotImplementedError

    def compiled_module(self, net: nn.Module) -> nn.Module:
        """The module of ``net`` that ``run.compile`` compiles for training steps (default: all of it; the loss,
        which may read the host, stays outside)."""
        return net

    def features(self, net: nn.Module, batch: Any) -> Tensor:
        """The representation the head sees, ``[batch, d]`` (for representation-level methods such as MOON)."""
        raise NotImplementedError(f"task {self.name!r} does not expose features")

    # -- cohorts (supports_cohorts): loss(net, batch) == output_loss(output(net, batch), batch) -------------------
    # and output_losses(output(net, joined), routing, batches)[k] == output_loss(output(net, batches[k]), batches[k])
    def join_batches(self, batches: list) -> tuple[Any, Routing]:
        """Several clients' batches as one batch and where each one is in it (:class:`Routing`: its rows, or its
        tokens in packed rows); padding changes no output the loss reads (e.g. :func:`join_padded` with the pad
        token, mask 0, label -100)."""
        raise NotImplementedError(f"task {self.name!r} cannot join batches")

    def output(self, net: nn.Module, batch: Any) -> Tensor:
        """What the loss reads from the network, row ``i`` for example ``i``: ``[B, ...]`` (logits; a causal LM's
        summed response log-likelihoods)."""
        raise NotImplementedError(f"task {self.name!r} cannot join batches")

    def output_loss(self, out: Tensor, batch: Any) -> Tensor:
        """The loss of ``batch`` from its rows of :meth:`output` (longer along a padded dimension when joined)."""
        raise NotImplementedError(f"task {self.name!r} cannot join batches")

    def output_losses(self, out: Tensor, routing: Routing, batches: list) -> Tensor:
        """``[K]`` the loss of each of ``batches`` from its part (``routing``) of the joined batch's :meth:`output`
        (default: :meth:`output_loss` of each one's rows; a task computes them together in a few operations)."""
        return torch.stack([self.output_loss(out[s], b) for s, b in zip(routing.rows, batches)])

    def evaluate(self, net: nn.Module) -> dict[str, float]:
        """Metrics on the global test set, e.g. ``{"accuracy": .., "loss": ..}`` (no autograd)."""
        raise NotImplementedError

    def column_values(self, name: str) -> list[str]:
        """The value of data column ``name`` for every training example (for ``partition.partition_by``)."""
        raise ValueError(f"partition.partition_by: task {self.name!r} has no data columns to split on")

    def embedding_texts(self) -> list[str]:
        """The text of every training example (for ``partition.kind = "clusters"``)."""
        raise ValueError(f"partition.kind = 'clusters': task {self.name!r} has no texts to embed")

    def pop_generations(self) -> list[dict[str, Any]]:
        """Examples of what the model produced in the last :meth:`evaluate` (e.g. prompt, reference, output),
        handed over once; the runtime writes them to the run directory. Default: none."""
        return []

    def evaluate_examples(self, net: nn.Module, indices: np.ndarray) -> dict[str, float]:
        """Metrics on the training examples at ``indices`` (a validation split held out of training)."""
        raise NotImplementedError(f"task {self.name!r} cannot evaluate on held-out training examples")

    def validation(self, indices: np.ndarray) -> "Task":
        """This task with :meth:`evaluate` on the training examples ``indices`` instead of the test set."""
        return ValidationView(self, indices)

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary for the run directory."""
        return {"name": self.name, "num_train": self.num_train}

    def describe_partition(self, parts: list[np.ndarray]) -> dict[str, Any]:
        """Task-specific facts about the clients' data for ``partition.json`` (e.g. each client's image domain)."""
        return {}


class ValidationView(Task):
    """``task`` whose :meth:`evaluate` reports on held-out training examples ``indices`` (the validation split);
    data, model, batches and loss are the task's own. The caller keeps ``indices`` out of every client's data."""

    def __init__(self, task: Task, indices: np.ndarray):
        self.task = task
        self.indices = np.sort(np.asarray(indices, dtype=np.int64))
        self.name = task.name
        self.train_labels = task.train_labels
        self.natural_partition = task.natural_partition
        self.validation_metric = task.validation_metric

    def __getattr__(self, key: str) -> Any:  # task-specific extras (e.g. ``batched_grad``, ``data``)
        return getattr(self.__dict__["task"], key)

    @property
    def supports_cohorts(self) -> bool:  # type: ignore[override]
        return self.task.supports_cohorts

    def join_batches(self, batches: list) -> tuple[Any, Routing]:
        return self.task.join_batches(batches)

    def output(self, net: nn.Module, batch: Any) -> Tensor:
        return self.task.output(net, batch)

    def output_loss(self, out: Tensor, batch: Any) -> Tensor:
        return self.task.output_loss(out, batch)

    def output_losses(self, out: Tensor, routing: Routing, batches: list) -> Tensor:
        return self.task.output_losses(out, routing, batches)

    @property
    def num_train(self) -> int:
        return self.task.num_train

    def build_model(self) -> AdaptedModel:
        return self.task.build_model()

    def batch(self, indices: np.ndarray) -> Any:
        return self.task.batch(indices)

    def probe_batch(self, rows: int) -> Any:
        return self.task.probe_batch(rows)

    def rows_per_step(self, batch_size: int) -> float:
        return self.task.rows_per_step(batch_size)

    def device_batch(self, batch: Any, device: torch.device) -> Any:
        return self.task.device_batch(batch, device)

    def loss(self, net: nn.Module, batch: Any) -> Tensor:
        return self.task.loss(net, batch)

    def compiled_module(self, net: nn.Module) -> nn.Module:
        return self.task.compiled_module(net)

    def features(self, net: nn.Module, batch: Any) -> Tensor:
        return self.task.features(net, batch)

    def column_values(self, name: str) -> list[str]:
        return self.task.column_values(name)

    def embedding_texts(self) -> list[str]:
        return self.task.embedding_texts()

    def evaluate(self, net: nn.Module) -> dict[str, float]:
        return self.task.evaluate_examples(net, self.indices)

    def describe(self) -> dict[str, Any]:
        return {**self.task.describe(), "num_validation": len(self.indices)}

    def describe_partition(self, parts: list[np.ndarray]) -> dict[str, Any]:
        return self.task.describe_partition(parts)

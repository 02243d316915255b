"""The task contract: data, model, loss and metrics bundled (DESIGN §6).

A task exposes its training labels (for partitioners), builds the :class:`AdaptedModel`, turns example indices
into a batch, computes the training loss, and evaluates a model on its global test set.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torch import Tensor, nn

from ..adapters.model import AdaptedModel


class Task:
    """Base class of tasks.

    Attributes:
        name: short name, e.g. ``"text-classification"``.
        train_labels: ``[N_train]`` integer labels of the training set (for label-based partitioners), or
            ``None`` when the task has no labels (partition with ``iid``/``quantity`` or natural ids).
        num_train: N_train.
        natural_partition: optional ``[N_train]`` client ids for tasks whose data come already split
            (e.g. the federated matrix regression); ``None`` otherwise.
    """

    name: str = ""
    train_labels: np.ndarray | None = None
    natural_partition: np.ndarray | None = None

    @property
    def num_train(self) -> int:
        raise NotImplementedError

    def build_model(self) -> AdaptedModel:
        """A fresh model (pretrained backbone + head) with targets resolved; deterministic."""
        raise NotImplementedError

    def batch(self, indices: np.ndarray) -> Any:
        """The training examples at ``indices`` as one batch."""
        raise NotImplementedError

    def loss(self, net: nn.Module, batch: Any) -> Tensor:
        """Scalar training loss of ``net`` on ``batch`` (with autograd)."""
        raise NotImplementedError

    def features(self, net: nn.Module, batch: Any) -> Tensor:
        """The representation the head sees, ``[batch, d]`` (for representation-level methods such as MOON)."""
        raise NotImplementedError(f"task {self.name!r} does not expose features")

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

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary for the run directory."""
        return {"name": self.name, "num_train": self.num_train}

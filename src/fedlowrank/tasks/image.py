"""Image classification on a ViT, a CLIP vision tower with a linear head, or a CIFAR-style ResNet-20, with
optional feature-shift **domains** (each training example in one domain, the test set under every domain).

Images are kept as ``uint8 [N, C, H, W]`` and turned into the model's input per batch with torch only: to
``[0, 1]``, grayscale → 3 channels (repeat) or RGB → 1 (luma) as the model wants, bilinear resize to its input
size (antialiased when shrinking), then ``(x − mean) / std`` from the model's ``preprocessor_config.json``.

Metrics: ``accuracy`` and ``loss`` on the test set; with domains, the mean over domains and ``accuracy_<domain>``
per domain. The head (``classifier.*``) is new, trained and shared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..adapters.model import AdaptedModel, Routing
from ..device import module_device
from ..models.loading import NOT_IMAGENET, load_model
from ..schema import distinct, setting
from . import register_task
from .base import (Classification, ClassificationOptions, adapted_copy, join_padded, prediction_counts,
                   prediction_summary)
from .fmnist_vit import fmnist_vit_folder
from .image_data import (DOMAINS, ImageData, apply_domain, assign_domains, check_domains, load_fashion_mnist,
                         load_hf_images, load_image_folder, subsample_images)

LUMA = (0.299, 0.587, 0.114)


def to_model_input(images: torch.Tensor, pre: dict[str, Any]) -> torch.Tensor:
    """``uint8 [n, C, H, W]`` → normalised ``float32 [n, C', S, S]`` for a model with ``pre`` =
    ``{image_size: S, num_channels: C', mean: [C'], std: [C']}``."""
    x = images.float() / 255.0
    want = pre["num_channels"]
    if x.shape[1] != want:
        if x.shape[1] == 1 and want == 3:
            x = x.expand(-1, 3, -1, -1)
        elif x.shape[1] == 3 and want == 1:
            x = torch.einsum("nchw,c->nhw", x, torch.tensor(LUMA))[:, None]
        else:
            raise ValueError(f"images have {x.shape[1]} channels; the model wants {want}")
    size = pre["image_size"]
    if tuple(x.shape[-2:]) != (size, size):
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False,
                          antialias=size < max(x.shape[-2:]))
    mean = torch.tensor(pre["mean"]).view(1, -1, 1, 1)
    std = torch.tensor(pre["std"]).view(1, -1, 1, 1)
    return (x - mean) / std


def shift_domain(images: np.ndarray, domain: str, seed: int) -> np.ndarray:
    """:func:`~.image_data.apply_domain` on ``uint8`` images, back to ``uint8`` (rounded)."""
    x = torch.from_numpy(images).float() / 255.0
    return (apply_domain(x, domain, seed) * 255.0).round().clamp(0, 255).to(torch.uint8).numpy()


@dataclass
class ImageOptions(ClassificationOptions):
    """``task.options`` of ``task.kind = "image-classification"``."""

    prefix = "task.options"

    classes: list[int] = setting([], "data.source = fashion-mnist: the class ids to keep, relabelled in this order "
                                 "([] = all ten)", ge=0, le=9, check=distinct)
    domains: list[str] = setting([], "feature-shift domains: training examples are dealt to them in equal seeded "
                                 "groups (partition.kind = domains gives each client one) and the test set is "
                                 "evaluated under each ([] = none)", choices=DOMAINS, check=distinct)


@register_task
class ImageClassification(Classification):
    """Image classification with cross-entropy.

    Args:
        data: images and labels.
        model: ``task.model`` (see :func:`fedlowrank.models.loading.load_image_model`): ``tiny-vit``, ``tiny-clip``,
            ``fmnist-vit`` (the project-pretrained stand-in), ``resnet20`` (from scratch), a folder or a hub id.
        targets: LoRA/adapter target suffixes; ``None`` = the architecture's default.
        eval_batch_size: images per evaluation forward pass.
        domains: feature-shift domain names (:data:`~.image_data.DOMAINS`); training examples are dealt to them in
            equal seeded groups (``natural_partition`` = domain ids, so ``partition.kind = "domains"`` gives each
            client one domain) and the test set is evaluated under each.
        seed: for the domain assignment and the noise domain.
        source: where the data came from (for :meth:`describe`).
        remedies: ``task.options``, the label-skew remedies of the training loss (:class:`~.base.Classification`).
    """

    name = "image-classification"
    metrics = ("accuracy", "loss")  # with domains, also accuracy_<domain>
    primary_metric = "accuracy"
    maximize = ("accuracy",)
    validation_metric = "accuracy"
    supports_cohorts = True
    Options = ImageOptions
    data_description = "image data"
    data_sources = {"fashion-mnist": ("max_train_examples", "max_test_examples", "train"),
                    "image-folder": ("max_train_examples", "max_test_examples", "train", "test", "test_fraction"),
                    "hf-images": ("max_train_examples", "max_test_examples", "hf_name")}

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        if cfg.task.options.get("classes") and cfg.data.source != "fashion-mnist":
            raise ValueError("task.options.classes applies to data.source = 'fashion-mnist' only")

    @classmethod
    def from_config(cls, cfg, cohorts: bool = False) -> "ImageClassification":
        """The images of ``data.source`` (Fashion-MNIST, a folder of class sub-folders or a Hugging Face image set),
        ``data.max_*_examples`` of them, on ``task.model`` with the options' classes and domains."""
        d, options = cfg.data, cls.checked_options(cfg)
        if d.source == "fashion-mnist":
            classes = options.classes or None
            data = load_fashion_mnist(d.train, classes)
            source = f"Fashion-MNIST classes {classes or list(range(10))}"
        elif d.source == "image-folder":
            if not d.train:
                raise ValueError("data.train: a folder of class sub-folders is required when data.source = "
                                 "'image-folder'")
            data, source = load_image_folder(d.train, d.test or None, d.test_fraction, cfg.run.seed), d.train
        else:
            data, source = load_hf_images(d.hf_name), d.hf_name
        data = subsample_images(data, d.max_train_examples, d.max_test_examples, cfg.run.seed)
        return cls(data, cfg.task.model, cfg.lora.targets or None, cfg.task.eval_batch_size, options.domains or None,
                   cfg.run.seed, source, options)

    def __init__(self, data: ImageData, model: str = "tiny-vit", targets: list[str] | None = None,
                 eval_batch_size: int = 256, domains: list[str] | None = None, seed: int = 0, source: str = "",
                 remedies: ClassificationOptions | None = None):
        self.data = data
        self.remedies = remedies or ClassificationOptions()
        self.model_name = model
        self.targets = targets
        self.eval_batch_size = eval_batch_size
        self.source = source
        spec = fmnist_vit_folder() if model == "fmnist-vit" else model
        self.loaded = load_model(spec, "image-classification", data.num_labels, data.label_names)
        self.train_labels = data.train_labels
        self.domains = check_domains(domains) if domains else []
        train = data.train_images
        if self.domains:
            self.domain_ids = assign_domains(len(train), len(self.domains), seed)
            self.natural_partition = self.domain_ids
            train = train.copy()
            for d, name in enumerate(self.domains):
                rows = np.flatnonzero(self.domain_ids == d)
                train[rows] = shift_domain(train[rows], name, seed)
        self.train_images = torch.from_numpy(np.ascontiguousarray(train))
        self.test_sets = {name: torch.from_numpy(shift_domain(data.test_images, name, seed + 1))
                          for name in (self.domains or ["clean"])}
        self.test_labels = torch.from_numpy(data.test_labels)

    @property
    def num_train(self) -> int:
        return len(self.data.train_labels)

    @property
    def num_labels(self) -> int:
        return self.data.num_labels

    def build_model(self) -> AdaptedModel:
        return adapted_copy(self.loaded, self.targets, train_outputs=True,  # the head: never a target
                            frozen_classifier=self.remedies.frozen_head)

    def inputs(self, images: torch.Tensor) -> torch.Tensor:
        return to_model_input(images, self.loaded.preprocess)

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        return {"pixel_values": self.inputs(self.train_images[idx]),
                "labels": torch.as_tensor(self.train_labels[idx.numpy()])}

    def output(self, net: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """Logits ``[B, C]``."""
        return net(pixel_values=batch["pixel_values"]).logits

    def join_batches(self, batches: list[dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], Routing]:
        return join_padded(batches, {})  # images of one size: nothing to pad

    def features(self, net: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """What the head sees, ``[batch, d]``: the input of the ``classifier`` module, caught by a hook."""
        seen: list[torch.Tensor] = []
        head = next(m for n, m in net.named_modules() if n.rsplit(".", 1)[-1] == "classifier")
        handle = head.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
        try:
            net(pixel_values=batch["pixel_values"])
        finally:
            handle.remove()
        return seen[0]

    @torch.no_grad()
    def _evaluate(self, net: nn.Module, images: torch.Tensor,
                  labels: torch.Tensor) -> tuple[dict[str, float], torch.Tensor]:
        """Accuracy and mean cross-entropy on ``images`` with ``[n]`` labels, and the ``[3, C]`` per-class
        :func:`~.base.prediction_counts`."""
        net.eval()
        device = module_device(net)
        correct, total_loss, n = 0, 0.0, len(labels)
        counts = torch.zeros(3, self.num_labels, dtype=torch.long)
        for start in range(0, n, self.eval_batch_size):
            x = self.inputs(images[start:start + self.eval_batch_size]).to(device)
            y = labels[start:start + self.eval_batch_size].to(device)
            logits = net(pixel_values=x).logits
            total_loss += float(F.cross_entropy(logits.float(), y, reduction="sum"))
            predicted = logits.argmax(-1)
            correct += int((predicted == y).sum())
            counts += prediction_counts(predicted, y, self.num_labels)
        return {"accuracy": correct / n, "loss": total_loss / n}, counts

    def evaluate(self, net: nn.Module) -> dict[str, Any]:
        """Accuracy and loss on the test set; with domains, their means over the domains plus
        ``accuracy_<domain>`` for each; ``predictions`` over every domain's test images together."""
        per = {name: self._evaluate(net, images, self.test_labels) for name, images in self.test_sets.items()}
        out: dict[str, Any] = {k: float(np.mean([m[k] for m, _ in per.values()])) for k in ("accuracy", "loss")}
        if self.domains:
            out.update({f"accuracy_{name}": m["accuracy"] for name, (m, _) in per.items()})
        out["predictions"] = prediction_summary(sum(c for _, c in per.values()), self.data.label_names)
        return out

    def evaluate_examples(self, net: nn.Module, indices: np.ndarray) -> dict[str, float]:
        idx = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        return self._evaluate(net, self.train_images[idx], torch.from_numpy(self.train_labels)[idx])[0]

    def describe_partition(self, parts: list[np.ndarray]) -> dict[str, Any]:
        """Each client's domain counts and its domain (``"mixed"`` when it holds several)."""
        if not self.domains:
            return {}
        hist = np.stack([np.bincount(self.domain_ids[p], minlength=len(self.domains)) for p in parts])
        names = [self.domains[int(np.flatnonzero(row)[0])] if np.count_nonzero(row) == 1 else "mixed" for row in hist]
        return {"domains": self.domains, "domain_histograms": hist.tolist(), "client_domains": names}

    def describe(self) -> dict[str, Any]:
        counts = np.bincount(self.train_labels, minlength=self.num_labels).tolist()
        if self.loaded.provenance is not None:
            backbone = self.loaded.provenance["note"]
        elif self.model_name in ("tiny-vit", "tiny-clip", "resnet20"):
            backbone = f"random initialisation ({NOT_IMAGENET})"
        else:
            backbone = f"pretrained weights as loaded from {self.loaded.source}"
        return {"name": self.name, "model": self.model_name, "backbone": backbone, "source": self.source,
                "num_train": self.num_train, "num_test": len(self.data.test_labels), "labels": self.data.label_names,
                "train_label_counts": counts, "domains": self.domains, "preprocess": self.loaded.preprocess}


__all__ = ["ImageClassification", "ImageOptions", "shift_domain", "to_model_input"]

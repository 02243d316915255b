"""``fmnist-vit``: the project's stand-in image backbone, pretrained here on first use.

No ImageNet ViT is obtainable offline, so this small ViT is pretrained inside fedlowrank on Fashion-MNIST classes
0–4 only, so that federated fine-tuning on classes 5–9 uses data it never saw; it is labelled
:data:`~fedlowrank.models.loading.NOT_IMAGENET` in every run. The folder is cached like the other generated
models (:func:`~fedlowrank.models.bundled.cached_folder`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..models.bundled import cached_folder
from ..models.loading import NOT_IMAGENET
from ..seeding import numpy_rng
from .image_data import load_fashion_mnist

FMNIST_VIT = {"classes": [0, 1, 2, 3, 4], "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
              "intermediate_size": 128, "image_size": 28, "patch_size": 4, "num_channels": 1, "steps": 300,
              "batch_size": 128, "lr": 2e-3, "weight_decay": 0.05, "seed": 0}


def build_fmnist_vit(folder: Path) -> None:
    """Pretrain :data:`FMNIST_VIT` on Fashion-MNIST classes 0–4 (AdamW, cosine, one thread, seeded) and save the
    backbone (``ViTModel``, no head), its preprocessing and ``pretraining.json`` (the record, test accuracy on
    classes 0–4). A few minutes on a CPU; deterministic for a given torch build."""
    from transformers import ViTConfig, ViTForImageClassification

    p = FMNIST_VIT
    data = load_fashion_mnist(classes=p["classes"])
    print(f"fedlowrank: pretraining the fmnist-vit stand-in backbone on Fashion-MNIST classes {p['classes']} "
          f"({p['steps']} steps of {p['batch_size']}; {NOT_IMAGENET}); cached in {folder.parent}", file=sys.stderr)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(p["seed"])
        cfg = ViTConfig(hidden_size=p["hidden_size"], num_hidden_layers=p["num_hidden_layers"],
                        num_attention_heads=p["num_attention_heads"], intermediate_size=p["intermediate_size"],
                        image_size=p["image_size"], patch_size=p["patch_size"], num_channels=p["num_channels"],
                        num_labels=len(p["classes"]))
        net = ViTForImageClassification(cfg)
        opt = torch.optim.AdamW(net.parameters(), lr=p["lr"], weight_decay=p["weight_decay"])
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=p["lr"], total_steps=p["steps"], pct_start=0.1)
        x = (torch.from_numpy(data.train_images).float() / 255 - 0.5) / 0.5
        y = torch.from_numpy(data.train_labels)
        rng = numpy_rng(p["seed"], "fmnist-vit-pretraining")
        order = np.concatenate([rng.permutation(len(y)) for _ in range(-(-p["steps"] * p["batch_size"] // len(y)))])
        t0 = time.perf_counter()
        net.train()
        for step in range(p["steps"]):
            idx = torch.from_numpy(order[step * p["batch_size"]:(step + 1) * p["batch_size"]])
            loss = F.cross_entropy(net(pixel_values=x[idx]).logits, y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        net.eval()
        xt = (torch.from_numpy(data.test_images).float() / 255 - 0.5) / 0.5
        with torch.no_grad():
            pred = torch.cat([net(pixel_values=xt[i:i + 500]).logits.argmax(-1) for i in range(0, len(xt), 500)])
        accuracy = float((pred == torch.from_numpy(data.test_labels)).float().mean())
    finally:
        torch.set_num_threads(threads)
    net.vit.save_pretrained(str(folder))
    (folder / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.5], "image_std": [0.5],
                                                                 "size": {"height": 28, "width": 28}}))
    record = {"note": f"{NOT_IMAGENET}: a small ViT pretrained inside fedlowrank on Fashion-MNIST classes "
                      f"{p['classes']} only (federated tasks should use the other classes)",
              "pretraining_classes": p["classes"], "test_accuracy_on_pretraining_classes": round(accuracy, 4),
              "seconds": round(time.perf_counter() - t0, 1), "torch": torch.__version__, **p}
    (folder / "pretraining.json").write_text(json.dumps(record, indent=1))


def fmnist_vit_folder() -> str:
    """The cached ``fmnist-vit`` model folder, pretrained by :func:`build_fmnist_vit` the first time."""
    return str(cached_folder("fmnist-vit-v1", build_fmnist_vit))

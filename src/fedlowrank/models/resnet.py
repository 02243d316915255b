"""A CIFAR-style ResNet-20 (He et al., "Deep Residual Learning for Image Recognition", CVPR 2016, §4.2) in plain
torch, for training from scratch (SSF's network study).

A 3×3 stem of 16 channels, three stages of three basic blocks (16, 32, 64 channels; stride 2 at the start of
stages 2 and 3), global average pooling and a linear ``classifier``: 19 convolutions + 1 linear = 20 weight layers,
0.27 M parameters. Shortcuts are the paper's option A (identity, strided and zero-padded in channels: no
parameters). **GroupNorm** (groups of 8 channels) replaces BatchNorm so that the model has no running statistics
to average between clients (Hsieh et al., "The Non-IID Data Quagmire", ICML 2020); its affine parameters are
trained in full with the classifier, never projected (:func:`norm_modules`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

CONV_TARGETS = ["stem", "conv1", "conv2"]  # every convolution (19): the weight matrices SSF projects
FASHION_MNIST_MEAN_STD = (0.2860, 0.3530)


@dataclass
class Logits:
    """The forward output, shaped like transformers' (``.logits [batch, classes]``)."""

    logits: torch.Tensor


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(max(1, channels // 8), channels)


class BasicBlock(nn.Module):
    """``relu(x̂ + norm2(conv2(relu(norm1(conv1(x))))))`` with the option-A shortcut ``x̂``."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = _norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = _norm(cout)
        self.stride, self.pad = stride, cout - cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        short = x[:, :, ::self.stride, ::self.stride] if self.stride > 1 else x
        if self.pad:
            short = F.pad(short, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))
        return F.relu(out + short)


class ResNet20(nn.Module):
    """ResNet-20 for ``[n, in_channels, H, W]`` images (any H, W ≥ 8); ``forward(pixel_values=x).logits``."""

    def __init__(self, num_classes: int, in_channels: int = 1, blocks_per_stage: int = 3):
        super().__init__()
        self.stem = nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False)
        self.norm = _norm(16)
        layers, cin = [], 16
        for stage, cout in enumerate((16, 32, 64)):
            for b in range(blocks_per_stage):
                layers.append(BasicBlock(cin, cout, 2 if stage > 0 and b == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.classifier = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, pixel_values: torch.Tensor) -> Logits:
        x = F.relu(self.norm(self.stem(pixel_values)))
        x = self.layers(x).mean(dim=(2, 3))
        return Logits(self.classifier(x))


def norm_modules(net: nn.Module) -> list[str]:
    """Names of the GroupNorm modules (trained in full, never projected)."""
    return [n for n, m in net.named_modules() if isinstance(m, nn.GroupNorm)]


__all__ = ["CONV_TARGETS", "Logits", "ResNet20", "norm_modules"]

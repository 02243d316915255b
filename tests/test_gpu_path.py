"""The GPU training path, proven on the CPU: tensors follow their module's device, the backbone in the compute
dtype, the logits-free causal-LM loss, host synchronisations and dispatched operations per step, fused optimizer
steps, length buckets, compiled steps and the cohort memory planner."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedlowrank.adapters.gram import GramLinear
from fedlowrank.adapters.lora import LoRALinear


# -- every tensor an adapter makes follows the module's device ------------------------------------------------
def _tensors_on(module: nn.Module, device: str) -> list[str]:
    """Names of the parameters and buffers of ``module`` that are not on ``device``."""
    return [n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.device.type != device]


@pytest.mark.parametrize("setter", [
    "gram: set_A with more rows",      # florg-no-procrustes: the factor grows to r' rows every round
    "gram: set_A",
    "lora: set_factors of another rank",  # heterogeneous ranks
    "lora: set_factors",
    "set_base_delta",
    "set_frozen_weight",
])
def test_adapter_setters_keep_the_module_s_device(setter):
    """A module on another device (``meta`` here, CUDA in a run) loaded from CPU tensors (messages live on the
    CPU) keeps every parameter and buffer on its device: a CPU tensor left behind is the "mat2 is on cpu" of
    ``self.L @ A.T`` on CUDA."""
    torch.manual_seed(0)
    base = nn.Linear(6, 4)
    if setter.startswith("gram"):
        module = GramLinear(base, torch.randn(4, 4), torch.randn(4, 6), rank=2, scale=1.0)
    else:
        module = LoRALinear(base, rank=2, alpha=4.0)
    module.to("meta")
    if setter == "gram: set_A with more rows":
        module.set_A(torch.randn(3, 4), any_rows=True)
        assert module.gram_A.shape == (3, 4)
    elif setter == "gram: set_A":
        module.set_A(torch.randn(2, 4))
    elif setter == "lora: set_factors of another rank":
        module.set_factors(torch.randn(3, 6), torch.randn(4, 3))
        assert module.rank == 3
    elif setter == "lora: set_factors":
        module.set_factors(torch.randn(2, 6), torch.randn(4, 2))
    elif setter == "set_base_delta":
        module.set_base_delta(torch.randn(4, 6))
    else:
        module.set_frozen_weight(torch.randn(4, 6))
    assert _tensors_on(module, "meta") == []

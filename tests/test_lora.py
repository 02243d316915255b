import math

import pytest
import torch
from torch import nn

from fedlowrank.adapters.lora import LoRALinear, lora_scale


def _layer():
    torch.manual_seed(0)
    return nn.Linear(6, 5)


def test_forward_equals_dense_reference():
    lin = _layer()
    mod = LoRALinear(lin, rank=3, alpha=6.0)
    A, B, D = torch.randn(3, 6), torch.randn(5, 3), torch.randn(5, 6)
    mod.set_factors(A, B)
    mod.set_base_delta(D)
    x = torch.randn(4, 6)
    dense = x @ (lin.weight + D + 2.0 * B @ A).T + lin.bias
    assert torch.allclose(mod(x), dense, atol=1e-5)
    assert torch.allclose(mod.adapter_delta(), 2.0 * B @ A)


def test_scaling_rule_lives_in_one_place_and_follows_rank():
    assert lora_scale(16, 4) == 4.0 and lora_scale(16, 4, "rslora") == 8.0
    with pytest.raises(ValueError, match="lora.scaling"):
        lora_scale(16, 4, "other")
    mod = LoRALinear(_layer(), rank=2, alpha=8.0, scaling="rslora")
    mod.set_factors(torch.zeros(4, 6), torch.zeros(5, 4))
    assert mod.rank == 4 and mod.scale == pytest.approx(8.0 / math.sqrt(4))


def test_rank_larger_than_layer_is_refused():
    with pytest.raises(ValueError, match=r"lora.rank must be in \[1, 5\]"):
        LoRALinear(_layer(), rank=6, alpha=1.0)


def test_base_weight_frozen_and_shape_checked():
    mod = LoRALinear(_layer(), rank=2, alpha=2.0)
    assert not mod.base.weight.requires_grad
    with pytest.raises(ValueError):
        mod.set_base_delta(torch.zeros(6, 5))
    with pytest.raises(ValueError):
        mod.set_factors(torch.zeros(2, 5), torch.zeros(5, 2))

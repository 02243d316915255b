"""QLoRA (task.quantize): the 4/8-bit frozen backbone, LoRA-family training over it, export over the unquantised base.

bitsandbytes (the optional extra ``fedlowrank[qlora]``) has a CPU backend from 0.48 on; the tests that need it
skip without it, those of the error paths run everywhere.
"""

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedlowrank.config import ConfigError, load_config
from fedlowrank.models.loading import pretrained_id
from fedlowrank.models.quantize import QuantizedLinear, quantize_linears, require_bitsandbytes, weight_bytes
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.tasks import build_task

SETS = ["partition.kind=iid", "task.options.eval_generate=0", "train.lr=1e-2"]


def has_bitsandbytes() -> bool:
    try:
        require_bitsandbytes("4bit")
    except ValueError:
        return False
    return True


needs_bnb = pytest.mark.skipif(not has_bitsandbytes(), reason="bitsandbytes (fedlowrank[qlora]) is not installed")


def test_without_bitsandbytes_quantize_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails
    with pytest.raises(ValueError, match=r"task.quantize = '4bit' needs bitsandbytes: pip install 'fedlowrank\[qlora\]'"):
        build_task(load_config("tiny-lm", ["task.quantize=4bit", *SETS]))


def test_a_bitsandbytes_without_a_cpu_backend_is_one_line(monkeypatch):
    import types

    monkeypatch.setitem(sys.modules, "bitsandbytes", types.SimpleNamespace(__version__="0.45.5"))
    with pytest.raises(ValueError, match=r"task.quantize = '8bit' needs bitsandbytes >= 0.48 \(its CPU backend "
                                         r"quantises the backbone\); found 0.45.5"):
        require_bitsandbytes("8bit")


@pytest.mark.parametrize("sets,match", [
    (["task.quantize=2bit"], r"task.quantize must be one of '', 4bit, 8bit; got '2bit'"),
    (["task.quantize=4bit", "task.kind=matrix-regression"], r"task.quantize = '4bit' is for task.kind"),
])
def test_bad_quantize_settings_are_refused_by_the_config(sets, match):
    with pytest.raises(ConfigError, match=match):
        load_config("tiny-lm", sets)


@needs_bnb
@pytest.mark.parametrize("mode,tol", [("4bit", 0.2), ("8bit", 0.006)])
def test_quantized_linear_is_its_dequantised_weight(mode, tol):
    torch.manual_seed(0)
    lin = nn.Linear(128, 48)
    q = QuantizedLinear(lin, mode)
    w = q.weight
    assert w.shape == (48, 128) and w.dtype == torch.float32 and not w.requires_grad
    error = float((w - lin.weight.detach()).abs().max())
    assert 0 < error < tol * float(lin.weight.detach().abs().max())  # ≤ half the widest code step of the (row or block) absmax, rounding of the scales aside
    x = torch.randn(6, 128, requires_grad=True)
    y = q(x)
    ref_x = x.detach().clone().requires_grad_(True)
    ref = F.linear(ref_x, w, lin.bias.detach())
    torch.testing.assert_close(y, ref, rtol=1e-2, atol=1e-2)  # 8 bit: the activations are quantised too
    y.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=2e-2, atol=2e-2)
    assert sorted(q.state_dict()) == ["bias", "weight"] and torch.equal(q.state_dict()["weight"], w)
    assert weight_bytes(q) < (0.2 if mode == "4bit" else 0.3) * weight_bytes(lin)


@needs_bnb
def test_quantize_linears_keeps_the_outputs_and_embeddings():
    loaded_task = build_task(load_config("tiny-lm", ["task.quantize=4bit", *SETS]))
    model = loaded_task.build_model()
    quantized = [n for n, m in model.net.named_modules() if isinstance(m, QuantizedLinear)]
    plain = [n for n, m in model.net.named_modules() if type(m) is nn.Linear]
    assert plain == ["lm_head"] and len(quantized) == 2 * 7  # q k v o gate up down in each of 2 layers
    assert model.target_names == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj",
                                  "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]
    assert not any(isinstance(m, QuantizedLinear) for m in loaded_task.loaded.net.modules())  # the base is intact
    assert quantize_linears(model.net, "4bit") == 1  # only lm_head was left


@needs_bnb
def test_qlora_trains_and_exports_a_plain_adapter_over_the_unquantised_base(tmp_path):
    from fedlowrank.export import export_run

    cfg = load_config("tiny-lm", ["task.quantize=4bit", *SETS, "run.rounds=3", "run.eval_every=3"])
    task = build_task(cfg)
    sim = Simulation(cfg, task=task, run_dir=tmp_path / "run")
    sim.run()
    losses = [row["train_loss"] for row in sim.history]
    assert losses[-1] < losses[0]
    lora = [p for n, p in sim.model.net.named_parameters() if "lora_" in n]
    assert lora and all(p.dtype == torch.float32 for p in lora)
    report = export_run(tmp_path / "run", tmp_path / "peft", "peft", task=task)
    assert not report["svd"] and report["peft"]["base_model_name_or_path"] == pretrained_id("tiny-llama")
    run_loss, exported_loss = report["check"]["run"]["loss"], report["check"]["exported"]["loss"]
    assert run_loss != exported_loss and abs(run_loss - exported_loss) < 0.05 * run_loss  # NF4 vs fp32 base
    from fedlowrank.export import load_peft

    peft_model = load_peft(task.loaded.net, tmp_path / "peft")
    bases = [m for n, m in peft_model.named_modules() if n.endswith("q_proj.base_layer")]
    assert bases and all(type(m) is nn.Linear for m in bases)  # a plain PEFT adapter over the unquantised base
    merged = export_run(tmp_path / "run", tmp_path / "merged", "merged", task=task)
    assert merged["check"]["exported"]["loss"] == pytest.approx(run_loss, rel=1e-5)  # the run's own weights
    assert merged["dequantized"] == "4bit" and "4bit (task.quantize)" in (tmp_path / "merged" / "README.md").read_text()


@needs_bnb
@pytest.mark.parametrize("mode", ["4bit", "8bit"])
def test_a_cohort_over_the_quantized_backbone_equals_one_at_a_time(mode):
    task = build_task(load_config("tiny-lm", [f"task.quantize={mode}", *SETS]))
    servers = []
    for cohort in (1, 2):
        sim = Simulation(load_config("tiny-lm", [f"task.quantize={mode}", *SETS, "run.rounds=1",
                                                 f"run.cohort={cohort}"]), task=task)
        sim.run()
        servers.append(sim.server)
    assert servers[0].keys() == servers[1].keys()
    for key, value in servers[0].items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(servers[1][key], value, rtol=1e-4, atol=1e-6)


@needs_bnb
def test_methods_that_train_the_backbone_are_refused_over_a_quantized_one():
    cfg = load_config("tiny-lm", ["task.quantize=8bit", *SETS, "run.rounds=1", "method.name=fedavg-full"])
    with pytest.raises(ValueError, match="with task.quantize the backbone's weights are frozen in 4/8 bits"):
        Simulation(cfg).run()


class FloatOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the shape of every fp32 tensor an operation produces."""

    def __init__(self):
        super().__init__()
        self.fp32_shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.fp32_shapes.append((str(func), tuple(t.shape)))
        return out


@needs_bnb
@pytest.mark.parametrize("mode", ["4bit", "8bit"])
def test_qlora_in_bf16_never_dequantises_the_frozen_weight_to_fp32(mode):
    from fedlowrank.adapters.lora import LoRALinear

    torch.manual_seed(0)
    layer = LoRALinear(QuantizedLinear(nn.Linear(128, 64), mode), rank=4, alpha=8)
    layer.lora_B.data.normal_()
    x = torch.randn(6, 128, dtype=torch.bfloat16, requires_grad=True)
    with FloatOps() as ops:
        y = layer(x)
        y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    weight_sized = [(f, s) for f, s in ops.fp32_shapes if len(s) == 2 and s[0] * s[1] >= 64 * 128]
    assert weight_sized == []
    assert layer.base.weight.dtype == torch.bfloat16
    dense = x.detach().float() @ layer.base.weight.float().T + layer.base.bias.float()
    assert torch.allclose(layer.frozen_output(x.detach()).float(), dense, rtol=0.05, atol=0.05)

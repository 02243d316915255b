"""Devices and precision: every method on CUDA (skipped without it), bf16 autocast on the CPU, and one-line errors
for devices and dtypes this machine cannot give."""

import pytest
import torch
from helpers import tiny_config, tiny_task
from lm_helpers import SGD_ONLY, lm_config, lm_task

from fedlowrank.config import ConfigError
from fedlowrank.device import resolve_device
from fedlowrank.methods import available_methods
from fedlowrank.runtime.simulator import Simulation

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
METHODS = sorted(available_methods())


def _one_round(cfg, task) -> Simulation:
    sim = Simulation(cfg, task=task)
    sim.run()
    return sim


def _assert_on_host(sim: Simulation) -> None:
    """Server state and every client state stay on the CPU; the global model evaluates to finite numbers."""
    for state in [sim.server, *sim.store.values()]:
        for key, t in state.tensors().items():
            assert t.device.type == "cpu", key
    assert all(v == v for k, v in sim.history[-1].items() if k in ("loss", "accuracy", "train_loss"))


@needs_cuda
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("model", ["tiny-bert", "tiny-llama"])
def test_every_method_runs_a_round_on_cuda(method, model):
    extra = ["train.optimizer=sgd"] if method in SGD_ONLY else []
    if model == "tiny-bert":
        sets = [f"method.name={method}", "run.rounds=1", *extra]
        task, cpu_cfg, gpu_cfg = tiny_task(), tiny_config(*sets), tiny_config(*sets, "run.device=cuda")
    else:
        task = lm_task("tiny-llama", ("q_proj", "k_proj", "v_proj"))
        cpu_cfg, gpu_cfg = lm_config(method), lm_config(method, "run.device=cuda")
    gpu = _one_round(gpu_cfg, task)
    assert all(p.device.type == "cuda" for p in gpu.model.parameters())
    _assert_on_host(gpu)
    cpu = _one_round(cpu_cfg, task)
    assert gpu.server.keys() == cpu.server.keys()
    for key, t in cpu.server.tensors().items():
        assert gpu.server[key].shape == t.shape and gpu.server[key].dtype == t.dtype, key


@needs_cuda
def test_bf16_on_cuda_keeps_fp32_trainables():
    sim = _one_round(lm_config("fedit", "run.device=cuda", "train.dtype=bf16"), lm_task())
    assert all(m.lora_A.dtype == torch.float32 for m in sim.model.adapters().values())
    _assert_on_host(sim)


def test_bf16_autocast_on_cpu_trains_fp32_parameters():
    task = lm_task()
    fp32 = _one_round(lm_config("fedit"), task)
    bf16 = _one_round(lm_config("fedit", "train.dtype=bf16"), task)
    for key, t in fp32.server.tensors().items():
        assert bf16.server[key].dtype == t.dtype == torch.float32, key
    assert all(m.lora_A.dtype == m.lora_B.dtype == torch.float32 for m in bf16.model.adapters().values())
    assert bf16.history[-1]["train_loss"] != fp32.history[-1]["train_loss"]  # autocast did run in bf16
    assert abs(bf16.history[-1]["train_loss"] - fp32.history[-1]["train_loss"]) < 0.05


def test_fp16_is_refused_on_the_cpu():
    with pytest.raises(ValueError, match="train.dtype = 'fp16' needs a CUDA device"):
        Simulation(tiny_config("train.dtype=fp16"), task=tiny_task())


def test_device_errors_are_one_line(monkeypatch):
    with pytest.raises(ConfigError, match="run.device must be one of auto, cpu, cuda, cuda:N; got 'gpu'"):
        tiny_config("run.device=gpu")
    with pytest.raises(ConfigError, match="train.dtype must be one of fp32, bf16, fp16"):
        tiny_config("train.dtype=half")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="run.device = 'cuda' but CUDA is not available on this machine"):
        Simulation(tiny_config("run.device=cuda"), task=tiny_task())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"run.device = 'cuda:7' but this machine has 1 CUDA device\(s\)") as err:
        resolve_device("cuda:7")
    assert "\n" not in str(err.value)


def _factors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 5, generator=g), torch.randn(7, 2, generator=g), torch.randn(3, generator=g),
            torch.randn(4, 4, generator=g).to(torch.bfloat16), torch.randn(2, 2, generator=g, dtype=torch.float64)]


def test_staging_many_tensors_moves_each_dtype_once_and_keeps_those_already_there(monkeypatch):
    """:func:`stage_together` to another device (``meta``, which any machine has) moves one packed buffer per dtype,
    each tensor coming back as a view of its shape and dtype; to the device they are on, it moves nothing and hands
    back the very tensors."""
    from fedlowrank import device

    tensors = _factors()
    assert all(a is b for a, b in zip(device.stage_together(tensors, torch.device("cpu")), tensors))
    moved = []
    staging = device.stage_tensor
    monkeypatch.setattr(device, "stage_tensor", lambda t, d: moved.append(t.dtype) or staging(t, d))
    out = device.stage_together(tensors, torch.device("meta"))
    assert sorted(map(str, moved)) == ["torch.bfloat16", "torch.float32", "torch.float64"]
    assert [(t.device.type, t.shape, t.dtype) for t in out] == [("meta", t.shape, t.dtype) for t in tensors]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_staging_many_tensors_to_cuda_keeps_their_values():
    from fedlowrank.device import stage_together

    tensors = _factors()
    out = stage_together(tensors, torch.device("cuda", torch.cuda.current_device()))
    assert all(o.is_cuda and torch.equal(o.cpu(), t) for o, t in zip(out, tensors))

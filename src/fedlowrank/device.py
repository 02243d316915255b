"""Where tensors live, in one place.

* The model and the batches live on the run's device (``run.device``: ``auto`` = ``cuda`` when available, else
  ``cpu``; ``cpu``; ``cuda``; ``cuda:N``). The runtime moves the model there once its method has set it up.
* Messages, replies, client states, the ledger and the server's linear algebra stay on the CPU (float64 where
  a method asks for it): the engine brings every reply and new client state back with :func:`to_host`.
* Anything loaded into the model goes through ``Parameter.copy_`` or an adapter setter, which copy across
  devices, so a method file never names a device.
* ``train.dtype`` (``fp32``, ``bf16``, ``fp16``) is the compute dtype. With bf16 or fp16 the frozen backbone is
  stored in it once training starts (:func:`store_frozen`): no weight is cast again at any step. What a method
  trains stays fp32 (adapter factors, the head, fully trained targets, their optimizer state, the messages): an
  adapter computes with its factors cast to the input's dtype (tiny), a trained module inside the backbone
  sees fp32 inputs and hands its output back in the compute dtype. fp16 needs CUDA (its gradient scaler is
  CUDA's). fp32 runs are untouched.
* Training steps: optimizers step with fused kernels on CUDA (:func:`optimizer_kernel`); gradient checkpointing
  (:func:`set_checkpointing`). Whether a run checkpoints or compiles is decided once per run
  (:mod:`fedlowrank.runtime.plan`); compiled steps and measurements have their own modules
  (:mod:`fedlowrank.execution`).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .schema import check_choice

DEVICES = ("auto", "cpu", "cuda", "cuda:N")
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_device_spec(spec: str, option: str = "run.device") -> None:
    """Syntax of a device option (``run.device`` unless ``option`` names another; no hardware query): ``auto``,
    ``cpu``, ``cuda`` or ``cuda:N``."""
    ok = isinstance(spec, str) and (spec in ("auto", "cpu", "cuda")
                                    or (spec.startswith("cuda:") and spec[5:].isdigit()))
    if not ok:
        raise ValueError(f"{option} must be one of {', '.join(DEVICES)}; got {spec!r}")


def resolve_device(spec: str, option: str = "run.device") -> torch.device:
    """A device option (``run.device`` unless ``option`` names another) → ``torch.device``; one line naming the
    option when the hardware is not there."""
    check_device_spec(spec, option)
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"{option} = {spec!r} but CUDA is not available on this machine (torch "
                         f"{torch.__version__}); use {option} = 'cpu' or 'auto'")
    index = int(spec[5:]) if ":" in spec else 0
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"{option} = {spec!r} but this machine has {count} CUDA device(s) "
                         f"(cuda:0..cuda:{count - 1})")
    return torch.device("cuda", index)


def check_dtype(dtype: str, device: torch.device) -> None:
    """``train.dtype`` is one of :data:`DTYPES`; fp16 only on CUDA."""
    check_choice("train.dtype", dtype, DTYPES)
    if dtype == "fp16" and device.type != "cuda":
        raise ValueError(f"train.dtype = 'fp16' needs a CUDA device (run.device resolved to {device}); "
                         f"use 'bf16' or 'fp32' on the CPU")


def store_frozen(model, dtype: str) -> None:
    """Store ``model``'s (an :class:`~fedlowrank.adapters.model.AdaptedModel`) frozen backbone in ``dtype``
    (``train.dtype``): every parameter no method trains (:meth:`~AdaptedModel.frozen_parameters`) and the
    adapters' frozen buffers; each module that trains inside it (:meth:`~AdaptedModel.trained_modules`: the head,
    fully trained targets) gets hooks that cast its floating inputs to its parameters' dtype and its outputs to
    ``dtype``, and the network's floating inputs (pixel values) are cast to ``dtype``. Nothing at fp32. Tensors
    change in place (views sharing them see the change); the model's declared ``stored_dtype`` records it.
    Idempotent: the runtime calls it (:meth:`fedlowrank.runtime.plan.Plan.prepare`) before a client trains, so a
    model that is only evaluated or exported stays as loaded."""
    if dtype == "fp32" or model.stored_dtype == dtype:
        return
    low = DTYPES[dtype]
    for p in model.frozen_parameters():
        if p.is_floating_point() and p.dtype != low:
            p.data = p.data.to(low)
    for adapter in model.adapters().values():
        adapter.store_frozen(low)
    for module in model.trained_modules():
        inner = next(module.parameters()).dtype
        module.register_forward_pre_hook(partial(_cast_inputs, dtype=inner), with_kwargs=True)
        module.register_forward_hook(partial(_cast_output, dtype=low))
    model.net.register_forward_pre_hook(partial(_cast_inputs, dtype=low), with_kwargs=True)  # e.g. pixel values
    model.stored_dtype = dtype


def can_checkpoint(net: nn.Module) -> bool:
    """Whether ``net`` supports transformers' gradient checkpointing."""
    return bool(getattr(net, "supports_gradient_checkpointing", False))


def set_checkpointing(net: nn.Module, on: bool) -> None:
    """Gradient checkpointing (transformers', non-reentrant) of ``net`` on or off; on needs :func:`can_checkpoint`
    (one line naming ``train.gradient_checkpointing`` otherwise)."""
    if on == bool(getattr(net, "is_activation_checkpointing", False)):
        return
    if not on:
        net.activation_checkpointing_disable()
    elif not can_checkpoint(net):
        raise ValueError(f"train.gradient_checkpointing: the model ({type(net).__name__}) does not support it; "
                         f"set train.gradient_checkpointing = false")
    else:
        net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def _cast(obj: Any, dtype: torch.dtype) -> Any:
    """Floating tensors in ``obj`` (a tensor, or tuples/lists/dicts of them) in ``dtype``; the rest as it is."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast(v, dtype) for v in obj)
    if isinstance(obj, dict):
        out = type(obj)()
        out.update({k: _cast(v, dtype) for k, v in obj.items()})
        return out
    return obj


def _cast_inputs(module: nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    return _cast(args, dtype), _cast(kwargs, dtype)


def _cast_output(module: nn.Module, args: tuple, output: Any, dtype: torch.dtype) -> Any:
    return _cast(output, dtype)


def grad_scaler(device: torch.device, dtype: str) -> torch.amp.GradScaler | None:
    """fp16's loss scaler (CUDA); ``None`` for fp32 and bf16."""
    return torch.amp.GradScaler(device.type) if dtype == "fp16" else None


OPTIMIZER_KERNELS = ("loop", "foreach", "fused")


def optimizer_kernel(device: torch.device) -> str:
    """How optimizers step on ``device`` (:data:`OPTIMIZER_KERNELS`): ``fused`` on CUDA (one kernel for every
    parameter, with the step counts on the device: no host reads); on the CPU torch's loop over the tensors,
    which keeps CPU runs bit-identical to those of earlier versions."""
    return "fused" if device.type == "cuda" else "loop"


def module_device(module: nn.Module) -> torch.device:
    """The device of a module's first parameter (CPU for a module without parameters)."""
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` applied to the tensors in ``obj`` (a tensor, or dicts/lists/tuples of them; other values kept); a dict
    keeps its class (``Message``, ``State``)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        out = type(obj)()
        out.update({k: map_tensors(v, fn) for k, v in obj.items()})
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def to_device(obj: Any, device: torch.device) -> Any:
    """Tensors in ``obj`` (:func:`map_tensors`) on ``device``."""
    return map_tensors(obj, lambda t: t.to(device))


def stage_tensor(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` ahead of its use, without the host waiting: on CUDA a host tensor is copied into
    pinned memory and moved with ``non_blocking=True`` (torch's pinned-memory allocator keeps the block until the
    copy is done); elsewhere ``tensor.to(device)``."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def stage(obj: Any, device: torch.device) -> Any:
    """The tensors in ``obj`` (:func:`map_tensors`) on ``device`` ahead of use (:func:`stage_tensor`): a local
    step's inputs are staged before the step (:data:`LOCAL_STEP`), so that the step itself never moves a tensor."""
    return map_tensors(obj, lambda t: stage_tensor(t, device))


def stage_together(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` on ``device`` ahead of use (:func:`stage_tensor`) as one move per dtype, not one per tensor: those
    of a dtype elsewhere packed into one buffer, moved at once (on CUDA from pinned memory, without the host
    waiting) and split into views of their shapes; those already on ``device`` kept as they are."""
    out = list(tensors)
    elsewhere: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.device != device:
            elsewhere.setdefault(t.dtype, []).append(i)
    for idx in elsewhere.values():
        flat = stage_tensor(torch.cat([tensors[i].reshape(-1) for i in idx]), device)
        for i, piece in zip(idx, flat.split([tensors[i].numel() for i in idx])):
            out[i] = piece.view(tensors[i].shape)
    return out


def to_host(obj: Any) -> Any:
    """:func:`to_device` to the CPU, detached: where messages and states live (a host tensor outside autograd is
    kept as it is: no operation)."""
    return map_tensors(obj, lambda t: t if t.device.type == "cpu" and not t.requires_grad else t.detach().to("cpu"))


__all__ = ["DEVICES", "DTYPES", "OPTIMIZER_KERNELS", "can_checkpoint", "check_device_spec", "check_dtype",
           "grad_scaler", "map_tensors", "module_device", "optimizer_kernel", "resolve_device", "set_checkpointing",
           "stage", "stage_tensor", "stage_together", "store_frozen", "to_device", "to_host"]

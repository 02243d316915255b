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
* Training steps (:func:`prepare_training`): optimizers step with fused kernels on CUDA (:func:`optimizer_kernel`);
  ``run.compile`` compiles the forward for training steps only (:func:`compile_module`, :func:`run_compiled`);
  ``train.gradient_checkpointing``; :func:`measured_peak_bytes` measures what a step allocates.
"""

from __future__ import annotations

import collections
import logging
import weakref
from functools import partial
from typing import Any, Callable

import torch
from torch import nn

from .schema import check_choice

log = logging.getLogger("fedlowrank")

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
    change in place (views sharing them see the change). Idempotent: the runtime calls it (through
    :func:`prepare_training`) before a client trains, so a model that is only evaluated or exported stays as
    loaded."""
    if dtype == "fp32" or getattr(model, "stored_dtype", None) == dtype:
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


COMPILE_BACKEND = "inductor"  # torch.compile's backend for run.compile (tests use the faster "aot_eager")


def prepare_training(model, task, cfg) -> None:
    """Everything a model needs before a client trains on it, once per model (idempotent): the frozen backbone in
    ``train.dtype`` (:func:`store_frozen`), ``train.gradient_checkpointing = true`` (:func:`set_checkpointing`;
    ``auto``: the cohort planner decides) and, with ``run.compile``, the
    compiled forward of the task's :meth:`~fedlowrank.tasks.base.Task.compiled_module` (:func:`compile_module`)."""
    store_frozen(model, cfg.train.dtype)
    net = model.net
    if cfg.train.gradient_checkpointing == "true":
        set_checkpointing(net, True)
    if cfg.run.compile:
        compile_module(task.compiled_module(net), module_device(net), static_shapes=bool(cfg.task.length_buckets))


def can_checkpoint(net: nn.Module) -> bool:
    """Whether ``net`` supports transformers' gradient checkpointing."""
    return bool(getattr(net, "supports_gradient_checkpointing", False))


def set_checkpointing(net: nn.Module, on: bool) -> None:
    """Gradient checkpointing (transformers', non-reentrant) of ``net`` on or off; on needs :func:`can_checkpoint`
    (one line naming ``train.gradient_checkpointing`` otherwise)."""
    if on == bool(getattr(net, "is_gradient_checkpointing", False)):
        return
    if not on:
        net.gradient_checkpointing_disable()
    elif not can_checkpoint(net):
        raise ValueError(f"train.gradient_checkpointing: the model ({type(net).__name__}) does not support it; "
                         f"set train.gradient_checkpointing = false")
    else:
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


_COMPILED: "weakref.WeakKeyDictionary[nn.Module, Callable | None]" = weakref.WeakKeyDictionary()
# each module's compiled call (None: compiling failed); kept beside the module, so that a deep copy (a cohort
# member's view) has none and never calls the original's


def compile_module(module: nn.Module, device: torch.device, static_shapes: bool) -> None:
    """Give ``module`` a compiled call (``torch.compile``, built lazily at its first use) that :func:`compiled`
    switches on: CUDA graphs (``mode="reduce-overhead"``) on CUDA when shapes are static (length buckets), each
    shape compiled once for the whole run; automatic dynamic shapes otherwise. Once per module."""
    if module in _COMPILED:
        return
    cuda_graphs = device.type == "cuda" and static_shapes and COMPILE_BACKEND == "inductor"
    _COMPILED[module] = torch.compile(module._call_impl, backend=COMPILE_BACKEND,
                                      mode="reduce-overhead" if cuda_graphs else None,
                                      dynamic=False if static_shapes else None)


def run_compiled(module: nn.Module, step: Callable[[], Any], restart: Callable[[], None]) -> Any:
    """``step()`` with ``module``'s compiled call on (:func:`compile_module`; eager without one). If compiling
    fails, one warning line, the module stays eager for the rest of the run, ``restart()`` (e.g. clear the
    gradients) and ``step()`` again."""
    compiled = _COMPILED.get(module)
    if compiled is None:
        return step()
    module._compiled_call_impl = compiled
    try:
        return step()
    except Exception as exc:  # noqa: BLE001 - only torch.compile's own failures are handled, the rest re-raised
        if not type(exc).__module__.startswith(("torch._dynamo", "torch._inductor")):
            raise
        _COMPILED[module] = None
        cause = getattr(exc, "inner_exception", None) or exc  # BackendCompilerFailed: the compiler's own error
        reason = (str(cause).strip().splitlines() or [""])[0][:200]
        log.warning("run.compile: torch.compile failed (%s: %s); the run goes on without compiling",
                    type(cause).__name__, reason)
    finally:
        module._compiled_call_impl = None
    restart()
    return step()


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


def to_device(obj: Any, device: torch.device) -> Any:
    """Tensors in ``obj`` (a tensor, or dicts/lists/tuples of them; other values kept) on ``device``; a dict
    keeps its class (``Message``, ``State``)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        out = type(obj)()
        out.update({k: to_device(v, device) for k, v in obj.items()})
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def measured_peak_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    """Peak bytes of tensors allocated on ``device`` while ``fn()`` runs, above what was allocated before
    (:func:`measured_bytes`)."""
    return measured_bytes(fn, device)[0]


def measured_bytes(fn: Callable[[], Any], device: torch.device) -> tuple[int, int]:
    """``(peak, held)``: the peak bytes of tensors allocated on ``device`` while ``fn()`` runs and the bytes still
    allocated when it returns, both above what was allocated before: CUDA's allocator statistics, or on the CPU the
    allocation events of the torch profiler (``profile_memory``)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before, torch.cuda.memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    peak = held = 0
    for e in events:
        held += e.nbytes()
        peak = max(peak, held)
    return peak, held


def dispatched_ops(fn: Callable[[], Any]) -> "collections.Counter[str]":
    """The aten operations (and optimizer steps) one call of ``fn`` dispatches, counted by the torch profiler on
    the CPU after a warm-up call, a multi-tensor operation (``_foreach_*``, ``_fused_*``) once (on CUDA it is one
    kernel, on the CPU a loop over its tensors). ``aten::item``/``aten::_local_scalar_dense`` are host reads."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()

    def inside_multi_tensor(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith(("aten::_foreach_", "aten::_fused_")):
                return True
            parent = parent.cpu_parent
        return False

    return collections.Counter(e.name for e in prof.events() if e.name.startswith(("aten::", "Optimizer.step"))
                               and not inside_multi_tensor(e))


def to_host(obj: Any) -> Any:
    """:func:`to_device` to the CPU, detached: where messages and states live."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu")
    if isinstance(obj, dict):
        out = type(obj)()
        out.update({k: to_host(v) for k, v in obj.items()})
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(v) for v in obj)
    return obj


__all__ = ["COMPILE_BACKEND", "DEVICES", "DTYPES", "OPTIMIZER_KERNELS", "can_checkpoint", "check_device_spec",
           "check_dtype", "set_checkpointing",
           "compile_module", "dispatched_ops", "grad_scaler", "measured_bytes", "measured_peak_bytes", "module_device",
           "optimizer_kernel", "prepare_training", "resolve_device", "run_compiled", "store_frozen", "to_device",
           "to_host"]

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
import contextlib
import functools
import logging
import math
import sys
import threading
import weakref
from functools import partial
from typing import Any, Callable, Iterator

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
    ``auto``: the cohort planner decides) and, when the run compiles
    (:func:`compile_decision`; the run logs its rule once), the compiled forward of the task's
    :meth:`~fedlowrank.tasks.base.Task.compiled_module` (:func:`compile_module`)."""
    store_frozen(model, cfg.train.dtype)
    net = model.net
    if cfg.train.gradient_checkpointing == "true":
        set_checkpointing(net, True)
    if getattr(model, "compiling", None) is None:
        model.compiling = compile_decision(cfg, task, module_device(net))[0]
    if model.compiling:
        compile_module(task.compiled_module(net), module_device(net), static_shapes=bool(cfg.task.length_buckets))


COMPILE_WARMUP_S = 98.0  # one shape's torch.compile warm-up (inductor, CUDA graphs), measured on an H100
COMPILE_SAVED_S = 0.128  # the time a compiled step saved there (142.6 → 14.8 ms; SmolLM2-135M, bf16, batch 4)
COMPILE_BREAK_EVEN = round(COMPILE_WARMUP_S / COMPILE_SAVED_S)  # steps per compiled shape that repay its warm-up


def planned_steps(cfg, task) -> int:
    """The local steps a run's compiled module will take (one per cohort step): ``run.rounds`` × the round's
    cohorts (``run.cohort``; 0 counts one cohort) × the steps per client (``train.local_steps``, or
    ``train.local_epochs`` over a client's mean share of the examples)."""
    train = cfg.train
    per_client = (math.ceil(train.local_epochs * task.num_train / cfg.partition.num_clients / train.batch_size)
                  if train.local_epochs > 0 else train.local_steps)
    cohorts = math.ceil(cfg.run.clients_per_round / (cfg.run.cohort or cfg.run.clients_per_round))
    return cfg.run.rounds * cohorts * max(per_client, 1)


def compile_decision(cfg, task, device: torch.device) -> tuple[bool, str]:
    """Whether a run compiles (``run.compile``), and the rule in one line. ``auto``: on CUDA with length buckets
    (static shapes: each compiled once, replayed as a CUDA graph) when the planned steps per bucket
    (:func:`planned_steps`) reach :data:`COMPILE_BREAK_EVEN`, a measured warm-up per shape over the time a step
    saved, else eager, naming how many buckets would repay it; never on the CPU (tiny-llama, inductor: 3 rounds
    took 106.6 s compiled against 3.4 s eager)."""
    if cfg.run.compile != "auto":
        return cfg.run.compile == "true", f"run.compile = {cfg.run.compile}"
    shapes = len(cfg.task.length_buckets)
    steps = planned_steps(cfg, task)
    if device.type != "cuda" or not shapes:
        why = "on the CPU" if device.type != "cuda" else "without task.length_buckets (no static shapes)"
        return False, f"run.compile = auto: eager {why}"
    per_shape = steps / shapes
    wanted = per_shape >= COMPILE_BREAK_EVEN
    fewer = steps // COMPILE_BREAK_EVEN
    advice = f"; {fewer} length bucket(s) would repay it" if not wanted and fewer else ""
    return wanted, (f"run.compile = auto: {'compiled' if wanted else 'eager'}: {steps} planned steps over {shapes} "
                    f"length buckets = {per_shape:.0f} per bucket {'≥' if wanted else '<'} {COMPILE_BREAK_EVEN}, the "
                    f"steps that repay a bucket's warm-up (≈ {COMPILE_WARMUP_S:.0f} s against "
                    f"{1000 * COMPILE_SAVED_S:.0f} ms saved per step, measured on an H100){advice}")


def release_compiled(model) -> None:
    """Drop ``model``'s compiled calls (the run has ended): its network and graphs (on CUDA their memory pools)
    are freed with it; dynamo's caches are reset when no compiled module is left. A later training step decides
    and compiles again (:func:`prepare_training`)."""
    if getattr(model, "compiling", None) is None:
        return
    for module in model.net.modules():
        if module in _COMPILED:
            del _COMPILED[module]
            module._compiled_call_impl = None
    model.compiling = None
    if not len(_COMPILED):
        torch._dynamo.reset()


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


def allocated_bytes(device: torch.device) -> int:
    """Bytes of the tensors now allocated on ``device`` by torch's CUDA allocator (0 on the CPU, where none is kept
    apart)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


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
    return map_tensors(obj, lambda t: t.detach().to("cpu"))


PHASE_PREFIX = "fedlowrank."  # the profiler ranges of a round's parts (phase, local_step) start with it
LOCAL_STEP = PHASE_PREFIX + "local_step"  # the profiler range of a local step (forward, backward, optimizer)


def phase(name: str) -> contextlib.AbstractContextManager:
    """The profiler range ``fedlowrank.<name>`` around a part of a round (a client's update, its reply's move to the
    host, the server's checks of a reply, the round's close), so that a profile names the part where an operation
    or a wait happened on any device, also where it records no Python frames."""
    return torch.profiler.record_function(PHASE_PREFIX + name)


def phased(name: str) -> Callable[[Callable], Callable]:
    """A function decorator: each call runs in its own :func:`phase` ``name`` (safe in threads, unlike one shared
    range object)."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with phase(name):
                return fn(*args, **kwargs)
        return inner
    return wrap


_STEP = threading.local()  # .depth: local steps this thread is in; .count: local steps it began


@contextlib.contextmanager
def local_step() -> Iterator[None]:
    """A local step's work (forward, backward, optimizer step): the profiler range :data:`LOCAL_STEP`, where
    :func:`step_transfers` counts. Its inputs are staged before it (:func:`stage`)."""
    _STEP.depth = getattr(_STEP, "depth", 0) + 1
    _STEP.count = getattr(_STEP, "count", 0) + 1
    try:
        with phase("local_step"):
            yield
    finally:
        _STEP.depth -= 1


_MOVES = (torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.pin_memory)
_HOST_DATA = (torch.tensor, torch.as_tensor, torch.from_numpy)
_READS = (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__, torch.Tensor.__int__,
          torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero,
          torch.Tensor.masked_select, torch.masked_select, torch.Tensor.unique, torch.unique, torch.Tensor.bincount,
          torch.bincount, torch.Tensor.repeat_interleave, torch.repeat_interleave)
# a host read of a device value: the value itself, or an output whose size depends on the values


def _is_move(func, args: tuple, kwargs: dict) -> bool:
    """A call that moves a tensor to a device: ``.to`` with a device (or a tensor's), ``.cpu()``, ``.cuda()``."""
    if func is not torch.Tensor.to:
        return func in _MOVES
    return "device" in kwargs or any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args[1:])


class _StepTransfers(torch.overrides.TorchFunctionMode):
    """Counts (:func:`step_transfers`) the calls of our code inside a :func:`local_step` that move or read."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(_STEP, "depth", 0):
            kind = ("moves" if _is_move(func, args, kwargs) else "host_data" if func in _HOST_DATA
                    else "reads" if func in _READS and not (func in (torch.Tensor.repeat_interleave,
                                                                      torch.repeat_interleave)
                                                            and "output_size" in kwargs) else None)
            if kind is not None and _called_by_us():  # frames: this, __torch_function__, the caller
                self.counts[kind] += 1
        return func(*args, **kwargs)


_PACKAGE = __file__.rsplit("/", 1)[0] + "/"


def _called_by_us() -> bool:
    """Whether the call comes from fedlowrank's code (not from torch's, e.g. the optimizer's step or
    ``clip_grad_norm_``, nor from a model's own, e.g. transformers' masks)."""
    return sys._getframe(3).f_code.co_filename.startswith(_PACKAGE)


def step_transfers(fn: Callable[[], Any]) -> "collections.Counter[str]":
    """What the local steps (:func:`local_step`) of one call of ``fn`` move between host and device, on any device,
    the CPU included (where no copy would show): ``steps``, and the calls of our code that would on CUDA, counted
    by a torch function mode: ``moves`` (``.to`` with a device, ``.cpu()``, ``.cuda()``: a copy, from pageable memory one the
    host waits for), ``host_data`` (a tensor made from Python or NumPy data: a copy from the host) and ``reads``
    (``.item()``, ``.tolist()``, a truth value, or an operation whose output size depends on values: the host waits
    for the device). Calls from torch's code (the optimizer's step: on CUDA a fused kernel that reads nothing) and
    a model's own (transformers') are left out."""
    mode, before = _StepTransfers(), getattr(_STEP, "count", 0)
    with mode:
        fn()
    mode.counts["steps"] = _STEP.count - before
    return mode.counts


__all__ = ["COMPILE_BACKEND", "DEVICES", "DTYPES", "LOCAL_STEP", "OPTIMIZER_KERNELS", "PHASE_PREFIX",
           "allocated_bytes", "can_checkpoint", "check_device_spec", "check_dtype", "compile_decision",
           "compile_module", "dispatched_ops", "grad_scaler", "local_step", "map_tensors", "measured_bytes",
           "measured_peak_bytes", "module_device", "optimizer_kernel", "phase", "phased", "planned_steps",
           "prepare_training", "release_compiled", "resolve_device", "run_compiled", "set_checkpointing", "stage",
           "stage_tensor", "step_transfers", "store_frozen", "to_device", "to_host"]

"""What a training step costs, measured on any device (the CPU included): the profiler ranges of a round's parts
(:func:`phase`, :func:`local_step`), the aten operations a call dispatches (:func:`dispatched_ops`), what local steps
move between host and device (:func:`step_transfers`), and the bytes a call allocates (:func:`measured_bytes`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
import threading
from typing import Any, Callable, Iterator

import torch


PHASE_PREFIX = "fedlowrank."  # the profiler ranges of a round's parts (phase, local_step) start with it
LOCAL_STEP = PHASE_PREFIX + "local_step"  # the profiler range of a local step (forward, backward, optimizer)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """The profiler range ``fedlowrank.<name>`` around a part of a round (a client's update, its reply's move to the
    host, the server's checks of a reply, the round's close), so that a profile names the part where an operation
    or a wait happened on any device, also where it records no Python frames."""
    _PHASES.names = [*getattr(_PHASES, "names", []), name]
    try:
        with torch.profiler.record_function(PHASE_PREFIX + name):
            yield
    finally:
        _PHASES.names = _PHASES.names[:-1]


_PHASES = threading.local()  # .names: the phases this thread is in


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


_MOVES = (torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.pin_memory, torch.Tensor.copy_)
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


class _Transfers(torch.overrides.TorchFunctionMode):
    """Counts (:func:`step_transfers`, :func:`client_transfers`) the calls of our code that move or read, inside a
    :func:`local_step` (``steps``) or in a client's update outside its steps (not ``steps``)."""

    def __init__(self, steps: bool) -> None:
        super().__init__()
        self.steps = steps
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        in_step = bool(getattr(_STEP, "depth", 0))
        if in_step if self.steps else (not in_step and "client_update" in getattr(_PHASES, "names", [])):
            kind = ("moves" if _is_move(func, args, kwargs) else "host_data" if func in _HOST_DATA
                    else "reads" if func in _READS and not (func in (torch.Tensor.repeat_interleave,
                                                                      torch.repeat_interleave)
                                                            and "output_size" in kwargs) else None)
            if kind is not None and _called_by_us():  # frames: this, __torch_function__, the caller
                self.counts[kind] += 1
        return func(*args, **kwargs)


_PACKAGE = __file__.rsplit("/", 2)[0] + "/"  # fedlowrank/


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
    mode, before = _Transfers(steps=True), getattr(_STEP, "count", 0)
    with mode:
        fn()
    mode.counts["steps"] = _STEP.count - before
    return mode.counts


def client_transfers(fn: Callable[[], Any]) -> "collections.Counter[str]":
    """:func:`step_transfers`' counts for what the clients' updates (:func:`phase` ``client_update``) of one call of
    ``fn`` do outside their local steps: loading a message into the model (``moves`` also counts ``copy_``, from a
    host tensor into a device one on CUDA), bringing the reply and state to the host, reading values."""
    mode = _Transfers(steps=False)
    with mode:
        fn()
    return mode.counts




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


def dispatched_ops(fn: Callable[[], Any], within: str | None = None,
                   top_level: bool = False) -> "collections.Counter[str]":
    """The aten operations (and optimizer steps) one call of ``fn`` dispatches, counted by the torch profiler on
    the CPU after a warm-up call, a multi-tensor operation (``_foreach_*``, ``_fused_*``) once (on CUDA it is one
    kernel, on the CPU a loop over its tensors); ``within``: only those inside the profiler range of that name
    (e.g. :data:`LOCAL_STEP`: a step's, not its inputs' staging); ``top_level``: only those no other operation
    dispatched (what our code and the model's call). ``aten::item``/``aten::_local_scalar_dense`` are host
    reads."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()

    def ancestors(event) -> Iterator[str]:
        parent = event.cpu_parent
        while parent is not None:
            yield parent.name
            parent = parent.cpu_parent

    def counted(event) -> bool:
        names = list(ancestors(event))
        if any(n.startswith(("aten::_foreach_", "aten::_fused_")) for n in names):
            return False
        if top_level and any(n.startswith(("aten::", "Optimizer.step")) for n in names):
            return False
        return within is None or within in names

    return collections.Counter(e.name for e in prof.events() if e.name.startswith(("aten::", "Optimizer.step"))
                               and counted(e))


__all__ = ["LOCAL_STEP", "PHASE_PREFIX", "allocated_bytes", "client_transfers", "dispatched_ops", "local_step",
           "measured_bytes", "measured_peak_bytes", "phase", "phased", "step_transfers"]

"""Compiled training steps (``run.compile``; whether a run compiles is decided once, by
:mod:`fedlowrank.runtime.plan`).

A module given a compiled call (:func:`compile_module`) runs it only inside :func:`run_compiled`, i.e. in training
steps: evaluation and generation stay eager. A compiler failure costs one warning line and the run goes on eagerly.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import torch
from torch import nn

log = logging.getLogger("fedlowrank")

COMPILE_BACKEND = "inductor"  # torch.compile's backend for run.compile (tests use the faster "aot_eager")

_COMPILED: "weakref.WeakKeyDictionary[nn.Module, Callable | None]" = weakref.WeakKeyDictionary()
# each module's compiled call (None: compiling failed); kept beside the module, so that a deep copy (a cohort
# member's view) has none and never calls the original's


def compile_module(module: nn.Module, device: torch.device, static_shapes: bool) -> None:
    """Give ``module`` a compiled call (``torch.compile``, built lazily at its first use) that :func:`run_compiled`
    switches on: CUDA graphs (``mode="reduce-overhead"``) on CUDA when shapes are static (length buckets), each
    shape compiled once for the whole run; automatic dynamic shapes otherwise. Once per module."""
    if module in _COMPILED:
        return
    cuda_graphs = device.type == "cuda" and static_shapes and COMPILE_BACKEND == "inductor"
    _COMPILED[module] = torch.compile(module._call_impl, backend=COMPILE_BACKEND,
                                      mode="reduce-overhead" if cuda_graphs else None,
                                      dynamic=False if static_shapes else None)


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` has a compiled call (:func:`compile_module`; also one that failed and runs eagerly)."""
    return module in _COMPILED


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


def release_compiled(*modules: nn.Module) -> None:
    """Drop the compiled calls of ``modules`` and of their submodules (the run has ended): their graphs (on CUDA
    their memory pools) are freed with them; dynamo's caches are reset when no compiled module is left."""
    found = False
    for module in (m for root in modules for m in root.modules()):
        if module in _COMPILED:
            del _COMPILED[module]
            module._compiled_call_impl = None
            found = True
    if found and not len(_COMPILED):
        torch._dynamo.reset()


__all__ = ["COMPILE_BACKEND", "compile_module", "is_compiled", "release_compiled", "run_compiled"]

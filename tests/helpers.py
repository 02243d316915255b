"""Shared test helpers: the tiny task (random 2-layer BERT, 200 BBC News articles) built once per session, and the
skip of tests that need AG News or GSM8K when neither a local copy nor the ``datasets`` cache has them."""

from __future__ import annotations

from functools import lru_cache

import pytest

from fedlowrank.config import load_config
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.tasks import build_task


@lru_cache(maxsize=None)
def tiny_task():
    """The task of the bundled ``tiny`` config (seed 0); reuse it, building it costs ~1 s."""
    return build_task(load_config("tiny"))


def tiny_config(*sets: str):
    """The bundled ``tiny`` config with ``--set`` style overrides, e.g. ``tiny_config("lora.rank=4")``."""
    return load_config("tiny", list(sets))


def tiny_simulation(method: str, *sets: str, rounds: int = 2) -> Simulation:
    """A :class:`Simulation` of ``method`` on the tiny task (not yet run)."""
    cfg = tiny_config(f"method.name={method}", f"run.rounds={rounds}", *sets)
    return Simulation(cfg, task=tiny_task())


def run_tiny(method: str, *sets: str, rounds: int = 2) -> Simulation:
    """Run ``rounds`` rounds of ``method`` on the tiny task and return the finished simulation
    (``sim.server``, ``sim.store``, ``sim.ledger.rows``, ``sim.history``, ``sim.model``)."""
    sim = tiny_simulation(method, *sets, rounds=rounds)
    sim.run()
    return sim


DPSGD = ("privacy.dpsgd=true", "privacy.dpsgd_clip=1.0", "privacy.dpsgd_noise=1.0")  # record-level DP-SGD settings


def assert_client_level_dp(method: str, mode: str, *sets: str) -> None:
    """Two tiny rounds of ``method`` under client-level DP ``mode`` (C = 0.5, σ = 0.5; central with uniform weights):
    no reply rejected, and every round noised (central: ``noise_std`` > 0) or accounted (local: ε > 0)."""
    extra = ("server.weighting=uniform",) if mode == "central" else ()
    sim = run_tiny(method, f"privacy.mode={mode}", "privacy.clip=0.5", "privacy.noise_multiplier=0.5", *extra, *sets)
    assert all(not r.get("rejected") for r in sim.history)
    if mode == "central":
        assert all(r["privacy"]["noise_std"] > 0 for r in sim.history)
    else:
        assert all(r["epsilon"] > 0 for r in sim.history)


def run_with_dpsgd(monkeypatch, method: str, *sets: str) -> tuple[Simulation, list[set[str]]]:
    """:func:`run_tiny` of ``method`` under DP-SGD (:data:`DPSGD`), and the names of the parameters each private
    step clipped and noised (one set per step)."""
    import fedlowrank.training.local as local

    seen: list[set[str]] = []
    real = local.private_step_gradients

    def spy(net, task, params, batch, dp):
        seen.append(set(params))
        return real(net, task, params, batch, dp)

    monkeypatch.setattr(local, "private_step_gradients", spy)
    sim = run_tiny(method, *sets, *DPSGD)
    return sim, seen


@lru_cache(maxsize=None)
def unavailable(source: str) -> str | None:
    """Why the known data set ``source`` (``agnews``, ``gsm8k``) cannot be read here, or ``None`` when it can: a local
    copy in ``$FEDLOWRANK_DATA/<source>``, else the hub's copy in the ``datasets`` cache (the tests run with
    ``HF_HUB_OFFLINE=1``, conftest)."""
    from fedlowrank.tasks.hub import KNOWN_SETS, HubUnavailable, known_hub_splits, local_copy

    known = KNOWN_SETS[source]
    if local_copy(known, "") is not None:
        return None
    try:
        known_hub_splits(known)
    except HubUnavailable as exc:
        return str(exc)
    return None


def require_dataset(source: str) -> None:
    """Skip the calling test, with the loader's reason, when the known data set ``source`` is not available."""
    reason = unavailable(source)
    if reason:
        pytest.skip(f"needs {source} (the tests run with HF_HUB_OFFLINE=1 unless it is set): {reason}")


def benchmark_module(name: str):
    """``benchmarks/NAME.py`` imported as a module (as ``benchmark_NAME``, registered while it loads, for its
    dataclasses), with ``benchmarks/`` on the path for its imports of ``common``."""
    import importlib.util
    import sys
    from pathlib import Path

    folder = str(Path(__file__).resolve().parents[1] / "benchmarks")
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", f"{folder}/{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, folder)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
        sys.modules.pop(spec.name, None)
    return module

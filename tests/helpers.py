"""Shared test helpers: the tiny task (random 2-layer BERT, 200 BBC News articles) built once per session, the
skip of tests that need AG News or GSM8K when neither a local copy nor the ``datasets`` cache has them, and a
``fedlowrank`` command started in a process of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path
from typing import Callable

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


CHECKOUT = Path(__file__).resolve().parents[1]
COMMAND_ENV = {**os.environ, "PYTHONPATH": str(CHECKOUT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}


def started(args: list[str], err_file: Path, shown: Callable[[str], bool], timeout: float = 240,
            **popen) -> subprocess.Popen:
    """``python -m fedlowrank ARGS`` in a session of its own (this checkout's sources, stderr to ``err_file``),
    returned once ``shown(its stderr so far)`` holds; fails when it ends or ``timeout`` seconds pass first."""
    with open(err_file, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "fedlowrank", *args], env=COMMAND_ENV, stdout=subprocess.DEVNULL,
                                stderr=err, start_new_session=True, **popen)
    deadline = time.monotonic() + timeout
    while not shown(err_file.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, err_file.read_text()
        time.sleep(0.1)
    return proc


def compare_rounds_begun(text: str) -> bool:
    """Whether both runs of ``compare tiny --methods fedit,ffa-lora --seeds 0 --jobs 2`` have begun round 1."""
    return all(f"[{m}] seed 0: [{m}] round 1/2000" in text for m in ("fedit", "ffa-lora"))


def ended(proc: subprocess.Popen, timeout: float = 90) -> int:
    """``proc``'s exit status once it has ended (its whole session killed if it has not within ``timeout`` s)."""
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


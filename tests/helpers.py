"""Shared test helpers: the tiny task (random 2-layer BERT, 200 AG News examples) built once per session."""

from __future__ import annotations

from functools import lru_cache

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

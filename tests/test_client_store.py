"""The client-state store with a memory budget: exact round trips through the disk, bounded
memory, and resume with spilled states bit-identical to a run that keeps every state in memory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fedlowrank.message import State
from fedlowrank.runtime.checkpoint import latest_checkpoint
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.runtime.store import ClientStore, state_bytes

from helpers import tiny_task
from test_robustness import _assert_same_run, _cfg


def _state(k: int) -> State:
    g = torch.Generator().manual_seed(k)
    return State({"w": torch.randn(3, 5, generator=g, dtype=torch.float64),
                  "h": torch.randn(7, generator=g).to(torch.bfloat16),
                  "c": torch.randn(2, 2, generator=g, dtype=torch.float32) * 1e-30,
                  "idx": torch.arange(k, k + 4), "flag": torch.tensor([True, False]),
                  "step": k, "lr": 0.1 + k / 3, "tag": f"client-{k}", "hist": [[k, 1.5], [2, -0.0]], "on": True})


def _same(a: State, b: State) -> None:
    assert set(a) == set(b)   # (key order is not kept, as through a checkpoint)
    for key, v in a.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == b[key].dtype and torch.equal(v, b[key]), key
        else:
            assert v == b[key] and type(v) is type(b[key]), key


def test_spilled_states_come_back_exactly(tmp_path):
    store = ClientStore(memory_mb=state_bytes(_state(0)) * 2.5 / 2**20, folder=tmp_path / "spill")
    for k in range(6):
        store[k] = _state(k)
    assert len(store.resident()) == 2 and sorted(store.spilled_files()) == [0, 1, 2, 3]
    assert all(p.is_file() for p in store.spilled_files().values())
    assert list(store) == list(range(6)) and len(store) == 6 and 3 in store and 9 not in store
    for k in range(6):
        _same(store[k], _state(k))          # reading one back spills the least recently used
    assert len(store.resident()) == 2 and store.memory_bytes <= store.limit
    store[0] = _state(10)                    # overwriting a spilled state drops its file
    _same(store[0], _state(10))
    del store[1]
    assert 1 not in store and len(store) == 5 and store.get(1) is None
    assert len(list((tmp_path / "spill").iterdir())) == len(store.spilled_files())


def test_without_a_budget_nothing_is_spilled():
    store = ClientStore()
    for k in range(4):
        store[k] = _state(k)
    assert len(store.resident()) == 4 and not store.spilled_files()
    with pytest.raises(ValueError, match="run.state_memory_mb"):
        ClientStore(memory_mb=-1)


# Run in a fresh interpreter, so that memory other tests freed cannot absorb the states being measured.
_MEASURE = """
import gc, os, sys
import torch
from fedlowrank.message import State
from fedlowrank.runtime.store import ClientStore

def rss_mb():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

def fill(store):
    gc.collect()
    before = rss_mb()
    for k in range(40):   # 40 states of 4 MiB: 160 MiB in all
        store[k] = State({"c": torch.full((2**19,), float(k), dtype=torch.float64), "k": k})
    assert float(store[7]["c"][0]) == 7.0 and len(store) == 40
    return rss_mb() - before

warm = ClientStore(memory_mb=0.001, folder=sys.argv[1] + "-warm-up")   # imports and the spill path, not measured
warm[0], warm[1] = State({"c": torch.zeros(4), "k": 0}), State({"c": torch.zeros(4), "k": 1})
store = ClientStore(memory_mb=16, folder=sys.argv[1]) if sys.argv[2] == "spill" else ClientStore(memory_mb=0)
print(fill(store), len(store.spilled_files()))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux) to read the RSS")
def test_spilling_keeps_memory_bounded(tmp_path):
    def measure(mode: str) -> tuple[float, int]:
        out = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path / mode), mode], capture_output=True,
                             text=True, check=True).stdout.split()
        return float(out[0]), int(out[1])

    grown_kept, _ = measure("keep")
    grown_spilling, files = measure("spill")
    assert grown_kept > 120          # the measurement sees the states when they stay in memory
    assert grown_spilling < 80       # 16 MiB of states in memory, plus what the allocator keeps of freed ones (~45 MiB)
    assert files >= 36


def test_resume_with_spilled_states_is_bit_identical(tmp_path):
    straight = Simulation(_cfg("scaffold"), task=tiny_task(), run_dir=tmp_path / "a")
    straight.run()
    tiny = "run.state_memory_mb=0.001"     # smaller than one SCAFFOLD state: every state is spilled
    interrupted = Simulation(_cfg("scaffold", tiny), task=tiny_task(), run_dir=tmp_path / "b")
    interrupted.run_round()
    interrupted.run_round()
    assert interrupted.store.spilled_files() and not interrupted.store.resident()
    ck = latest_checkpoint(tmp_path / "b")
    assert sorted(p.name for p in (ck / "clients").iterdir()) == sorted(
        p.name for p in interrupted.store.spilled_files().values())
    del interrupted
    resumed = Simulation.resume(tmp_path / "b", task=tiny_task())
    assert resumed.round == 2 and len(resumed.store.spilled_files()) > 0
    resumed.run()
    _assert_same_run(straight, resumed)

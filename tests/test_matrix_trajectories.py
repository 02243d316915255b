"""Pinned per-round RelErr trajectories of the vectorised matrix regression (issue #18 item 2).

The runner's speed-ups must not change a single bit of its results: the trajectories below were recorded with
the code before them (`tests/data/matrix_trajectories.json`, float64 as ``float.hex``) and are compared exactly.
The setting is the paper's toy (``configs/matrix.toml``: N = 20, d = 100, m = 10, het 2, S = 10, K = 5, b = 20,
r = 20, η = 1e-3) for 200 rounds, evaluated every round, with both minibatch draws.

Re-record (only for an intended change of the results): ``python tests/test_matrix_trajectories.py --write``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from fedlowrank.config import load_config
from fedlowrank.runtime.vectorized import run_vectorized

FIXTURE = Path(__file__).parent / "data" / "matrix_trajectories.json"
ROUNDS = 200
METHODS = {"ssf": ["method.name=ssf"], "fedsub": ["method.name=fedsub"],
           "scaffold": ["method.name=fedavg-full", "method.correction=scaffold"], "fedavg": ["method.name=fedavg-full"]}
CASES = [(m, "fresh") for m in METHODS] + [("ssf", "trainer"), ("scaffold", "trainer")]


def trajectory(method: str, batches: str) -> list[float]:
    cfg = load_config("matrix", [*METHODS[method], f"run.rounds={ROUNDS}", "run.eval_every=1", "run.threads=1"])
    run = run_vectorized(cfg, batches=batches)
    assert run.rounds == ROUNDS
    return [row["rel_error"] for row in run.history]


@pytest.mark.parametrize("method,batches", CASES)
def test_rel_error_trajectory_is_reproduced_exactly(method, batches):
    pinned = [float.fromhex(x) for x in json.loads(FIXTURE.read_text())[f"{method}/{batches}"]]
    got = trajectory(method, batches)
    first = next((i for i, (a, b) in enumerate(zip(got, pinned)) if a != b), None)
    assert first is None, f"round {first + 1}: rel_error {got[first]!r} != pinned {pinned[first]!r}"
    assert len(got) == len(pinned)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(__doc__)
    torch.set_num_threads(1)
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps({f"{m}/{b}": [x.hex() for x in trajectory(m, b)] for m, b in CASES}, indent=0) + "\n")
    print(f"wrote {FIXTURE}")

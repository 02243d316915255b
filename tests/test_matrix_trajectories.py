"""Pinned per-round RelErr trajectories of the vectorised matrix regression.

The runner's speed-ups (NumPy's BLAS for the gradient products, any other kernel) may change rounding, not
results: the trajectories in `tests/data/matrix_trajectories.json` (float64 as ``float.hex``, recorded with torch's
kernels) must be reproduced to a relative tolerance :data:`RTOL` in every round. Rounding, on any BLAS, moves them
by ~1e-16 (measured 2.8e-16–4.0e-16 with NumPy's OpenBLAS against torch's MKL); the smallest difference with a
cause — the same method with the other minibatch draw, or two methods — is 5.5e-6 (SSF fresh vs trainer batches)
and at least 2.3e-3 between methods from round 2 on, so RTOL = 1e-10 separates every case and fails on any change
of the maths or the random streams. The setting is the paper's toy (``configs/matrix.toml``: N = 20, d = 100,
m = 10, het 2, S = 10, K = 5, b = 20, r = 20, η = 1e-3) for 200 rounds, evaluated every round, with both
minibatch draws.

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
RTOL = 1e-10


def pinned() -> dict[str, list[float]]:
    return {k: [float.fromhex(x) for x in v] for k, v in json.loads(FIXTURE.read_text()).items()}


def trajectory(method: str, batches: str) -> list[float]:
    cfg = load_config("matrix", [*METHODS[method], f"run.rounds={ROUNDS}", "run.eval_every=1", "run.threads=1"])
    run = run_vectorized(cfg, batches=batches)
    assert run.rounds == ROUNDS
    return [row["rel_error"] for row in run.history]


@pytest.mark.parametrize("method,batches", CASES)
def test_rel_error_trajectory_is_reproduced_to_rounding(method, batches):
    pin = pinned()[f"{method}/{batches}"]
    got = trajectory(method, batches)
    assert len(got) == len(pin)
    first = next((i for i, (a, b) in enumerate(zip(got, pin)) if abs(a - b) > RTOL * abs(b)), None)
    assert first is None, f"round {first + 1}: rel_error {got[first]!r} differs from the pinned {pin[first]!r} " \
                          f"by more than {RTOL:g} relative"


def test_the_tolerance_separates_every_pinned_case():
    """Any two pinned cases differ by ≥ 1e4 · RTOL in every round from round 2 on (round 1 of Full-FedAvg and
    Full-SCAFFOLD is the same step: the controls start at zero)."""
    pins = pinned()
    keys = sorted(pins)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            gap = min(abs(x - y) / abs(y) for x, y in zip(pins[a][1:], pins[b][1:]))
            assert gap > 1e4 * RTOL, (a, b, gap)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(__doc__)
    torch.set_num_threads(1)
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps({f"{m}/{b}": [x.hex() for x in trajectory(m, b)] for m, b in CASES}, indent=0) + "\n")
    print(f"wrote {FIXTURE}")

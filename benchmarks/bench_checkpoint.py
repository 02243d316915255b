"""What checkpoints cost: the `main` config (MiniLM, BBC News, 10 clients, 5 per round, 5 local steps, 6 rounds)
with a checkpoint after EVERY round (``run.checkpoint_every = 1``), the worst case of the default policy
(``run.checkpoint_seconds = 60``, never sooner than 50 times the last checkpoint's duration). Prints, per method, the
time the checkpoints took against the run's wall time, and the size of one checkpoint.

    python benchmarks/bench_checkpoint.py [--methods fedit,fedgalore] [--rounds 6] [--threads 1]

Target: checkpointing by default costs at most 2 % of the run time on `main`. Builds the simulator itself: it reads
the time its checkpointer spent.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

from common import provenance, setup_line  # noqa: E402

from fedlowrank.config import load_config  # noqa: E402
from fedlowrank.runtime.checkpoint import latest_checkpoint  # noqa: E402
from fedlowrank.runtime.simulator import Simulation  # noqa: E402


def measure(method: str, rounds: int, threads: int) -> None:
    base = load_config("main")
    sets = [f"method.name={method}", f"run.rounds={rounds}", f"run.threads={threads}", "run.checkpoint_every=1",
            *base.compare.overrides.get(method, [])]
    cfg = load_config("main", sets)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        sim = Simulation(cfg, run_dir=Path(tmp) / "run")
        built = time.perf_counter() - t0
        sim.run()
        wall = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in latest_checkpoint(Path(tmp) / "run").rglob("*") if f.is_file())
        print(setup_line(cfg, sim.task))
        spent = sim.checkpoints.seconds
        print(f"  {method}: {rounds} checkpoints ({size / 1e6:.2f} MB each) took {spent:.3f} s in all "
              f"({1e3 * spent / rounds:.1f} ms each); run {wall:.1f} s wall ({built:.1f} s set-up) -> "
              f"{100 * spent / wall:.2f} % of the run, {100 * spent / (wall - built):.2f} % of its rounds")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="fedit,fedgalore")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    print(provenance())
    for method in args.methods.split(","):
        measure(method, args.rounds, args.threads)


if __name__ == "__main__":
    main()

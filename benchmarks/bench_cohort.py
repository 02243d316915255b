"""Client cohorts (issue #18 item 1): round time of one cohort against one client at a time.

FedIT (LoRA r = 8 on MiniLM-L6, BBC News, the ``main`` config) with 10 clients per round × 5 local steps of 16
examples, run twice with the same seed: ``run.cohort = 1`` (one client at a time) and ``run.cohort = 10`` (the
round's clients in one forward/backward per step). Reports the mean round time without evaluation over the rounds
after the first (which also builds the cohort's model views), their ratio, and the largest difference between the
two runs' global states: float rounding for a dropout-free backbone; MiniLM trains with dropout 0.1, whose masks a
cohort draws from its own stream, so there the runs differ as two dropout draws do. Target: ≥ 5× on an H100; on
the CPU a joint step gains ≈ nothing (0.94× measured, 2 loaded cores).

    python benchmarks/bench_cohort.py [--device auto] [--rounds 3] [--dtype fp32] [--threads 0] [--model minilm]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from common import provenance, setup_line  # noqa: E402

import torch  # noqa: E402

from fedlowrank.config import load_config  # noqa: E402
from fedlowrank.runtime.simulator import Simulation  # noqa: E402


def round_seconds(sim: Simulation) -> float:
    """Mean wall time of the rounds after the first, evaluation excluded."""
    rows = sim.history[1:] or sim.history
    return sum(r["time"]["total"] - r["time"]["evaluation"] for r in rows) / len(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--model", default="minilm")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    sets = ["method.name=fedit", f"run.rounds={args.rounds}", f"run.eval_every={args.rounds}",
            f"partition.num_clients={args.clients}", f"run.clients_per_round={args.clients}",
            f"train.local_steps={args.steps}", f"run.device={args.device}", f"train.dtype={args.dtype}",
            f"run.threads={args.threads}", f"task.model={args.model}", f"run.seed={args.seed}"]
    print(provenance(argv))
    sims = {}
    for cohort in (1, args.clients):
        cfg = load_config("main", [*sets, f"run.cohort={cohort}"])
        sim = Simulation(cfg, task=sims[1].task if sims else None)
        sim.run()
        sims[cohort] = sim
    one, joint = sims[1], sims[args.clients]
    if joint.cohort_size() != args.clients:
        raise SystemExit(f"the cohort run trained {joint.cohort_size()} client(s) at a time, not {args.clients}")
    diff = max(float((one.server[k] - joint.server[k]).abs().max()) for k in one.server.tensors())
    dropout = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in one.model.net.modules())
    print(setup_line(one.cfg, one.task))
    name = torch.cuda.get_device_name(joint.device) if joint.device.type == "cuda" else "cpu"
    print(f"device {joint.device} ({name}), dtype {args.dtype}; mean round time over rounds 2..{args.rounds}, "
          f"evaluation excluded")
    t1, tc = round_seconds(one), round_seconds(joint)
    print(f"  one client at a time: {t1:8.3f} s/round")
    print(f"  cohort of {args.clients:<2d}        : {tc:8.3f} s/round")
    print(f"  -> speed-up {t1 / tc:.2f}x (target >= 5x on an H100; ~1x on the CPU); "
          f"max |global state difference| {diff:.2e} "
          f"({'dropout: different mask streams' if dropout else 'no dropout: float rounding'})")


if __name__ == "__main__":
    main()

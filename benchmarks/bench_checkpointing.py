"""What gradient checkpointing costs and saves in a cohort's joint step, on the CPU.

A joint step of ``--cohort`` FedIT members (the simulator's :class:`~fedlowrank.runtime.cohort.Joint`) on the
``tiny-lm`` task with ``--model`` (default tiny-llama), every member on the task's longest examples: the median step
time over ``--steps`` steps after one warm-up, and the step's peak allocation (the torch profiler's allocator
events), with and without ``train.gradient_checkpointing``; the ratios are what ``run.cohort = 0`` trades when it
turns checkpointing on (``train.gradient_checkpointing = "auto"``). It builds the simulator itself: it times the
cohort engine's joint step, not a run::

    PYTHONPATH=src python benchmarks/bench_checkpointing.py --model tiny-llama --cohort 4 --steps 5
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import median_seconds, provenance  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fedlowrank.config import load_config  # noqa: E402
from fedlowrank.device import set_checkpointing  # noqa: E402
from fedlowrank.execution.measure import measured_peak_bytes  # noqa: E402
from fedlowrank.runtime.cohort import Joint  # noqa: E402
from fedlowrank.runtime.simulator import Simulation  # noqa: E402
from fedlowrank.tasks import build_task  # noqa: E402
from fedlowrank.training.local import Fit, LocalSteps, LocalTrainer, MemberFit  # noqa: E402


def joint_fit(sim: Simulation, size: int, batch, steps: int) -> LocalSteps:
    members = []
    for k in range(size):
        view = sim.model.shared_copy()
        sim.method.load_global(view, sim.server)
        params = sim.method.trainable(view, ("A", "B"))
        view.set_trainable(params)
        trainer = LocalTrainer(sim.task, sim.parts[k % len(sim.parts)], sim.cfg.train, k, 1, 2, 0)
        member = MemberFit(trainer, Fit(view, params))
        member.batches = iter([batch] * (steps + 2))
        members.append(member)
    return LocalSteps(members, Joint(sim.model, members, seed=0))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llama", help="task.model")
    ap.add_argument("--cohort", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(provenance(argv))
    cfg = load_config("tiny-lm", ["task.options.eval_generate=0", f"task.model={args.model}",
                                  f"run.clients_per_round={args.cohort}", "train.gradient_checkpointing=false",
                                  f"train.local_steps={args.steps + 2}"])
    sim = Simulation(cfg, task=build_task(cfg))
    longest = np.argsort([-len(e.ids) for e in sim.task.train], kind="stable")[:cfg.train.batch_size]
    batch = sim.task.batch(longest)
    figures = {}
    for on in (False, True):
        set_checkpointing(sim.model.net, on)
        fit = joint_fit(sim, args.cohort, batch, args.steps + 1)
        fit.step(0)
        steps = iter(range(1, args.steps + 1))
        seconds, _ = median_seconds(lambda: fit.step(next(steps)), args.steps)
        peak = measured_peak_bytes(lambda: fit.step(args.steps + 1), torch.device("cpu"))
        figures[on] = (seconds, peak)
        print(f"checkpointing {'on ' if on else 'off'}: {1e3 * figures[on][0]:.1f} ms per joint step, "
              f"step peak {peak / 2**20:.1f} MiB")
    (t0, p0), (t1, p1) = figures[False], figures[True]
    print(f"{args.model}, cohort of {args.cohort} × {cfg.train.batch_size} rows: checkpointing costs {t1 / t0:.2f}× "
          f"the step time and needs {p1 / p0:.2f}× the step's peak memory")


if __name__ == "__main__":
    main()

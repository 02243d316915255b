"""Framework overhead and memory of the simulator (foundation issue targets).

1. Overhead: FedIT on MiniLM (BBC News, 10 clients, 5 per round, 5 local steps, 10 rounds). Everything that
   is not forward/backward/optimizer steps, aggregation or evaluation ("other") as a share of wall time.
   Target ≤ 5 %.
2. Memory: AG News (10,001 examples), 100 clients, 10 per round, a stateful method (SCAFFOLD: a control variate per client). Peak RSS
   against base model + activations + 100 × one client's state + 300 MB. Target: within that bound.

    python benchmarks/bench_overhead.py [--rounds 10] [--threads 2] [--skip-overhead] [--skip-memory]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from common import provenance  # noqa: E402

from fedlowrank.config import load_config  # noqa: E402
from fedlowrank.runtime.simulator import Simulation, peak_rss_mb  # noqa: E402


def overhead(rounds: int, threads: int) -> None:
    cfg = load_config("main", ["method.name=fedit", f"run.rounds={rounds}", "run.eval_every=5",
                               f"run.threads={threads}"])
    sim = Simulation(cfg)
    sim.run()
    t = sim.summary()["time"]
    print(f"overhead: FedIT MiniLM BBC News, 10 clients, 5/round, 5 steps, {rounds} rounds, seed 0")
    for k in ("client_compute", "aggregation", "evaluation", "other", "total"):
        print(f"  {k:15s} {t[k]:8.2f} s  ({100 * t[k] / t['total']:5.2f} %)")
    print(f"  -> framework overhead = {100 * t['other'] / t['total']:.2f} % of wall time (target <= 5 %); "
          f"final accuracy {sim.last_eval.get('accuracy', float('nan')):.4f}")


def memory(threads: int) -> None:
    cfg = load_config("main", ["method.name=scaffold", "run.rounds=12", "run.eval_every=100", "partition.num_clients=100",
                               "data.source=agnews", "data.max_test_examples=200",
                               "partition.min_partition_size=5", "run.clients_per_round=10",
                               "train.local_steps=1", f"run.threads={threads}"])
    sim = Simulation(cfg)
    loaded = peak_rss_mb()
    sim.run_round()
    with_activations = peak_rss_mb()  # model + data + one round's activations, optimizer state and messages
    sim.run()
    state_mb = max(sum(v.numel() * v.element_size() for v in s.tensors().values()) for s in sim.store.values()) / 2**20
    peak = peak_rss_mb()
    bound = with_activations + 100 * state_mb + 300
    print(f"memory: SCAFFOLD MiniLM, AG News, 100 clients, 10/round, 12 rounds ({len(sim.store)} clients hold state)")
    print(f"  peak RSS after model + data load {loaded:.0f} MB; after round 1 (+ activations) {with_activations:.0f} MB; "
          f"one client's state {state_mb:.2f} MB; peak RSS after 12 rounds {peak:.0f} MB")
    print(f"  bound = base model + activations + 100 x state + 300 MB = {bound:.0f} MB -> "
          f"{'within' if peak <= bound else 'ABOVE'}")

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    args = ap.parse_args()
    print(provenance())
    if not args.skip_overhead:
        overhead(args.rounds, args.threads)
    if not args.skip_memory:
        memory(args.threads)
    print(provenance().splitlines()[1] + " (at the end)")

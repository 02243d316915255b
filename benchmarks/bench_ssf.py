"""SSF performance and communication on the federated matrix regression (specs/ssf.md §10.1, §10.2 item 13).

1. Speed: one vectorised run of each method (default SSF at r = 20, het = 2, T = 25,000 rounds, S = 10 of
   N = 20, K = 5, b = 20, η_l = 1e-3), wall and CPU seconds. Target: SSF at r = 20 in ≤ 60 s.
2. Communication: a short run in the simulator (every message serialised and counted by the ledger); floats
   per participant per round, down and up, against the paper's 4rm (SSF) and 4dm (SCAFFOLD), with and without
   the catch-up of the model copy under partial participation.

    .venv/bin/python benchmarks/bench_ssf.py                       # both parts
    .venv/bin/python benchmarks/bench_ssf.py --rounds 2000 --methods ssf,fedsub --skip-comm
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import provenance  # noqa: E402

from fedlowrank.config import from_dict  # noqa: E402
from fedlowrank.runtime.simulator import Simulation  # noqa: E402
from fedlowrank.runtime.vectorized import run_vectorized  # noqa: E402

METHODS = {"ssf": {"name": "ssf"}, "fedsub": {"name": "fedsub"}, "scaffold": {"name": "fedavg-full", "correction": "scaffold"},
           "fedavg": {"name": "fedavg-full"}}


def toy_config(method: dict, rounds: int, rank: int, het: float, lr: float, seed: int, per_round: int = 10,
               eval_every: int = 100) -> object:
    return from_dict({
        "run": {"rounds": rounds, "clients_per_round": per_round, "eval_every": eval_every, "seed": seed,
                "threads": 1, "stop_metric": "rel_error", "stop_above": 1e6},
        "task": {"kind": "matrix-regression", "options": {"het": het}},
        "partition": {"kind": "natural", "num_clients": 20},
        "train": {"optimizer": "sgd", "lr": lr, "local_steps": 5, "batch_size": 20},
        "server": {"weighting": "uniform"},
        "lora": {"rank": rank}, "method": dict(method)})


def speed(args) -> None:
    print(f"\n== speed: T={args.rounds}, r={args.rank}, het={args.het}, lr={args.lr}, S=10 of N=20, K=5, b=20 ==")
    for name in args.methods.split(","):
        cfg = toy_config(METHODS[name], args.rounds, args.rank, args.het, args.lr, args.seed)
        cpu = time.process_time()
        run = run_vectorized(cfg)
        cpu = time.process_time() - cpu
        print(f"{name:9s} wall={run.seconds:7.2f}s cpu={cpu:7.2f}s rounds={run.rounds} "
              f"final rel_error={run.final.get('rel_error', float('nan')):.4e} loadavg={os.getloadavg()[0]:.2f}")


def communication(args) -> None:
    d, m, r = 100, 10, args.rank
    print(f"\n== communication (simulator ledger): d={d}, m={m}, r={r}, {args.comm_rounds} rounds ==")
    for name, per_round in (("ssf", 20), ("ssf", 10), ("fedsub", 10), ("scaffold", 20)):
        cfg = toy_config(METHODS[name], args.comm_rounds, r, args.het, args.lr, args.seed, per_round,
                         eval_every=args.comm_rounds)
        sim = Simulation(cfg)
        sim.run()
        rows = [row for row in sim.ledger.rows if row["round"] > 1]
        down = np.mean([row["down"] for row in rows]) / 8
        up = np.mean([row["up"] for row in rows]) / 8
        print(f"{name:9s} S={per_round:2d}/20: per participant per round down={down:8.1f} up={up:8.1f} "
              f"total={down + up:8.1f} floats (bytes/8, header included); 4rm={4 * r * m} 4dm={4 * d * m}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=25_000)
    ap.add_argument("--rank", type=int, default=20)
    ap.add_argument("--het", type=float, default=2.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default="ssf", help=f"comma-separated among {', '.join(METHODS)}")
    ap.add_argument("--comm-rounds", type=int, default=20)
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-comm", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(provenance())
    print(f"seed {args.seed}")
    if not args.skip_speed:
        speed(args)
    if not args.skip_comm:
        communication(args)


if __name__ == "__main__":
    main()

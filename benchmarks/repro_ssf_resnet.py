"""A CPU proxy of the SSF paper's network study (its Table 5: ResNet on CIFAR-100): a CIFAR-style ResNet-20
(``task.model = "resnet20"``, GroupNorm, trained from scratch) on Fashion-MNIST with 4 clients, comparing
SSF, Full-SCAFFOLD, Full-FedAvg and FedSub.

CIFAR-100 is not obtainable offline on the project machines, so this is Fashion-MNIST (10 classes, 28×28
grayscale), Dirichlet label skew. SSF and FedSub project **every convolution** (19 kernels, each seen as
``[out, in·3·3]``) with per-layer rank ``round(ratio · in·9)``; the classifier and the GroupNorm parameters are not
projected (SSF: full SCAFFOLD on them, FedSub: FedAvg). Full-SCAFFOLD and Full-FedAvg train every parameter.
Every method gets the same rounds, local steps, batch and learning rate (compute-matched in steps, not in
wall time); plain SGD local steps, all 4 clients every round.

Smoke run (seconds; what CI and reviewers run):

    .venv/bin/python benchmarks/repro_ssf_resnet.py --smoke

A fuller CPU run (hours on a loaded 2-core machine; not run by us):

    .venv/bin/python benchmarks/repro_ssf_resnet.py --rounds 200 --local-steps 10 --batch 32 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import Grid, provenance, run_resumable, setup_line, sweep_options  # noqa: E402

from fedlowrank.config import from_dict  # noqa: E402

METHODS = {
    "ssf": lambda a: {"name": "ssf", "ratio": a.ratio},
    "scaffold": lambda a: {"name": "fedavg-full", "correction": "scaffold"},
    "fedavg": lambda a: {"name": "fedavg-full"},
    "fedsub": lambda a: {"name": "fedsub", "ratio": a.ratio, "refresh_every": 5},
}


def config(args, method: dict, seed: int):
    return from_dict({
        "run": {"rounds": args.rounds, "clients_per_round": 4, "eval_every": args.eval_every, "seed": seed,
                "threads": 1, "device": "cpu"},
        "task": {"kind": "image-classification", "model": "resnet20", "eval_batch_size": 500},
        "data": {"source": "fashion-mnist", "max_train_examples": args.max_train, "max_test_examples": args.max_test},
        "partition": {"kind": "dirichlet", "num_clients": 4, "alpha": args.alpha, "min_partition_size": 10},
        "train": {"optimizer": "sgd", "lr": args.lr, "local_steps": args.local_steps, "batch_size": args.batch},
        "server": {"weighting": "num_examples", "lr": 1.0},
        "method": method})


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--local-steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--ratio", type=float, default=0.25, help="SSF/FedSub per-layer rank ratio r_l/d_l")
    ap.add_argument("--alpha", type=float, default=0.3, help="Dirichlet label skew")
    ap.add_argument("--max-train", type=int, default=0, help="0 = all 60,000")
    ap.add_argument("--max-test", type=int, default=2000)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--smoke", action="store_true", help="2 rounds of 2 steps on 400/200 examples")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    sweep_options(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.rounds, args.local_steps, args.batch, args.eval_every = 2, 2, 16, 1
        args.max_train, args.max_test = 400, 200
    print(provenance(argv))
    print("CPU proxy of SSF's Table 5: CIFAR-100 is not obtainable offline, so Fashion-MNIST; ResNet-20 with "
          "GroupNorm from scratch; not the paper's protocol (the paper gives none beyond 4 clients, ResNet-110, 100 epochs)")
    results: dict = {"args": vars(args), "runs": []}
    grid = Grid(args)
    cells = [(int(seed), name) for seed in args.seeds.split(",") for name in args.methods.split(",")]
    for seed, name in cells:
        grid.add(f"{name}-seed{seed}", config(args, METHODS[name](args), seed))

    def done(i: int, outcome) -> None:
        seed, name = cells[i]
        cfg, summary = grid.runs[i].cfg, outcome.summary
        if i == 0:
            print(setup_line(cfg, grid.task(cfg)))
        rows = [r for r in outcome.history if "accuracy" in r]
        run = {"method": name, "seed": seed, "final_accuracy": rows[-1]["accuracy"],
               "best_accuracy": max(r["accuracy"] for r in rows), "final_loss": rows[-1]["loss"],
               "mb_up_per_round": summary["bytes_up"] / 1e6 / cfg.run.rounds,
               "mb_down_per_round": summary["bytes_down"] / 1e6 / cfg.run.rounds,
               "seconds": round(grid.seconds(outcome), 1)}
        results["runs"].append(run)
        print(f"{name:9s} seed {seed}: final acc {run['final_accuracy']:.4f}  best {run['best_accuracy']:.4f}  "
              f"loss {run['final_loss']:.4f}  up {run['mb_up_per_round']:.3f} MB/round  "
              f"down {run['mb_down_per_round']:.3f} MB/round  {run['seconds']} s", flush=True)

    grid.run(done)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)
    return results


if __name__ == "__main__":
    sys.exit(run_resumable(main))

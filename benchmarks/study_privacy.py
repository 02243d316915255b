"""Client-level DP study (issue 19): FedIT, FFA-LoRA, FLoRG and FedSA-LoRA at ε ∈ {1, 3, 8} (δ = 1/N) on BBC News
with MiniLM, several seeds, the clipping norm C tuned per (method, ε) from a grid: does freezing A help under DP,
as FFA-LoRA claims?

Each method runs in the strongest mode it supports (``supported_privacy_modes()``): central DP (noise σ·C on the
sum, server.weighting = uniform) for FedIT, FFA-LoRA and FedSA-LoRA, local DP (noise σ·C on each reply) for FLoRG,
whose Gram aggregation needs individual replies; σ is computed from the target ε for the configured rounds and
sampling (``privacy.target_epsilon``). ε = inf is the non-private run. C is tuned on the seeds' *test* accuracy
(there is no validation split): the "best C" row is optimistic by construction, the per-C rows are not.

Prints, per run, final accuracy, the ε reached and the bytes the ledger counted (client-level DP adds no bytes:
clipping and noise keep every tensor's shape; SecAgg+ is a Flower-only mechanism whose protocol traffic is not in
this simulator's ledger); then accuracy mean ± 95% CI (t over seeds) per (method, ε) at the best C.

The study (hours of MiniLM training on 2 cores; not run here):

    python benchmarks/study_privacy.py --epsilons 1,3,8,inf --seeds 0,1,2 --clips 0.1,0.3,1.0 --rounds 20

A smoke run (tiny random BERT, 1 round):

    python benchmarks/study_privacy.py --smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import provenance  # noqa: E402

from fedlowrank.config import load_config  # noqa: E402
from fedlowrank.methods import method_class  # noqa: E402
from fedlowrank.runtime.simulator import Simulation  # noqa: E402
from fedlowrank.tasks import build_task  # noqa: E402

METHODS = "fedit,ffa-lora,florg,fedsa-lora"
T_95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--epsilons", default="1,3,8,inf", help="target ε per run (inf = no privacy)")
    p.add_argument("--clips", default="0.1,0.3,1.0", help="clipping norms C tried per (method, ε)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--config", default="main", help="base config (bundled name or TOML)")
    p.add_argument("--set", action="append", default=[], help="extra config overrides")
    p.add_argument("--out", default="", help="append every run's summary as JSON lines here")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="tiny config, 1 round, one ε and C: checks the script runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.config, args.rounds, args.epsilons, args.clips, args.seeds = "tiny", 1, "8", "1.0", "0"
    return args


def config(args, method: str, eps: float, clip: float, seed: int):
    sets = [f"method.name={method}", f"run.rounds={args.rounds}", f"run.seed={seed}", f"run.threads={args.threads}",
            f"run.eval_every={args.rounds}", "server.weighting=uniform", *args.set]
    if math.isfinite(eps):
        mode = "central" if "central" in method_class(method).supported_privacy_modes() else "local"
        sets += [f"privacy.mode={mode}", f"privacy.clip={clip}", f"privacy.target_epsilon={eps}"]
    return load_config(args.config, sets)


def ci95(values: list[float]) -> tuple[float, float]:
    """Mean and half-width of the 95% t-interval (0 for a single value)."""
    mean = float(np.mean(values))
    if len(values) < 2:
        return mean, 0.0
    return mean, T_95.get(len(values) - 1, 1.96) * float(np.std(values, ddof=1)) / math.sqrt(len(values))


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(provenance(argv))
    methods, seeds = args.methods.split(","), [int(s) for s in args.seeds.split(",")]
    epsilons, clips = [float(e) for e in args.epsilons.split(",")], [float(c) for c in args.clips.split(",")]
    tasks: dict[int, object] = {}
    acc: dict[tuple[str, float, float], list[float]] = {}
    out = open(args.out, "a") if args.out else None
    for seed in seeds:
        for method in methods:
            for eps in epsilons:
                for clip in clips if math.isfinite(eps) else [math.inf]:
                    cfg = config(args, method, eps, clip, seed)
                    if seed not in tasks:
                        tasks[seed] = build_task(cfg)
                    summary = Simulation(cfg, task=tasks[seed]).run()
                    acc.setdefault((method, eps, clip), []).append(summary.get("accuracy", float("nan")))
                    print(f"{method:10s} eps={eps:<5g} C={clip:<5g} seed={seed} mode={cfg.privacy.mode or '-':7s} "
                          f"acc={summary.get('accuracy', float('nan')):.4f} eps_reached={summary.get('epsilon', 0):.3f} "
                          f"up={summary['bytes_up']} down={summary['bytes_down']}", flush=True)
                    if out:
                        out.write(json.dumps({"method": method, "target_epsilon": eps, "clip": clip, "seed": seed,
                                              "mode": cfg.privacy.mode, **summary}) + "\n")
    print("\naccuracy (mean ± 95% CI over seeds) at the best C per (method, ε); C in brackets")
    print("method      " + "".join(f"{'eps=' + format(e, 'g'):>22s}" for e in epsilons))
    for method in methods:
        cells = []
        for eps in epsilons:
            best = max((ci95(acc[(method, eps, c)]) + (c,) for c in (clips if math.isfinite(eps) else [math.inf])),
                       key=lambda t: t[0])
            cells.append(f"{best[0]:.3f}±{best[1]:.3f} [{best[2]:g}]")
        print(f"{method:12s}" + "".join(f"{c:>22s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How far FedRot-LoRA's clients rotate their factors before upload, in the ``fedrot-10`` protocol's setting
(benchmarks/protocols.py; docs/methods/fedrot_lora.md, "Measured"). Not part of CI.

Per round and over every client and target module: the largest rotation angle of the full Procrustes rotation R*
(λ = 1, the frame that matches the global factor best) and of the rotation R the client applies (the soft rotation
at ``method.align_lambda``), each the largest |arg| of the r×r matrix's eigenvalues, in degrees; and the relative
change of the aligned factor, ‖RᵀA − A‖_F / ‖A‖_F (A, or B R − B when B is aligned). Near-zero angles mean the
clients' factors already share the global frame, and FedRot-LoRA's upload is FedIT's.

    python benchmarks/fedrot_alignment.py --lr 3e-3 --seed 0
    python benchmarks/fedrot_alignment.py --lr 3e-3 --seed 0 --set partition.num_clients=50
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(__file__))
from common import provenance, setup_line  # noqa: E402
from protocols import PROTOCOLS  # noqa: E402

import fedlowrank.methods.fedrot_lora as fedrot_module  # noqa: E402
from fedlowrank.config import load_config  # noqa: E402
from fedlowrank.runtime.simulator import Simulation  # noqa: E402
from fedlowrank.tasks import build_task  # noqa: E402


def largest_angle(R) -> float:
    """The largest rotation angle of the orthogonal matrix ``R`` [r, r], in degrees."""
    import torch

    return math.degrees(float(torch.linalg.eigvals(R.double()).angle().abs().max()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lr", type=float, default=3e-3, help="train.lr (fedrot-10's tuned rate: 3e-3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="on top of the protocol's")
    args = ap.parse_args(argv)
    print(provenance(argv))
    p = PROTOCOLS["fedrot-10"]
    cfg = load_config(p.config, [*p.sets, "method.name=fedrot-lora", f"train.lr={args.lr}", f"run.seed={args.seed}",
                                 "data.max_test_examples=500", *args.set])
    task = build_task(cfg)
    sim = Simulation(cfg, task=task)
    print(setup_line(cfg, task))
    seen: dict[int, list[tuple[str, float, float, float]]] = defaultdict(list)
    real = fedrot_module.align_factors

    def recording(B, A, B_ref, A_ref, factor, lam, hard=False):
        B2, A2, R = real(B, A, B_ref, A_ref, factor, lam, hard=hard)
        _, _, R_star = real(B, A, B_ref, A_ref, factor, 1.0)
        old, new = (A, A2) if factor == "A" else (B, B2)
        change = float((new.double() - old.double()).norm() / old.double().norm().clamp_min(1e-30))
        seen[sim.round + 1].append((factor, largest_angle(R_star), largest_angle(R), change))
        return B2, A2, R

    fedrot_module.align_factors = recording
    sim.run()
    print("\n| round | aligned | R* largest angle: mean / max (°) | R largest angle: mean / max (°) | "
          "factor change: mean / max |")
    print("|---|---|---|---|---|")
    for rnd, rows in sorted(seen.items()):
        cols = list(zip(*rows))
        cells = [f"{sum(c) / len(c):.2f} / {max(c):.2f}" for c in cols[1:3]]
        print(f"| {rnd} | {cols[0][0]} | {cells[0]} | {cells[1]} | "
              f"{sum(cols[3]) / len(cols[3]):.4f} / {max(cols[3]):.4f} |")
    print(f"\nfinal accuracy {sim.last_eval.get('accuracy', float('nan')):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

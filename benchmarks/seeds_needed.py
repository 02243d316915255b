"""How many paired seeds decide FLoRG vs FedIT and FedSub vs SSF: the power of the two-sided Wilcoxon signed-rank
test at p < 0.05 (the verdict rule of ``fedlowrank compare``) under models of the per-seed differences fitted to
the 12-seed GPU rerun of the AG News protocols. A planning estimate, not a measurement:

* FedIT − FLoRG (reported: mean +0.077 ± 0.088, median +0.032, FedIT ahead in 9 of 12): FLoRG collapses with
  probability 0.15 (difference uniform in [0.3, 0.5]), else the difference is normal (0.02, 0.03²). This model has
  mean 0.077, median ≈ 0.03, P(FedIT ahead) ≈ 0.79 and sd ≈ 0.14 (the t half-width 0.088 at n = 12).
* FedSub − SSF (reported: −0.010 ± 0.016, median −0.012): normal (−0.010, 0.025²).

    python benchmarks/seeds_needed.py [--replications 2000] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import provenance  # noqa: E402

from fedlowrank.experiments.stats import ALPHA, wilcoxon_signed_rank  # noqa: E402


def florg_minus(rng: np.random.Generator, n: int) -> np.ndarray:
    collapsed = rng.random(n) < 0.15
    return np.where(collapsed, rng.uniform(0.3, 0.5, n), rng.normal(0.02, 0.03, n))


def fedsub_minus_ssf(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.normal(-0.010, 0.025, n)


MODELS = {"FedIT − FLoRG": (florg_minus, (12, 16, 20, 24, 30)),
          "FedSub − SSF": (fedsub_minus_ssf, (12, 24, 40, 52, 64, 80))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replications", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(provenance(argv))
    print(f"seed {args.seed}, {args.replications} replications per n; power = P(signed-rank p < {ALPHA:g})")
    rng = np.random.default_rng(args.seed)
    for name, (draw, sizes) in MODELS.items():
        for n in sizes:
            p = np.array([wilcoxon_signed_rank(draw(rng, n).tolist()).p for _ in range(args.replications)])
            print(f"{name}: n = {n:3d} seeds, power {np.mean(p < ALPHA):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

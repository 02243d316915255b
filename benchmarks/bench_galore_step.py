"""GaLore-AdamW optimiser step vs plain AdamW on MiniLM-L6's query/value weights, one thread.

The optimisers are timed alone, on 12 weight-shaped fp32 tensors ``[384, 384]`` (MiniLM-L6: 6 layers × query,
value) with synthetic Gaussian gradients (a pool of 8 gradient sets, reused), not on the model's forward and
backward pass. GaLore: r = 8, S = 2 SVD refreshes then seeded random bases, α_g = 4; refresh period τ = 200 and
τ = 10. The mean over ``--steps`` steps amortises the refreshes; the refresh costs are also shown alone.

    python benchmarks/bench_galore_step.py                 # 400 steps, r = 8
    python benchmarks/bench_galore_step.py --steps 1000 --rank 16 --projector rsvd
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

from fedlowrank.seeding import torch_generator  # noqa: E402
from fedlowrank.training.galore import GaLore  # noqa: E402

SHAPES = [(384, 384)] * 12


def run(make_opt, steps: int, grads: list[list[torch.Tensor]]) -> tuple[float, list[float]]:
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    opt = make_opt(params)
    times = []
    for t in range(steps):
        for p, g in zip(params, grads[t % len(grads)]):
            p.grad = g
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return float(np.mean(times)), times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--taus", default="200,10")
    p.add_argument("--projector", default="svd", choices=["svd", "rsvd"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(provenance(argv))
    print(f"seed {args.seed}")
    g = torch_generator(args.seed, "bench-galore")
    grads = [[torch.randn(s, generator=g) * 1e-3 for s in SHAPES] for _ in range(8)]

    adamw, _ = run(lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01), args.steps, grads)
    print(f"\n12 blocks 384x384, {args.steps} steps; mean optimiser step over all blocks")
    print(f"  torch AdamW (dense m, v)                      {adamw * 1e3:8.2f} ms")
    for tau in (int(x) for x in args.taus.split(",")):
        mean, times = run(lambda ps: GaLore(ps, lr=1e-4, weight_decay=0.01, rank=args.rank, tau=tau, svd_refreshes=2,
                                            scale=4.0, projector=args.projector, seed=args.seed), args.steps, grads)
        refresh = [times[t] for t in range(args.steps) if t % tau == 0]
        plain = [times[t] for t in range(args.steps) if t % tau]
        svd_steps, rand_steps = refresh[:2], refresh[2:]
        print(f"  GaLore-AdamW r={args.rank} tau={tau:<4d} ({args.projector})        {mean * 1e3:8.2f} ms  "
              f"= {mean / adamw:.2f}x AdamW")
        print(f"      step without refresh (median)             {np.median(plain) * 1e3:8.2f} ms")
        print(f"      step with an SVD refresh (mean of {len(svd_steps)})       {np.mean(svd_steps) * 1e3:8.2f} ms")
        if rand_steps:
            print(f"      step with a random refresh (median of {len(rand_steps)}) {np.median(rand_steps) * 1e3:8.2f} ms")
    print("\noptimiser state per 384x384 block: AdamW 2x384x384 floats = 1.18 MB; "
          f"GaLore m̃, ṽ 2x384x{args.rank} + Q 384x{args.rank} = {3 * 384 * args.rank * 4 / 1e6:.3f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

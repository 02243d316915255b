"""AJIVE server latency (the FedGaLore paper's Table 7, arXiv:2602.01746 App. E), one thread, float64.

Views are FedGaLore's: client i's second moment lifted to ``X_i = S_i Qᵀ: [n, n]`` (``S_i: [n, r]``, a shared
orthonormal ``Q: [n, r]``), fixed joint rank r, no rank resampling. Three routes:

* ``dense-full``  — AJIVE on the dense n×n views with exact SVDs (what a literal implementation does);
* ``dense-rsvd``  — the same with randomized SVDs (the paper's GPU implementation uses rSVD);
* ``compact``     — AJIVE on the n×r matrices ``S_i`` (what :mod:`fedlowrank.methods.fedgalore` runs; exact,
  since the views share Q): the largest difference to the dense result is printed next to it.

Then the per-round server cost for MiniLM-L6 (6 layers, query/value 384×384, and with all ``dense`` blocks
too: 384×1536 / 1536×384 canonical d_u = 1536) with 5 clients and r = 8.

    python benchmarks/bench_ajive.py                       # 5 views × n = 1024 + the MiniLM sizes
    python benchmarks/bench_ajive.py --views 1,2,5,10 --sizes 512,768,1024   # the full Table 7 grid
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import median_seconds, provenance  # noqa: E402

from fedlowrank.linalg.ajive import ajive_combine  # noqa: E402
from fedlowrank.seeding import torch_generator  # noqa: E402


def make_views(n_views: int, d_u: int, d_p: int, r: int, seed: int):
    g = torch_generator(seed, "bench-ajive", n_views, d_u, d_p)
    Q = torch.linalg.qr(torch.randn(d_p, r, generator=g, dtype=torch.float64))[0]
    shared = torch.rand(d_u, r, generator=g, dtype=torch.float64)
    S = [shared + 0.5 * torch.rand(d_u, r, generator=g, dtype=torch.float64) for _ in range(n_views)]
    return S, Q


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--views", default="5")
    p.add_argument("--sizes", default="1024")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(provenance(argv))
    print(f"seed {args.seed}")
    r = args.rank
    print(f"\nAJIVE latency, median of {args.repeats} (ms); paper Table 7 CPU: 5 views n=1024 ≈ 92.5 ms")
    print(f"{'views':>5} {'n':>5} {'dense-full':>11} {'dense-rsvd':>11} {'compact':>9}  max|dense-compact|")
    for n_views in (int(v) for v in args.views.split(",")):
        for n in (int(s) for s in args.sizes.split(",")):
            S, Q = make_views(n_views, n, n, r, args.seed)
            w = [1.0 / n_views] * n_views
            dense_views = [s @ Q.T for s in S]
            t_full, (dense, _) = median_seconds(lambda: ajive_combine(dense_views, w, r, r), args.repeats)
            t_rsvd, _ = median_seconds(lambda: ajive_combine(dense_views, w, r, r, svd="randomized",
                                                     generator=torch_generator(args.seed, "rsvd")), args.repeats)
            t_comp, (compact, _) = median_seconds(lambda: ajive_combine(S, w, r, r), args.repeats)
            err = float((dense - compact @ Q.T).abs().max())
            print(f"{n_views:>5} {n:>5} {t_full * 1e3:>11.1f} {t_rsvd * 1e3:>11.1f} {t_comp * 1e3:>9.2f}  {err:.1e}")

    print(f"\nMiniLM-L6 server sync per round (5 clients, r = {r}, compact path), median of {args.repeats}")
    blocks = {"query/value (12 blocks 384x384)": [384] * 12,
              "query/value/all dense (6 x [384,384,384,1536,1536])": [384, 384, 384, 1536, 1536] * 6}
    for label, dims in blocks.items():
        views = {d: make_views(5, d, d, r, args.seed)[0] for d in set(dims)}
        t, _ = median_seconds(lambda: [ajive_combine(views[d], [0.2] * 5, r, r) for d in dims], args.repeats)
        print(f"  {label}: {t * 1e3:.1f} ms per round")
    return 0


if __name__ == "__main__":
    sys.exit(main())

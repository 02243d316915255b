"""Server time per round of the LoRA-family baselines at MiniLM shapes (target: ≤ 10% of a round's
client compute, about 20 clients × 5 steps × 0.4 s = 40 s on this machine, so ≤ 4 s).

The model is a stand-in with MiniLM's adapted shapes: ``--modules`` (12 = 6 layers × query/value) linear layers
``--dim × --dim`` (384) and a 4-class head; no backbone is needed to time the server. Clients are played by a fake
trainer (seeded noise on the trainable parameters) through the real ``broadcast → train → aggregate`` path,
so the replies have the shapes and the structure of real ones. For each method and round it times
``aggregate`` and the sum of the ``--clients`` broadcasts (server work too: FedEx-LoRA's per-client dense base
delta, FlexLoRA's slices), and prints the median over rounds 2..``--rounds`` (round 1 of FedEx-LoRA has no
residual yet).

    .venv/bin/python benchmarks/bench_aggregation.py                       # all nine methods, 20 clients, rank 8
    .venv/bin/python benchmarks/bench_aggregation.py --methods flexlora --hetero 2,4,8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from common import provenance  # noqa: E402

from fedlowrank.adapters.model import AdaptedModel  # noqa: E402
from fedlowrank.message import Reply  # noqa: E402
from fedlowrank.methods import get_method  # noqa: E402
from fedlowrank.methods.base import SetupInfo  # noqa: E402
from fedlowrank.runtime.engine import wire  # noqa: E402
from fedlowrank.training.local import FitResult  # noqa: E402

METHODS = ["ffa-lora", "fedsa-lora", "fedex-lora", "flora", "flexlora", "federa", "hetlora", "lora-fair", "rolora"]


class NoiseTrainer:
    def __init__(self, client: int, rnd: int, seed: int):
        self.client, self.rnd, self.seed, self.num_examples = client, rnd, seed, 100 + 10 * client

    def fit(self, model, params, corrections=(), optimizer=None):
        g = torch.Generator().manual_seed(self.seed * 100003 + 1000 * self.rnd + self.client)
        with torch.no_grad():
            for p in params.values():
                p.add_(1e-3 * torch.randn(p.shape, generator=g))
        return FitResult(loss=0.0, steps=5, lr=5e-4)


def stand_in(modules: int, dim: int, classes: int = 4) -> AdaptedModel:
    net = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(modules)], nn.Linear(dim, classes))
    return AdaptedModel(net, [str(i) for i in range(modules)], [f"{modules}.weight", f"{modules}.bias"])


def bench(name: str, args, ranks: list[int]) -> dict[str, float]:
    torch.manual_seed(args.seed)
    model = stand_in(args.modules, args.dim)
    info = SetupInfo(num_clients=args.clients, client_sizes=[100 + 10 * k for k in range(args.clients)],
                     client_ranks=ranks, rank=max(ranks), alpha=2.0 * max(ranks), seed=args.seed, rounds=args.rounds)
    method = get_method(name)
    server = method.setup(model, info)
    store: dict = {}
    agg, down = [], []
    for rnd in range(1, args.rounds + 1):
        replies, t_down = [], 0.0
        for k in range(args.clients):
            t0 = time.perf_counter()
            msg = method.broadcast(server, k, rnd)
            t_down += time.perf_counter() - t0
            for mod in model.adapters().values():
                mod.set_base_delta(None)
            reply, store[k] = method.train(model, wire(msg), store.get(k, method.init_client(k)),
                                           NoiseTrainer(k, rnd, args.seed))
            replies.append(Reply(k, int(reply["num_examples"]), wire(reply)))
        t0 = time.perf_counter()
        server = method.aggregate(server, replies, rnd)
        agg.append(time.perf_counter() - t0)
        down.append(t_down)
        method.pop_metrics()
    return {"aggregate_s": statistics.median(agg[1:] or agg), "broadcasts_s": statistics.median(down[1:] or down)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--hetero", default="", help="comma-separated ranks dealt round-robin (hetero-capable methods)")
    ap.add_argument("--modules", type=int, default=12)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=float, default=40.0, help="a round's client compute in seconds (20×5×0.4)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cycle = [int(x) for x in args.hetero.split(",")] if args.hetero else [args.rank]
    ranks = [cycle[k % len(cycle)] for k in range(args.clients)]
    print(provenance())
    print(f"seed {args.seed}")
    print(f"shapes: {args.modules} modules {args.dim}x{args.dim}, ranks {sorted(set(ranks))}, {args.clients} clients, "
          f"median over rounds 2..{args.rounds}; budget {args.budget:.0f} s/round, target <= {0.1 * args.budget:.1f} s")
    print(f"{'method':<12} {'aggregate s':>12} {'broadcasts s':>13} {'server total s':>15} {'% of budget':>12}")
    for name in args.methods.split(","):
        if len(set(ranks)) > 1 and not get_method(name).supports_heterogeneous_ranks:
            print(f"{name:<12} {'(homogeneous ranks only)':>40}")
            continue
        r = bench(name, args, ranks)
        total = r["aggregate_s"] + r["broadcasts_s"]
        print(f"{name:<12} {r['aggregate_s']:>12.4f} {r['broadcasts_s']:>13.4f} {total:>15.4f} "
              f"{100 * total / args.budget:>11.2f}%")
    print(f"loadavg after: {os.getloadavg()}")


if __name__ == "__main__":
    main()

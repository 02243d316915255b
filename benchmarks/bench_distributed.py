"""Round throughput of the distributed runner: 2 gloo ranks × 1 thread against 1 process × 1 thread, on the
bundled ``main`` config with FedIT (evaluation only after the last round), and a scaling model for K ranks.

    python benchmarks/bench_distributed.py [--rounds 3] [--repeats 3] [--config main] [--set KEY=VALUE ...]

Per repeat it runs the same rounds in one process (:class:`~fedlowrank.runtime.simulator.Simulation`) and on two
spawned ranks (:class:`~fedlowrank.runtime.distributed.Distributed`), and reads each round's time from the metrics
rows (``time.total`` less ``time.evaluation``; the first round, which warms up, is left out). It prints the median
round time of each, their ratio (the throughput gain), the share of a 2-rank round spent in collectives, and the
parts of the scaling model: compute per client, bytes per reply, the gloo bandwidth measured by an all-gather of
one reply's size, and the server step. Model, for K ranks with n clients a round (replies gathered to rank 0 over
its link, the global state broadcast back):

    T(K) ≈ ceil(n / K) · c  +  (K − 1) · n/K · b / β  +  s  +  d / β · ceil(log2 K)

with ``c`` compute per client, ``b`` bytes per reply, ``d`` bytes of the global state, ``β`` bandwidth, ``s`` the
server step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import provenance, setup_line  # noqa: E402


def _config(name: str, rounds: int, sets: list[str]):
    from fedlowrank.config import load_config

    return load_config(name, ["method.name=fedit", f"run.rounds={rounds}", f"run.eval_every={rounds}",
                              "run.threads=1", "run.device=cpu", "run.checkpoint_seconds=0", *sets])


def _round_times(history: list[dict]) -> list[float]:
    return [r["time"]["total"] - r["time"]["evaluation"] for r in history[1:]]


def _ranks_job(name: str, rounds: int, sets: list[str], out: str) -> int:
    """Each spawned rank: the distributed run, then an all-gather of one reply's size (bandwidth)."""
    import torch
    import torch.distributed as dist

    from fedlowrank.runtime.distributed import Distributed

    run = Distributed(_config(name, rounds, sets))
    run.run()
    size = int(run.history[-1]["bytes_up"] / len(run.history[-1]["replied"])) if run.rank == 0 else 0
    n = torch.tensor([size])
    dist.broadcast(n, 0)
    buf = torch.zeros(int(n.item()), dtype=torch.uint8)
    bufs = [torch.empty_like(buf) for _ in range(run.world)]
    dist.all_gather(bufs, buf)  # warm-up
    t0 = time.perf_counter()
    for _ in range(5):
        dist.all_gather(bufs, buf)
    seconds = (time.perf_counter() - t0) / 5
    if run.rank == 0:
        Path(out).write_text(json.dumps({"history": run.history, "reply_bytes": int(n.item()),
                                         "all_gather_s": seconds, "state_bytes": run.server.nbytes()}))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="main")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for both runs, e.g. run.clients_per_round=6 (repeatable)")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import torch

    from fedlowrank.runtime.distributed import spawn
    from fedlowrank.runtime.simulator import Simulation

    torch.set_num_threads(1)
    print(provenance(argv))
    cfg = _config(args.config, args.rounds, args.set)
    one, two, shares, parts = [], [], [], []
    for rep in range(args.repeats):
        sim = Simulation(cfg)
        if rep == 0:
            print(setup_line(cfg, sim.task))
        sim.run()
        one += _round_times(sim.history)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "ranks.json"
            codes = spawn(_ranks_job, (args.config, args.rounds, args.set, str(out)), ["cpu", "cpu"], grace_s=120)
            if codes != [0, 0]:
                raise SystemExit(f"error: the 2-rank run failed (exit codes {codes})")
            got = json.loads(out.read_text())
        two += _round_times(got["history"])
        shares += [r["time"]["collective"] / (r["time"]["total"] - r["time"]["evaluation"])
                   for r in got["history"][1:]]
        parts.append((sim.history, got))
        print(f"repeat {rep + 1}: 1 process {statistics.median(_round_times(sim.history)):.2f} s/round, "
              f"2 ranks {statistics.median(_round_times(got['history'])):.2f} s/round; load "
              f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    t1, t2 = statistics.median(one), statistics.median(two)
    print(f"round time, median of {len(one)} rounds: 1 process × 1 thread {t1:.2f} s, 2 ranks × 1 thread {t2:.2f} s")
    print(f"round throughput, 2 ranks / 1 process: {t1 / t2:.2f}x")
    print(f"collective time per 2-rank round: {100 * statistics.median(shares):.1f} % (median; waiting for the "
          f"slower rank included)")
    history, got = parts[-1]
    n = cfg.run.clients_per_round
    c = statistics.median([r["time"]["client_compute"] / n for r in history[1:]])
    s = statistics.median([r["time"]["aggregation"] for r in history[1:]])
    b, d = got["reply_bytes"], got["state_bytes"]
    beta = b * 2 / got["all_gather_s"]  # 2 ranks' replies cross in one all-gather
    print(f"model parts: compute per client c = {c:.3f} s, bytes per reply b = {b:,}, global state d = {d:,} bytes, "
          f"gloo all-gather bandwidth β = {beta / 1e6:.0f} MB/s (loopback), server step s = {s * 1e3:.1f} ms")
    for k in (1, 2, 4, 8, 16, 32):
        tk = math.ceil(n / k) * c + (k - 1) * (n / k) * b / beta + s + d / beta * math.ceil(math.log2(k) if k > 1 else 0)
        print(f"  model K = {k:>2}: {tk:.3f} s/round, throughput {(n * c + s) / tk:.2f}x one rank"
              + ("  (n = %d clients a round: ranks beyond n idle)" % n if k > n else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

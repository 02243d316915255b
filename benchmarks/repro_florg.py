"""FLoRG reproduction at CPU scale (arXiv:2602.17095, Tables 1–2): accuracy grid and communication to target.

Grid: Dirichlet ρ × rank r × seed × method, AG News + MiniLM, every client in every round. Methods: FLoRG with
and without Procrustes (``florg``, ``florg-noproc``) against FedIT, FeDeRA, FFA-LoRA, FedSA-LoRA, FedEx-LoRA
(registry names ``fedit federa ffa-lora fedsa-lora fedex-lora``; methods not registered are skipped with a note).
Every other setting is passed to the project's config with ``--set`` (e.g. ``--set train.optimizer=sgd`` for the check
that Procrustes cannot matter under SGD when r' ≤ r: the loss depends on AᵀA only, so SGD is rotation-equivariant and
the paper's Table 3 gap must come from Adam or the truncation).

Prints, per run, the final / best accuracy and the bytes counted by the runtime's ledger; then the accuracy table
(mean over seeds) and the communication table (paper Table 2): bytes up + down until the first evaluated round
whose accuracy reaches each target, in total and without the head (``- head``: the head's fp32 bytes times the
number of messages; the safetensors header stays in), "–" where a seed never reaches it.

The CPU-scale slice whose results are in docs/methods/florg.md (24 runs of about 90 s on one core):

    python benchmarks/repro_florg.py --rhos 0.5,0.1 --ranks 4 --seeds 0,1 --clients 20 --rounds 4 --max-train 0 \\
        --max-test 500 --max-length 32 --batch-size 8 --local-steps 5 --lr 5e-3 --targets 0.7,0.8 \\
        --methods florg,florg-noproc,fedit,federa,ffa-lora,fedex-lora

The full grid (hours of MiniLM training on 2 cores; not run here):

    python benchmarks/repro_florg.py --rhos 1,0.5,0.1 --ranks 2,4,8 --seeds 0,1 --clients 20 --rounds 20 \\
        --methods florg,florg-noproc,fedit,federa,ffa-lora,fedsa-lora,fedex-lora --targets 0.8,0.85

A smoke run (seconds, tiny random BERT):

    python benchmarks/repro_florg.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import Grid, median_seconds, provenance, run_resumable, setup_line, sweep_options  # noqa: E402

from fedlowrank.config import load_config  # noqa: E402
from fedlowrank.methods import available_methods  # noqa: E402

# benchmark name -> (registered method, extra --set overrides)
VARIANTS = {"florg-noproc": ("florg", ["method.procrustes=false"])}
DEFAULT_METHODS = "florg,florg-noproc,fedit,federa,ffa-lora,fedsa-lora,fedex-lora"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="", help=f"comma-separated (default: {DEFAULT_METHODS})")
    p.add_argument("--rhos", default="0.5", help="Dirichlet concentrations ρ, comma-separated")
    p.add_argument("--ranks", default="4")
    p.add_argument("--seeds", default="0")
    p.add_argument("--clients", type=int, default=20, help="clients (all of them take part in every round)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--model", default="minilm", help="task.model (minilm or tiny-bert)")
    p.add_argument("--max-train", type=int, default=4000, help="AG News training examples used (0 = all)")
    p.add_argument("--max-test", type=int, default=2000, help="test examples evaluated (>= 2,000 for a reproduction)")
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--alpha", type=float, default=16.0, help="lora.alpha (s = α/r)")
    p.add_argument("--targets", default="0.8,0.85", help="accuracy targets of the communication table")
    p.add_argument("--set", action="append", default=[], help="extra config overrides, e.g. train.optimizer=sgd")
    p.add_argument("--out", default="", help="write every run's history as JSON lines here")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="tiny BERT, 4 clients, 2 rounds: checks the script runs")
    p.add_argument("--kernel-study", action="store_true",
                   help="only the server-step study (Gram sum, truncation error, drift) on random factors, k=64 r=4 N=8")
    p.add_argument("--server-cost", action="store_true",
                   help="only time the three server routes (eigh / stacked_svd / closed_form) per layer")
    sweep_options(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.clients, args.rounds, args.max_train, args.max_test = "tiny-bert", 4, 2, 200, 64
        args.max_length, args.local_steps, args.batch_size, args.lr, args.rhos, args.ranks = 16, 2, 8, 1e-3, "0.5", "2"
    args.methods = args.methods or ("florg,florg-noproc,fedit" if args.smoke else DEFAULT_METHODS)
    return args


def floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def config(args, method: str, rho: float, rank: int, seed: int):
    name, extra = VARIANTS.get(method, (method, []))
    sets = [f"method.name={name}", f"task.model={args.model}", "data.source=agnews",
            f"data.max_train_examples={args.max_train}", f"data.max_test_examples={args.max_test}",
            f"task.max_length={args.max_length}", f"partition.num_clients={args.clients}",
            f"partition.alpha={rho}", f"partition.min_partition_size={max(args.batch_size, 10)}",
            f"run.clients_per_round={args.clients}", f"run.rounds={args.rounds}", "run.eval_every=1",
            f"run.seed={seed}", f"run.threads={args.threads}", f"lora.rank={rank}", f"lora.alpha={args.alpha}",
            f"train.local_steps={args.local_steps}", f"train.batch_size={args.batch_size}", f"train.lr={args.lr}",
            "train.head_lr=0", "server.weighting=uniform", *extra, *args.set]
    return load_config("main", sets)


def head_bytes(task) -> int:
    """fp32 bytes of the head in one message (the ledger counts it in every message, both ways)."""
    return sum(p.numel() * p.element_size() for p in task.build_model().head_parameters().values())


def to_target(history: list[dict], target: float, head: int, clients: int) -> tuple[float, float] | None:
    """(total bytes, bytes without the head) up + down until the first round with accuracy ≥ target."""
    for row in history:
        if row.get("accuracy", -1.0) >= target:
            total = row["cum_bytes_up"] + row["cum_bytes_down"]
            return total, total - 2 * head * clients * row["round"]
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(provenance(argv))
    if args.server_cost:
        return server_cost(args)
    if args.kernel_study:
        return kernel_study()
    registered = available_methods()
    methods = [m for m in args.methods.split(",") if VARIANTS.get(m, (m,))[0] in registered]
    skipped = sorted(set(args.methods.split(",")) - set(methods))
    if skipped:
        print(f"not registered, skipped: {', '.join(skipped)}")
    targets = floats(args.targets)
    results: list[dict] = []
    grid = Grid(args)
    cells = [(rho, rank, seed, method) for rho in floats(args.rhos) for rank in (int(r) for r in args.ranks.split(","))
             for seed in (int(s) for s in args.seeds.split(",")) for method in methods]
    for rho, rank, seed, method in cells:
        grid.add(f"{method}-rho{rho:g}-r{rank}-seed{seed}", config(args, method, rho, rank, seed))
    out = open(args.out, "a") if args.out else None
    heads: dict[int, int] = {}  # seed → head bytes, with the setup line printed before its first run

    def done(i: int, outcome) -> None:
        rho, rank, seed, method = cells[i]
        cfg, summary = grid.runs[i].cfg, outcome.summary
        if seed not in heads:
            heads[seed] = head_bytes(grid.task(cfg))
            print(setup_line(cfg, grid.task(cfg)), flush=True)
        row = {"method": method, "rho": rho, "rank": rank, "seed": seed,
               "final": summary["accuracy"], "best": summary["best_accuracy"],
               "bytes": summary["bytes_up"] + summary["bytes_down"], "up": summary["bytes_up"],
               "head": heads[seed], "seconds": grid.seconds(outcome), "history": outcome.history}
        results.append(row)
        print(f"rho={rho} r={rank} seed={seed} {method:13s} final={row['final']:.4f} "
              f"best={row['best']:.4f} up={row['up']} up+down={row['bytes']} B "
              f"({row['seconds']:.0f}s, loadavg {os.getloadavg()[0]:.1f})", flush=True)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()

    grid.run(done)
    print_tables(results, methods, targets, args.clients)
    return 0


def kernel_study(k: int = 64, r: int = 4, N: int = 8, seed: int = 0) -> int:
    """Truncation error and drift of one server step vs the client spread ε (the Gram sum is exact, eq. 4, but the
    rank-r truncation that follows is not, and Procrustes, Theorem 1, keeps the drift small).

    ``Aᵗ ~ N(0, 1)^{r×k}``, ``Aₙ = Aᵗ + ε·N(0, 1)``, uniform weights. Printed: FLoRG's relative Gram error
    ``‖Gram(Aᵗ⁺¹) − Q‖/‖Q − AᵗᵀAᵗ‖``, the best rank-r eigen-truncation's, FedIT's relative aggregation error
    ``‖mean BₙAₙ − B̄Ā‖/‖mean BₙAₙ − BA‖`` (B ~ N(0,1)^{k×r} perturbed the same way), and the drift
    ``‖Aᵗ⁺¹ − Aᵗ‖`` with Procrustes, without (canonical rows), and ``‖mean Aₙ − Aᵗ‖``.
    """
    from fedlowrank.linalg.gram import aggregate_gram, gram_sum

    g = torch.Generator().manual_seed(seed)
    D = torch.float64
    print(f"k={k} r={r} N={N} seed={seed}")
    print(f"{'eps':>6s} {'florg_gram_err':>15s} {'best_rank_r':>12s} {'fedit_agg_err':>14s} "
          f"{'drift_procr':>12s} {'drift_canon':>12s} {'mean_update':>12s}")
    for eps in (1e-1, 1e-2, 1e-3):
        A = torch.randn(r, k, generator=g, dtype=D)
        B = torch.randn(k, r, generator=g, dtype=D)
        As = [A + eps * torch.randn(r, k, generator=g, dtype=D) for _ in range(N)]
        Bs = [B + eps * torch.randn(k, r, generator=g, dtype=D) for _ in range(N)]
        Q = gram_sum(As)
        A_next, _ = aggregate_gram(A, As, None, "eigh")
        A_canon, _ = aggregate_gram(A, As, None, "eigh", align=False)
        lam = torch.linalg.eigvalsh(Q).flip(0)
        denom = torch.linalg.norm(Q - A.T @ A)
        mean_prod = sum(b @ a for b, a in zip(Bs, As)) / N
        fedit = torch.linalg.norm(mean_prod - (sum(Bs) / N) @ (sum(As) / N)) / torch.linalg.norm(mean_prod - B @ A)
        print(f"{eps:>6g} {float(torch.linalg.norm(A_next.T @ A_next - Q) / denom):>15.3e} "
              f"{float(lam[r:].square().sum().sqrt() / denom):>12.3e} {float(fedit):>14.3e} "
              f"{float((A_next - A).norm()):>12.3e} {float((A_canon - A).norm()):>12.3e} "
              f"{float((sum(As) / N - A).norm()):>12.3e}")
    return 0


def server_cost(args) -> int:
    """Seconds per layer of one FLoRG server step by each route (the paper's Table 8), median of 5, float64."""
    from fedlowrank.linalg.gram import aggregate_gram

    g = torch.Generator().manual_seed(0)
    print("generator seed 0, float64, median of 5 runs")
    print("k     N   r   " + "".join(f"{d:>14s}" for d in ("eigh", "stacked_svd", "closed_form")))
    for k in (384, 768, 1024):
        for rank in (int(r) for r in args.ranks.split(",")):
            A = torch.randn(rank, k, generator=g, dtype=torch.float64) * 0.01
            As = [A + 1e-3 * torch.randn(rank, k, generator=g, dtype=torch.float64) for _ in range(args.clients)]
            w = [1.0 / args.clients] * args.clients
            line = f"{k:<5d} {args.clients:<3d} {rank:<3d} "
            for route in ("eigh", "stacked_svd", "closed_form"):
                seconds, _ = median_seconds(lambda route=route: aggregate_gram(A, As, w, route), 5)
                line += f"{seconds * 1e3:>11.2f} ms"
            print(line)
    return 0


def print_tables(results: list[dict], methods: list[str], targets: list[float], clients: int) -> None:
    cells = sorted({(r["rho"], r["rank"]) for r in results}, key=lambda c: (-c[0], c[1]))
    print("\nfinal accuracy, mean over seeds (best-round accuracy in brackets)")
    print("rho   r  " + "".join(f"{m:>18s}" for m in methods))
    for rho, rank in cells:
        line = f"{rho:<5g} {rank:<2d} "
        for m in methods:
            rows = [r for r in results if (r["rho"], r["rank"], r["method"]) == (rho, rank, m)]
            line += f"{np.mean([r['final'] for r in rows]):>10.4f} ({np.mean([r['best'] for r in rows]):.4f})"
        print(line)
    print("\nbytes up + down to reach the target accuracy (mean over seeds that reach it; n = seeds reaching)")
    for target in targets:
        for rho, rank in cells:
            line = f"target {target:g} rho={rho:g} r={rank}: "
            for m in methods:
                rows = [r for r in results if (r["rho"], r["rank"], r["method"]) == (rho, rank, m)]
                hits = [h for r in rows if (h := to_target(r["history"], target, r["head"], clients))]
                line += (f"{m} –  " if not hits else
                         f"{m} {np.mean([h[0] for h in hits]):.3g} (- head {np.mean([h[1] for h in hits]):.3g}, "
                         f"n={len(hits)})  ")
            print(line)


if __name__ == "__main__":
    sys.exit(run_resumable(main))

"""FedRPCA reproduction at CPU scale (arXiv:2506.01194, §5): AG News + MiniLM, accuracy, convergence speed
and the structure diagnostics, against the paper's baselines on the same budget.

Grid: clients × Dirichlet α × seed × method, every client in every round (paper §5), uniform client weights
(Eqs. 4, 10, 11), 1 local epoch of AdamW with weight decay 0.1 and a fresh optimizer per round (Table 5), LoRA
rank 4 on query/value. Methods (benchmark name → registered method and options):

    fedavg (fedit) · fedprox (μ) · scaffold · ta (task-arithmetic, β = 2) · ties (keep 0.1) · fedrpca (adaptive β)
    fedrpca+fedprox · fedrpca+scaffold (paper Fig. 5) · fedrpca-b2 / -b3 / -b4 (fixed β, Fig. 8)

Printed per run: final and best accuracy, R@90 = first round whose accuracy is ≥ 0.9 × the run's final accuracy (our
measure of "convergence speed", which the paper does not define; also rounds to ``--abs-target``), mean client-compute
and server (aggregation) seconds per round and their ratio; for FedRPCA the per-round means of E, β, ADMM iterations
and the cosine similarities of the columns of M, L and S (paper Figs. 1 and 4: cos L > cos M > cos S ≈ 0, E rising
over rounds). Then the table of final accuracy, mean ± std over seeds, FedRPCA's margin over the best baseline, and
R@90.

The CPU-scale grid whose results are in docs/methods/fedrpca.md (36 runs of about 110 s on one core):

    python benchmarks/repro_fedrpca.py --clients 20 --alphas 0.5,0.1 --seeds 0,1,2 --rounds 5 --max-train 0 \\
        --max-test 500 --max-length 32 --batch-size 8 --local-epochs 0 --lr 5e-3 --set train.local_steps=5

The full grid (many hours of MiniLM training on 2 cores; not run here):

    python benchmarks/repro_fedrpca.py --clients 20,50 --alphas 0.5,0.1 --seeds 0,1,2 --rounds 30 \\
        --methods fedavg,fedprox,scaffold,ta,ties,fedrpca

At α = 0.1 a Dirichlet draw over 20 or 50 clients leaves some client with fewer than ``--batch-size`` examples unless
the data are large: with 2,000 or 4,000 AG News examples no draw in 100 succeeds (seeds 0–2), with 8,000 only some
seeds do at 20 clients and none at 50. Use ``--max-train 0`` (all 10,001 examples of a local AG News copy:
docs/data.md) for α = 0.1, as ``fedlowrank compare agnews`` does; one local epoch then means hundreds of steps per
client.

A smoke run (seconds, tiny random BERT, 4 clients, 2 rounds):

    python benchmarks/repro_fedrpca.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import Grid, provenance, run_resumable, setup_line, sweep_options  # noqa: E402

from fedlowrank.config import load_config  # noqa: E402

BASELINES = ("fedavg", "fedprox", "scaffold", "ta", "ties")


PAPER_RPCA = ["method.name=fedrpca", "method.rpca_solver=admm"]  # the paper's Algorithm 2 (its iterates)


def variants(args) -> dict[str, list[str]]:
    """Benchmark name → ``--set`` overrides selecting the registered method and its options."""
    return {
        "fedavg": ["method.name=fedit"],
        "fedprox": ["method.name=fedprox", f"method.mu={args.prox_mu}"],
        "scaffold": ["method.name=scaffold"],
        "ta": ["method.name=task-arithmetic", f"method.beta={args.ta_beta}"],
        "ties": ["method.name=ties", f"method.keep_fraction={args.ties_keep}"],
        "fedrpca": [*PAPER_RPCA],
        "fedrpca+fedprox": [*PAPER_RPCA, "method.correction=fedprox", f"method.mu={args.prox_mu}"],
        "fedrpca+scaffold": [*PAPER_RPCA, "method.correction=scaffold"],
        **{f"fedrpca-b{b}": [*PAPER_RPCA, f"method.beta={b}"] for b in (2, 3, 4)},
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="fedavg,fedprox,scaffold,ta,ties,fedrpca")
    p.add_argument("--clients", default="20", help="numbers of clients, comma-separated (full grid: 20,50)")
    p.add_argument("--alphas", default="0.5", help="Dirichlet α, comma-separated (full grid: 0.5,0.1)")
    p.add_argument("--seeds", default="0", help="seeds, comma-separated (full grid: 0,1,2)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--model", default="minilm", help="task.model (minilm or tiny-bert)")
    p.add_argument("--max-train", type=int, default=2000, help="AG News training examples (0 = all)")
    p.add_argument("--max-test", type=int, default=2000, help="test examples evaluated (>= 2,000 for a reproduction)")
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--local-epochs", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--prox-mu", type=float, default=0.01, help="FedProx μ (paper's selected value)")
    p.add_argument("--ta-beta", type=float, default=2.0, help="Task Arithmetic β (paper's selected value)")
    p.add_argument("--ties-keep", type=float, default=0.1, help="TIES kept fraction s (paper's selected value)")
    p.add_argument("--abs-target", type=float, default=0.8, help="accuracy threshold of the rounds-to-target column")
    p.add_argument("--set", action="append", default=[], help="extra config overrides, e.g. train.max_grad_norm=1")
    p.add_argument("--out", default="", help="append every run's history as JSON lines here")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="tiny BERT, 4 clients, 2 rounds: checks that the script runs")
    sweep_options(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.clients, args.rounds, args.max_train, args.max_test = "tiny-bert", "4", 2, 200, 64
        args.max_length, args.batch_size, args.rank = 16, 8, 2
        args.methods = "fedavg,ta,fedrpca,fedrpca+scaffold"
    return args


def config(args, method: str, clients: int, alpha: float, seed: int):
    sets = [f"task.model={args.model}", "data.source=agnews", f"data.max_train_examples={args.max_train}",
            f"data.max_test_examples={args.max_test}", f"task.max_length={args.max_length}",
            f"partition.num_clients={clients}", f"partition.alpha={alpha}",
            f"partition.min_partition_size={args.batch_size}", f"run.clients_per_round={clients}",
            f"run.rounds={args.rounds}", "run.eval_every=1", f"run.seed={seed}", f"run.threads={args.threads}",
            f"lora.rank={args.rank}", f"lora.alpha={2.0 * args.rank}", f"train.local_epochs={args.local_epochs}",
            f"train.batch_size={args.batch_size}", f"train.lr={args.lr}", "train.head_lr=0",
            "train.optimizer=adamw", f"train.weight_decay={args.weight_decay}", "server.weighting=uniform",
            *variants(args)[method], *args.set]
    return load_config("main", sets)


def rounds_to(history: list[dict], threshold: float) -> int | None:
    """First round whose accuracy is ≥ threshold (None if never)."""
    return next((row["round"] for row in history if row.get("accuracy", -1.0) >= threshold), None)


def summarize_run(row: dict) -> str:
    hist = row["history"]
    client = np.mean([h["time"]["client_compute"] for h in hist])
    server = np.mean([h["time"]["aggregation"] for h in hist])
    line = (f"final={row['final']:.4f} best={row['best']:.4f} R@90={row['r90']} R@abs={row['rabs']} "
            f"client {client:.2f} s/round, server {server:.3f} s/round ({100 * server / client:.1f}%)")
    diags = [h["diagnostics"] for h in hist if "rpca/E_mean" in h.get("diagnostics", {})]
    if diags:
        def series(key: str) -> str:
            values = [d[key] for d in diags]
            picks = sorted({0, len(values) // 2, len(values) - 1})
            return "/".join(f"{values[i]:.3g}" for i in picks)
        line += (f"\n    rpca (first/middle/last round): E {series('rpca/E_mean')}  beta {series('rpca/beta_mean')}  "
                 f"iters {series('rpca/iterations_mean')}  cos M {series('rpca/cos_M_mean')}  "
                 f"cos L {series('rpca/cos_L_mean')}  cos S {series('rpca/cos_S_mean')}  "
                 f"nnz S {series('rpca/nnz_S_mean')}  not converged {sum(d['rpca/not_converged'] for d in diags):.0f}")
    return line


def print_table(results: list[dict], methods: list[str]) -> None:
    cells = sorted({(r["clients"], r["alpha"]) for r in results}, key=lambda c: (c[0], -c[1]))
    print("\nfinal accuracy, mean ± std over seeds [mean R@90 rounds]")
    print("clients alpha " + "".join(f"{m:>26s}" for m in methods) + "   fedrpca − best baseline")
    for clients, alpha in cells:
        line, means = f"{clients:<7d} {alpha:<5g} ", {}
        for m in methods:
            rows = [r for r in results if (r["clients"], r["alpha"], r["method"]) == (clients, alpha, m)]
            if not rows:
                line += f"{'–':>26s}"
                continue
            acc = [r["final"] for r in rows]
            r90 = [r["r90"] for r in rows if r["r90"] is not None]
            means[m] = float(np.mean(acc))
            line += f"{np.mean(acc):>12.4f} ± {np.std(acc):.4f} [{np.mean(r90) if r90 else float('nan'):4.1f}]"
        base = [v for m, v in means.items() if m in BASELINES]
        if "fedrpca" in means and base:
            line += f"   {means['fedrpca'] - max(base):+.4f}"
        print(line)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(provenance(argv))
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(variants(args)))
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; allowed: {', '.join(variants(args))}")
    results: list[dict] = []
    grid = Grid(args)
    cells = [(clients, alpha, seed, method) for clients in (int(c) for c in args.clients.split(","))
             for alpha in (float(a) for a in args.alphas.split(",")) for seed in (int(s) for s in args.seeds.split(","))
             for method in methods]
    for clients, alpha, seed, method in cells:
        grid.add(f"{method}-clients{clients}-alpha{alpha:g}-seed{seed}", config(args, method, clients, alpha, seed))
    out = open(args.out, "a") if args.out else None
    seen: set[int] = set()  # the seeds whose setup line is printed, before their first run

    def done(i: int, outcome) -> None:
        clients, alpha, seed, method = cells[i]
        cfg, summary, history = grid.runs[i].cfg, outcome.summary, outcome.history
        if seed not in seen:
            seen.add(seed)
            print(setup_line(cfg, grid.task(cfg)), flush=True)
        row = {"method": method, "clients": clients, "alpha": alpha, "seed": seed,
               "final": summary["accuracy"], "best": summary["best_accuracy"],
               "seconds": grid.seconds(outcome), "history": history}
        row["r90"] = rounds_to(history, 0.9 * row["final"])
        row["rabs"] = rounds_to(history, args.abs_target)
        results.append(row)
        print(f"clients={clients} alpha={alpha} seed={seed} {method:17s} {summarize_run(row)} "
              f"({row['seconds']:.0f}s, loadavg {os.getloadavg()[0]:.1f})", flush=True)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()

    grid.run(done)
    print_table(results, methods)
    return 0


if __name__ == "__main__":
    sys.exit(run_resumable(main))

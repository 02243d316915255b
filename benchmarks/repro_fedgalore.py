"""FedGaLore reproduction at CPU scale (arXiv:2602.01746, Table 3 and Fig. 1): the IID → non-IID drop.

Grid: data source × partition (IID and Dirichlet α) × seed × method, MiniLM on AG News (or BBC News), M clients
with K per round. The paper's claim: FedGaLore's drop Δ = acc(IID) − acc(non-IID) is close to FedAvg-Full's and
well below the LoRA baselines'; FedGaLore- (no state sync) degrades more under heterogeneity. Prints a row per
run (final and best accuracy, bytes up per client-round, seconds), then per source × α: IID, non-IID and Δ per
method as mean ± std over seeds (Δ computed per seed).

Learning rates (the paper "matches" one rate, which SGD baselines cannot train at): FFT-like ``--lr-full`` for
fedavg-full and FedGaLore(-), ``--lr-lora`` for the LoRA methods; ``--method-set METHOD:section.key=value`` adds
per-method overrides (e.g. ``--method-set ffa-lora:train.optimizer=sgd --method-set ffa-lora:train.lr=0.03`` for
Table 1's SGD).
Registered names: fedavg-full fedit ffa-lora flora lora-fair fr-lora fedgalore-minus fedgalore (absent ones are
skipped with a note).

The CPU-scale grid whose results are in docs/methods/fedgalore.md (42 runs of 50–65 s on one core):

    python benchmarks/repro_fedgalore.py --sources agnews --alphas 0.5 --seeds 0,1,2 --clients 20 --per-round 5 \\
        --rounds 6 --max-train 0 --max-test 500 --max-length 32 --batch-size 8 --local-epochs 0 --local-steps 5 \\
        --lr-full 1e-4 --lr-lora 5e-3 --head-lr 1e-2 \\
        --methods fedavg-full,fedit,ffa-lora,flora,lora-fair,fedgalore-minus,fedgalore

The full grid (many hours on 2 cores; NOT run here):

    python benchmarks/repro_fedgalore.py --sources agnews,bbc-news --alphas 0.5,0.1 --seeds 0,1,2 \\
        --clients 20 --per-round 5 --rounds 20 --local-epochs 2

A smoke run (seconds, tiny random BERT, 2 rounds):

    python benchmarks/repro_fedgalore.py --smoke

``--toy``: the state-synchronisation ablation (App. F: state_sync ∈ {none, avg, avg_svd, ajive},
both init modes, both ṽ re-projection rules) on the project's synthetic federated matrix regression
(``task.kind = matrix-regression``: X [100 × 10], i.e. one 10×100 left block, feature-mean heterogeneity ``het``;
metric ‖X − X*‖/‖X*‖), in about a minute:

    python benchmarks/repro_fedgalore.py --toy --seeds 0,1,2
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

from fedlowrank.config import from_dict, load_config  # noqa: E402
from fedlowrank.methods import available_methods  # noqa: E402

DEFAULT_METHODS = "fedavg-full,fedit,ffa-lora,flora,lora-fair,fr-lora,fedgalore-minus,fedgalore"
FULL_LR_METHODS = ("fedavg-full", "fedgalore", "fedgalore-minus")
SOURCES = {"agnews": ["data.source=agnews"], "bbc-news": ["data.source=bbc-news"]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default=DEFAULT_METHODS)
    p.add_argument("--sources", default="agnews", help="agnews and/or bbc-news")
    p.add_argument("--alphas", default="0.5", help="Dirichlet α of the non-IID runs (IID is always run)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--per-round", type=int, default=5)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--model", default="minilm", help="task.model (minilm or tiny-bert)")
    p.add_argument("--max-train", type=int, default=4000, help="training examples used (0 = all)")
    p.add_argument("--max-test", type=int, default=2000, help="test examples evaluated (>= 2,000 for a reproduction)")
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--local-epochs", type=float, default=2.0, help="local epochs (0 = use --local-steps)")
    p.add_argument("--local-steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--lr-full", type=float, default=1e-4, help="lr of fedavg-full and FedGaLore(-)")
    p.add_argument("--lr-lora", type=float, default=1e-3, help="lr of the LoRA methods")
    p.add_argument("--head-lr", type=float, default=3e-3)
    p.add_argument("--method-set", action="append", default=[], help="METHOD:section.key=value")
    p.add_argument("--set", action="append", default=[], help="overrides for every run")
    p.add_argument("--out", default="", help="append every run (with its history) as JSON lines here")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="tiny BERT, 4 clients, 2 rounds: checks the script runs")
    p.add_argument("--toy", action="store_true", help="state-sync ablation on the synthetic matrix regression")
    p.add_argument("--toy-het", default="0,2", help="feature-mean heterogeneity of the toy clients")
    p.add_argument("--toy-rounds", type=int, default=30)
    p.add_argument("--toy-lr", type=float, default=0.01)
    sweep_options(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.clients, args.per_round, args.rounds, args.max_train, args.max_test = "tiny-bert", 4, 2, 2, 200, 64
        args.max_length, args.local_epochs, args.local_steps, args.batch_size, args.rank = 16, 0, 4, 8, 2
        args.seeds, args.methods = "0", "fedavg-full,fr-lora,fedgalore-minus,fedgalore"
    return args


def config(args, source: str, alpha: float | None, method: str, seed: int):
    lr = args.lr_full if method in FULL_LR_METHODS else args.lr_lora
    part = ["partition.kind=iid"] if alpha is None else ["partition.kind=dirichlet", f"partition.alpha={alpha}"]
    sets = [f"method.name={method}", f"task.model={args.model}", *SOURCES[source],
            f"data.max_train_examples={args.max_train}", f"data.max_test_examples={args.max_test}",
            f"task.max_length={args.max_length}", f"partition.num_clients={args.clients}", *part,
            f"partition.min_partition_size={args.batch_size}", f"run.clients_per_round={args.per_round}",
            f"run.rounds={args.rounds}", "run.eval_every=1", f"run.seed={seed}", f"run.threads={args.threads}",
            f"lora.rank={args.rank}", f"lora.alpha={args.lora_alpha}", f"train.local_epochs={args.local_epochs}",
            f"train.local_steps={args.local_steps}", f"train.batch_size={args.batch_size}", f"train.lr={lr}",
            f"train.head_lr={args.head_lr}", "train.max_grad_norm=1.0", *args.set]
    sets += [s.split(":", 1)[1] for s in args.method_set if s.split(":", 1)[0] == method]
    return load_config("main", sets)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(provenance(argv))
    if args.toy:
        return toy(args)
    registered = available_methods()
    methods = [m for m in args.methods.split(",") if m in registered]
    skipped = sorted(set(args.methods.split(",")) - set(methods))
    if skipped:
        print(f"not registered, skipped: {', '.join(skipped)}")
    alphas: list[float | None] = [None] + [float(a) for a in args.alphas.split(",") if a]
    out = open(args.out, "a") if args.out else None
    results = []
    grid = Grid(args)
    cells = [(source, seed, alpha, method) for source in args.sources.split(",")
             for seed in (int(s) for s in args.seeds.split(",")) for alpha in alphas for method in methods]
    for source, seed, alpha, method in cells:
        part = "iid" if alpha is None else f"dir{alpha:g}"
        grid.add(f"{source}-{part}-{method}-seed{seed}", config(args, source, alpha, method, seed))
    seen: set[tuple[str, int]] = set()  # (source, seed) whose setup line is printed, before their first run

    def done(i: int, outcome) -> None:
        source, seed, alpha, method = cells[i]
        cfg, summary = grid.runs[i].cfg, outcome.summary
        if (source, seed) not in seen:
            seen.add((source, seed))
            print(setup_line(cfg, grid.task(cfg)), flush=True)
        client_rounds = args.per_round * summary["rounds"]
        row = {"source": source, "alpha": alpha, "seed": seed, "method": method,
               "final": summary["accuracy"], "best": summary.get("best_accuracy", float("nan")),
               "up_per_client_round": summary["bytes_up"] / client_rounds,
               "down_per_client_round": summary["bytes_down"] / client_rounds,
               "seconds": grid.seconds(outcome)}
        results.append(row)
        part = "iid" if alpha is None else f"dir{alpha:g}"
        print(f"{source} {part:7s} seed={seed} {method:16s} final={row['final']:.4f} best={row['best']:.4f} "
              f"up/client-round={row['up_per_client_round'] / 1e6:.3f}MB ({row['seconds']:.0f}s, "
              f"loadavg {os.getloadavg()[0]:.1f})", flush=True)
        if out:
            out.write(json.dumps({**row, "history": outcome.history}) + "\n")
            out.flush()

    grid.run(done)
    print_table(results, methods, alphas[1:])
    return 0


TOY_VARIANTS = {  # label -> method options
    "fedavg-full": {"name": "fedavg-full"},
    "fedgalore-minus": {"name": "fedgalore-minus"},
    "sync=avg": {"name": "fedgalore", "state_sync": "avg"},
    "sync=avg_svd(r/2)": {"name": "fedgalore", "state_sync": "avg_svd", "sync_rank": 2},
    "sync=ajive (fedgalore)": {"name": "fedgalore"},
    "sync=avg, init=svd": {"name": "fedgalore", "state_sync": "avg", "init_mode": "svd"},
    "sync=ajive, init=svd": {"name": "fedgalore", "init_mode": "svd"},
    "fedgalore-minus, v linear": {"name": "fedgalore-minus", "v_reproject": "linear"},
    "fedgalore, v linear": {"name": "fedgalore", "v_reproject": "linear"},
}


def toy(args) -> int:
    """Final relative error of each variant, mean ± std over seeds, per heterogeneity level."""
    hets = [float(h) for h in args.toy_het.split(",")]
    print(f"matrix regression: 20 clients, 5 per round, {args.toy_rounds} rounds, 20 local AdamW steps of batch 10, "
          f"lr {args.toy_lr}, r = 4, α_g = 1 (scale), weights uniform")
    print(f"{'variant':28s}" + "".join(f"{f'het={h:g}':>22s}" for h in hets))
    grid = Grid(args, metric="rel_error")
    seeds = [int(s) for s in args.seeds.split(",")]
    cells = [(label, het, seed) for label in TOY_VARIANTS for het in hets for seed in seeds]
    for label, het, seed in cells:
        method = TOY_VARIANTS[label]
        options = dict(method) if method["name"] == "fedavg-full" else {**method, "scale": 1.0}
        grid.add(f"toy-{label}-het{het:g}-seed{seed}", from_dict({
            "run": {"rounds": args.toy_rounds, "clients_per_round": 5, "eval_every": args.toy_rounds,
                    "seed": seed, "threads": args.threads},
            "task": {"kind": "matrix-regression", "options": {"het": het, "dtype": "float32"}},
            "partition": {"kind": "natural", "num_clients": 20},
            "train": {"optimizer": "adamw", "lr": args.toy_lr, "local_steps": 20, "batch_size": 10},
            "server": {"weighting": "uniform"}, "lora": {"rank": 4}, "method": options}))
    errs: dict[str, list[float]] = {}

    def done(i: int, outcome) -> None:
        label, het, seed = cells[i]
        errs.setdefault(label, []).append(outcome.summary.get("rel_error", float("nan")))
        if len(errs[label]) == len(hets) * len(seeds):  # the variant's last run: its line
            per_het = np.reshape(errs[label], (len(hets), len(seeds)))
            print(f"{label:28s}" + "".join(f"{np.mean(e):>13.3g} ± {np.std(e):<6.2g}" for e in per_het), flush=True)

    grid.run(done)
    return 0


def _ms(xs) -> str:
    return f"{100 * np.mean(xs):5.1f} ± {100 * np.std(xs):4.1f}" if xs else "   –"


def print_table(results: list[dict], methods: list[str], alphas: list[float]) -> None:
    for source in sorted({r["source"] for r in results}):
        for alpha in alphas:
            print(f"\n{source}, final accuracy % (mean ± std over seeds): IID, Dirichlet α={alpha:g}, Δ = IID − non-IID")
            print(f"{'method':16s} {'IID':>13s} {'non-IID':>13s} {'Δ':>13s}")
            for m in methods:
                iid = {r["seed"]: r["final"] for r in results if (r["source"], r["alpha"], r["method"]) == (source, None, m)}
                non = {r["seed"]: r["final"] for r in results if (r["source"], r["alpha"], r["method"]) == (source, alpha, m)}
                delta = [iid[s] - non[s] for s in iid if s in non]
                print(f"{m:16s} {_ms(list(iid.values())):>13s} {_ms(list(non.values())):>13s} {_ms(delta):>13s}")


if __name__ == "__main__":
    sys.exit(run_resumable(main))

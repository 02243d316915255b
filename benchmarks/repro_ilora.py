"""Reproduction grid of the ILoRA paper's text-classification claims at CPU scale (arXiv:2511.16069, §6.4).

Grid (every axis is an option): datasets {agnews, bbc-news} × client-rank sets {2,4,8} and {2,8,16} (dealt
round-robin, server rank = max) × Dirichlet α {1.0, 0.5, 0.1} × seeds {0,1,2} × methods. Defaults follow the
spec's CPU recommendations: MiniLM-L6, 3 clients, full participation, T = 5 rounds, E = 1 local epoch, AdamW,
max length 64, evaluation of the global model after every round; reported per cell: mean ± std over seeds of
the peak accuracy over rounds (the paper's NLP metric) and of the final accuracy.

A method is ``name`` or ``name:opt=value,opt=value`` (e.g. ``ilora:hetero_base=residual``); names that are not
registered are listed and skipped. The paper predicts ILoRA ≫ FedIT+QR (+5 to +15 points), ILoRA-S ≥ ILoRA, and
the gap growing as α falls.

The CPU-scale grid whose results are in docs/methods/ilora.md (≈ 77 s per run on one core)::

    .venv/bin/python benchmarks/repro_ilora.py --datasets agnews --rank-sets 2-4-8 --alphas 1.0,0.5,0.1 \\
        --seeds 0,1,2 --clients 3 --rounds 5 --local-epochs 1 --batch-size 8 --max-train 480 --max-test 500 \\
        --set task.max_length=32

Full grid (about 288 MiniLM runs of several minutes each: days on 2 shared cores; run it on a quiet machine)::

    .venv/bin/python benchmarks/repro_ilora.py --out runs/repro_ilora.jsonl

Smoke version (tiny random BERT, seconds; checks that the script and every method run, not the paper)::

    .venv/bin/python benchmarks/repro_ilora.py --smoke

Server-side cost of the aggregation (factored QR of the concatenation vs the dense QR of Σ p_k B_k A_k) on
MiniLM's shapes (12 target matrices of 384×384), no training::

    .venv/bin/python benchmarks/repro_ilora.py --aggregation-timing --rank-sets 2-4-8,2-8-16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import Grid, median_seconds, provenance, run_resumable, setup_line, sweep_options  # noqa: E402

from fedlowrank.config import load_config  # noqa: E402
from fedlowrank.linalg.lowrank import factored_basis, normalize_qr_signs, stack_factors  # noqa: E402
from fedlowrank.methods import available_methods  # noqa: E402

DEFAULT_METHODS = "ilora,ilora-s,fedit-qr,hetlora,flora,flexlora,ffa-lora,lora-fair"


def parse_method(token: str) -> tuple[str, str, list[str]]:
    """``"ilora:hetero_base=residual"`` → (label, name, ["method.hetero_base=residual"])."""
    name, _, opts = token.partition(":")
    sets = [f"method.{kv}" for kv in opts.split(",") if kv]
    return token, name, sets


def mean_std(xs: list[float]) -> str:
    if not xs:
        return "—"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{100 * statistics.mean(xs):.2f} ± {100 * sd:.2f}"


def aggregation_timing(rank_sets: list[list[int]], dim: int = 384, modules: int = 12, repeats: int = 5) -> None:
    """Median wall time of one server aggregation (all modules): factored vs dense QR, and their difference."""
    g = torch.Generator().manual_seed(0)
    for ranks in rank_sets:
        Bs = [[torch.randn(dim, r, generator=g) for r in ranks] for _ in range(modules)]
        As = [[torch.randn(r, dim, generator=g) for r in ranks] for _ in range(modules)]
        p = torch.full((len(ranks),), 1.0 / len(ranks), dtype=torch.float64)

        def factored():
            return [factored_basis(*stack_factors(b, a, p), "qr") for b, a in zip(Bs, As)]

        def dense():
            out = []
            for b, a in zip(Bs, As):
                B_c, A_c = stack_factors(b, a, p)
                out.append(normalize_qr_signs(*torch.linalg.qr(B_c @ A_c)))
            return out

        times = {name: median_seconds(fn, repeats) for name, fn in (("factored", factored), ("dense", dense))}
        R_t = sum(ranks)
        diff = max(float((qf[:, :R_t] - qd[:, :R_t]).abs().max()) for (qf, _), (qd, _) in
                   zip(times["factored"][1], times["dense"][1]))
        print(f"ranks {ranks}: {modules} modules {dim}x{dim}: factored {1e3 * times['factored'][0]:.2f} ms, "
              f"dense {1e3 * times['dense'][0]:.2f} ms (median of {repeats}); max |Q_factored - Q_dense| over the "
              f"first {R_t} columns = {diff:.1e}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--datasets", default="agnews,bbc-news", help="comma list of data.source values")
    ap.add_argument("--rank-sets", default="2-4-8,2-8-16", help="comma list of client-rank sets, ranks joined by '-'")
    ap.add_argument("--alphas", default="1.0,0.5,0.1", help="Dirichlet α values")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--local-epochs", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3, help="paper: 1e-4 (RoBERTa, 5 rounds); MiniLM needs more")
    ap.add_argument("--head-lr", type=float, default=3e-3)
    ap.add_argument("--lora-alpha", type=float, default=16.0)
    ap.add_argument("--lora-dropout", type=float, default=0.1)
    ap.add_argument("--max-train", type=int, default=3000, help="training examples kept (0 = all)")
    ap.add_argument("--max-test", type=int, default=2000, help="test examples evaluated (>= 2,000 for a reproduction)")
    ap.add_argument("--model", default="minilm")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], help="extra config overrides section.key=value")
    ap.add_argument("--out", default="", help="append one JSON line per run to this file")
    ap.add_argument("--aggregation-timing", action="store_true", help="time the server aggregation only")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny random BERT, agnews, ranks 1-2-3, α 0.5, 1 seed, 2 rounds, 2 local steps")
    sweep_options(ap)
    args = ap.parse_args(argv)

    base = "main"
    if args.smoke:
        base = "tiny"
        args.datasets, args.rank_sets, args.alphas, args.seeds = "agnews", "1-2-3", "0.5", "0"
        args.rounds, args.model, args.max_train, args.max_test = 2, "tiny-bert", 200, 64
    torch.set_num_threads(args.threads)
    registered = available_methods()
    methods = [parse_method(t) for t in args.methods.split(",") if t]
    missing = sorted({name for _, name, _ in methods if name not in registered})
    methods = [m for m in methods if m[1] in registered]
    print(provenance())
    if args.aggregation_timing:
        aggregation_timing([[int(r) for r in rs.split("-")] for rs in args.rank_sets.split(",")])
        return 0
    if missing:
        print(f"not registered, skipped: {', '.join(missing)}")

    results: dict[tuple, dict[str, list[float]]] = {}
    grid = Grid(args)
    cells = [(dataset, rank_set, alpha, seed, label) for dataset in args.datasets.split(",")
             for rank_set in args.rank_sets.split(",") for alpha in [float(a) for a in args.alphas.split(",")]
             for seed in [int(s) for s in args.seeds.split(",")] for label, _, _ in methods]
    msets = {label: [f"method.name={name}", *sets] for label, name, sets in methods}
    for dataset, rank_set, alpha, seed, label in cells:
        ranks = [int(r) for r in rank_set.split("-")]
        sets = [*msets[label], f"run.seed={seed}", f"run.rounds={args.rounds}", "run.eval_every=1",
                f"run.clients_per_round={args.clients}", f"run.threads={args.threads}",
                f"task.model={args.model}", "task.max_length=64", f"data.source={dataset}",
                f"data.max_train_examples={args.max_train}", f"data.max_test_examples={args.max_test}",
                f"partition.num_clients={args.clients}", f"partition.alpha={alpha}",
                f"lora.ranks={ranks}", f"lora.alpha={args.lora_alpha}", f"lora.dropout={args.lora_dropout}",
                "train.optimizer=adamw", f"train.lr={args.lr}", f"train.head_lr={args.head_lr}",
                f"train.batch_size={args.batch_size}", *args.set]
        if args.smoke:
            sets += ["train.local_steps=2", "partition.min_partition_size=5"]
        else:
            sets += [f"train.local_epochs={args.local_epochs}"]
        grid.add(f"{dataset}-ranks{rank_set}-alpha{alpha:g}-seed{seed}-{label}", load_config(base, sets))
    seen: set[tuple] = set()  # (dataset, seed) whose setup line is printed, before their first run

    def done(i: int, outcome) -> None:
        dataset, rank_set, alpha, seed, label = cells[i]
        cfg, summary, history = grid.runs[i].cfg, outcome.summary, outcome.history
        if (dataset, seed) not in seen:
            seen.add((dataset, seed))
            print(setup_line(cfg, grid.task(cfg)), flush=True)
        accs = [r["accuracy"] for r in history if "accuracy" in r]
        row = {"dataset": dataset, "ranks": [int(r) for r in rank_set.split("-")], "alpha": alpha, "seed": seed,
               "method": label, "peak": max(accs), "final": accs[-1], "accuracy": accs,
               "bytes_up": summary["bytes_up"], "bytes_down": summary["bytes_down"],
               "diagnostics": [r.get("diagnostics", {}) for r in history],
               "seconds": grid.seconds(outcome), "loadavg": os.getloadavg()}
        print(json.dumps({k: row[k] for k in ("dataset", "ranks", "alpha", "seed", "method", "peak", "final",
                                              "seconds")}), flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(row) + "\n")
        cell = results.setdefault((dataset, rank_set, alpha, label), {"peak": [], "final": []})
        cell["peak"].append(row["peak"])
        cell["final"].append(row["final"])

    grid.run(done)

    print(f"\nseeds {args.seeds}; accuracy % of the global model, mean ± std over seeds; loadavg at end {os.getloadavg()}")
    print("| dataset | ranks | α | method | peak | final |\n|---|---|---|---|---|---|")
    for (dataset, rank_set, alpha, label), cell in results.items():
        print(f"| {dataset} | {rank_set} | {alpha} | {label} | {mean_std(cell['peak'])} | {mean_std(cell['final'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(run_resumable(main))

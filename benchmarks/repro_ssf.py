"""Reproduction of the SSF paper's federated matrix-regression study (Tables 2–4, Figures 1–3, LR search) and,
optionally, SSF on a network (AG News, MiniLM, Dirichlet α = 0.1).

Grid (paper §5.1, Table 1): het ∈ {0.1, 0.5, 2.0}; r ∈ {1, 5, 10, 20, 50}; T = 25,000; S = 10 of N = 20;
K = 5; b = 20; η_g = 1; x⁰ = 0; FedSub refresh every 5 rounds; data seed 0 for every run (X* shared); run
seeds vary client sampling, minibatches and projectors. Methods: Full-SCAFFOLD (``fedavg-full``,
correction = scaffold), Full-FedAvg (``fedavg-full``), SSF (``ssf``), FedSub (``fedsub``), all through
the vectorised runner (``run.vectorized = true``; ``fedavg-full`` needs its ``batched_round`` hook), one run
after another or in ``--jobs`` worker processes (``--runs-dir``, ``--resume``: ``fedlowrank.experiments.sweep``).

Everything the paper's tables need, with 3 seeds (24 runs of 25,000 rounds per seed, 30–60 s each on one core:
about 20 minutes per seed; results in docs/methods/ssf.md):

    .venv/bin/python benchmarks/repro_ssf.py --lr-search --seeds 0,1,2 --plots

A reduced run, e.g. Table 2 at het 0.1/0.5 with T = 5,000 and one seed:

    .venv/bin/python benchmarks/repro_ssf.py --lr-search --het 0.1,0.5 --tables 2 --rounds 5000 --seeds 0

A paired verdict in one cell (each method's η_l tuned on 3 seeds apart from the compared ones, then 64 paired
seeds at the tuned rates; the signed-rank test, bootstrap interval and an equivalence margin on RelErr ratios):

    .venv/bin/python benchmarks/repro_ssf.py --decide ssf,fedsub --het 0.5 --ranks 20 --rounds 2000 \
        --decide-grid 1e-3,3e-3,1e-2,3e-2 --tune-seeds 100,101,102 --seeds 0-63

Network part (many MiniLM rounds; not CPU-cheap):

    .venv/bin/python benchmarks/repro_ssf.py --network --network-rounds 50
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import Grid, provenance, run_resumable, sweep_options  # noqa: E402

from fedlowrank.config import from_dict, load_config  # noqa: E402
from fedlowrank.experiments.stats import (bootstrap_interval, mean_interval, median, rank_verdict,  # noqa: E402
                                          wilcoxon_signed_rank, wins_losses)

FULL = {"scaffold": {"name": "fedavg-full", "correction": "scaffold"}, "fedavg": {"name": "fedavg-full"}}
SUB = {"ssf": {"name": "ssf"}, "fedsub": {"name": "fedsub", "refresh_every": 5}}
PAPER_LR = {0.1: 1e-2, 0.5: 1e-2, 2.0: 1e-3}
LR_GRID = (1e-4, 1e-3, 1e-2, 1e-1)
NAN = float("nan")
# paper's final RelErr at T = 25,000 (Tables 2, 3, 4): (het, r) -> method -> value
PAPER = {
    (0.1, 20): {"scaffold": 6.9726e-3, "fedavg": 9.1265e-3, "ssf": 7.5535e-3, "fedsub": 1.1295e-2},
    (0.5, 20): {"scaffold": 6.4701e-3, "fedavg": 1.1197e-2, "ssf": 8.2431e-3, "fedsub": 1.0556e-2},
    (2.0, 20): {"scaffold": 2.0831e-3, "fedavg": 3.8143e-3, "ssf": 3.4495e-3, "fedsub": 6.0512e-3},
    (2.0, 1): {"scaffold": 2.12e-3, "fedavg": 3.65e-3, "ssf": 2.82e-1, "fedsub": 2.81e-1},
    (2.0, 5): {"scaffold": 2.03e-3, "fedavg": 3.71e-3, "ssf": 7.81e-3, "fedsub": 6.76e-3},
    (2.0, 10): {"scaffold": 2.06e-3, "fedavg": 3.89e-3, "ssf": 3.74e-3, "fedsub": 4.32e-3},
    (2.0, 50): {"scaffold": 2.08e-3, "fedavg": 3.87e-3, "ssf": 3.03e-3, "fedsub": NAN},
    (0.1, 50): {"scaffold": 7.27e-3, "fedavg": 8.25e-3, "ssf": 7.69e-3, "fedsub": NAN},
    (0.5, 50): {"scaffold": 7.00e-3, "fedavg": 1.04e-2, "ssf": 8.70e-3, "fedsub": NAN},
}


def toy_config(method: dict, het: float, rank: int, lr: float, rounds: int, seed: int, data_seed: int,
               eval_every: int) -> object:
    return from_dict({
        "run": {"rounds": rounds, "clients_per_round": 10, "eval_every": eval_every, "seed": seed, "threads": 1,
                "stop_metric": "rel_error", "stop_above": 1e6, "vectorized": True},
        "task": {"kind": "matrix-regression", "options": {"het": het, "data_seed": data_seed}},
        "partition": {"kind": "natural", "num_clients": 20},
        "train": {"optimizer": "sgd", "lr": lr, "local_steps": 5, "batch_size": 20},
        "server": {"weighting": "uniform", "lr": 1.0},
        "lora": {"rank": rank}, "method": dict(method)})


def final_error(outcome) -> float:
    """Final RelErr; NaN when the run diverged (as the paper's "NaN (diverged)" entries)."""
    return NAN if "diverged_at" in outcome.summary else float(outcome.history[-1]["rel_error"])


def lr_search(args, log) -> dict[float, float]:
    """Full-SCAFFOLD, RelErr after ``search_rounds``; diverged = +inf; ties toward the smaller step (the paper does
    not say)."""
    grid = Grid(args, metric="rel_error")
    for het in args.het:
        for lr in LR_GRID:
            grid.add(f"lr-search-het{het:g}-lr{lr:g}", toy_config(FULL["scaffold"], het, 20, lr, args.search_rounds,
                                                                  args.seeds[0], args.data_seed, args.search_rounds))
    chosen, scores = {}, {}

    def done(i: int, outcome) -> None:
        het, lr = args.het[i // len(LR_GRID)], LR_GRID[i % len(LR_GRID)]
        err = final_error(outcome)
        scores[lr] = math.inf if not math.isfinite(err) else err
        log({"kind": "lr-search", "het": het, "lr": lr, "rel_error": err, "seconds": grid.seconds(outcome)})
        if lr == LR_GRID[-1]:
            chosen[het] = min(LR_GRID, key=lambda lr: (scores[lr], lr))
            print(f"LR search het={het}: " + " ".join(f"{lr:g}:{scores[lr]:.3g}" for lr in LR_GRID)
                  + f" -> {chosen[het]:g} (paper {PAPER_LR[het]:g})", flush=True)

    grid.run(done)
    return chosen


def cells(args) -> list[tuple[float, int]]:
    """The (het, r) cells of the requested tables."""
    out: list[tuple[float, int]] = []
    for table in args.tables:
        if table == 2:
            out += [(het, 20) for het in args.het]
        elif table == 3:
            out += [(2.0, r) for r in args.ranks if 2.0 in args.het]
        elif table == 4:
            out += [(het, 50) for het in args.het]
    return sorted(set(out))


def run_grid(args, lrs, log) -> dict:
    """``results[(het, r, method)] = [final RelErr per seed]`` and ``curves[(het, r, method)]`` (seed 0)."""
    results: dict = {}
    curves: dict = {}
    todo = []
    for het, r in cells(args):
        todo += [(het, 0, m) for m in FULL] + [(het, r, m) for m in SUB]
    todo = sorted((t for t in set(todo) if t[2] in args.methods), key=lambda t: (t[0], t[1], t[2]))
    runs = [(seed, het, r, name) for seed in args.seeds for het, r, name in todo]
    grid = Grid(args, metric="rel_error")
    for seed, het, r, name in runs:
        grid.add(f"het{het:g}-r{r}-{name}-seed{seed}", toy_config(FULL.get(name) or SUB[name], het, max(r, 1),
                                                                 lrs[het], args.rounds, seed, args.data_seed,
                                                                 args.eval_every))

    def done(i: int, outcome) -> None:
        seed, het, r, name = runs[i]
        err, rounds, seconds = final_error(outcome), outcome.summary["rounds"], grid.seconds(outcome)
        results.setdefault((het, r, name), []).append(err)
        if seed == args.seeds[0]:
            curves[(het, r, name)] = [(row["round"], row["rel_error"]) for row in outcome.history]
        log({"kind": "run", "het": het, "r": r, "method": name, "seed": seed, "lr": lrs[het], "rounds": rounds,
             "rel_error": err, "diverged_at": outcome.summary.get("diverged_at"), "seconds": seconds})
        print(f"seed={seed} het={het} r={r or '-'} {name:8s} final RelErr={err:.4e} "
              f"({rounds} rounds, {seconds:.1f}s, load {os.getloadavg()[0]:.1f})", flush=True)

    grid.run(done)
    return {"results": results, "curves": curves}


def cell(results, het, r, name) -> float:
    vals = results.get((het, 0 if name in FULL else r, name), [])
    return float(np.mean(vals)) if vals else NAN


def fmt(vals) -> str:
    if not vals:
        return "-"
    m = np.mean(vals)
    return f"{m:.3e}" + (f"±{np.std(vals):.1e}" if len(vals) > 1 else "")


def report(args, grid) -> None:
    results = grid["results"]
    names = list(FULL) + list(SUB)
    print("\n| het | r | " + " | ".join(f"{n} (ours) | {n} (paper) | ratio" for n in names) + " |")
    print("|---|---|" + "---|---|---|" * len(names))
    for het, r in cells(args):
        row = []
        for n in names:
            vals = results.get((het, 0 if n in FULL else r, n), [])
            paper = PAPER.get((het, r), {}).get(n, NAN)
            row.append(f"{fmt(vals)} | {paper:.3e} | {np.mean(vals) / paper:.2f}" if vals else "- | - | -")
        print(f"| {het} | {r} | " + " | ".join(row) + " |")

    print("\nOrderings (the paper's §5.2):")

    def check(label, ok) -> None:
        print(f"  [{'holds' if ok else 'FAILS'}] {label}")

    for het in args.het:
        sc, fa = cell(results, het, 20, "scaffold"), cell(results, het, 20, "fedavg")
        if math.isfinite(sc) and math.isfinite(fa):
            check(f"item 2, het {het}: SCAFFOLD < FedAvg (FedAvg/SCAFFOLD = {fa / sc:.2f}; paper "
                  f"{PAPER[(het, 20)]['fedavg'] / PAPER[(het, 20)]['scaffold']:.2f})", sc < fa)
        ssf, fs = cell(results, het, 20, "ssf"), cell(results, het, 20, "fedsub")
        if math.isfinite(ssf):
            check(f"item 3, het {het}, r 20: SCAFFOLD < SSF < FedSub", sc < ssf and (ssf < fs or math.isnan(fs)))
            check(f"item 4, het {het}, r 20: SSF < FedAvg", ssf < fa)
        if math.isfinite(fs) and math.isfinite(fa):
            print(f"  [report] het {het}, r 20: FedSub {'<' if fs < fa else '>'} FedAvg "
                  f"(paper: {'<' if PAPER[(het, 20)]['fedsub'] < PAPER[(het, 20)]['fedavg'] else '>'})")
        f50 = cell(results, het, 50, "fedsub")
        if (het, 50, "fedsub") in results:
            print(f"  [report] het {het}, r 50: FedSub final {f50:.3e} (paper: NaN, diverged)")
    if 2.0 in args.het:
        ranks = [r for r in sorted(args.ranks) if (2.0, r, "ssf") in results]
        errs = [cell(results, 2.0, r, "ssf") for r in ranks]
        if len(errs) > 1:
            check(f"item 5, het 2: SSF monotone in r {ranks}: " + ", ".join(f"{e:.3e}" for e in errs),
                  all(a > b for a, b in zip(errs, errs[1:])))
        sc = cell(results, 2.0, 20, "scaffold")
        for r in ranks:
            if r >= 10:
                print(f"  [report] item 7, het 2, r {r}: SSF/SCAFFOLD = {cell(results, 2.0, r, 'ssf') / sc:.2f} "
                      f"(paper {PAPER[(2.0, r)]['ssf'] / PAPER[(2.0, r)]['scaffold']:.2f})")


def plots(args, grid, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = grid["curves"]
    figures = {"fig1_r20": [(het, 20) for het in args.het], "fig2_het2": [(2.0, r) for r in (10, 20, 50)],
               "fig3_het0.5_r50": [(0.5, 50)]}
    for fname, panels in figures.items():
        panels = [p for p in panels if any(k[:2] == p or (k[0] == p[0] and k[1] == 0) for k in curves)
                  and (p[0], p[1], "ssf") in curves]
        if not panels:
            continue
        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
        for ax, (het, r) in zip(axes[0], panels):
            for name in list(FULL) + list(SUB):
                pts = curves.get((het, 0 if name in FULL else r, name))
                if pts:
                    ax.semilogy([p[0] for p in pts], [p[1] for p in pts], label=name)
            ax.set_title(f"het={het}, r={r}")
            ax.set_xlabel("round")
            ax.set_ylabel("RelErr")
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"{fname}.png", dpi=100)
        plt.close(fig)
        print(f"plot: {out / (fname + '.png')}")


def decide(args, log) -> None:
    """FedSub vs SSF (``--decide A,B``) in one cell (het, r): each method's η_l chosen from ``--decide-grid`` by the
    mean final RelErr over ``--tune-seeds`` (diverged = +inf; ties toward the smaller step), then both at their
    rates on ``--seeds``. Per seed the relative difference ``d = RelErr_B / RelErr_A − 1`` (negative: B better);
    its mean with the 95 % t- and paired bootstrap intervals, median, wins, the signed-rank verdict, and whether the
    bootstrap interval lies within ±``--margin`` (equivalence)."""
    (het,), (rank,) = args.het, args.ranks
    methods = {name: FULL.get(name) or SUB[name] for name in args.decide}
    tuning = Grid(args, metric="rel_error")
    for name in methods:
        for lr in args.decide_grid:
            for seed in args.tune_seeds:
                tuning.add(f"decide-tune-{name}-lr{lr:g}-seed{seed}",
                           toy_config(methods[name], het, rank, lr, args.rounds, seed, args.data_seed, args.rounds))
    tuned: dict[tuple[str, float], list[float]] = {}

    def tuned_one(i: int, outcome) -> None:
        name = list(methods)[i // (len(args.decide_grid) * len(args.tune_seeds))]
        lr = args.decide_grid[i // len(args.tune_seeds) % len(args.decide_grid)]
        seed = args.tune_seeds[i % len(args.tune_seeds)]
        tuned.setdefault((name, lr), []).append(final_error(outcome))
        log({"kind": "tune", "het": het, "r": rank, "method": name, "lr": lr, "seed": seed,
             "rel_error": tuned[name, lr][-1], "seconds": tuning.seconds(outcome)})

    tuning.run(tuned_one)
    rates = {}
    for name in methods:
        scores = {lr: float(np.mean(tuned[name, lr])) if all(map(math.isfinite, tuned[name, lr])) else math.inf
                  for lr in args.decide_grid}
        rates[name] = min(args.decide_grid, key=lambda lr: (scores[lr], lr))
        print(f"tune {name} het={het} r={rank} T={args.rounds} seeds {args.tune_seeds}: "
              + " ".join(f"{lr:g}:{scores[lr]:.4e}" for lr in args.decide_grid) + f" -> {rates[name]:g}", flush=True)
    paired = Grid(args, metric="rel_error")
    for seed in args.seeds:
        for i, name in enumerate(args.decide):  # by position: A and B may be the same method
            paired.add(f"decide-{i}-{name}-lr{rates[name]:g}-seed{seed}",
                       toy_config(methods[name], het, rank, rates[name], args.rounds, seed, args.data_seed,
                                  args.rounds))
    errs: list[list[float]] = [[] for _ in args.decide]

    def paired_one(i: int, outcome) -> None:
        seed, k = args.seeds[i // len(args.decide)], i % len(args.decide)
        errs[k].append(final_error(outcome))
        log({"kind": "decide", "het": het, "r": rank, "method": args.decide[k], "lr": rates[args.decide[k]],
             "seed": seed, "rel_error": errs[k][-1], "seconds": paired.seconds(outcome)})
        if k == len(args.decide) - 1:
            print(f"seed={seed} " + " ".join(f"{n}={e[-1]:.4e}" for n, e in zip(args.decide, errs))
                  + f" (load {os.getloadavg()[0]:.1f})", flush=True)

    paired.run(paired_one)
    a, b = args.decide
    d = [eb / ea - 1.0 if math.isfinite(ea) and math.isfinite(eb) else math.inf if math.isfinite(ea) else -math.inf
         for ea, eb in zip(*errs)]
    t, boot, test = mean_interval(d), bootstrap_interval(d), wilcoxon_signed_rank(d)
    wl = wins_losses(d, higher_is_better=False)
    inside = boot is not None and -args.margin < boot[0] and boot[1] < args.margin
    for n, e in zip(args.decide, errs):
        print(f"{n}: lr {rates[n]:g}, final RelErr {mean_interval(e).format(6)} over {len(args.seeds)} seeds")
    print(f"{b}/{a} − 1 per seed: mean {t.format(4, signed=True)} (95 % t), bootstrap 95 % "
          f"[{boot[0]:+.4f}, {boot[1]:+.4f}], median {median(d):+.4f}, {b} better on {wl['wins']}, worse on "
          f"{wl['losses']}, tied {wl['ties']}; signed-rank p = {test.p:.3g} ({'exact' if test.exact else 'normal'}):"
          f" verdict for {b} against {a}: {rank_verdict(test, higher_is_better=False)}; the bootstrap interval "
          f"{'lies' if inside else 'does not lie'} within ±{args.margin:g} (equivalence at that margin "
          f"{'shown' if inside else 'not shown'})")


def network(args, log) -> None:
    """SSF vs SCAFFOLD vs FedAvg vs FedSub on text classification through the simulator (bytes from the ledger)."""
    methods = {"ssf": ["method.name=ssf", f"method.ratio={args.network_ratio}"],
               "scaffold": ["method.name=fedavg-full", "method.correction=scaffold"],
               "fedavg": ["method.name=fedavg-full"],
               "fedsub": ["method.name=fedsub", f"method.ratio={args.network_ratio}"]}
    base = ["train.optimizer=sgd", f"train.lr={args.network_lr}", f"run.rounds={args.network_rounds}",
            "partition.kind=dirichlet", f"partition.alpha={args.network_alpha}", f"run.seed={args.seeds[0]}"]
    base += args.network_set
    grid = Grid(args)
    for name, sets in methods.items():
        grid.add(f"network-{name}", load_config(args.network_config, base + sets))

    def done(i: int, outcome) -> None:
        name, summary = list(methods)[i], outcome.summary
        row = {"kind": "network", "method": name, "accuracy": summary.get("accuracy"),
               "best_accuracy": summary.get("best_accuracy"), "bytes_up": summary["bytes_up"],
               "bytes_down": summary["bytes_down"], "seconds": summary["time"]["total"]}
        log(row)
        print(f"{name:9s} acc={row['accuracy']:.4f} best={row['best_accuracy']:.4f} "
              f"up={row['bytes_up'] / 1e6:.3f}MB down={row['bytes_down'] / 1e6:.3f}MB {row['seconds']:.1f}s", flush=True)

    grid.run(done)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731

    def seed_list(s: str) -> list[int]:  # "0,1,2" or "0-63"
        lo, _, hi = s.partition("-")
        return list(range(int(lo), int(hi) + 1)) if hi else ints(s)
    ap.add_argument("--het", type=floats, default=[0.1, 0.5, 2.0])
    ap.add_argument("--ranks", type=ints, default=[1, 5, 10, 20, 50])
    ap.add_argument("--tables", type=ints, default=[2, 3, 4])
    ap.add_argument("--methods", type=lambda s: s.split(","), default=list(FULL) + list(SUB),
                    help="subset of scaffold,fedavg,ssf,fedsub")
    ap.add_argument("--rounds", type=int, default=25_000)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--seeds", type=seed_list, default=[0, 1, 2], help="0,1,2 or a range 0-63")
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--lr-search", action="store_true", help="search η_l (else the paper's 1e-2/1e-2/1e-3)")
    ap.add_argument("--search-rounds", type=int, default=500)
    ap.add_argument("--plots", action="store_true")
    ap.add_argument("--decide", type=lambda s: s.split(","), default=None, metavar="A,B",
                    help="paired verdict of B against A in the one cell --het H --ranks R (see decide())")
    ap.add_argument("--decide-grid", type=floats, default=[1e-3, 3e-3, 1e-2, 3e-2])
    ap.add_argument("--tune-seeds", type=seed_list, default=[100, 101, 102],
                    help="--decide: the seeds each rate is tuned on (apart from --seeds)")
    ap.add_argument("--margin", type=float, default=0.05,
                    help="--decide: equivalence margin on the relative RelErr difference (0.05 = ±5 %%)")
    ap.add_argument("--out", default="bench_out/ssf")
    ap.add_argument("--network", action="store_true", help="run the network comparison instead of the toy")
    ap.add_argument("--network-config", default="agnews",
                    help="AG News, 2,000 test examples (the bundled agnews config)")
    ap.add_argument("--network-rounds", type=int, default=50)
    ap.add_argument("--network-lr", type=float, default=0.05)
    ap.add_argument("--network-alpha", type=float, default=0.1)
    ap.add_argument("--network-ratio", type=float, default=0.25)
    ap.add_argument("--network-set", action="append", default=[], help="extra --set overrides")
    sweep_options(ap)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(provenance())
    print(f"seeds={args.seeds} data_seed={args.data_seed}")
    log_path = out / f"log-{int(time.time())}.jsonl"

    def log(row) -> None:
        with log_path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")

    if args.network:
        network(args, log)
        return
    if args.decide:
        if len(args.decide) != 2 or len(args.het) != 1 or len(args.ranks) != 1:
            ap.error("--decide takes two methods A,B and one cell: --het H --ranks R")
        decide(args, log)
        print(f"log: {log_path}")
        return
    lrs = lr_search(args, log) if args.lr_search else {het: PAPER_LR[het] for het in args.het}
    grid = run_grid(args, lrs, log)
    report(args, grid)
    if args.plots:
        plots(args, grid, out)
    print(f"log: {log_path}")


if __name__ == "__main__":
    sys.exit(run_resumable(main))

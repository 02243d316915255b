"""When federated models collapse under label skew: arms that each change one factor of a base setting, paired by
seed (docs/comparison.md, "When federated models collapse"). Not part of CI.

Base (a held-out check's setting, cut to fit a shared 2-core CPU: 3 rounds instead of 6, batches of 8 × 32 tokens
instead of 16 × 64 (the agnews config's length), 500 test examples): MiniLM-L6, 10 clients, Dirichlet α = 0.5, 3
rounds of 5 clients × 10 local AdamW steps, lr 3e-3, head lr 1e-2, clients weighted by their examples, every round
evaluated. Each arm is one ``fedlowrank compare`` (``run``) with the arm's ``--set`` values on the same seeds, so
each arm's runs are paired with the base's by seed (same partition, sampling and data order wherever the arm leaves
the partition alone).

    python benchmarks/collapse_study.py run --data binary --seeds 0,1,2 --out runs/collapse
    python benchmarks/collapse_study.py run --data agnews --arms base,uniform --seeds 0,1,2 --out runs/collapse
    python benchmarks/collapse_study.py run --data bbc --arms base,centralized,alpha-100,uniform --out runs/collapse
    python benchmarks/collapse_study.py run --data agnews --arms logit-adjust-0.5,logit-adjust-1,logit-adjust-2 \
        --seeds 0,1,2,3,4,5 --out runs/collapse                                             # the τ sweep
    python benchmarks/collapse_study.py run --data binary --arms base,logit-adjust-1,fedlc-1,fedlc-10,fedrs-0.5 \
        --out runs/collapse                                                        # three remedies against one base
    python benchmarks/collapse_study.py run --data binary --arms base,frozen-head --out runs/collapse  # FedBABU
    python benchmarks/collapse_study.py run --data binary --arms base,ccvr --out runs/collapse         # CCVR
    python benchmarks/collapse_study.py run --data binary --out runs/collapse --arms check-fedit,check-florg,\
        check-florg-examples,check-florg-no-procrustes,check-florg-lr-1e-3,check-florg-lr-1e-4,\
        check-florg-head-lr-1e-3,check-fedit-uniform
    python benchmarks/collapse_study.py report --out runs/collapse

``--data binary`` is AG News' Business and Sci/Tech classes (written once under ``--out`` from the local copy,
``$FEDLOWRANK_DATA/agnews``): a binary task built from the data the project uses; ``--data bbc`` is the packaged BBC
News (5 classes); ``--train FILE [--test FILE]`` is your own data set (any file the text task reads, docs/data.md;
without ``--test`` a stratified split of it), named by its folder. Every run is kept under ``--out/<data>/<arm>/``
and read back when the command is repeated (``compare --resume``); with ``--records benchmarks/records/collapse``
the finished runs are kept there too, and ``run`` with the same arms then rebuilds the tables from them without
training (the per-round lines need each run's ``partition.json``, which records do not keep).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from common import keep_records, provenance, run_resumable  # noqa: E402

from fedlowrank.experiments.compare import run_comparison  # noqa: E402
from fedlowrank.experiments.stats import median, wilcoxon_signed_rank  # noqa: E402

BASE = ["partition.num_clients=10", "partition.alpha=0.5", "run.rounds=3", "run.clients_per_round=5",
        "train.local_steps=10", "train.batch_size=8", "train.lr=3e-3", "train.head_lr=1e-2",
        "server.weighting=num_examples", "task.max_length=32", "data.max_test_examples=500", "run.eval_every=1",
        "run.threads=1"]
# arm -> (methods, settings on top of BASE): one factor each
ARMS = {
    "base": (["fedit"], []),
    "centralized": (["centralized"], []),
    "uniform": (["fedit"], ["server.weighting=uniform"]),
    "head-lr-1e-3": (["fedit"], ["train.head_lr=1e-3"]),
    "lr-1e-3": (["fedit"], ["train.lr=1e-3"]),
    "steps-2": (["fedit"], ["train.local_steps=2"]),
    "alpha-100": (["fedit"], ["partition.alpha=100"]),
    "florg": (["florg"], ["train.lr=1e-3"]),
    "logit-adjust-0.5": (["fedit"], ["task.options.logit_adjustment=0.5"]),
    "logit-adjust-1": (["fedit"], ["task.options.logit_adjustment=1"]),
    "logit-adjust-2": (["fedit"], ["task.options.logit_adjustment=2"]),
    "fedlc-1": (["fedit"], ["task.options.calibration=1"]),
    "fedlc-10": (["fedit"], ["task.options.calibration=10"]),
    "fedrs-0.5": (["fedit"], ["task.options.restricted_softmax=0.5"]),
    "frozen-head": (["fedit"], ["task.options.frozen_head=true"]),
    "ccvr": (["fedit"], ["task.options.ccvr_samples=100"]),
    # FLoRG under label skew: the held-out check's setting (every client every round, 6 rounds, rank 4, main's lr
    # 5e-3), one factor at a time from FLoRG as that check ran it (its preset's uniform weights)
    "check-fedit": (["fedit"], []),
    "check-florg": (["florg"], ["server.weighting=uniform"]),
    "check-florg-examples": (["florg"], []),
    "check-florg-no-procrustes": (["florg-no-procrustes"], ["server.weighting=uniform"]),  # Q kept whole
    "check-florg-lr-1e-3": (["florg"], ["server.weighting=uniform", "train.lr=1e-3"]),
    "check-florg-lr-1e-4": (["florg"], ["server.weighting=uniform", "train.lr=1e-4"]),
    "check-florg-head-lr-1e-3": (["florg"], ["server.weighting=uniform", "train.head_lr=1e-3"]),
    "check-fedit-uniform": (["fedit"], ["server.weighting=uniform"]),
}
CHECK = ["run.rounds=6", "run.clients_per_round=10", "lora.rank=4", "train.lr=5e-3"]  # the check-* arms' base
CLASSES = ("Business", "Sci/Tech")
SOURCES = {"agnews": "agnews", "bbc": "bbc-news"}  # --data -> data.source (binary: files written from AG News)


def binary_files(out: Path) -> list[str]:
    """AG News' Business and Sci/Tech examples as ``out/agnews-binary/{train,test}.tsv`` (written once)."""
    folder = out / "agnews-binary"
    source = Path(os.environ.get("FEDLOWRANK_DATA", "")) / "agnews"
    if not (folder / "test.tsv").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        for split in ("train", "test"):
            lines = (source / f"{split}.tsv").read_text().splitlines()
            kept = [line for line in lines if line.rsplit("\t", 1)[-1] in CLASSES]
            (folder / f"{split}.tsv").write_text("\n".join(kept) + "\n")
    return ["data.source=files", f"data.train={folder / 'train.tsv'}", f"data.test={folder / 'test.tsv'}",
            "data.header=false", "data.max_train_examples=0"]


def arm_settings(arm: str) -> list[str]:
    """The ``--set`` values of ``arm`` on top of :data:`BASE` (a ``check-*`` arm's start with :data:`CHECK`)."""
    return (CHECK if arm.startswith("check-") else []) + ARMS[arm][1]


def data_settings(args) -> tuple[str, list[str]]:
    """``(name, --set values)`` of the study's data set: ``--data`` or, with ``--train``, the user's files (their
    folder's name; any file the task reads, docs/data.md)."""
    if args.train is not None:
        sets = ["data.source=files", f"data.train={args.train.resolve()}", "data.max_train_examples=0"]
        return args.train.resolve().parent.name, sets + ([f"data.test={args.test.resolve()}"] if args.test else [])
    if args.data == "binary":
        return "binary", binary_files(args.out)
    return args.data, [f"data.source={SOURCES[args.data]}"]


def run(args) -> None:
    name, data = data_settings(args)
    if args.records:
        keep_records(args.records, args.out, [name], into_out=True)
    try:
        for arm in args.arms:
            methods, sets = ARMS[arm][0], arm_settings(arm)
            print(f"\n## {name} / {arm}: {','.join(methods)} --set {' '.join(sets) or '(base)'}", flush=True)
            run_comparison("agnews", methods, args.seeds, BASE + data + sets, args.out / name / arm,
                           lambda line: print(line, flush=True), resume=True)
    finally:
        if args.records:
            keep_records(args.records, args.out, [name], into_out=False)


def per_seed(out: Path) -> dict:
    """``{(data, arm): {seed: run}}`` from every ``results.json`` under ``out``."""
    found = {}
    for path in sorted(out.glob("*/*/results.json")):
        results = json.loads(path.read_text())
        for row in results["rows"]:
            found[(path.parent.parent.name, path.parent.name)] = {r["seed"]: r for r in row["runs"]}
    return found


def rounds_of(run_dir: Path) -> list[str]:
    """Per evaluated round of a run: its accuracy, the most-predicted class with its share of the test predictions,
    and that class's share of the label mix the server's average saw (the sampled clients' label histograms
    weighted as ``server.weighting`` weights them), e.g. ``r1 0.501 Sci/Tech 100 % (mix 71 %, its largest
    class)``; for a pooled reference (``centralized``) the mix of the data it pooled (the row's ``pooled``)."""
    if not (run_dir / "partition.json").is_file():  # a run read back from --records: no partition file
        return []
    part = json.loads((run_dir / "partition.json").read_text())
    cfg = json.loads((run_dir / "config.json").read_text())
    names, hist = part["task"]["labels"], [[float(x) for x in h] for h in part["label_histograms"]]
    out = []
    for row in (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line):
        pooled = row.get("pooled")
        pred, clients = row.get("predictions"), pooled or row.get("clients")
        if not pred or not clients:
            continue
        uniform = cfg["server"]["weighting"] == "uniform" and not pooled
        weights = [1.0 / sum(hist[k]) if uniform else 1.0 for k in clients]
        mix = [sum(w * hist[k][c] for w, k in zip(weights, clients)) for c in range(len(names))]
        largest = ", its largest class" if mix[pred["top_class"]] == max(mix) else ""
        share = "" if cfg["method"]["name"] == "centralized" and not pooled else \
            f" (mix {100 * mix[pred['top_class']] / sum(mix):.0f} %{largest})"
        out.append(f"r{row['round']} {row['accuracy']:.3f} {pred['top_label']} {100 * pred['top_share']:.0f} %{share}")
    return out


def base_arm(arm: str) -> str:
    """The arm ``arm`` is paired with: ``check-florg`` for the ``check-*`` arms, else ``base``."""
    return "check-florg" if arm.startswith("check-") else "base"


def report(args) -> None:
    found = per_seed(args.out)
    for data in sorted({d for d, _ in found}):
        print(f"\n### {data}\n")
        print("| arm | final accuracy per seed (collapsed: first round → end) | mean | collapsed at the end | "
              "arm − its base (base; check-florg for check-*): median; ahead; signed-rank p |")
        print("|---|---|---|---|---|")
        for arm in ARMS:
            runs = found.get((data, arm))
            if not runs:
                continue
            reference = base_arm(arm)
            base = found.get((data, reference), {})
            seeds = sorted(runs)
            cells = []
            for s in seeds:
                c = runs[s]["collapse"]
                mark = "" if c is None else f" (c {c['round']}→{'end' if c['at_end'] else 'no'})"
                cells.append(f"s{s} {runs[s]['final']:.3f}{mark}")
            finals = [runs[s]["final"] for s in seeds]
            at_end = sum(1 for s in seeds if runs[s]["collapse"] and runs[s]["collapse"]["at_end"])
            shared = [s for s in seeds if s in base]
            diff = "–"
            if arm != reference and shared:
                d = [runs[s]["final"] - base[s]["final"] for s in shared]
                diff = (f"{median(d):+.3f}; {sum(x > 0 for x in d)} of {len(d)}; "
                        f"p = {wilcoxon_signed_rank(d).p:.3g}")
            print(f"| {arm} | {', '.join(cells)} | {sum(finals) / len(finals):.3f} | {at_end} of {len(seeds)} | "
                  f"{diff} |")
        print("\nPer round: accuracy, the most-predicted class and its share, and that class's share of the label "
              "mix the round's average saw\n")
        for arm in ARMS:
            for s, r in sorted(found.get((data, arm), {}).items()):
                if "run_dir" in r:
                    print(f"- {arm} s{s}: " + "; ".join(rounds_of(Path(r["run_dir"]))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=("run", "report"))
    ap.add_argument("--data", choices=("binary", *SOURCES), default="binary")
    ap.add_argument("--train", type=Path, help="your own training file (.tsv/.csv/.jsonl, docs/data.md) instead of "
                    "--data; its folder's name names the data set under --out")
    ap.add_argument("--test", type=Path, help="with --train: its test file (default: a split of --train)")
    ap.add_argument("--arms", type=lambda s: s.split(","), default=list(ARMS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", type=Path, default=Path("runs/collapse"))
    ap.add_argument("--records", type=Path, metavar="DIR", help="finished runs kept between machines (e.g. "
                    "benchmarks/records/collapse): copied from DIR into --out before `run`, reused instead of run "
                    "again, and every finished run copied back after (also when stopped)")
    args = ap.parse_args(argv)
    if args.test is not None and args.train is None:
        ap.error("--test needs --train")
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        ap.error(f"--arms: unknown {', '.join(unknown)} (known: {', '.join(ARMS)})")
    print(provenance(argv))
    (run if args.command == "run" else report)(args)
    return 0


if __name__ == "__main__":
    sys.exit(run_resumable(main))

"""Accuracy against bytes for each codec (docs/codecs.md): methods × codecs × paired seeds, each codec one
``fedlowrank compare`` of every method on the same partitions and seeds.

The protocol (issue "Fewer bytes on the wire"): on the ``main`` config (BBC News, MiniLM-L6) and on one causal-LM
task, FedIT, FFA-LoRA, FLoRG, SSF, ILoRA, FedRPCA and FedSVD × {fp32, bf16, int8, int4, int4 + error feedback,
top-k 10 % + error feedback} on the uplink × 4 paired seeds, each method at its tuned learning rate (``--tuned``, a
``tune.json`` of ``fedlowrank tune``; without it the compare presets and overrides of the config). It writes, in
``--out``: one compare directory per codec (``<codec>/results.json``, the run directories with ``metrics.jsonl``),
``study.json`` and ``study.md``: per method and codec the final metric (mean ± 95 % t-interval over seeds), the
paired difference to fp32 on the same seeds (mean ± t-interval), the uplink and downlink bytes as a share of fp32's,
the codec's encode + decode time as a share of a round's (``time.codec`` / ``time.total``, this process's), and
whether the issue's targets hold (int8: uplink ≤ 0.27× and within 0.5 point; int4 + EF: ≤ 0.15× within 1 point;
top-k 10 % + EF: ≤ 0.2× within 1 point; "met" only when the paired interval's lower end is above −target), and
``<metric>_vs_bytes-<method>.png``: the method's curve of each codec against bytes sent, up + down.

Full protocol on ``main`` (42 runs per seed; about 7.5 min per seed of the 6 methods of ``fedlowrank compare main``
on 2 idle CPU cores, so ≈ 6 × 7 × 4 runs ≈ 4–5 hours on 2 cores):

    python benchmarks/study_codecs.py --config main --seeds 0,1,2,3 --out study-codecs-main --jobs 2 \\
        --tuned tune-main/tune.json

Causal LM (GSM8K with SmolLM2-135M, ``FEDLOWRANK_DATA`` holding gsm8k; minutes per run, hours in all):

    python benchmarks/study_codecs.py --config gsm8k --seeds 0,1,2,3 --out study-codecs-gsm8k --jobs 2

A smoke run (a minute, tiny random BERT: checks the script, measures nothing):

    python benchmarks/study_codecs.py --smoke --out /tmp/study-codecs-smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import provenance, run_resumable  # noqa: E402

METHODS = ("fedit", "ffa-lora", "florg", "ssf", "ilora", "fedrpca", "fedsvd")
# codec name -> its --set overrides (the uplink's; the downlink stays fp32 so that the uplink's trade is measured)
CODECS = {
    "fp32": (),
    "bf16": ("uplink.codec=bf16",),
    "int8": ("uplink.codec=int8",),
    "int4": ("uplink.codec=int4",),
    "int4+ef": ("uplink.codec=int4", "uplink.error_feedback=true"),
    "topk10+ef": ("uplink.codec=topk", "uplink.topk_fraction=0.1", "uplink.error_feedback=true"),
}
# codec -> (largest uplink bytes as a share of fp32's, largest loss of the metric in points): the issue's targets
TARGETS = {"int8": (0.27, 0.5), "int4+ef": (0.15, 1.0), "topk10+ef": (0.2, 1.0)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="main", help="bundled config or TOML file (main; gsm8k for the causal LM)")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated registered methods")
    p.add_argument("--codecs", default=",".join(CODECS), help=f"comma-separated, of {', '.join(CODECS)}")
    p.add_argument("--seeds", default="0,1,2,3", help="paired seeds, comma-separated")
    p.add_argument("--tuned", default="", help="a tune.json whose learning rates each method runs at")
    p.add_argument("--set", action="append", default=[], help="extra config overrides for every run")
    p.add_argument("--out", required=True, help="folder of the compare directories, study.json and study.md")
    p.add_argument("--jobs", type=int, default=1, help="worker processes per comparison")
    p.add_argument("--resume", action="store_true", help="reuse the runs that ended in --out")
    p.add_argument("--smoke", action="store_true", help="tiny config, fedit and ssf, fp32 and int4+ef, 2 seeds")
    args = p.parse_args(argv)
    if args.smoke:
        args.config, args.methods, args.codecs, args.seeds = "tiny", "fedit,ssf", "fp32,int4+ef", "0,1"
        args.set = [*args.set, "run.rounds=2"]
    args.methods = [m for m in args.methods.split(",") if m]
    args.codecs = [c for c in args.codecs.split(",") if c]
    unknown = [c for c in args.codecs if c not in CODECS]
    if unknown or "fp32" not in args.codecs:
        raise SystemExit(f"error: --codecs must list fp32 (the reference) and codecs among {', '.join(CODECS)}; got "
                         f"{','.join(args.codecs)}")
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    return args


def check_grid(config: str, methods: list[str], codecs: list[str], sets: list[str]) -> None:
    """Every run of the grid, as its comparison configures it (preset, overrides, the codec), is a valid config (one
    ``error:`` line otherwise), before anything trains."""
    from fedlowrank.config import load_config
    from fedlowrank.experiments.compare import method_settings

    base = load_config(config, sets, method_checks=False)
    for codec in codecs:
        for method in methods:
            load_config(config, [*method_settings(base, method, [*sets, *CODECS[codec]])])


def run_histories(results: dict) -> dict[str, list[list[dict]]]:
    """Per method, each seed's metrics rows (its run directory's ``metrics.jsonl``), led by round 0 (the model before
    training, its ``summary.json``'s ``initial``)."""
    from fedlowrank.reporting.plots import with_round_zero

    out: dict[str, list[list[dict]]] = {}
    for row in results["rows"]:
        for run in row["runs"]:
            run_dir = Path(run["run_dir"])
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
            initial = json.loads((run_dir / "summary.json").read_text()).get("initial")
            out.setdefault(row["method"], []).append(with_round_zero(rows, initial))
    return out


def codec_share(histories: list[list[dict]]) -> float:
    """Seconds spent coding and decoding as a share of the rounds' total time, over every run."""
    rows = [r for run in histories for r in run if r["round"] > 0]
    total = sum(r["time"]["total"] for r in rows)
    return sum(r["time"].get("codec", 0.0) for r in rows) / total if total else 0.0


def study(results: dict[str, dict], histories: dict[str, dict[str, list[list[dict]]]], methods: list[str]) -> list[dict]:
    """One entry per method and codec: final metric, paired difference to fp32, byte shares, codec time, targets."""
    from fedlowrank.experiments.stats import mean_interval

    metric = results["fp32"]["metric"]
    scale = 100.0 if metric == "accuracy" else 1.0  # points
    entries = []
    for method in methods:
        ref = {r["seed"]: r for row in results["fp32"]["rows"] if row["method"] == method for r in row["runs"]}
        for codec, res in results.items():
            runs = {r["seed"]: r for row in res["rows"] if row["method"] == method for r in row["runs"]}
            seeds = sorted(runs.keys() & ref.keys())
            diff = mean_interval([scale * (runs[s]["final"] - ref[s]["final"]) for s in seeds])
            up = float(np.mean([runs[s]["bytes_up"] / ref[s]["bytes_up"] for s in seeds]))
            down = float(np.mean([runs[s]["bytes_down"] / ref[s]["bytes_down"] for s in seeds]))
            entry = {"method": method, "codec": codec, "seeds": seeds,
                     "final": mean_interval([runs[s]["final"] for s in seeds]).to_dict(),
                     "paired_diff_points": diff.to_dict(), "uplink_share": up, "downlink_share": down,
                     "codec_time_share": codec_share(histories[codec][method])}
            if codec in TARGETS:
                bound, points = TARGETS[codec]
                low = diff.mean - diff.half_width if len(seeds) > 1 else float("nan")
                entry["target"] = {"uplink_share_at_most": bound, "within_points": points,
                                   "verdict": ("met" if up <= bound and low >= -points else
                                               "missed" if up > bound or diff.mean + diff.half_width < -points
                                               else "undecided")}
            entries.append(entry)
    return entries


def markdown(entries: list[dict], metric: str, header: str) -> str:
    lines = [header, "", f"| method | codec | final {metric} | Δ vs fp32 (points, paired) | uplink × fp32 | "
             "downlink × fp32 | codec time / round | target |", "|---|---|---|---|---|---|---|---|"]
    for e in entries:
        f, d = e["final"], e["paired_diff_points"]
        target = e.get("target", {}).get("verdict", "–")
        lines.append(f"| {e['method']} | {e['codec']} | {f['mean']:.4f} ± {f['half_width']:.4f} | "
                     f"{d['mean']:+.2f} ± {d['half_width']:.2f} | {e['uplink_share']:.3f} | {e['downlink_share']:.3f} | "
                     f"{100 * e['codec_time_share']:.2f} % | {target} |")
    return "\n".join(lines) + "\n"


def plot(out: Path, histories: dict[str, dict[str, list[list[dict]]]], metric: str) -> list[str]:
    """``<metric>_vs_bytes-<method>.png`` per method: one curve per codec against bytes sent (up + down); none
    without matplotlib."""
    from fedlowrank.experiments.plots import comparison_figure
    from fedlowrank.reporting.plots import pyplot

    written = []
    for method in sorted({m for per in histories.values() for m in per}):
        curves = {codec: per[method] for codec, per in histories.items() if method in per}
        fig = comparison_figure(curves, metric, "bytes", title=f"{method}: {metric} vs bytes sent, by uplink codec")
        if fig is None:
            return written
        path = out / f"{metric}_vs_bytes-{method}.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        pyplot().close(fig)
        written.append(str(path))
    return written


def main(argv=None) -> int:
    args = parse_args(argv)
    from fedlowrank.experiments.compare import run_comparison

    head = provenance(argv)
    print(head)
    check_grid(args.config, args.methods, args.codecs, args.set)
    out = Path(args.out)
    results, histories = {}, {}
    for codec in args.codecs:
        results[codec] = run_comparison(args.config, args.methods, args.seeds, [*args.set, *CODECS[codec]],
                                        out / codec, print, tuned=args.tuned or None, resume=args.resume,
                                        jobs=args.jobs)
        histories[codec] = run_histories(results[codec])
    metric = results["fp32"]["metric"]
    entries = study(results, histories, args.methods)
    (out / "study.json").write_text(json.dumps({"provenance": head, "entries": entries}, indent=2))
    text = markdown(entries, metric, "```\n" + head + "\n```")
    (out / "study.md").write_text(text)
    plot(out, histories, metric)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(run_resumable(main))

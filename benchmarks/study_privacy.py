"""Client-level DP study: FedIT, FFA-LoRA, FLoRG and FedSA-LoRA at ε ∈ {1, 3, 8} (δ = 1/N) on AG News
with MiniLM, paired seeds, the clipping norm C tuned per (method, ε) on a validation split: does freezing A help
under DP, as FFA-LoRA claims?

The protocol, every step a ``fedlowrank`` call whose directory under ``--out`` is kept (``--resume`` reuses the
runs that ended there, so an interrupted study continues):

1. ``tune``: each method's learning rate without privacy, on the validation split held out of the clients'
   training data (``--lr-grid``; one more rate past an edge, ``--extend``) → ``OUT/tune-lr``.
2. per ε (or only at ``--clip-at``): ``tune --param privacy.clip --tuned OUT/tune-lr/tune.json``: C from
   ``--clips`` (one more past an edge) at the method's tuned rate, on the same validation split, with σ computed
   from ε for the configured rounds and client sampling (``privacy.target_epsilon``) → ``OUT/tune-clip-eps<ε>``.
   The test set is never used to choose.
3. per ε, then ε = inf (no privacy, at the tuned rates; ``--no-plain`` leaves it out): ``compare`` over
   ``--seeds`` at the tuned (lr, C): accuracy mean ± 95 % t-interval, paired differences against ``--reference``
   (FedIT) with their interval and verdict, the ε reached and the bytes the ledger counted →
   ``OUT/compare-eps<ε>``.

Every method trains with local AdamW, FFA-LoRA included (its preset is SGD, as in FedGaLore's Table 1; this is
its AdamW variant, FedGaLore's App. D), so that the optimizer is held fixed and the question is only whether
freezing A helps. FedSA-LoRA's personalised evaluation loads each client's own model, one pass over the test set
per client: ``run.personal_eval_clients = 10`` evaluates 10 of the 100 (the same 10 for every run of a seed).

Each method runs in the strongest privacy mode it supports (``supported_privacy_modes()``, set per method through
``compare.overrides``): central DP (noise σ·C on the sum, ``server.weighting = uniform`` for all) for FedIT,
FFA-LoRA and FedSA-LoRA, local DP (noise σ·C on each reply) for FLoRG, whose Gram aggregation needs individual
replies. Client-level DP adds no bytes (clipping and noise keep every tensor's shape).

The study as sized for this CPU (100 clients of AG News, Dirichlet α = 1, 10 per round, 20 rounds of 2 local steps;
C tuned at ε = 3 and used at every ε, to fit a session — leave ``--clip-at`` out to tune it at each ε):

    python benchmarks/study_privacy.py --out runs/study-privacy --jobs 2 --clip-at 3

A smoke run (seconds, tiny random BERT, 1 round, one ε):

    python benchmarks/study_privacy.py --smoke --out /tmp/study-privacy-smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import provenance, run_resumable  # noqa: E402

from fedlowrank.experiments.compare import describe_partition, run_comparison  # noqa: E402
from fedlowrank.config import load_config  # noqa: E402
from fedlowrank.methods import method_class  # noqa: E402
from fedlowrank.reporting.progress import format_bytes  # noqa: E402
from fedlowrank.experiments.tune import run_tuning  # noqa: E402

METHODS = "fedit,ffa-lora,florg,fedsa-lora"
METHOD_SETS = {"ffa-lora": ["train.optimizer=adamw"], "fedsa-lora": ["run.personal_eval_clients=10"]}
# 100 clients of ~100 examples (Dirichlet α = 1: at α = 0.5 no draw gives every client a batch of 16), 10 sampled
# per round: client-level DP needs many clients per round to leave any signal
STUDY_SETS = ["partition.num_clients=100", "partition.min_partition_size=16", "run.clients_per_round=10",
              "partition.alpha=1.0", "run.rounds=20", "train.local_steps=2", "train.batch_size=16",
              "task.max_length=32", "lora.rank=4", "run.eval_every=10", "data.max_test_examples=2000",
              "server.weighting=uniform", "run.threads=1"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--reference", default="fedit", help="the method the paired differences are taken against")
    p.add_argument("--epsilons", default="1,3,8", help="target ε values (the non-private run is always added)")
    p.add_argument("--clips", default="0.1,0.3,1,3", help="clipping norms C tuned over per (method, ε)")
    p.add_argument("--lr-grid", default="3e-4,1e-3,3e-3", help="learning rates tuned over (AdamW's ladder)")
    p.add_argument("--extend", type=int, default=1, help="values tried past an edge of --lr-grid and of --clips")
    p.add_argument("--no-plain", action="store_true", help="leave out the ε = inf (no privacy) comparison")
    p.add_argument("--clip-at", type=float, default=None,
                   help="tune C only at this ε and use it at every ε (default: tune C at each ε)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--config", default="agnews", help="base config (bundled name or TOML)")
    p.add_argument("--set", action="append", default=[], help="extra config overrides, after the study's own")
    p.add_argument("--out", required=True, help="the study's directory (reused: finished runs are read back)")
    p.add_argument("--jobs", type=int, default=1, help="runs side by side (processes)")
    p.add_argument("--smoke", action="store_true", help="tiny config, 1 round, ε = 8: checks the script runs")
    args = p.parse_args(argv)
    args.sets = [*STUDY_SETS, *args.set]
    if args.smoke:
        args.config, args.epsilons, args.clips, args.lr_grid, args.seeds = "tiny", "8", "0.1,1", "0.01,0.1", "0,1"
        args.extend, args.clip_at = 0, None
        args.sets = ["run.rounds=1", "server.weighting=uniform", "run.clients_per_round=4",
                     "run.personal_eval_clients=2", *args.set]
    return args


def study_overrides(config: str, sets: list[str], methods: list[str], private: bool) -> str:
    """``compare.overrides`` with the study's :data:`METHOD_SETS` and, when ``private``, each method's strongest
    privacy mode added to the config's own entries."""
    base = load_config(config, sets, method_checks=False).compare.overrides
    entries = {m: [*base.get(m, []), *METHOD_SETS.get(m, []),
                   *([f"privacy.mode={'central' if 'central' in method_class(m).supported_privacy_modes() else 'local'}"]
                     if private else [])]
               for m in methods}
    entries.update({m: v for m, v in base.items() if m not in entries})
    return "compare.overrides={" + ", ".join(f'"{m}" = {json.dumps(v)}' for m, v in entries.items()) + "}"


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    print(provenance(argv))
    out, methods = Path(args.out), args.methods.split(",")
    epsilons = [float(e) for e in args.epsilons.split(",")]
    plain = [*args.sets, study_overrides(args.config, args.sets, methods, private=False)]
    private = [*args.sets, study_overrides(args.config, args.sets, methods, private=True)]
    lr = run_tuning(args.config, methods, args.lr_grid, "0", plain, out / "tune-lr", log, resume=True,
                    jobs=args.jobs, extend=args.extend)
    print(f"learning rates (validation, no privacy): "
          + ", ".join(f"{m} {c['value']:g}" for m, c in lr["chosen"].items()), flush=True)
    clips, results, clip_dirs = {}, {}, {}
    for eps in ([args.clip_at] if args.clip_at is not None else epsilons):
        clip_dirs[eps] = out / f"tune-clip-eps{eps:g}"
        tuned = run_tuning(args.config, methods, args.clips, "0", [*private, f"privacy.target_epsilon={eps:g}"],
                           clip_dirs[eps], log, resume=True, jobs=args.jobs, param="privacy.clip",
                           tuned=out / "tune-lr" / "tune.json", extend=args.extend)
        print(f"clipping norms (validation, ε = {eps:g}): "
              + ", ".join(f"{m} {c['value']:g}" for m, c in tuned["chosen"].items()), flush=True)
    for eps in epsilons:
        clip_dir = clip_dirs[args.clip_at if args.clip_at is not None else eps]
        clips[eps] = {m: c["value"] for m, c in json.loads((clip_dir / "tune.json").read_text())["chosen"].items()}
        results[eps] = run_comparison(args.config, methods, args.seeds, [*private, f"privacy.target_epsilon={eps:g}"],
                                      out / f"compare-eps{eps:g}", log, reference=args.reference,
                                      tuned=clip_dir / "tune.json", resume=True, jobs=args.jobs)
    if not args.no_plain:
        results[math.inf] = run_comparison(args.config, methods, args.seeds, plain, out / "compare-epsinf", log,
                                           reference=args.reference, tuned=out / "tune-lr" / "tune.json",
                                           resume=True, jobs=args.jobs)
    setup = results[epsilons[0]]["setup"]
    print(f"\nsetup as run: {setup['data_source']}, {setup['num_train']:,} training / {setup['num_test']:,} test "
          f"examples, {describe_partition(setup['partition'])}, {setup['clients_per_round']} per round, "
          f"{setup['rounds']} rounds "
          f"of {setup['local_steps']} local steps of batch {setup['batch_size']}, seeds {args.seeds}; δ = 1/N")
    print("final accuracy, mean ± 95 % t half-width over the seeds [C chosen on validation; ε reached]")
    print(f"{'method':12s}" + "".join(f"{'ε = ' + format(e, 'g'):>30s}" for e in results))
    for m in methods:
        cells = []
        for eps, res in results.items():
            row = next(r for r in res["rows"] if r["method"] == m)
            extra = f" [C {clips[eps][m]:g}; ε {row['epsilon']:.2f}]" if math.isfinite(eps) else ""
            cells.append(f"{row['final']['mean']:.3f} ± {row['final']['half_width']:.3f}{extra}")
        print(f"{m:12s}" + "".join(f"{c:>30s}" for c in cells))
    print(f"\npaired difference against {args.reference} (same seeds' partitions), final accuracy")
    for eps, res in results.items():
        for d in res["paired"]:
            f = d["final"]
            print(f"ε = {eps:g}: {d['method']} − {args.reference} = {f['mean']:+.4f} ± {f['half_width']:.4f} "
                  f"[{f['low']:+.4f}, {f['high']:+.4f}] {f['verdict']}")
    bytes_row = {r["method"]: (r["bytes_up"], r["bytes_down"]) for r in results[epsilons[0]]["rows"]}
    print("\nbytes per run (mean over seeds; the same at every ε): "
          + ", ".join(f"{m} up {format_bytes(u)} / down {format_bytes(d)}" for m, (u, d) in bytes_row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(run_resumable(main))

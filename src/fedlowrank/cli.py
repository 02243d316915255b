"""Command line: ``fedlowrank run | compare | methods``.

* ``fedlowrank run [CONFIG] [--set section.key=value ...]`` — one method, one run directory.
* ``fedlowrank compare [CONFIG] [--methods a,b] [--seeds 0,1]`` — several methods on the same partition,
  seeds and budget; prints a table, writes ``results.json``, ``results.md`` and accuracy-vs-round /
  accuracy-vs-bytes plots.
* ``fedlowrank resume RUN_DIR`` — continue an interrupted run from its newest checkpoint, bit for bit.
* ``fedlowrank export RUN_DIR [--format peft|merged] [--rank R]`` — the global model as a PEFT adapter
  (or its rank-R SVD re-factorisation) or a merged Hugging Face model.
* ``fedlowrank methods`` — every registered method with its paper and payloads.

CONFIG is a TOML file or the name of a bundled config (``main``, ``tiny``, ``agnews``, ``matrix``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _run_dir(cfg, suffix: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(cfg.run.out_dir) / f"{cfg.run.name}-{suffix}-{stamp}"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def cmd_methods(args) -> int:
    from .methods import available_methods

    for name, cls in available_methods().items():
        flags = []
        if cls.needs_individual_replies:
            flags.append("needs individual replies")
        if cls.supports_heterogeneous_ranks:
            flags.append("heterogeneous ranks")
        print(f"{name}\n  {cls.description}\n  paper: {cls.paper}\n  up:   {cls.uplink}\n  down: {cls.downlink}"
              + (f"\n  ({'; '.join(flags)})" if flags else ""))
    return 0


def cmd_run(args) -> int:
    from .config import load_config
    from .runtime.simulator import Simulation

    cfg = load_config(args.config, args.set)
    if args.vectorized:
        from .runtime.vectorized import run_vectorized

        result = run_vectorized(cfg, log=None if args.quiet else _log)
        print(json.dumps({"method": result.method, "rounds": result.rounds, "seconds": result.seconds,
                          "diverged_at": result.diverged_at, **result.final}, indent=1))
        return 0
    run_dir = Path(args.out) if args.out else _run_dir(cfg, cfg.method_name)
    sim = Simulation(cfg, run_dir=run_dir, log=None if args.quiet else _log)
    return _finish(sim, run_dir)


def _finish(sim, run_dir: Path) -> int:
    try:
        summary = sim.run()
    except KeyboardInterrupt:
        _log(f"interrupted in round {sim.round + 1}; continue with: fedlowrank resume {run_dir}"
             + ("" if sim.cfg.run.checkpoint_every else " (needs run.checkpoint_every > 0)"))
        return 130
    _log(f"run directory: {run_dir}")
    print(json.dumps(summary, indent=1))
    return 0


def cmd_resume(args) -> int:
    from .runtime.simulator import Simulation

    run_dir = Path(args.run_dir)
    sim = Simulation.resume(run_dir, log=None if args.quiet else _log)
    _log(f"resuming {run_dir} after round {sim.round} of {sim.cfg.run.rounds}")
    return _finish(sim, run_dir)


def cmd_export(args) -> int:
    from .export import export_run

    suffix = args.format + (f"-r{args.rank}" if args.rank is not None else "")
    out = Path(args.out) if args.out else Path(args.run_dir) / f"export-{suffix}"
    report = export_run(args.run_dir, out, args.format, args.rank)
    _log(f"exported to {out}")
    print(json.dumps(report, indent=1))
    return 0


def _table(rows: list[dict[str, Any]], metric: str) -> str:
    head = f"| method | final {metric} | best {metric} | bytes up | bytes down | time (s) |"
    lines = [head, "|---|---|---|---|---|---|"]
    for r in rows:
        def cell(key: str) -> str:
            vals = r[key]
            if not vals:
                return "–"
            return f"{np.mean(vals):.4f}" + (f" ± {np.std(vals):.4f}" if len(vals) > 1 else "")
        lines.append(f"| {r['method']} | {cell('final')} | {cell('best')} | {_fmt_bytes(r['bytes_up'])} | "
                     f"{_fmt_bytes(r['bytes_down'])} | {r['time']:.0f} |")
    return "\n".join(lines)


def cmd_compare(args) -> int:
    from .config import load_config
    from .plots import plot_comparison
    from .runtime.simulator import Simulation
    from .tasks import build_task

    cfg = load_config(args.config, args.set)
    methods = args.methods.split(",") if args.methods else list(cfg.compare.methods)
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else list(cfg.compare.seeds)
    def method_sets(name: str) -> list[str]:
        """Per-method settings (``compare.overrides``, e.g. a learning rate tuned per method), then --set."""
        return [f"method.name={name}", *cfg.compare.overrides.get(name, []), *args.set]

    for name in methods:  # validate every method before any work
        load_config(args.config, method_sets(name))
    out = Path(args.out) if args.out else _run_dir(cfg, "compare")
    out.mkdir(parents=True, exist_ok=True)
    metric = cfg.run.stop_metric or {"text-classification": "accuracy", "causal-lm": "loss"}.get(cfg.task.kind,
                                                                                                 "rel_error")
    histories: dict[str, list[list[dict[str, Any]]]] = {}
    rows = []
    tasks: dict[int, Any] = {}
    for name in methods:
        finals, bests, up, down, secs = [], [], 0, 0, 0.0
        for seed in seeds:
            mcfg = load_config(args.config, [*method_sets(name), f"run.seed={seed}"])
            if seed not in tasks:
                tasks[seed] = build_task(mcfg)
            sim = Simulation(mcfg, task=tasks[seed], run_dir=out / f"{name}-seed{seed}",
                             log=None if args.quiet else _log)
            summary = sim.run()
            histories.setdefault(name, []).append(sim.history)
            if metric in summary:
                finals.append(summary[metric])
                vals = [r[metric] for r in sim.history if metric in r]
                bests.append(max(vals) if metric == "accuracy" else min(vals))
            up, down, secs = up + summary["bytes_up"], down + summary["bytes_down"], secs + summary["time"]["total"]
        n = len(seeds)
        rows.append({"method": name, "final": finals, "best": bests, "bytes_up": up / n, "bytes_down": down / n,
                     "time": secs / n})
    table = _table(rows, metric)
    plots = plot_comparison(histories, out, metric)
    (out / "results.json").write_text(json.dumps({"metric": metric, "seeds": seeds, "rows": rows}, indent=1))
    (out / "results.md").write_text(table + "\n")
    print(table)
    _log(f"results: {out / 'results.md'}" + "".join(f"\nplot: {p}" for p in plots))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedlowrank", description="Federated low-rank fine-tuning under non-IID data")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("config", nargs="?", default=None, help="TOML file or bundled config name (main, tiny, agnews, matrix)")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. lora.rank=4")
        sp.add_argument("--out", default=None, help="output directory (default: runs/<name>-...)")
        sp.add_argument("--quiet", action="store_true", help="no progress lines")

    sp = sub.add_parser("run", help="run one method")
    common(sp)
    sp.add_argument("--vectorized", action="store_true",
                    help="batched rounds for closed-form tasks (matrix-regression) and methods with a batched_round")
    sp.set_defaults(func=cmd_run)
    sp = sub.add_parser("compare", help="compare methods on the same partition, seeds and budget")
    common(sp)
    sp.add_argument("--methods", default=None, help="comma-separated method names (default: compare.methods)")
    sp.add_argument("--seeds", default=None, help="comma-separated seeds (default: compare.seeds)")
    sp.set_defaults(func=cmd_compare)
    sp = sub.add_parser("resume", help="continue an interrupted run from its newest checkpoint")
    sp.add_argument("run_dir", help="the run directory")
    sp.add_argument("--quiet", action="store_true", help="no progress lines")
    sp.set_defaults(func=cmd_resume)
    sp = sub.add_parser("methods", help="list the methods")
    sp.set_defaults(func=cmd_methods)
    sp = sub.add_parser("export", help="export a run's global model: PEFT LoRA adapter or merged model")
    sp.add_argument("run_dir", help="the run directory (needs a checkpoint)")
    sp.add_argument("--format", choices=("peft", "merged"), default="peft", help="default: peft")
    sp.add_argument("--rank", type=int, default=None,
                    help="peft only: re-factorise each target's total update to this rank by truncated SVD")
    sp.add_argument("--out", default=None, help="output directory (default: RUN_DIR/export-FORMAT[-rRANK])")
    sp.set_defaults(func=cmd_export)
    return p


def main(argv: list[str] | None = None) -> int:
    from .config import ConfigError
    from .runtime.checkpoint import CheckpointError
    from .runtime.simulator import DivergenceError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError, CheckpointError, DivergenceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

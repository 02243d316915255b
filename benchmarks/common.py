"""What every benchmark prints beside its figures: the command, load and versions."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path


def provenance(argv: list[str] | None = None) -> str:
    """The command (the script and ``argv``, else the process's arguments), the load average, the versions and
    the torch threads, as lines to print before a benchmark's figures."""
    import numpy
    import torch

    args = sys.argv[1:] if argv is None else argv
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"command: {' '.join([os.path.basename(sys.argv[0]), *args])}\nload average (1, 5, 15 min): {load}\n"
            f"python {platform.python_version()}, torch {torch.__version__}, numpy {numpy.__version__}, "
            f"threads {torch.get_num_threads()}, cpus {os.cpu_count()}")


def keep_records(records: Path, out: Path, homes: list[str], into_out: bool) -> None:
    """Copy the finished runs of each folder in ``homes`` from ``records`` into ``out`` (``into_out``) or back
    (:func:`fedlowrank.experiments.sweep.copy_finished_runs`: four small files a run, all that a verdict and a
    resumed sweep read, only while they match their seal), logging to stderr what was copied and what was refused."""
    from fedlowrank.experiments.sweep import copy_finished_runs

    src, dest = (records, out) if into_out else (out, records)
    for home in homes:
        if (src / home).is_dir():
            written, skipped, refused = copy_finished_runs(src / home, dest / home)
            for line in refused:
                print(f"--records: not copied: {line}", file=sys.stderr, flush=True)
            runs = f"{len(written)} finished run{'' if len(written) == 1 else 's'}"
            print(f"--records: {runs} of {home} copied from {src / home} to {dest / home} ({len(skipped)} there "
                  f"already, kept as they are{f'; {len(refused)} refused' if refused else ''})", file=sys.stderr,
                  flush=True)


def run_resumable(main) -> int:
    """``main()``'s exit status for a script whose runs resume (``--resume``, or reused from ``--out``): stopped by
    Ctrl-C or SIGTERM (:class:`fedlowrank.runtime.stopping.StopRequested`), it prints one line, not a traceback, and
    returns 128 + the signal's number; the finished runs and the interrupted run's checkpoint stay on disk (SIGTERM
    stops it as Ctrl-C does: its worker processes are stopped and waited for, not left running). An error that is
    the user's to fix (bad input, a data set that is not there: :func:`fedlowrank.cli.is_user_error`) is one
    ``error:`` line and exit status 2, as in the ``fedlowrank`` command."""
    from fedlowrank.cli import error_line, is_user_error
    from fedlowrank.runtime.stopping import terminate_as_interrupt

    try:
        with terminate_as_interrupt():
            return main()
    except KeyboardInterrupt as exc:
        name = getattr(exc, "name", "SIGINT")
        print(f"stopped by {name}: the finished runs and the last checkpoint are kept; the same command continues "
              "from them", file=sys.stderr)
        return getattr(exc, "exit_status", 130)
    except Exception as exc:
        if not is_user_error(exc):
            raise
        print(error_line(exc), file=sys.stderr)
        return 2


def median_seconds(fn, repeats: int) -> tuple[float, object]:
    """The median wall time of ``repeats`` calls of ``fn()`` (seconds) and the last call's result."""
    import statistics
    import time

    out, times = None, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def setup_line(cfg, task) -> str:
    """The data and budget of a run as it was run: data source, the training and test examples actually used,
    partition, rounds, local steps, batch, the run's method, learning rate and seed (one line)."""
    from fedlowrank.experiments.compare import describe_partition, setup_of

    s = setup_of(cfg, task.describe(), [cfg.run.seed])
    local = f"{s['local_epochs']:g} local epochs" if s["local_epochs"] > 0 else f"{s['local_steps']} local steps"
    return (f"setup as run: {s['data_source']}: {s['num_train']:,} training / {s['num_test']:,} test examples used; "
            f"{s['model'] or cfg.task.kind}; {describe_partition(s['partition'])}, {s['clients_per_round']} per round; "
            f"{s['rounds']} rounds of {local} of batch {s['batch_size']}; {cfg.method_name} at lr {cfg.train.lr:g}; "
            f"seed {cfg.run.seed}")


def sweep_options(parser) -> None:
    """The options of a script's grid of runs (:class:`Grid`): ``--jobs``, ``--runs-dir``, ``--resume``."""
    group = parser.add_argument_group("runs (fedlowrank.experiments.sweep)")
    group.add_argument("--jobs", type=int, default=1, help="worker processes for the runs (> 1 needs --runs-dir)")
    group.add_argument("--runs-dir", default="", help="write each run's run directory here, named by its label")
    group.add_argument("--resume", action="store_true",
                       help="read each run that ended in --runs-dir with the same config instead of running it")


class Grid:
    """A script's runs, run by :class:`fedlowrank.experiments.sweep.Sweep` (its worker processes, run directories
    and resumption) with the options of :func:`sweep_options`; each task is built once per seed and data."""

    def __init__(self, args, metric: str = "accuracy"):
        from pathlib import Path

        from fedlowrank.config import ConfigError
        from fedlowrank.experiments.sweep import Sweep

        if args.resume and not args.runs_dir:
            raise SystemExit("error: --resume reads the runs in --runs-dir; give --runs-dir")
        try:
            self.sweep = Sweep(Path(args.runs_dir) if args.runs_dir else None, jobs=args.jobs, resume=args.resume)
        except ConfigError as exc:
            raise SystemExit(f"error: {exc} (--runs-dir)") from None
        self.metric = metric
        self.runs: list = []

    def task(self, cfg):
        """The task of ``cfg``, built once (shared with the runs in this process)."""
        return self.sweep.task(cfg)

    def add(self, label: str, cfg) -> int:
        """Add the run of ``cfg`` named ``label`` (its run directory: the label with each run of other characters
        than letters, digits and ``.=+-`` as one ``_``); returns its index."""
        import re

        from fedlowrank.experiments.sweep import Run

        run_dir = self.sweep.out / re.sub(r"[^A-Za-z0-9.=+-]+", "_", label) if self.sweep.out is not None else None
        self.runs.append(Run(cfg.method_name, label, cfg, run_dir, self.metric))
        return len(self.runs) - 1

    @staticmethod
    def seconds(outcome) -> float:
        """A run's wall time, set-up included; for a run read back with ``--resume``, the time its rounds took."""
        return outcome.seconds if outcome.seconds is not None else outcome.summary["time"]["total"]

    def run(self, on_done) -> list:
        """Run every run (a divergence raises); ``on_done(i, outcome)`` hears run ``i`` as soon as it and every run
        before it have ended (:class:`~fedlowrank.experiments.sweep.Outcome`: ``history``, ``metrics``,
        ``summary``)."""
        from fedlowrank.config import ConfigError

        try:
            return self.sweep.run(self.runs, stop_on_divergence=True, on_done=on_done)
        except ConfigError as exc:  # a run directory of another run, a refused setting
            raise SystemExit(f"error: {exc}") from None

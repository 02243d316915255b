"""One sweep of federated runs, shared by ``fedlowrank compare`` and ``fedlowrank tune``.

A sweep is a list of :class:`Run` (a method at one config and seed, with its run directory). :class:`Sweep`
builds each task once (per :func:`task_key`), each seed's partition once, and for tuning each client's validation
split (:func:`split_validation`); checks the pairing before anything trains (:meth:`Sweep.check_pairing`: every
run of one seed trains on the same partition, and evaluates on the same validation split); then runs them
(:meth:`Sweep.run`):

* one after another in this process (with the runs' progress lines), or in ``jobs`` worker processes
  (:func:`run_in_processes`), each run writing its run directory, read back with :func:`finished_run`; the results
  are the same either way;
* over the ranks of a ``torch.distributed`` job (``torchrun``, or ``run.devices`` through the command line):
  rank 0 deals the runs to the ranks in run order, round-robin (:func:`deal`, :func:`serve_ranks`); each rank runs
  its share one after another, each run a plain one-process run on the rank's device; the ranks meet at a gather
  (the divergence messages) and rank 0 reads the runs back with :func:`finished_run`; the results are the same;
* with ``resume``, a run directory whose run ended with the same config is read instead of run again, so an
  interrupted sweep continues where it stopped and runs made by separate processes into one ``out`` combine;
* each run by the runner its config asks for (:func:`runner`: the simulator, or the vectorised runner with
  ``run.vectorized``), its outcome handed to ``on_done`` in the order of the runs as they end;
* progress lines: ``run k of N: LABEL (ETA 0:04:10 for 3 runs)`` as a run starts in this process (``(worker
  process PID)`` in a worker), each round's line of a run in a worker prefixed with ``LABEL:``, and ``run k of N
  done: LABEL: METRIC`` as it ends (in the order of the runs, with the ETA when the runs end in worker processes);
  the ETA is the mean measured time of the runs ended × the runs left, less what the running ones have done,
  over the runs going at once;
* stopped (Ctrl-C, SIGTERM), the run in this process or each worker's saves its state after its last finished
  round and the sweep raises ``KeyboardInterrupt`` (:func:`run_in_processes`); ``--resume`` continues it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pickle
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..config import ConfigError, RunConfig
from ..privacy.runtime import PRIVACY_KEYS
from ..reporting.progress import format_eta
from ..seeding import numpy_rng

Log = Callable[[str], None] | None

SUMMARY_KEYS = ("method", "rounds", "bytes_up", "bytes_down", "time", "peak_rss_mb", "best_accuracy",
                *PRIVACY_KEYS, "initial")  # summary.json keys that are not the final evaluation


def task_key(cfg: RunConfig) -> str:
    """What a built task depends on: the seed, the [task] and [data] sections and whether it packs a cohort's
    batches (:func:`~fedlowrank.runtime.plan.packs_cohorts`)."""
    from ..runtime.plan import packs_cohorts

    return json.dumps([cfg.run.seed, dataclasses.asdict(cfg.task), dataclasses.asdict(cfg.data), packs_cohorts(cfg)],
                      sort_keys=True)


def built_task(cfg: RunConfig):
    """The task of ``cfg`` as its run builds it (:func:`~fedlowrank.runtime.plan.packs_cohorts`)."""
    from ..runtime.plan import packs_cohorts
    from ..tasks import build_task

    return build_task(cfg, cohorts=packs_cohorts(cfg))


def partition_digest(parts: list[np.ndarray]) -> str:
    """A short hash of the client index arrays (equal digests = the same partition)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(np.int64(len(p)).tobytes() + np.asarray(p, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def split_validation(parts: list[np.ndarray], fraction: float, seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Hold out ``floor(fraction · n_k)`` of client k's examples (at most ``n_k − 1``), chosen by the seeded
    stream ``("validation", k)``. Returns the clients' training indices and the sorted validation indices."""
    train_parts, held = [], []
    for k, p in enumerate(parts):
        n_hold = min(int(math.floor(fraction * len(p))), len(p) - 1)
        order = numpy_rng(seed, "validation", k).permutation(len(p))
        held.append(p[order[:n_hold]])
        train_parts.append(np.sort(p[order[n_hold:]]))
    return train_parts, np.sort(np.concatenate(held)) if held else np.array([], dtype=np.int64)


def check_jobs(jobs: int, out: Path | None) -> None:
    """Refuse a ``--jobs`` that is not a positive integer, or ``> 1`` without an output directory."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"--jobs must be an integer >= 1, got {jobs!r}")
    if jobs > 1 and out is None:
        raise ConfigError("--jobs > 1 needs an output directory (the worker processes write their runs there)")


def ran_to_its_end(summary: dict[str, Any], last_row: dict[str, Any] | None) -> bool:
    """Whether a run's ``metrics.jsonl`` (its last row) reaches the round its ``summary.json`` ends at."""
    return last_row is not None and last_row.get("round") == summary.get("rounds")


def finished_run(run_dir: Path, cfg: RunConfig) -> dict[str, Any] | None:
    """``{"summary": summary.json, "history": metrics.jsonl rows, "metrics": the final evaluation}`` of the run
    that ended in ``run_dir``, or ``None`` when none did there (no ``summary.json``: never started or interrupted; or
    ``metrics.jsonl`` does not reach the round ``summary.json`` ends at).

    A run that ended with another config than ``cfg`` (its ``config.json`` has another fingerprint,
    :func:`fedlowrank.runtime.checkpoint.config_fingerprint`; ``run.device`` aside), or whose files are not those
    it wrote (:func:`~fedlowrank.runtime.rundir.seal_problem`: edited, linked or unsealed), raises
    :class:`ConfigError`: reusing it would mix two experiments, or trust what the run did not write."""
    from ..config import from_dict
    from ..runtime.checkpoint import config_fingerprint

    from ..runtime.rundir import seal_problem

    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--resume: {run_dir / 'summary.json'} is unreadable ({exc}); delete {run_dir} to run "
                          "it again") from None
    try:
        old = from_dict(json.loads((run_dir / "config.json").read_text()))
        history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    except (OSError, json.JSONDecodeError, ConfigError) as exc:
        raise ConfigError(f"--resume: the finished run in {run_dir} is unreadable ({exc}); delete it to run it "
                          "again") from None
    if not ran_to_its_end(summary, history[-1] if history else None):  # its metrics were cut: run it again
        return None
    problem = seal_problem(run_dir)  # a run that looks finished: only as it was written
    if problem is not None:
        raise ConfigError(f"--resume: the finished run in {run_dir} is not reused: {problem}; delete {run_dir} to "
                          "run it again")
    same_device = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, device=old.run.device))
    if config_fingerprint(old) != config_fingerprint(same_device):  # a rank of a sweep pins its device
        raise ConfigError(f"--resume: {run_dir} holds a run of another config than this one (different settings "
                          "or learning rate); use another --out, or delete that directory")
    metrics = {k: v for k, v in summary.items() if k not in SUMMARY_KEYS}
    return {"summary": summary, "history": history, "metrics": metrics}


RECORD_FILES = ("config.json", "metrics.jsonl", "summary.json", "seal.json")  # all that finished_run reads


def copy_finished_runs(src: Path, dest: Path) -> tuple[list[Path], list[Path], list[str]]:
    """Copy every finished run under ``src`` (a run directory whose ``metrics.jsonl`` reaches the round its
    ``summary.json`` ends at) to the same relative place under ``dest``: its :data:`RECORD_FILES` and a claim owning
    them, all that a sweep continued there with ``resume`` reads instead of running the run again. A run whose place
    under ``dest`` exists already is left as it is there; one whose files are not those it wrote
    (:func:`~fedlowrank.runtime.rundir.seal_problem`: edited since, linked from elsewhere, unsealed) is not copied,
    and a linked folder is not followed. Returns (the run directories written under ``dest``, the places skipped
    because they existed, a line for each run refused)."""
    from ..runtime.rundir import new_claim, read_claim, seal_problem, write_claim

    src = Path(src)
    written: list[Path] = []
    skipped: list[Path] = []
    refused = [f"{p} is a symbolic link (not followed)" for p in sorted(src.rglob("*")) if p.is_symlink() and p.is_dir()]
    for summary in sorted(src.rglob("summary.json")):  # never below a linked folder
        run_dir = summary.parent
        claim = read_claim(run_dir)
        if claim is None or claim.kind != "run":
            continue
        problem = seal_problem(run_dir)
        if problem is not None:
            refused.append(problem)
            continue
        try:
            rows = (run_dir / "metrics.jsonl").read_text().splitlines()
            if not ran_to_its_end(json.loads(summary.read_text()), json.loads(rows[-1]) if rows else None):
                continue
        except (OSError, ValueError, AttributeError):
            continue
        target = Path(dest) / run_dir.relative_to(src)
        if target.exists():
            skipped.append(target)
            continue
        target.mkdir(parents=True)
        write_claim(target, new_claim("run", list(RECORD_FILES)))
        for name in RECORD_FILES:  # the seal last: a copy cut short reads as a run that cannot be reused
            (target / name).write_bytes((run_dir / name).read_bytes())
        written.append(target)
    return written, skipped, refused


def interrupted_run(run_dir: Path, cfg: RunConfig) -> bool:
    """Whether ``run_dir`` holds a run of exactly ``cfg`` (its ``config.json``'s fingerprint) that stopped before its
    end with a checkpoint saved (``checkpoints/round-N``): one ``--resume`` continues rather than starts again."""
    from ..config import from_dict
    from ..runtime.checkpoint import checkpoint_folders, config_fingerprint

    if (run_dir / "summary.json").is_file() or not checkpoint_folders(run_dir):
        return False
    try:
        old = from_dict(json.loads((run_dir / "config.json").read_text()))
    except (OSError, ValueError, ConfigError):
        return False
    return config_fingerprint(old) == config_fingerprint(cfg)


def runner(cfg: RunConfig, task, parts: list[np.ndarray], run_dir: Path | None, log: Log, log_partition: bool,
           overwrite: bool, one_process: bool = False):
    """The runner of ``cfg`` (:func:`fedlowrank.runtime.runner_for`; ``one_process``: not the distributed one) on
    ``task`` with the clients' index arrays ``parts``: the simulator, or with ``run.vectorized`` the vectorised
    runner, which partitions ``task`` itself (the same partition as :meth:`Sweep.partition`; a run with a
    validation split is refused by :meth:`Sweep.run`). A vectorised run that diverges stops and says so in its
    summary (``diverged_at``) instead of raising.

    With ``overwrite`` (``--resume``), a run of ``cfg`` interrupted in ``run_dir`` (:func:`interrupted_run`)
    continues from its newest intact checkpoint (a damaged one is skipped; none intact: it starts again); any
    other run there is started again."""
    from ..runtime import runner_for
    from ..runtime.checkpoint import CheckpointError

    cls = runner_for(cfg, one_process)
    build = {} if cfg.run.vectorized else {"parts": parts}
    if overwrite and run_dir is not None and interrupted_run(run_dir, cfg):
        try:
            run = cls.resume(run_dir, task=task, log=log, **build)
        except CheckpointError as exc:
            if log is not None:
                log(f"{run_dir}: no intact checkpoint to continue from ({exc}); running it again from the start")
        else:
            if log is not None:
                log(f"continuing the interrupted run in {run_dir} after round {run.round}")
            return run
    if cfg.run.vectorized:
        return cls(cfg, task=task, run_dir=run_dir, log=log, overwrite=overwrite)
    return cls(cfg, task=task, run_dir=run_dir, log=log, parts=parts, overwrite=overwrite, log_partition=log_partition)


_WORKER_TASKS: dict[str, Any] = {}  # a worker process's built tasks (task_key → task), reused by its later runs


def _run_one(cfg: RunConfig, run_dir: Path, parts: list[np.ndarray], held_out: np.ndarray | None,
             overwrite: bool, log_partition: bool, log: Log, one_process: bool = False) -> str | None:
    """One run in a worker process (:func:`run_in_processes`): on the validation view of ``held_out`` when
    given (``fedlowrank tune``), on ``parts``; progress lines to ``log`` (the partition's label counts with
    ``log_partition``); ``one_process``: a rank's run of a sweep over ranks (:func:`_run_share`). Returns
    ``None``, or the message of a divergence."""
    from ..runtime.simulator import DivergenceError

    key = task_key(cfg)
    if key not in _WORKER_TASKS:
        _WORKER_TASKS[key] = built_task(cfg)
    task = _WORKER_TASKS[key]
    try:
        runner(cfg, task if held_out is None else task.validation(held_out), parts, run_dir, log, log_partition,
               overwrite, one_process).run()
    except DivergenceError as exc:
        return str(exc)
    return None


def _stop_worker(signum: int, frame) -> None:
    from ..runtime.stopping import StopRequested

    raise StopRequested(signum)


def _stop_when_orphaned(parent: int) -> None:
    """A worker's watch: once its parent process has ended without stopping it (killed with SIGKILL, say), stop as
    on the parent's SIGTERM, saving the run's state, rather than train on with nobody to read its events."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


def _worker(tasks, events, lines: bool) -> None:
    """A worker process of :func:`run_in_processes`: runs ``(i, arguments of _run_one)`` from ``tasks`` until
    ``None`` and reports on ``events``: ``("start", i, pid)``, ``("line", i, progress line)`` (with ``lines``),
    ``("done", i, divergence message or None)``, ``("failed", i, exception)``, ``("stopped", i or None, pid)``.

    It ignores SIGINT (Ctrl-C on a terminal reaches the whole process group: the parent decides) and stops on
    the SIGTERM its parent forwards, or stops likewise when its parent has ended (:func:`_stop_when_orphaned`): a
    run in progress saves the state after its last finished round (:mod:`fedlowrank.runtime.stopping`), then the
    worker ends. A second stop signal (the parent's forwarded SIGTERM after one from elsewhere) that arrives while
    the first is handled ends it the same way. Its runs' files closed and its events sent, it ends without the
    interpreter's teardown, which takes seconds with torch loaded (and much longer on a busy machine) while the
    parent waits for it. ``events`` is this worker's own queue: a worker killed while it writes (SIGKILL) cannot
    leave another one's writes waiting on the lock it held."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop_worker)
    threading.Thread(target=_stop_when_orphaned, args=(os.getppid(),), daemon=True).start()
    i = None
    try:
        try:
            for i, arguments in iter(tasks.get, None):
                events.put(("start", i, os.getpid()))
                log = (lambda line, i=i: events.put(("line", i, line))) if lines else None
                try:
                    message = _run_one(*arguments, log=log)
                except Exception as exc:
                    events.put(("failed", i, _picklable(exc)))
                    break
                events.put(("done", i, message))
                i = None
        except KeyboardInterrupt:
            _report_stopped(events, i)
    except KeyboardInterrupt:  # the second stop signal, arrived while the first was handled
        _report_stopped(events, i)
    events.close()
    events.join_thread()  # every event is in the pipe
    sys.stderr.flush()
    os._exit(0)


def _report_stopped(events, i: int | None) -> None:
    """A stopped worker's last event: further stop signals are ignored, then ``("stopped", i, pid)`` is sent."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    events.put(("stopped", i, os.getpid()))


def _picklable(exc: Exception) -> Exception:
    """``exc``, or a ``RuntimeError`` with its text when it cannot be sent to the parent process."""
    try:
        pickle.dumps(exc)
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


Event = tuple[str, int, Any]


def run_in_processes(runs: list[tuple[str, RunConfig, Path, list[np.ndarray], np.ndarray | None]], jobs: int,
                     overwrite: bool, report: Callable[[str, int, Any], None] | None = None,
                     lines: bool = False) -> dict[str, str]:
    """Run ``(label, cfg, run_dir, parts, held_out)`` in ``jobs`` worker processes (spawned: no state shared with
    this one), ``run.threads`` torch threads each (0: ``os.cpu_count() // jobs``, at least 1); every run writes its
    run directory, to be read back with :func:`finished_run`. ``report(kind, i, value)`` hears, for run ``i`` of
    ``runs``: ``"start"`` (the worker's pid), ``"line"`` (a progress line of the run, with ``lines``) and
    ``"done"`` (its divergence message or ``None``). Returns ``{label: divergence message}`` of the runs that
    diverged; any other error of a worker is raised here.

    Stopped (``KeyboardInterrupt``: Ctrl-C, or SIGTERM through the command line), or on a worker's error, it
    forwards SIGTERM to every worker, waits for each to save its run's state (a run stops at once in local
    training or evaluation, else as soon as its round is committed), then raises; a second stop while it waits
    kills the workers at once. A worker stopped by a signal from elsewhere stops the sweep the same way."""
    import multiprocessing

    from ..runtime.stopping import StopRequested

    report = report or (lambda kind, i, value: None)
    threads = max(1, (os.cpu_count() or 1) // jobs)
    ctx = multiprocessing.get_context("spawn")
    tasks = ctx.Queue()
    tasks.cancel_join_thread()  # at exit, do not wait to write the runs left into a pipe no live worker reads
    partitions: set[str] = set()  # the label counts of a partition are logged once, with its first run
    for i, (_, cfg, run_dir, parts, held_out) in enumerate(runs):
        cfg = cfg if cfg.run.threads else dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, threads=threads))
        digest = partition_digest(parts)
        tasks.put((i, (cfg, run_dir, parts, held_out, overwrite, digest not in partitions)))
        partitions.add(digest)
    events = [ctx.Queue() for _ in range(min(jobs, len(runs)))]  # one per worker (:func:`_worker`)
    workers = [ctx.Process(target=_worker, args=(tasks, q, lines), daemon=True) for q in events]
    for _ in workers:
        tasks.put(None)
    diverged: dict[str, str] = {}
    running: dict[int, Any] = {}  # run index → the worker process running it
    ended: dict[int, float] = {}  # run index (-1: every worker) → when its worker was first seen ended
    try:
        for w in workers:
            w.start()
        left = len(runs)
        while left:
            kind, i, value = _next_event(events, workers, running, runs, ended)
            if kind == "start":
                running[i] = next(w for w in workers if w.pid == value)
            elif kind == "failed":
                raise value
            elif kind == "stopped":  # a worker stopped by a signal from elsewhere stops the sweep
                raise StopRequested(signal.SIGTERM)
            elif kind == "done":
                running.pop(i)
                left -= 1
                if value is not None:
                    diverged[runs[i][0]] = value
            report(kind, i, value)
    except BaseException:
        _stop_workers(workers, events, report)
        raise
    for w in workers:
        w.join()
    return diverged


class WorkerLost(RuntimeError):
    """A worker process ended (killed from outside: SIGKILL, the out-of-memory killer) before the run it held
    finished; the sweep stops its other workers, which save their runs, and ``--resume`` continues."""


def _ended_how(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


GRACE = 1.0  # seconds the last events of a worker that ended may take to arrive


def _get_event(events: list, timeout: float) -> Event:
    """The next event on any of the workers' queues ``events``; ``queue.Empty`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        for q in events:
            try:
                return q.get_nowait()
            except queue.Empty:
                pass
        if time.monotonic() > deadline:
            raise queue.Empty
        time.sleep(0.01)


def _next_event(events: list, workers: list, running: dict[int, Any], runs: list, ended: dict[int, float]) -> Event:
    """The next event of a worker; :class:`WorkerLost` once a worker that holds a run has ended (or every worker
    has, with runs left) and :data:`GRACE` has passed without its last events. ``ended``: when each was first seen
    ended (by run; -1: every worker), kept by the caller between calls."""
    while True:
        now = time.monotonic()
        for i, w in running.items():
            if not w.is_alive():
                ended.setdefault(i, now)
        if not any(w.is_alive() for w in workers):
            ended.setdefault(-1, now)
        if any((i == -1 or i in running) and now - t > GRACE for i, t in ended.items()):
            lost = [f"{runs[i][0]} ({_ended_how(w.exitcode)})" for i, w in running.items() if not w.is_alive()]
            raise WorkerLost(f"the worker process of {', '.join(lost) or 'the runs left'} ended before its run "
                             "finished")
        try:
            return _get_event(events, timeout=0.25)
        except queue.Empty:
            continue


def _stop_workers(workers: list, events: list, report: Callable[[str, int, Any], None]) -> None:
    """Forward SIGTERM to the live workers and wait until each has saved its run's state and ended, passing on
    their last progress lines; a second stop meanwhile kills them."""
    try:
        for w in workers:
            if w.is_alive():
                os.kill(w.pid, signal.SIGTERM)
        while any(w.is_alive() for w in workers):
            try:
                kind, i, value = _get_event(events, timeout=0.2)
            except queue.Empty:
                continue
            if kind == "line":
                report(kind, i, value)
    except BaseException:
        for w in workers:
            if w.is_alive():
                w.kill()
        raise
    finally:
        for w in workers:
            if w.pid is not None:  # started
                w.join()


Work = tuple[RunConfig, Path, list[np.ndarray], np.ndarray | None, bool, bool]  # _run_one's arguments but log


SWEEP_BACKEND = "gloo"  # the sweep's collectives carry small objects; gloo lets ranks share a GPU


def deal(n: int, world: int, rank: int) -> list[int]:
    """The runs (of ``n``, in run order) that rank ``rank`` of ``world`` runs: round-robin, ``rank, rank + world,
    ...``."""
    return list(range(rank, n, world))


def _run_share(work: list[Work], log: Log) -> dict[int, str | None]:
    """This rank's share of ``work`` (:func:`deal`), one after another, each run pinned to the rank's device
    (:func:`~fedlowrank.runtime.distributed.init_process_group`) with ``run.devices`` cleared and ``run.threads``
    torch threads (0: the cores / the ranks on this machine, at least 1); ``{index in work: divergence message or
    None}``."""
    import torch.distributed as dist

    from ..runtime.distributed import init_process_group

    threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())))
    done = {}
    for i in deal(len(work), dist.get_world_size(), dist.get_rank()):
        cfg, *arguments = work[i]
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, device=str(init_process_group(cfg)),
                                                               devices=[], threads=cfg.run.threads or threads))
        done[i] = _run_one(cfg, *arguments, log=log, one_process=True)
    return done


def _collective(fn, *args, **kwargs) -> None:
    """``fn(*args, **kwargs)``, a collective of the sweep's ranks; its failure (a rank stopped, or did not answer
    within ``run.collective_timeout_s``) is one :class:`~fedlowrank.runtime.distributed.RankFailure` line."""
    import torch.distributed as dist

    from ..runtime.distributed import RankFailure

    try:
        fn(*args, **kwargs)
    except Exception as exc:
        raise RankFailure(f"rank {dist.get_rank()} of {dist.get_world_size()}: another rank of the sweep stopped or "
                          f"did not answer within run.collective_timeout_s ({type(exc).__name__}); the finished runs "
                          "are kept: run the same command with --out and --resume to continue") from None


def _meet(done: dict[int, str | None]) -> dict[int, str | None]:
    """Every rank's ``done`` (:func:`_run_share`) gathered to rank 0 (``{}`` on the others): the ranks meet here,
    within ``run.collective_timeout_s`` of the slowest."""
    import torch.distributed as dist

    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    _collective(dist.gather_object, done, out, dst=0)
    return {i: m for d in out for i, m in d.items()} if out is not None else {}


def serve_ranks(cfg: RunConfig, quiet: bool = False) -> None:
    """A rank other than 0 of a sweep over ranks: joins the job (``cfg``: its ``run.devices`` and
    ``run.collective_timeout_s``), then runs its share of each list of runs rank 0 sends (:meth:`Sweep.run`), until
    rank 0 sends ``None`` (:func:`end_ranks`). Its runs' progress lines go to stderr, prefixed with the rank
    (none with ``quiet``)."""
    import torch.distributed as dist

    from ..runtime.distributed import init_process_group

    init_process_group(cfg, SWEEP_BACKEND)
    rank = dist.get_rank()
    while True:
        box: list[Any] = [None]
        _collective(dist.broadcast_object_list, box, src=0)
        if box[0] is None:
            _collective(dist.barrier)  # end_ranks' last collective: no rank tears the group down before all are here
            return
        _meet(_run_share(box[0], None if quiet else lambda line: print(f"rank {rank}: {line}", file=sys.stderr,
                                                                        flush=True)))


def end_ranks() -> None:
    """Rank 0 of a sweep over ranks, its sweep done: tell the other ranks (:func:`serve_ranks`) that no runs
    follow, then wait at a barrier for all of them, so that no rank destroys the process group while a message of
    the broadcast is still in flight. (Rank 0 stopped by an error sends nothing: the others' next collective fails
    and they end.)"""
    import torch.distributed as dist

    if dist.is_initialized():
        _collective(dist.broadcast_object_list, [None], src=0)
        _collective(dist.barrier)


@dataclass(frozen=True)
class Run:
    """One run of a sweep: ``method`` at ``cfg`` (its seed is ``cfg.run.seed``), writing ``run_dir`` (``None``:
    nothing written); named ``label`` in progress lines, which show its final ``metric``. ``validation``: each
    client holds out ``data.validation_fraction`` of its examples, and the model is evaluated on them instead of
    the test set (``fedlowrank tune``)."""

    method: str
    label: str
    cfg: RunConfig
    run_dir: Path | None
    metric: str
    validation: bool = False


@dataclass
class Outcome:
    """What a run left: its metrics rows (``metrics.jsonl``), its final evaluation (``metrics``: test set, or the
    validation split), ``summary.json`` (``None`` when it diverged), the divergence message, whether an earlier
    run directory was read instead of running it (``reused``), and the run's wall time in seconds, from its start
    to its end in this sweep, set-up and evaluations included (``None`` when reused)."""

    history: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    summary: dict[str, Any] | None = None
    diverged: str | None = None
    reused: bool = False
    seconds: float | None = None


class Sweep:
    """Runs that share tasks, partitions and validation splits (see the module docstring).

    Args:
        out: the directory the runs write under (``None``: nothing written; then ``jobs`` must be 1).
        jobs: worker processes (1: this process).
        resume: read each run that ended in its run directory with the same config instead of running it.
        log: where progress lines go (``None``: silent).
        ranks: this process is rank 0 of a ``torch.distributed`` job whose other ranks serve the sweep
            (:func:`serve_ranks`); needs ``out`` and ``jobs`` = 1.
    """

    def __init__(self, out: Path | None, jobs: int = 1, resume: bool = False, log: Log = None, ranks: bool = False):
        check_jobs(jobs, out)
        if ranks and (out is None or jobs > 1):
            raise ConfigError("a sweep over ranks needs an output directory (each rank writes its runs there) and "
                              "one worker per rank (--jobs 1)")
        self.out, self.jobs, self.resume, self.log, self.ranks = out, jobs, resume, log, ranks
        self._tasks: dict[str, Any] = {}
        self._partitions: dict[str, list[np.ndarray]] = {}
        self._splits: dict[str, tuple[list[np.ndarray], np.ndarray]] = {}
        self._logged_partitions: set[str] = set()
        self._paired: dict[int, tuple[Run, str]] = {}  # per seed: the first run checked and its data's digest

    # -- data ------------------------------------------------------------------------------------------------
    def task(self, cfg: RunConfig):
        """The task of ``cfg``, built once per :func:`task_key`."""
        key = task_key(cfg)
        if key not in self._tasks:
            self._tasks[key] = built_task(cfg)
        return self._tasks[key]

    def partition(self, cfg: RunConfig) -> list[np.ndarray]:
        """The clients' index arrays of ``cfg``'s task, ``[partition]`` and seed."""
        from ..tasks.partition import partition_task

        key = task_key(cfg) + json.dumps(dataclasses.asdict(cfg.partition), sort_keys=True)
        if key not in self._partitions:
            self._partitions[key] = partition_task(self.task(cfg), cfg.partition, cfg.run.seed)[0]
        return self._partitions[key]

    def split(self, cfg: RunConfig) -> tuple[list[np.ndarray], np.ndarray]:
        """(the clients' training indices, the validation indices) of ``cfg``'s partition
        (:func:`split_validation` with ``data.validation_fraction``)."""
        key = task_key(cfg) + json.dumps([dataclasses.asdict(cfg.partition), cfg.data.validation_fraction],
                                         sort_keys=True)
        if key not in self._splits:
            self._splits[key] = split_validation(self.partition(cfg), cfg.data.validation_fraction, cfg.run.seed)
        return self._splits[key]

    def data_of(self, run: Run) -> tuple[Any, list[np.ndarray], np.ndarray | None]:
        """(the task the run sees, its clients' training indices, the validation indices or ``None``)."""
        if not run.validation:
            return self.task(run.cfg), self.partition(run.cfg), None
        train_parts, held_out = self.split(run.cfg)
        return self.task(run.cfg).validation(held_out), train_parts, held_out

    def check_pairing(self, runs: list[Run]) -> None:
        """Refuse, before they train, runs of one seed that would train on different partitions (or evaluate on
        different validation splits): the first run of each seed checked by this sweep is the one the others, in
        this call and later ones, must match."""
        for run in runs:
            _, parts, held_out = self.data_of(run)
            digest = partition_digest(parts + ([held_out] if held_out is not None else []))
            first, first_digest = self._paired.setdefault(run.cfg.run.seed, (run, digest))
            if digest != first_digest:
                raise ConfigError(f"seed {run.cfg.run.seed}: {run.method!r} would train on another partition than "
                                  f"{first.method!r} (a per-method setting changes [data] or [partition]); paired "
                                  "runs need the same partition")

    # -- runs --------------------------------------------------------------------------------------------------
    def run(self, runs: list[Run], stop_on_divergence: bool = False,
            on_done: Callable[[int, Outcome], None] | None = None) -> list[Outcome]:
        """Run (or, with ``resume``, read) every run; returns their outcomes in the order of ``runs``. A diverged
        run's outcome carries its message; with ``stop_on_divergence`` it raises
        :class:`~fedlowrank.runtime.simulator.DivergenceError` instead (at once in this process; after the others
        have ended with ``jobs > 1``). ``on_done(i, outcome)`` hears each run as soon as it and every run before it
        have ended, in the order of ``runs``."""
        from ..runtime.simulator import DivergenceError

        for run in runs:
            if run.validation and run.cfg.run.vectorized:
                raise ConfigError(f"{run.label}: run.vectorized = true cannot hold out a validation split (the "
                                  "vectorised runner trains on its configured partition); use the simulator")
        outcomes: dict[int, Outcome] = {}
        heard = 0  # the runs on_done has heard: runs[:heard]

        def settle(i: int, outcome: Outcome) -> None:
            nonlocal heard
            outcomes[i] = outcome
            while heard < len(runs) and heard in outcomes:
                if on_done is not None:
                    on_done(heard, outcomes[heard])
                heard += 1

        pending: list[int] = []
        for i, run in enumerate(runs):
            done = finished_run(run.run_dir, run.cfg) if self.resume and run.run_dir is not None else None
            if done is None:
                pending.append(i)
                continue
            self._say(f"run {i + 1} of {len(runs)}: {run.label}: reusing the finished run in {run.run_dir}")
            settle(i, Outcome(done["history"], done["metrics"], done["summary"], reused=True))
        clock = _Clock(len(pending), self.jobs)
        if self.ranks and pending:
            self._run_on_ranks(runs, pending, settle)
            for i in pending:
                if outcomes[i].diverged is not None and stop_on_divergence:
                    raise DivergenceError(f"{runs[i].label}: {outcomes[i].diverged}")
        elif self.jobs > 1 and pending:
            self._say(f"{len(pending)} of {len(runs)} runs go to {self.jobs} worker processes")
            self._run_in_processes(runs, pending, clock, settle)
            for i in pending:
                if outcomes[i].diverged is not None and stop_on_divergence:
                    raise DivergenceError(f"{runs[i].label}: {outcomes[i].diverged}")
        else:
            for i in pending:
                self._say(f"run {i + 1} of {len(runs)}: {runs[i].label}{clock.suffix()}")
                clock.start(i)
                outcome = self._run_here(runs[i], stop_on_divergence)
                outcome.seconds = clock.end(i)
                self._say(f"run {i + 1} of {len(runs)} done: {runs[i].label}: {_result(runs[i], outcome)}")
                settle(i, outcome)
        return [outcomes[i] for i in range(len(runs))]

    def _say(self, line: str) -> None:
        if self.log is not None:
            self.log(line)

    def _run_here(self, run: Run, stop_on_divergence: bool) -> Outcome:
        from ..runtime.simulator import DivergenceError

        task, parts, _ = self.data_of(run)
        digest = partition_digest(parts)
        sim = runner(run.cfg, task, parts, run.run_dir, self.log, digest not in self._logged_partitions, self.resume)
        self._logged_partitions.add(digest)  # the label counts of a partition are logged once, with its first run
        try:
            summary = sim.run()
        except DivergenceError as exc:
            if stop_on_divergence:
                raise
            return Outcome(list(sim.history), {}, None, diverged=str(exc))
        return Outcome(sim.history, dict(sim.last_eval), summary)

    def _run_in_processes(self, runs: list[Run], pending: list[int], clock: "_Clock",
                          settle: Callable[[int, Outcome], None]) -> None:
        """The pending runs in worker processes: each one's start and progress lines (prefixed with its label) as
        they come, its "done" line once it and every pending run before it have ended; ``settle(i, outcome)`` as
        run ``i`` ends."""
        work = []
        for i in pending:
            _, parts, held_out = self.data_of(runs[i])
            work.append((runs[i].label, runs[i].cfg, runs[i].run_dir, parts, held_out))
        outcomes: dict[int, Outcome] = {}
        said = 0  # the done lines said: those of pending[:said]

        def report(kind: str, j: int, value: Any) -> None:
            nonlocal said
            i = pending[j]
            if kind == "start":
                clock.start(i)
                self._say(f"run {i + 1} of {len(runs)}: {runs[i].label} (worker process {value})")
            elif kind == "line":
                self._say(f"{runs[i].label}: {value}")
            else:
                seconds = clock.end(i)
                outcomes[i] = Outcome(diverged=value) if value is not None else self._read(runs[i])
                outcomes[i].seconds = seconds
                while said < len(pending) and pending[said] in outcomes:
                    k = pending[said]
                    said += 1
                    self._say(f"run {k + 1} of {len(runs)} done: {runs[k].label}: {_result(runs[k], outcomes[k])}"
                              f"{clock.suffix()}")
                    settle(k, outcomes[k])

        run_in_processes(work, self.jobs, self.resume, report, lines=self.log is not None)

    def _run_on_ranks(self, runs: list[Run], pending: list[int], settle: Callable[[int, Outcome], None]) -> None:
        """Rank 0 of a sweep over ranks: send the pending runs to every rank (:func:`serve_ranks`), run its own
        share (:func:`deal`), meet the others, then read every run back; ``settle(i, outcome)`` for each."""
        import torch.distributed as dist

        from ..runtime.distributed import init_process_group

        init_process_group(runs[pending[0]].cfg, SWEEP_BACKEND)
        work: list[Work] = []
        for i in pending:
            _, parts, held_out = self.data_of(runs[i])
            digest = partition_digest(parts)
            work.append((runs[i].cfg, runs[i].run_dir, parts, held_out, self.resume,
                         digest not in self._logged_partitions))
            self._logged_partitions.add(digest)
        self._say(f"{len(pending)} of {len(runs)} runs go to {dist.get_world_size()} ranks")
        _collective(dist.broadcast_object_list, [work], src=0)
        messages = _meet(_run_share(work, self.log))
        for j, i in enumerate(pending):
            outcome = Outcome(diverged=messages[j]) if messages[j] is not None else self._read(runs[i])
            self._say(f"run {i + 1} of {len(runs)} done: {runs[i].label}: {_result(runs[i], outcome)}")
            settle(i, outcome)

    @staticmethod
    def _read(run: Run) -> Outcome:
        assert run.run_dir is not None
        done = finished_run(run.run_dir, run.cfg)
        if done is None:
            raise ConfigError(f"{run.label}: its worker process ended without a finished run in {run.run_dir}")
        return Outcome(done["history"], done["metrics"], done["summary"])


def _result(run: Run, outcome: Outcome) -> str:
    """``accuracy 0.8125`` or ``diverged (message)``, for a run's last progress line."""
    if outcome.diverged is not None:
        return f"diverged ({outcome.diverged})"
    value = outcome.metrics.get(run.metric)
    where = "validation " if run.validation else ""
    return f"{where}{run.metric} {value:.4f}" if isinstance(value, (int, float)) else f"no {run.metric} reported"


class _Clock:
    """The ETA of the rest of a sweep from its measured run times: the mean time of the runs ended × the runs
    left, less the time the running ones have had (each counted up to that mean), shared by the ``jobs`` running
    at once."""

    def __init__(self, total: int, jobs: int = 1, clock: Callable[[], float] = time.perf_counter):
        self.total, self.jobs, self.clock = total, jobs, clock
        self.durations: list[float] = []
        self.started: dict[int, float] = {}  # run → when it started, for the runs going

    def start(self, run: int) -> None:
        self.started[run] = self.clock()

    def end(self, run: int) -> float:
        """The run's duration (also counted for the ETA)."""
        self.durations.append(self.clock() - self.started.pop(run))
        return self.durations[-1]

    def eta(self) -> float:
        if not self.durations:
            return math.nan
        mean, now = sum(self.durations) / len(self.durations), self.clock()
        left = self.total - len(self.durations)
        work = left * mean - sum(min(now - t, mean) for t in self.started.values())
        return max(work, 0.0) / max(1, min(self.jobs, left))

    def suffix(self) -> str:
        """`` (ETA 0:04:10 for 3 runs)`` once a run has ended and while runs are left, else nothing."""
        left = self.total - len(self.durations)
        if not self.durations or left == 0:
            return ""
        return f" (ETA {format_eta(self.eta())} for {left} run{'s' if left > 1 else ''})"

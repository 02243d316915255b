"""``fedlowrank compare``: several methods on the same partition, seeds and budget, with confidence intervals.

For each seed every method sees the same data, the same partition (a function of ``run.seed``, the labels and
``[partition]``), the same client sampling (``run.seed``, round) and the same local data order
(``run.seed``, client, round): the runs are *paired* by seed, and the partition's digest is checked to be the
same for every method. Per method: the final and best metric over rounds, as the mean over seeds and its 95%
Student-t interval (:mod:`fedlowrank.experiments.stats`); against the reference method, the per-seed differences, their
mean and paired t-interval, and a verdict ("better"/"worse" only where the interval excludes 0).

Settings per method, later ones winning: the method's preset (:func:`fedlowrank.methods.preset_overrides`),
``compare.overrides[method]``, the learning rate chosen by ``fedlowrank tune`` (``--tuned`` or
``compare.tuned``), then the user's ``--set``.

Files (when ``out`` is given): one run directory per (method, seed), ``results.json`` (setup, per-seed values,
means, intervals, paired differences), ``results.md`` (opens with the setup as run) and the plots.

``resume``: a run directory in ``out`` whose run ended (:func:`finished_run`) is read instead of run again; any
other is run from the start. So an interrupted comparison continues where it stopped, and runs made by
separate processes (one ``--methods m --seeds s`` each, with the same ``--out``) are combined by one last call.

``jobs``: the (method, seed) runs go to that many worker processes (:func:`run_in_processes`), each with
``run.threads`` torch threads (when 0: the cores divided by ``jobs``), and are read back from their run
directories; the results are the same as one process's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..config import ConfigError, RunConfig, load_config
from ..models.architectures import check_measures_quality
from ..reporting.progress import format_bytes
from .stats import CONFIDENCE, Interval, mean_interval, paired_interval, verdict

Log = Callable[[str], None] | None


def default_metric(cfg: RunConfig) -> str:
    """``run.stop_metric`` if set, else ``accuracy`` for text and image classification, the held-out ``loss`` for a
    causal LM and ``rel_error`` otherwise (the matrix regression)."""
    by_kind = {"text-classification": "accuracy", "image-classification": "accuracy", "causal-lm": "loss"}
    return cfg.run.stop_metric or by_kind.get(cfg.task.kind, "rel_error")


def higher_is_better(metric: str) -> bool:
    """``accuracy`` is maximised; every other metric of the tasks (loss, rel_error, objective) minimised."""
    return metric == "accuracy"


def method_settings(cfg: RunConfig, name: str, user_sets: list[str] | tuple[str, ...] = (),
                    tuned: dict[str, float] | None = None) -> list[str]:
    """The ``--set`` list that configures ``name`` in a comparison: the method's preset, then
    ``compare.overrides[name]``, then the tuned values (``{"train.lr": 1e-3, ...}``), then ``user_sets``."""
    from ..methods import preset_overrides

    chosen = [f"{key}={value!r}" for key, value in (tuned or {}).items()]
    return [f"method.name={name}", *preset_overrides(name), *cfg.compare.overrides.get(name, []), *chosen,
            *user_sets]


SUMMARY_KEYS = ("method", "rounds", "bytes_up", "bytes_down", "time", "peak_rss_mb", "best_accuracy", "epsilon")


def finished_run(run_dir: Path, cfg: RunConfig) -> dict[str, Any] | None:
    """``{"summary": summary.json, "history": metrics.jsonl rows, "metrics": the final evaluation}`` of the run
    that ended in ``run_dir``, or ``None`` when none did there (no ``summary.json``: never started or interrupted).

    A run that ended with another config than ``cfg`` (its ``config.json`` has another fingerprint,
    :func:`fedlowrank.runtime.checkpoint.config_fingerprint`) raises :class:`ConfigError`: reusing it would mix
    two experiments."""
    from ..config import from_dict
    from ..runtime.checkpoint import config_fingerprint

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
    if config_fingerprint(old) != config_fingerprint(cfg):
        raise ConfigError(f"--resume: {run_dir} holds a run of another config than this one (different settings "
                          "or learning rate); use another --out, or delete that directory")
    metrics = {k: v for k, v in summary.items() if k not in SUMMARY_KEYS}
    return {"summary": summary, "history": history, "metrics": metrics}


def check_jobs(jobs: int, out: Path | None) -> None:
    """Refuse a ``--jobs`` that is not a positive integer, or ``> 1`` without an output directory."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"--jobs must be an integer >= 1, got {jobs!r}")
    if jobs > 1 and out is None:
        raise ConfigError("--jobs > 1 needs an output directory (the worker processes write their runs there)")


_WORKER_TASKS: dict[str, Any] = {}  # a worker process's built tasks (task_key → task), reused by its later runs


def _run_one(cfg: RunConfig, run_dir: Path, parts: list[np.ndarray], held_out: np.ndarray | None,
             overwrite: bool) -> str | None:
    """One run in a worker process (:func:`run_in_processes`): on the validation view of ``held_out`` when
    given (``fedlowrank tune``), on ``parts``. Returns ``None``, or the message of a divergence."""
    from ..runtime.simulator import DivergenceError, Simulation
    from ..tasks import build_task

    key = task_key(cfg)
    if key not in _WORKER_TASKS:
        _WORKER_TASKS[key] = build_task(cfg)
    task = _WORKER_TASKS[key]
    try:
        Simulation(cfg, task=task if held_out is None else task.validation(held_out), run_dir=run_dir, parts=parts,
                   overwrite=overwrite).run()
    except DivergenceError as exc:
        return str(exc)
    return None


def run_in_processes(runs: list[tuple[str, RunConfig, Path, list[np.ndarray], np.ndarray | None]], jobs: int,
                     overwrite: bool, log: Log = None) -> dict[str, str]:
    """Run ``(label, cfg, run_dir, parts, held_out)`` in ``jobs`` worker processes (spawned: no state shared with
    this one), ``run.threads`` torch threads each (0: ``os.cpu_count() // jobs``, at least 1); every run writes its
    run directory, to be read back with :func:`finished_run`. Returns ``{label: divergence message}`` of the runs
    that diverged; any other error of a worker is raised here."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor, as_completed

    threads = max(1, (os.cpu_count() or 1) // jobs)
    diverged: dict[str, str] = {}
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_run_one, cfg if cfg.run.threads else
                               dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, threads=threads)),
                               run_dir, parts, held_out, overwrite): label
                   for label, cfg, run_dir, parts, held_out in runs}
        for i, future in enumerate(as_completed(futures), 1):
            label = futures[future]
            message = future.result()
            if message is not None:
                diverged[label] = message
            if log:
                log(f"{label}: {'diverged' if message else 'done'} ({i}/{len(runs)} runs)")
    return diverged


def parse_methods(text: str | list[str] | None, cfg: RunConfig) -> list[str]:
    """Method names from ``--methods a,b`` (or a list), default ``compare.methods``; non-empty, no repeats."""
    names = cfg.compare.methods if text is None else (text.split(",") if isinstance(text, str) else list(text))
    names = [n.strip() for n in names]
    if not names or not all(names):
        raise ConfigError(f"--methods: expected comma-separated method names, got {text!r}")
    if len(set(names)) != len(names):
        raise ConfigError(f"--methods: a method is named twice in {','.join(names)}")
    return names


def parse_seeds(text: str | list[int] | None, cfg: RunConfig) -> list[int]:
    """Seeds from ``--seeds 0,1`` (or a list), default ``compare.seeds``; non-empty integers, no repeats."""
    if text is None:
        seeds = list(cfg.compare.seeds)
    elif isinstance(text, str):
        try:
            seeds = [int(s) for s in text.split(",")]
        except ValueError:
            raise ConfigError(f"--seeds: expected comma-separated integers, got {text!r}") from None
    else:
        seeds = [int(s) for s in text]
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds: expected distinct integers, got {text!r}")
    return seeds


def read_tuned(path: str | Path, field: str = "compare.tuned") -> dict[str, dict[str, float]]:
    """The values chosen per method in a ``tune.json`` written by ``fedlowrank tune``: ``{method: {key: value}}``
    (the tuned parameter and those of the ``--tuned`` file it was tuned on; ``{"train.lr": lr}`` in the files of
    versions that tuned only the learning rate)."""
    try:
        chosen = json.loads(Path(path).read_text())["chosen"]
        sets = {name: entry["sets"] if "sets" in entry else {"train.lr": entry["lr"]} for name, entry in chosen.items()}
        return {name: {k: float(v) for k, v in values.items()} for name, values in sets.items()}
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{field}: {path} is not a tune.json written by fedlowrank tune ({exc})") from None


def partition_digest(parts: list[np.ndarray]) -> str:
    """A short hash of the client index arrays (equal digests = the same partition)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(np.int64(len(p)).tobytes() + np.asarray(p, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def task_key(cfg: RunConfig) -> str:
    """What a built task depends on: the seed and the [task] and [data] sections."""
    return json.dumps([cfg.run.seed, dataclasses.asdict(cfg.task), dataclasses.asdict(cfg.data)], sort_keys=True)


def data_source(cfg: RunConfig) -> str:
    """Where the data came from, in words."""
    d = cfg.data
    if cfg.task.kind == "matrix-regression":
        return "synthetic (" + ", ".join(f"{k} = {v}" for k, v in cfg.task.options.items()) + ")"
    if d.source == "agnews":
        from ..tasks.data import agnews_folder

        return f"AG News files in {agnews_folder(d.path)}"
    if d.source == "files":
        return f"files {d.train}" + (f" and {d.test}" if d.test else f" (test: a {d.test_fraction:g} stratified split)")
    if d.source == "hf":
        return f"Hugging Face dataset {d.hf_name}"
    if cfg.task.kind == "image-classification":
        opts = cfg.task.options
        where = {"fashion-mnist": f"Fashion-MNIST (classes {opts.get('classes', 'all')})",
                 "image-folder": f"image folder {d.train}" + (f" and {d.test}" if d.test else
                                                              f" (test: a {d.test_fraction:g} stratified split)"),
                 "hf-images": f"Hugging Face image set {d.hf_name}"}[d.source]
        return where + (f", domains {', '.join(opts['domains'])}" if opts.get("domains") else "")
    return f"{d.source} (test: a {d.test_fraction:g} stratified split)"


def setup_of(cfg: RunConfig, task_description: dict[str, Any], seeds: list[int]) -> dict[str, Any]:
    """The settings shared by every run of a comparison (or a tuning), as run."""
    p, t = cfg.partition, cfg.train
    partition = {"kind": p.kind, "num_clients": p.num_clients}
    if p.kind in ("dirichlet", "quantity", "clusters"):
        partition["alpha"] = p.alpha
    if p.kind == "clusters":
        partition["num_clusters"] = p.num_clusters
    if p.partition_by:
        partition["partition_by"] = p.partition_by
    if p.kind == "shards":
        partition["classes_per_client"] = p.classes_per_client
    if p.kind in ("dirichlet", "quantity", "clusters"):
        partition["min_partition_size"] = p.min_partition_size
    return {
        "task": cfg.task.kind, "model": task_description.get("model"),
        "data_source": data_source(cfg), "num_train": task_description.get("num_train"),
        "num_test": task_description.get("num_test"), "partition": partition,
        "clients_per_round": cfg.run.clients_per_round, "rounds": cfg.run.rounds, "eval_every": cfg.run.eval_every,
        "local_steps": t.local_steps, "local_epochs": t.local_epochs, "batch_size": t.batch_size, "seeds": seeds,
    }


def describe_partition(partition: dict[str, Any]) -> str:
    extra = ", ".join(f"{k} = {v:g}" if isinstance(v, float) else f"{k} = {v}"
                      for k, v in partition.items() if k not in ("kind", "num_clients"))
    return f"{partition['kind']}" + (f" ({extra})" if extra else "") + f", {partition['num_clients']} clients"


def setup_lines(setup: dict[str, Any]) -> list[str]:
    """The setup block as Markdown bullet lines."""
    sizes = f"{setup['num_train']:,} training examples" if setup["num_train"] is not None else ""
    if setup.get("num_test") is not None:
        sizes += f", {setup['num_test']:,} test examples"
    if setup.get("num_validation") is not None:
        sizes += (f" ({setup['num_validation']:,} of them held out for validation with seed {setup['seeds'][0]}; "
                  "tune.json gives each run's count)")
    local = (f"{setup['local_epochs']:g} local epoch(s)" if setup["local_epochs"] > 0
             else f"{setup['local_steps']} local steps")
    return [
        f"- task: {setup['task']}" + (f", model {setup['model']}" if setup["model"] else ""),
        f"- data: {setup['data_source']}; used: {sizes}",
        f"- partition: {describe_partition(setup['partition'])}; {setup['clients_per_round']} clients per round",
        f"- rounds: {setup['rounds']} (evaluated every {setup['eval_every']}); {local} of batch "
        f"{setup['batch_size']} per round",
        f"- seeds: {', '.join(map(str, setup['seeds']))}",
    ]


def _title(setup: dict[str, Any]) -> str:
    seeds = setup["seeds"]
    model = f" ({setup['model']})" if setup["model"] else ""
    return (f"{setup['task']}{model}, {describe_partition(setup['partition'])}, "
            f"{len(seeds)} seed{'s' if len(seeds) > 1 else ''}")


def _interval(d: dict[str, Any]) -> Interval:
    return Interval(d["mean"], d["half_width"], d["n"], d["sd"], d["confidence"])


def _metric_values(history: list[dict[str, Any]], metric: str) -> list[float]:
    return [r[metric] for r in history if metric in r]


def run_comparison(config: str | Path | None, methods: str | list[str] | None = None,
                   seeds: str | list[int] | None = None, overrides: list[str] | tuple[str, ...] = (),
                   out: str | Path | None = None, log: Log = None, *, reference: str | None = None,
                   tuned: str | Path | None = None, resume: bool = False, jobs: int = 1) -> dict[str, Any]:
    """Run every method on every seed and return the results (see the module docstring); with ``out`` also
    write the run directories, ``results.json``, ``results.md`` and the plots there; with ``resume`` reuse the
    runs that ended in ``out``; with ``jobs > 1`` run them in that many processes (needs ``out``).

    Args:
        config: a TOML file or bundled config name; ``overrides``: ``"section.key=value"`` strings for all.
        methods, seeds: default ``compare.methods`` and ``compare.seeds``.
        reference: the method the others are compared with, per seed (default: the first method).
        tuned: a ``tune.json`` whose chosen learning rates are applied (default: ``compare.tuned``).
    """
    from ..tasks.partition import partition_task
    from ..runtime.simulator import DivergenceError, Simulation
    from ..tasks import build_task

    overrides = list(overrides)
    base = load_config(config, overrides, method_checks=False)
    check_measures_quality(base.task.model, "compare")
    names = parse_methods(methods, base)
    seed_list = parse_seeds(seeds, base)
    reference = reference or names[0]
    if reference not in names:
        raise ConfigError(f"--reference: {reference!r} is not one of the compared methods ({', '.join(names)})")
    tuned = tuned or base.compare.tuned or None
    chosen = read_tuned(tuned) if tuned else {}
    missing = [n for n in names if tuned and n not in chosen]
    if missing:
        raise ConfigError(f"compare.tuned: {tuned} chose no value for {', '.join(missing)} "
                          f"(tuned: {', '.join(chosen) or 'none'})")
    settings = {n: method_settings(base, n, overrides, chosen.get(n)) for n in names}
    configs = {n: {s: load_config(config, [*settings[n], f"run.seed={s}"]) for s in seed_list} for n in names}
    metric = default_metric(base)
    out = Path(out) if out is not None else None
    check_jobs(jobs, out)

    tasks: dict[str, Any] = {}
    parts: dict[tuple[str, int], list[np.ndarray]] = {}
    # data and partitions first (the reference's first): the pairing is checked before any training
    for name in [reference, *(n for n in names if n != reference)]:
        for seed in seed_list:
            cfg = configs[name][seed]
            key = task_key(cfg)
            if key not in tasks:
                tasks[key] = build_task(cfg)
            task = tasks[key]
            parts[name, seed] = partition_task(task, cfg.partition, seed)[0]
            if partition_digest(parts[name, seed]) != partition_digest(parts[reference, seed]):
                raise ConfigError(f"compare: seed {seed}: {name!r} would train on another partition than "
                                  f"{reference!r} (a per-method setting changes [data] or [partition]); paired "
                                  "differences need the same partition")
    if jobs > 1:
        pending = [(f"[{n}] seed {s}", configs[n][s], out / f"{n}-seed{s}", parts[n, s], None)
                   for n in names for s in seed_list
                   if not (resume and finished_run(out / f"{n}-seed{s}", configs[n][s]))]
        diverged = run_in_processes(pending, jobs, resume, log)
        if diverged:
            label, message = next(iter(diverged.items()))
            raise DivergenceError(f"{label}: {message}")
    histories: dict[str, list[list[dict[str, Any]]]] = {}
    rows: list[dict[str, Any]] = []
    setup: dict[str, Any] | None = None
    for name in names:
        runs = []
        for seed in seed_list:
            cfg = configs[name][seed]
            task = tasks[task_key(cfg)]
            run_dir = out / f"{name}-seed{seed}" if out else None
            done = finished_run(run_dir, cfg) if (resume or jobs > 1) and run_dir is not None else None
            if done is not None:
                if log:
                    log(f"[{name}] seed {seed}: reusing the finished run in {run_dir}")
                summary, history, final = done["summary"], done["history"], done["metrics"]
            else:
                # the methods share each seed's partition: its label counts are logged once, with the first method
                sim = Simulation(cfg, task=task, run_dir=run_dir, log=log, parts=parts[name, seed],
                                 log_partition=name == names[0], overwrite=resume)
                summary, history, final = sim.run(), sim.history, sim.last_eval
            values = _metric_values(history, metric)
            if not values:
                raise ConfigError(f"run.stop_metric: the task reports no {metric!r} "
                                  f"(it reports {', '.join(sorted(final)) or 'nothing'})")
            if setup is None:
                setup = setup_of(cfg, task.describe(), seed_list)
            histories.setdefault(name, []).append(history)
            runs.append({"seed": seed, "final": values[-1], "best": max(values) if higher_is_better(metric)
                         else min(values), "bytes_up": summary["bytes_up"], "bytes_down": summary["bytes_down"],
                         "time": summary["time"]["total"], "epsilon": summary.get("epsilon"),
                         "partition": partition_digest(parts[name, seed]),
                         "sampling": hashlib.sha256(json.dumps([r["clients"] for r in history]).encode())
                         .hexdigest()[:16],
                         **({"run_dir": str(out / f"{name}-seed{seed}")} if out else {})})
        cfg0 = configs[name][seed_list[0]]
        rows.append({
            "method": name, "lr": cfg0.train.lr, "head_lr": cfg0.train.head_lr, "optimizer": cfg0.train.optimizer,
            "weighting": cfg0.server.weighting, "settings": settings[name][1:], "runs": runs,
            "final": mean_interval([r["final"] for r in runs]).to_dict(),
            "best": mean_interval([r["best"] for r in runs]).to_dict(),
            "bytes_up": float(np.mean([r["bytes_up"] for r in runs])),
            "bytes_down": float(np.mean([r["bytes_down"] for r in runs])),
            "time": float(np.mean([r["time"] for r in runs])),
            "epsilon": max((r["epsilon"] for r in runs if r["epsilon"] is not None), default=None),
        })
    assert setup is not None
    ref = next(r for r in rows if r["method"] == reference)
    paired = []
    for row in rows:
        if row["method"] == reference:
            continue
        entry: dict[str, Any] = {"method": row["method"], "reference": reference}
        for key in ("final", "best"):
            diffs, iv = paired_interval([r[key] for r in row["runs"]], [r[key] for r in ref["runs"]])
            entry[key] = {"differences": diffs, **iv.to_dict(), "verdict": verdict(iv, higher_is_better(metric))}
        paired.append(entry)
    results = {"metric": metric, "higher_is_better": higher_is_better(metric), "confidence": CONFIDENCE,
               "setup": setup, "seeds": seed_list, "reference": reference, "tuned": str(tuned) if tuned else None,
               "rows": rows, "paired": paired}
    if out is not None:
        from .plots import plot_comparison

        out.mkdir(parents=True, exist_ok=True)
        results["plots"] = [str(p) for p in plot_comparison(histories, out, metric, _title(setup))]
        (out / "results.json").write_text(json.dumps(results, indent=1))
        (out / "results.md").write_text(results_markdown(results))
    return results


def results_markdown(results: dict[str, Any]) -> str:
    """``results.md``: the setup as run, what ± means, the table per method and the paired differences."""
    metric, setup, ref = results["metric"], results["setup"], results["reference"]
    n = len(results["seeds"])
    direction = "higher is better" if results["higher_is_better"] else "lower is better"
    lines = [f"# Comparison: {', '.join(r['method'] for r in results['rows'])}", "", "## Setup (as run)", "", *setup_lines(setup),
             "- paired by seed: for a given seed every method has the same partition (checked), client sampling "
             "and local data order", ""]
    lines += ["| method | train.lr | head lr | optimizer | weighting | settings applied (preset, compare.overrides, "
              "tuned lr, --set) |", "|---|---|---|---|---|---|"]
    for r in results["rows"]:
        head = f"{r['head_lr']:g}" if r["head_lr"] else "= lr"
        lines.append(f"| {r['method']} | {r['lr']:g} | {head} | {r['optimizer']} | {r['weighting']} | "
                     f"{', '.join(f'`{s}`' for s in r['settings']) or '–'} |")
    if results.get("tuned"):
        lines += ["", f"Learning rates chosen on a validation split of the training data by `fedlowrank tune`: "
                      f"{results['tuned']}."]
    conf = f"{results['confidence']:.0%}"
    pm = (f"mean ± half-width of the {conf} Student-t confidence interval of the mean over the {n} seeds "
          f"(t_{{{0.5 + results['confidence'] / 2:g}, n−1}} · sd / √n, sample sd with ddof = 1)" if n > 1
          else "a single seed (n = 1): no interval")
    where = f"on the {setup['num_test']:,} test examples" if setup.get("num_test") else "as the task evaluates it"
    private = any(r.get("epsilon") is not None for r in results["rows"])
    lines += ["", "## Results", "", f"Metric: {metric} {where} ({direction}); final = after the last round, "
              f"best = the best evaluated round. Values are {pm}.", "",
              f"| method | final {metric} | best {metric} | bytes up | bytes down | time (s) |"
              + (" ε (client-level DP) |" if private else ""), "|---|---|---|---|---|---|" + ("---|" if private else "")]
    for r in results["rows"]:
        eps = (f" {r['epsilon']:.3g} |" if r.get("epsilon") is not None else " – |") if private else ""
        lines.append(f"| {r['method']} | {_interval(r['final']).format()} | {_interval(r['best']).format()} | "
                     f"{format_bytes(r['bytes_up'])} | {format_bytes(r['bytes_down'])} | {r['time']:.1f} |{eps}")
    if results["paired"]:
        lines += ["", f"## Paired differences against {ref}", "",
                  f"Per seed, method − {ref} on the same partition and data order; mean ± half-width of the paired "
                  f"{conf} t-interval. Verdict: \"better\"/\"worse\" only where the interval excludes 0, else "
                  "\"undecided\" (always with one seed).", "",
                  f"| method | Δ final {metric} | verdict | Δ best {metric} | verdict | Δ final per seed |",
                  "|---|---|---|---|---|---|"]
        for p in results["paired"]:
            per_seed = ", ".join(f"{s}: {d:+.4f}" for s, d in zip(results["seeds"], p["final"]["differences"]))
            lines.append(f"| {p['method']} | {_interval(p['final']).format()} | {p['final']['verdict']} | "
                         f"{_interval(p['best']).format()} | {p['best']['verdict']} | {per_seed} |")
    return "\n".join(lines) + "\n"

"""``fedlowrank tune``: per-method selection of a hyper-parameter (the learning rate by default) on a validation
split of the clients' training data.

The validation split: after the usual partition (the same one ``compare`` uses for that seed), each client
holds out a seeded ``data.validation_fraction`` of its examples (``floor(fraction · n_k)``, keeping at least one
to train on). Clients train only on the rest; the global model is evaluated on the union of the held-out
examples (:meth:`fedlowrank.tasks.Task.validation`) and never on the test set. So the choice is made on data
drawn like the training data, and it cannot depend on the test set.

For each method, each value of the grid (``--grid``; for ``train.lr`` by default the method's paper grid,
:func:`fedlowrank.methods.lr_grid`) and each seed: one run at ``param = value`` with the method's settings as
``compare`` applies them; the score of a value is the mean over seeds of the final model's validation metric
(the task's ``validation_metric``: accuracy, maximised, for classification; held-out loss, minimised, for
regression); ties go to the first value of the grid. A diverged run scores worst. ``tune.json`` holds every
(method, value, seed, score) and the choice; ``compare --tuned tune.json`` (or ``compare.tuned``) runs each
method at its chosen values. ``--param privacy.clip --tuned lr/tune.json`` tunes a second parameter with each
method at its tuned learning rate; the choice then carries both. With ``resume``, a run directory in ``out``
whose run ended with the same config is read instead of run again (:func:`fedlowrank.experiments.compare.finished_run`);
any other is run from the start. Tuning into a directory that already holds a ``tune.json`` keeps the methods
that tuning chose and this one does not re-tune (:func:`earlier_choices`), so a method's grid can be extended, or a
method added, without losing the others' choices.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from .compare import (Log, check_jobs, finished_run, higher_is_better, method_settings, parse_methods, parse_seeds,
                         read_tuned, run_in_processes, setup_lines, setup_of, task_key)
from ..config import ConfigError, load_config
from ..models.architectures import check_measures_quality
from ..runtime.checkpoint import config_fingerprint
from ..seeding import numpy_rng

LR = "train.lr"  # the parameter tuned by default


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


def parse_grid(text: str | list[float] | None) -> list[float] | None:
    """``--grid 1e-3,3e-3`` → positive, distinct learning rates (``None`` = each method's own grid)."""
    if text is None:
        return None
    try:
        grid = [float(x) for x in text.split(",")] if isinstance(text, str) else [float(x) for x in text]
    except ValueError:
        raise ConfigError(f"--grid: expected comma-separated numbers, got {text!r}") from None
    if not grid or any(not math.isfinite(x) or x <= 0 for x in grid) or len(set(grid)) != len(grid):
        raise ConfigError(f"--grid: expected distinct positive numbers, got {text!r}")
    return grid


def run_tuning(config: str | Path | None, methods: str | list[str] | None = None,
               grid: str | list[float] | None = None, seeds: str | list[int] | None = None,
               overrides: list[str] | tuple[str, ...] = (), out: str | Path | None = None,
               log: Log = None, resume: bool = False, jobs: int = 1, param: str = LR,
               tuned: str | Path | None = None, extend: int = 0) -> dict[str, Any]:
    """Tune ``param`` (default ``train.lr``) per method on the validation split; returns what ``tune.json`` holds
    (written to ``out`` with one run directory per (method, value, seed) when ``out`` is given; ``resume`` reuses
    the runs that ended there; ``jobs > 1`` runs them in that many processes,
    :func:`fedlowrank.experiments.compare.run_in_processes`). ``tuned``: a ``tune.json`` whose choices each method runs at
    while ``param`` is tuned (a learning rate tuned first, then ``privacy.clip`` at it); each method's chosen
    ``sets`` hold both, for ``compare --tuned``. ``extend``: while a method's best value is at an edge of what was
    tried, try one more value beyond it (:func:`beyond_edge`), at most ``extend`` times."""
    from ..methods import lr_grid
    from ..tasks.partition import partition_task
    from ..runtime.simulator import DivergenceError, Simulation
    from ..tasks import build_task

    overrides = list(overrides)
    base = load_config(config, overrides, method_checks=False)
    check_measures_quality(base.task.model, "tune")
    names = parse_methods(methods, base)
    seed_list = parse_seeds(seeds if seeds is not None else [base.run.seed], base)
    fixed = [s for s in overrides if s.split("=", 1)[0].strip() == param]
    if fixed:
        raise ConfigError(f"tune: --set {fixed[0]} fixes {param}, the parameter being tuned; remove it")
    if isinstance(extend, bool) or not isinstance(extend, int) or extend < 0:
        raise ConfigError(f"--extend must be an integer >= 0, got {extend!r}")
    fixed_grid = parse_grid(grid)
    if fixed_grid is None and param != LR:
        raise ConfigError(f"--grid: give the values of {param} to try (only train.lr has default grids)")
    grids = {n: fixed_grid or lr_grid(n) for n in names}
    earlier = read_tuned(tuned, "--tuned") if tuned else {}
    missing = [n for n in names if tuned and n not in earlier]
    if missing:
        raise ConfigError(f"--tuned: {tuned} chose no value for {', '.join(missing)} (tuned: {', '.join(earlier)})")
    at = {n: {k: v for k, v in earlier.get(n, {}).items() if k != param} for n in names}
    configs: dict[tuple[str, float, int], Any] = {}

    def config_of(name: str, value: float, seed: int):
        if (name, value, seed) not in configs:
            configs[name, value, seed] = load_config(config, [*method_settings(base, name, overrides,
                                                                               {**at[name], param: value}),
                                                              f"run.seed={seed}"])
        return configs[name, value, seed]

    for n in names:  # every config is checked before anything runs
        for v in grids[n]:
            for s in seed_list:
                config_of(n, v, s)
    out = Path(out) if out is not None else None
    base_fingerprint = config_fingerprint(base)
    kept = earlier_choices(out / "tune.json", names, base_fingerprint, seed_list, param) if out is not None else {}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)

    tasks: dict[str, Any] = {}
    splits: dict[str, tuple[list[np.ndarray], np.ndarray]] = {}

    def split_of(cfg) -> tuple[Any, list[np.ndarray], np.ndarray]:
        """(task, the clients' training indices, the validation indices) of ``cfg``'s task, partition and seed."""
        key = task_key(cfg)
        if key not in tasks:
            tasks[key] = build_task(cfg)
        split_key = key + json.dumps([dataclasses.asdict(cfg.partition), cfg.data.validation_fraction])
        if split_key not in splits:
            parts = partition_task(tasks[key], cfg.partition, cfg.run.seed)[0]
            splits[split_key] = split_validation(parts, cfg.data.validation_fraction, cfg.run.seed)
        return (tasks[key], *splits[split_key])

    short = "lr" if param == LR else param  # run directories: fedit-lr0.001-seed0, fedit-privacy.clip0.3-seed0

    def run_dir_of(name: str, value: float, seed: int) -> Path | None:
        return out / f"{name}-{short}{value:g}-seed{seed}" if out else None

    check_jobs(jobs, out)
    diverged: dict[str, str] = {}

    def run_ahead(cells: list[tuple[str, float]]) -> None:
        """With ``jobs > 1``: run the (method, value) cells' unfinished runs in worker processes first."""
        if jobs == 1:
            return
        pending = []
        for name, value in cells:
            for seed in seed_list:
                cfg, run_dir = config_of(name, value, seed), run_dir_of(name, value, seed)
                if not (resume and finished_run(run_dir, cfg)):
                    _, train_parts, held_out = split_of(cfg)
                    pending.append((f"tune [{name}] {short}={value:g} seed={seed}", cfg, run_dir, train_parts,
                                    held_out))
        diverged.update(run_in_processes(pending, jobs, resume, log))

    runs: list[dict[str, Any]] = []
    setup: dict[str, Any] | None = None

    def score_of(name: str, value: float) -> tuple[float, str]:
        """The mean validation score over the seeds of ``param = value`` (nan if a run diverged), and the metric."""
        nonlocal setup
        values = []
        for seed in seed_list:
            cfg = config_of(name, value, seed)
            task, train_parts, held_out = split_of(cfg)
            view = task.validation(held_out)
            metric = view.validation_metric
            if setup is None:  # sizes of the first seed's split (each run records its own)
                setup = {**setup_of(cfg, task.describe(), seed_list), "num_validation": int(len(held_out)),
                         "validation_fraction": cfg.data.validation_fraction, "metric": metric}
                setup["num_test"] = None  # the test set is not used
            run_dir = run_dir_of(name, value, seed)
            label = f"tune [{name}] {short}={value:g} seed={seed}"
            done = finished_run(run_dir, cfg) if (resume or jobs > 1) and run_dir is not None else None
            try:
                if label in diverged:
                    raise DivergenceError(diverged[label])
                if done is not None:
                    if log and jobs == 1:
                        log(f"{label}: reusing the finished run in {run_dir}")
                    validation = done["metrics"]
                else:
                    sim = Simulation(cfg, task=view, run_dir=run_dir, log=log, parts=train_parts, overwrite=resume)
                    sim.run()
                    validation = dict(sim.last_eval)
                score = validation.get(metric, math.nan)
            except DivergenceError as exc:
                score, validation = math.nan, {"diverged": str(exc)}
            values.append(score)
            runs.append({"method": name, "param": param, "value": value, "lr": cfg.train.lr, "seed": seed,
                         "metric": metric, "score": score, "num_validation": int(len(held_out)),
                         "validation": validation})
            if log:
                log(f"{label}: validation {metric} = {score:.4f}")
        return (float(np.mean(values)) if all(math.isfinite(v) for v in values) else math.nan), metric

    def best(scores: dict[float, float], metric: str) -> float | None:
        finite = {v: x for v, x in scores.items() if math.isfinite(x)}
        return (max if higher_is_better(metric) else min)(finite, key=finite.get) if finite else None

    run_ahead([(n, v) for n in names for v in grids[n]])
    chosen: dict[str, dict[str, Any]] = {}
    for name in names:
        scores: dict[float, float] = {}
        for value in grids[name]:
            scores[value], metric = score_of(name, value)
        for _ in range(extend):
            pick, tried = best(scores, metric), sorted(scores)
            if pick is None or len(tried) < 2 or pick not in (tried[0], tried[-1]):
                break
            value = beyond_edge(tried, pick == tried[-1])
            if log:
                log(f"tune [{name}]: the best {short} {pick:g} is at an edge of {', '.join(f'{v:g}' for v in tried)}; "
                    f"trying {value:g}")
            run_ahead([(name, value)])
            scores[value], metric = score_of(name, value)
        grids[name] = list(scores)
        pick = best(scores, metric)
        if pick is None:
            raise ValueError(f"tune: every {param} of {name!r} diverged ({', '.join(map(str, grids[name]))})")
        chosen[name] = {"param": param, "value": pick, "sets": {**at[name], param: pick}, "score": scores[pick],
                        "scores": {f"{v:g}": x for v, x in scores.items()}}
    assert setup is not None
    result = {"setup": setup, "seeds": seed_list, "base": base_fingerprint, "param": param,
              "tuned": str(tuned) if tuned else None,
              "grid": {**kept.get("grid", {}), **{n: grids[n] for n in names}},
              "settings": {**kept.get("settings", {}), **{n: method_settings(base, n, overrides, at[n])[1:]
                                                          for n in names}},
              "runs": kept.get("runs", []) + runs, "chosen": {**kept.get("chosen", {}), **chosen}}
    if out is not None:
        (out / "tune.json").write_text(json.dumps(result, indent=1))
        (out / "tune.md").write_text(tune_markdown(result))
    return result


def beyond_edge(tried: list[float], upper: bool) -> float:
    """The next value past the upper (``upper``) or lower edge of the sorted values ``tried``, as far from the edge
    as its neighbour is: on the 1–3–10 ladder when every value is 1·10ᵏ or 3·10ᵏ (3e-4 → 1e-4 → 3e-5 in a
    half-decade grid, 1e-2 → 1e-1 in a decade grid), else the geometric step ``edge²/neighbour``."""
    edge, neighbour = (tried[-1], tried[-2]) if upper else (tried[0], tried[1])

    def rung(v: float) -> int | None:
        """Position on the ladder …, 1e-3, 3e-3, 1e-2, … (None off it)."""
        exponent = math.floor(math.log10(v) + 1e-9)
        mantissa = v / 10.0 ** exponent
        for step, m in ((0, 1.0), (1, 3.0)):
            if abs(mantissa - m) < 1e-6 * m:
                return 2 * exponent + step
        return None

    rungs = {v: rung(v) for v in tried}
    if None not in rungs.values():
        target = 2 * rungs[edge] - rungs[neighbour]
        return float(f"{1 if target % 2 == 0 else 3}e{target // 2}")
    return edge * edge / neighbour


def earlier_choices(path: Path, names: list[str], base_fingerprint: str, seeds: list[int],
                    param: str) -> dict[str, Any]:
    """What the ``tune.json`` at ``path`` holds for the methods not in ``names`` (``grid``, ``settings``, ``runs``,
    ``chosen``; empty when there is no such file or method), to be kept beside this tuning's. It must come from the
    same base config (``base``: :func:`~fedlowrank.runtime.checkpoint.config_fingerprint` of the config and
    ``--set`` before the methods' own settings), seeds and tuned parameter; otherwise :class:`ConfigError`, before
    anything runs."""
    if not path.exists():
        return {}
    try:
        earlier = json.loads(path.read_text())
        others = [n for n in earlier["chosen"] if n not in names]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ConfigError(f"tune: {path} is not a tune.json written by fedlowrank tune ({exc}); use another --out, "
                          "or delete it") from None
    if not others:
        return {}
    if (earlier.get("base"), earlier.get("seeds"), earlier.get("param", LR)) != (base_fingerprint, seeds, param):
        raise ConfigError(f"tune: {path} holds the tuning of {', '.join(others)} with another config, seeds or "
                          "parameter than this one; use another --out, or delete it")
    return {"grid": {n: earlier["grid"][n] for n in others}, "settings": {n: earlier["settings"][n] for n in others},
            "runs": [r for r in earlier["runs"] if r["method"] in others],
            "chosen": {n: earlier["chosen"][n] for n in others}}


def tune_markdown(result: dict[str, Any]) -> str:
    """``tune.md``: the setup as run and, per method, each tried value's mean validation score."""
    setup = result["setup"]
    param = result.get("param", LR)
    direction = "higher" if higher_is_better(setup["metric"]) else "lower"
    lines = ["# Tuning", "", "## Setup (as run)", "", *setup_lines(setup),
             f"- validation: {setup['validation_fraction']:g} of each client's examples held out (not trained on); "
             "the test set is not used", *([f"- each method at the values chosen in {result['tuned']}"]
                                           if result.get("tuned") else []), "",
             f"Score: the final model's validation {setup['metric']}, mean over the seeds ({direction} is better; "
             "nan = diverged).", "", f"| method | {param} | score | chosen |", "|---|---|---|---|"]
    for name, c in result["chosen"].items():
        pick = c.get("value", c.get("lr"))
        for value, score in c["scores"].items():
            lines.append(f"| {name} | {value} | {score:.4f} | {'✓' if float(value) == pick else ''} |")
    return "\n".join(lines) + "\n"

"""``fedlowrank tune``: per-method selection of a hyper-parameter (the learning rate by default) on a validation
split of the clients' training data.

The validation split: after the usual partition (the same one ``compare`` uses for that seed), each client
holds out a seeded ``data.validation_fraction`` of its examples (``floor(fraction · n_k)``, keeping at least one
to train on). Clients train only on the rest; the global model is evaluated on the union of the held-out
examples (:meth:`fedlowrank.tasks.Task.validation`) and never on the test set. So the choice is made on data
drawn like the training data, and it cannot depend on the test set. Where the run's test evaluation is own-task
(:mod:`fedlowrank.runtime.evaluation`: task-heterogeneous clients), so is the validation: each client is scored on
the held-out examples of its own task, a personalised method's clients with their own models.

For each method, each value of the grid (``--grid``; for ``train.lr`` by default the method's paper grid,
:func:`fedlowrank.methods.lr_grid`) and each seed (``--seeds``; two or three keep the choice from hinging on one
seed's partition): one run at ``param = value`` with the method's settings as ``compare`` applies them. The score
of a value is the mean over seeds of the final model's validation metric (the task's ``validation_metric``:
accuracy, maximised, for classification; held-out loss, minimised, otherwise), shown with each seed's score and
their spread. The choice (:func:`choose`): the best mean; a value with a diverged run has no mean and is never
chosen; among equal means (within ``TIE_TOLERANCE``) the value tried first, and the tie is logged and named in
``tune.md``. A run that diverged, or whose validation accuracy is no higher than always predicting the validation
split's most frequent class (:func:`chance_level`), is marked collapsed. ``tune.json`` holds every (method, value,
seed, score, collapse) and the choice; ``compare --tuned tune.json`` (or ``compare.tuned``) runs each method at
its chosen values. ``--param privacy.clip --tuned lr/tune.json`` tunes a second parameter with each method at its
tuned learning rate; the choice then carries both. The runs go through
:class:`~fedlowrank.experiments.sweep.Sweep` (``resume``, ``jobs``). Tuning into a directory that already holds a
``tune.json`` keeps the methods that tuning chose and this one does not re-tune (:func:`earlier_choices`), so a
method's grid can be extended, or a method added, without losing the others' choices.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ConfigError, load_config
from ..models.architectures import check_measures_quality
from ..runtime.checkpoint import config_fingerprint
from ..runtime.evaluation import metric_description
from ..tasks import higher_is_better
from .compare import method_settings, parse_methods, parse_seeds, read_tuned, setup_lines, setup_of
from .sweep import Log, Outcome, Run, Sweep, split_validation  # noqa: F401  (split_validation: tune's split)

LR = "train.lr"  # the parameter tuned by default
TIE_TOLERANCE = 1e-12  # mean scores closer than this are a tie


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


def chance_level(labels: np.ndarray | None, held_out: np.ndarray) -> float | None:
    """The accuracy of always predicting the most frequent class of the validation examples (``None`` without
    labels or examples): a run that scores no more has learnt nothing the validation split can see."""
    if labels is None or len(held_out) == 0:
        return None
    return float(np.bincount(np.asarray(labels)[held_out]).max() / len(held_out))


def collapse(outcome: Outcome, metric: str, chance: float | None) -> str | None:
    """``"diverged"``, ``"at chance"`` (validation accuracy at most :func:`chance_level`) or ``None``."""
    if outcome.diverged is not None:
        return "diverged"
    score = outcome.metrics.get(metric, math.nan)
    if metric == "accuracy" and chance is not None and score <= chance + TIE_TOLERANCE:
        return "at chance"
    return None


def choose(scores: dict[float, float], higher: bool) -> tuple[float | None, list[float]]:
    """The value with the best finite mean score (the first tried among equal ones) and every value tied with it
    (within ``TIE_TOLERANCE``; just the choice when none ties)."""
    finite = {v: x for v, x in scores.items() if math.isfinite(x)}
    if not finite:
        return None, []
    best = (max if higher else min)(finite.values())
    tied = [v for v, x in finite.items() if abs(x - best) <= TIE_TOLERANCE]
    return tied[0], tied


def run_tuning(config: str | Path | None, methods: str | list[str] | None = None,
               grid: str | list[float] | None = None, seeds: str | list[int] | None = None,
               overrides: list[str] | tuple[str, ...] = (), out: str | Path | None = None,
               log: Log = None, resume: bool = False, jobs: int = 1, param: str = LR,
               tuned: str | Path | None = None, extend: int = 0, ranks: bool = False) -> dict[str, Any]:
    """Tune ``param`` (default ``train.lr``) per method on the validation split; returns what ``tune.json`` holds
    (written to ``out`` with one run directory per (method, value, seed) when ``out`` is given; ``resume`` reuses
    the runs that ended there; ``jobs > 1`` runs them in that many processes, ``ranks`` over the ranks of this
    ``torch.distributed`` job, :class:`fedlowrank.experiments.sweep.Sweep`). ``tuned``: a ``tune.json`` whose
    choices each method runs at while ``param`` is tuned (a learning rate tuned first, then ``privacy.clip`` at
    it); each method's chosen ``sets`` hold both, for ``compare --tuned``. ``extend``: while a method's best value
    is at an edge of what was tried, try one more value beyond it (:func:`beyond_edge`), at most ``extend`` times;
    each time, the next value of every method that needs one is run in the same sweep."""
    from ..methods import lr_grid

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
    grids = {n: list(fixed_grid or lr_grid(n)) for n in names}
    earlier = read_tuned(tuned, "--tuned") if tuned else {}
    missing = [n for n in names if tuned and n not in earlier]
    if missing:
        raise ConfigError(f"--tuned: {tuned} chose no value for {', '.join(missing)} (tuned: {', '.join(earlier)})")
    at = {n: {k: v for k, v in earlier.get(n, {}).items() if k != param} for n in names}
    out = Path(out) if out is not None else None
    short = "lr" if param == LR else param  # run directories: fedit-lr0.001-seed0, fedit-privacy.clip0.3-seed0

    def config_of(name: str, value: float, seed: int):
        return load_config(config, [*method_settings(base, name, overrides, {**at[name], param: value}),
                                    f"run.seed={seed}"])

    configs = {(n, v): [config_of(n, v, s) for s in seed_list] for n in names for v in grids[n]}  # all checked first
    base_fingerprint = config_fingerprint(base)
    kept = earlier_choices(out / "tune.json", names, base_fingerprint, seed_list, param) if out is not None else {}
    sweep = Sweep(out, jobs, resume, log, ranks)
    first_cfg = configs[names[0], grids[names[0]][0]][0]
    metric = sweep.task(first_cfg).validation_metric
    higher = higher_is_better(metric)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)

    def runs_of(name: str, value: float) -> list[Run]:
        """The runs of ``param = value`` for ``name``, one per seed (configs made once)."""
        if (name, value) not in configs:
            configs[name, value] = [config_of(name, value, s) for s in seed_list]
        return [Run(name, f"tune [{name}] {short}={value:g} seed={cfg.run.seed}", cfg,
                    out / f"{name}-{short}{value:g}-seed{cfg.run.seed}" if out else None, metric, validation=True)
                for cfg in configs[name, value]]

    records: dict[tuple[str, float], list[dict[str, Any]]] = {}

    def run_cells(keys: list[tuple[str, float]]) -> None:
        """Run the (method, value) cells ``keys`` in one sweep; record each run's validation score."""
        flat = [(key, run) for key in keys for run in runs_of(*key)]
        sweep.check_pairing([run for _, run in flat])
        for (key, run), outcome in zip(flat, sweep.run([run for _, run in flat])):
            _, held_out = sweep.split(run.cfg)
            chance = chance_level(sweep.task(run.cfg).train_labels, held_out)
            records.setdefault(key, []).append({
                "method": run.method, "param": param, "value": key[1], "lr": run.cfg.train.lr,
                "seed": run.cfg.run.seed, "metric": metric,
                "score": math.nan if outcome.diverged else outcome.metrics.get(metric, math.nan),
                "num_validation": int(len(held_out)),
                "validation": {"diverged": outcome.diverged} if outcome.diverged else outcome.metrics,
                "chance": chance, "collapsed": collapse(outcome, metric, chance)})

    def mean_score(key: tuple[str, float]) -> float:
        """The mean over seeds (nan if a run diverged or reported no score)."""
        values = [r["score"] for r in records[key]]
        return float(np.mean(values)) if all(math.isfinite(v) for v in values) else math.nan

    run_cells(list(configs))
    scores = {n: {v: mean_score((n, v)) for v in grids[n]} for n in names}
    for _ in range(extend):  # one more value past the edge for every method whose best sits at one, together
        beyond = []
        for name in names:
            pick, _ = choose(scores[name], higher)
            tried = sorted(scores[name])
            if pick is None or len(tried) < 2 or pick not in (tried[0], tried[-1]):
                continue
            value = beyond_edge(tried, pick == tried[-1])
            if log:
                log(f"tune [{name}]: the best {short} {pick:g} is at an edge of {', '.join(f'{v:g}' for v in tried)}; "
                    f"trying {value:g}")
            beyond.append((name, value))
        if not beyond:
            break
        run_cells(beyond)
        for name, value in beyond:
            scores[name][value] = mean_score((name, value))
            grids[name].append(value)

    chosen: dict[str, dict[str, Any]] = {}
    runs: list[dict[str, Any]] = []
    for name in names:
        pick, tied = choose(scores[name], higher)
        if pick is None:
            raise ValueError(f"tune: every {param} of {name!r} diverged ({', '.join(map(str, grids[name]))})")
        if len(tied) > 1 and log:
            log(f"tune [{name}]: {len(tied)} values tie at the best validation {metric} {scores[name][pick]:.4f} "
                f"({', '.join(f'{v:g}' for v in tied)}); chose {pick:g}, the first tried: the grid does not decide")
        chosen[name] = {"param": param, "value": pick, "sets": {**at[name], param: pick}, "score": scores[name][pick],
                        "scores": {f"{v:g}": x for v, x in scores[name].items()},
                        "spread": {f"{v:g}": spread([r["score"] for r in records[name, v]]) for v in grids[name]},
                        "tied": tied if len(tied) > 1 else []}
        runs += [r for v in grids[name] for r in records[name, v]]
    held_out = sweep.split(first_cfg)[1]
    setup = {**setup_of(first_cfg, sweep.task(first_cfg).validation(held_out).describe(), seed_list),
             "num_validation": int(len(held_out)), "validation_fraction": first_cfg.data.validation_fraction,
             "metric": metric, "num_test": None,  # sizes of the first seed's split (each run records its own)
             "metric_description": metric_description(metric, [r["validation"] for r in runs])}
    result = {"setup": setup, "seeds": seed_list, "base": base_fingerprint, "param": param,
              "tuned": str(tuned) if tuned else None,
              "grid": {**kept.get("grid", {}), **{n: grids[n] for n in names}},
              "settings": {**kept.get("settings", {}), **{n: method_settings(base, n, overrides, at[n])[1:]
                                                          for n in names}},
              "runs": kept.get("runs", []) + runs, "chosen": {**kept.get("chosen", {}), **chosen}}
    if out is not None:
        from ..runtime.rundir import own

        own(out, "tune.json", "tune.md")
        (out / "tune.json").write_text(json.dumps(result, indent=1))
        (out / "tune.md").write_text(tune_markdown(result))
    return result


def spread(scores: list[float]) -> dict[str, float | None]:
    """``min``, ``max`` and sample ``sd`` (ddof = 1; ``None`` with one seed) of a value's finite scores."""
    finite = [x for x in scores if math.isfinite(x)]
    if not finite:
        return {"min": None, "max": None, "sd": None}
    return {"min": min(finite), "max": max(finite),
            "sd": float(np.std(finite, ddof=1)) if len(finite) > 1 else None}


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
    """``tune.md``: the setup as run, the choice rule and, per method and value, the mean validation score with
    each seed's score (collapsed runs marked) and their spread."""
    setup = result["setup"]
    param = result.get("param", LR)
    seeds = result.get("seeds", setup["seeds"])
    direction = "higher" if higher_is_better(setup["metric"]) else "lower"
    lines = ["# Tuning", "", "## Setup (as run)", "", *setup_lines(setup),
             f"- validation: {setup['validation_fraction']:g} of each client's examples held out (not trained on); "
             "the test set is not used", *([f"- each method at the values chosen in {result['tuned']}"]
                                           if result.get("tuned") else []), "",
             f"Score: the validation {setup.get('metric_description', setup['metric'])} after the last round, "
             f"mean over the {len(seeds)} seed"
             f"{'s' if len(seeds) > 1 else ''} ({direction} is better). Choice: per method, the value with the best "
             "mean score; a value where a run diverged has no mean (nan) and is never chosen; among equal means the "
             "value tried first, and the tie is named below the table. Per seed, a collapsed run is marked: "
             "diverged, or at chance (validation accuracy no higher than always predicting the most frequent class "
             "of the validation examples).", "",
             f"| method | {param} | mean score | per seed ({', '.join(map(str, seeds))}) | sd over seeds | chosen |",
             "|---|---|---|---|---|---|"]
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in result["runs"]:
        runs.setdefault((r["method"], f"{r.get('value', r.get('lr')):g}"), []).append(r)
    ties = []
    for name, c in result["chosen"].items():
        pick = c.get("value", c.get("lr"))
        for value, score in c["scores"].items():
            per_seed = ", ".join(_seed_cell(r) for r in runs.get((name, value), []))
            sd = (c.get("spread") or {}).get(value, {}).get("sd")
            lines.append(f"| {name} | {value} | {score:.4f} | {per_seed or '–'} | "
                         f"{'–' if sd is None else f'{sd:.4f}'} | {'✓' if float(value) == pick else ''} |")
        if len(c.get("tied") or []) > 1:
            ties.append(f"- {name}: {', '.join(f'{v:g}' for v in c['tied'])} tie at the best mean score "
                        f"{c['score']:.4f}; {pick:g}, tried first, was chosen: the grid does not decide between them.")
    if ties:
        lines += ["", "Ties:", "", *ties]
    return "\n".join(lines) + "\n"


def _seed_cell(run: dict[str, Any]) -> str:
    """A run's score in the tuning table: ``0.8125``, ``0.2575 (at chance)`` or ``diverged``."""
    if run.get("collapsed") == "diverged" or "diverged" in run.get("validation", {}):
        return "diverged"
    mark = f" ({run['collapsed']})" if run.get("collapsed") else ""
    return f"{run['score']:.4f}{mark}"

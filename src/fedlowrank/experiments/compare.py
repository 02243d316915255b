"""``fedlowrank compare``: several methods on the same partition, seeds and budget, with paired statistics.

For each seed every method sees the same data, the same partition (a function of ``run.seed``, the labels and
``[partition]``), the same client sampling (``run.seed``, round) and the same local data order
(``run.seed``, client, round): the runs are *paired* by seed, and the partition is checked to be the same for
every method before anything trains (:meth:`fedlowrank.experiments.sweep.Sweep.check_pairing`). Per method: the
final and best metric over rounds, as the mean over seeds and its 95% Student-t interval
(:mod:`fedlowrank.experiments.stats`); on task-heterogeneous clients (an own-task evaluation,
:mod:`fedlowrank.runtime.evaluation`) the metric is the mean over clients of each one's own-task metric, and the
tables say so (``metric_description``, e.g. "mean own-task exact match over clients"). Against the reference
method, per seed, the differences and (:func:`paired_statistics`) their mean with its paired t-interval, their
median, the method's wins and losses, a paired bootstrap interval of the mean and the Wilcoxon signed-rank test,
whose two-sided ``p < 0.05`` alone gives a verdict ("better"/"worse"; else "undecided"): it does not assume normal differences, which a method that
sometimes collapses does not have.

Settings per method, later ones winning: the method's preset (:func:`fedlowrank.methods.preset_overrides`),
``compare.overrides[method]``, the values chosen by ``fedlowrank tune`` (``--tuned`` or ``compare.tuned``),
then the user's ``--set``.

Files (when ``out`` is given): one run directory per (method, seed), ``results.json`` (setup, per-seed values,
means, intervals, paired statistics, the command), ``results.md`` (opens with the setup as run), the plots and
``report.html``, all of it on one self-contained page (:func:`write_report`). The runs go
through :class:`~fedlowrank.experiments.sweep.Sweep`: ``resume`` reads each run that ended in ``out`` instead of
running it again, ``jobs`` runs them in that many worker processes, with the same results as one process.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ConfigError, RunConfig, load_config
from ..models.architectures import check_measures_quality
from ..privacy.runtime import PRIVACY_KEYS
from ..reporting.plots import with_round_zero
from ..reporting.progress import format_bytes
from ..runtime.evaluation import COLLAPSE_SHARE, metric_description, run_collapse
from ..tasks import headline_metric, higher_is_better, metric_range
from ..tasks.catalog import data_name, data_source
from .stats import (ALPHA, BOOTSTRAP_RESAMPLES, CONFIDENCE, Interval, bootstrap_interval, mean_interval, median,
                    paired_interval, rank_verdict, verdict, wilcoxon_signed_rank, wins_losses)
from .sweep import Log, Run, Sweep, partition_digest

BOOTSTRAP_SEED = 0  # the paired bootstrap's stream: the same results give the same interval


def method_settings(cfg: RunConfig, name: str, user_sets: list[str] | tuple[str, ...] = (),
                    tuned: dict[str, float] | None = None) -> list[str]:
    """The ``--set`` list that configures ``name`` in a comparison: the method's preset, then
    ``compare.overrides[name]``, then the tuned values (``{"train.lr": 1e-3, ...}``), then ``user_sets``."""
    from ..methods import preset_overrides

    chosen = [f"{key}={value!r}" for key, value in (tuned or {}).items()]
    return [f"method.name={name}", *preset_overrides(name), *cfg.compare.overrides.get(name, []), *chosen,
            *user_sets]


SETTING_SOURCES = ("preset", "compare.overrides", "tuned", "--set")
"""Where a comparison's setting of a method comes from, in the order they apply (later ones win)."""


def settings_in_force(cfg: RunConfig, name: str, user_sets: list[str] | tuple[str, ...] = (),
                      tuned: dict[str, float] | None = None) -> list[dict[str, str]]:
    """The keys :func:`method_settings` sets for ``name``, each once with the value in force (the last one set)
    and where it comes from (:data:`SETTING_SOURCES`): ``[{"key", "value", "source"}, ...]`` in the order the keys
    are first set; ``value`` as ``--set`` writes it (TOML). The ``compare.*`` keys, which configure the comparison
    itself, are left out."""
    from ..methods import preset_overrides

    given = zip(SETTING_SOURCES, (preset_overrides(name), cfg.compare.overrides.get(name, []),
                                  [f"{key}={value!r}" for key, value in (tuned or {}).items()], user_sets))
    in_force: dict[str, dict[str, str]] = {}
    for source, sets in given:
        for text in sets:
            key, _, value = text.partition("=")
            in_force[key.strip()] = {"key": key.strip(), "value": value.strip(), "source": source}
    return [s for key, s in in_force.items() if key != "method.name" and not key.startswith("compare.")]


def settings_cell(in_force: list[dict[str, str]]) -> str:
    """The "settings applied" cell of results.md: each key once, its value in force and its source."""
    return ", ".join(f"`{s['key']}={s['value']}` ({s['source']})" for s in in_force) or "–"


def interval_cell(iv: Interval, metric: str) -> str:
    """``mean ± half-width``, and where the interval crosses a bound of the metric's range
    (:func:`~fedlowrank.tasks.metric_range`) the interval clipped to it: ``0.1953 ± 0.2978 (in [0, 0.4931])``."""
    low, high = metric_range(metric)
    if iv.half_width is None or low <= iv.mean - iv.half_width and iv.mean + iv.half_width <= high:
        return iv.format()
    return f"{iv.format()} (in [{max(iv.mean - iv.half_width, low):.4g}, {min(iv.mean + iv.half_width, high):.4g}])"


def codec_of(cfg: RunConfig) -> str:
    """The codecs of a run, up / down (``docs/codecs.md``): ``int8 uniform b64 nearest / fp32``."""
    return f"{cfg.uplink.describe()} / {cfg.downlink.describe()}"


def method_cell(row: dict[str, Any]) -> str:
    """A method's name in a table, marked when it is a reference row (``Method.reference``)."""
    return f"{row['method']} (reference)" if row.get("reference_row") else row["method"]


def collapse_summary(row: dict[str, Any]) -> str | None:
    """One line naming the seeds where ``row``'s global model predicted one class for at least
    :data:`~fedlowrank.runtime.evaluation.COLLAPSE_SHARE` of the test set (first round, class, share; whether it
    lasted to the end) and the label-skew remedies its runs used; ``None`` when none did."""
    runs = [r for r in row["runs"] if r.get("collapse")]
    if not runs:
        return None
    each = "; ".join(f"seed {r['seed']}: round {c['round']}, class {c['top_label']!r} ({100 * c['top_share']:.1f} %"
                     f"{', to the end' if c['at_end'] else ', recovered'})" for r in runs for c in [r["collapse"]])
    remedies = runs[0].get("remedies") or {}
    used = ", ".join(f"task.options.{k} = {json.dumps(v)}" for k, v in sorted(remedies.items())) or "none"
    return (f"collapse: {row['method']} predicted one class for ≥ {100 * COLLAPSE_SHARE:.0f} % of the test set in "
            f"{len(runs)} of {len(row['runs'])} seeds ({each}); label-skew remedies in use: {used}")


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
        "data_name": data_name(cfg), "data_source": data_source(cfg), "num_train": task_description.get("num_train"),
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


def plot_title(setup: dict[str, Any]) -> str:
    """``AG News (all-MiniLM-L6-v2), dirichlet (alpha = 0.1, ...), 10 clients, 6 seeds``."""
    seeds = setup["seeds"]
    model = f" ({setup['model']})" if setup["model"] else ""
    return (f"{setup.get('data_name', setup['task'])}{model}, {describe_partition(setup['partition'])}, "
            f"{len(seeds)} seed{'s' if len(seeds) > 1 else ''}")


def _interval(d: dict[str, Any]) -> Interval:
    return Interval(d["mean"], d["half_width"], d["n"], d["sd"], d["confidence"])


def _metric_values(history: list[dict[str, Any]], metric: str) -> list[float]:
    return [r[metric] for r in history if metric in r]


def run_comparison(config: str | Path | None, methods: str | list[str] | None = None,
                   seeds: str | list[int] | None = None, overrides: list[str] | tuple[str, ...] = (),
                   out: str | Path | None = None, log: Log = None, *, reference: str | None = None,
                   tuned: str | Path | None = None, resume: bool = False, jobs: int = 1,
                   ranks: bool = False, command: str | None = None) -> dict[str, Any]:
    """Run every method on every seed and return the results (see the module docstring); with ``out`` also
    write the run directories, ``results.json``, ``results.md``, the plots and ``report.html``
    (:func:`write_report`; ``command``: the command line that asked for it) there; with ``resume`` reuse the
    runs that ended in ``out``; with ``jobs > 1`` run them in that many processes (needs ``out``); with ``ranks``,
    over the ranks of this ``torch.distributed`` job (this process is rank 0, the others serve the sweep:
    :func:`~fedlowrank.experiments.sweep.serve_ranks`).

    Args:
        config: a TOML file or bundled config name; ``overrides``: ``"section.key=value"`` strings for all.
        methods, seeds: default ``compare.methods`` and ``compare.seeds``.
        reference: the method the others are compared with, per seed (default: the first method).
        tuned: a ``tune.json`` whose chosen learning rates are applied (default: ``compare.tuned``).
        command: the exact command, as ``results.json`` and ``report.html`` give it (``None``: from Python).
    """
    from ..methods import method_class

    overrides = list(overrides)
    base = load_config(config, overrides, method_checks=False)
    check_measures_quality(base.task.model, "compare")
    names = parse_methods(methods, base)
    seed_list = parse_seeds(seeds, base)
    reference = check_reference(reference or names[0], names)
    tuned = tuned or base.compare.tuned or None
    chosen = read_tuned(tuned) if tuned else {}
    missing = [n for n in names if tuned and n not in chosen]
    if missing:
        raise ConfigError(f"compare.tuned: {tuned} chose no value for {', '.join(missing)} "
                          f"(tuned: {', '.join(chosen) or 'none'})")
    settings = {n: method_settings(base, n, overrides, chosen.get(n)) for n in names}
    metric = headline_metric(base)
    out = Path(out) if out is not None else None
    sweep = Sweep(out, jobs, resume, log, ranks)
    runs = [Run(n, f"[{n}] seed {s}", load_config(config, [*settings[n], f"run.seed={s}"]),
                out / f"{n}-seed{s}" if out else None, metric) for n in names for s in seed_list]
    sweep.check_pairing(sorted(runs, key=lambda r: r.method != reference))  # data and partitions before training
    outcomes = sweep.run(runs, stop_on_divergence=True)

    histories: dict[str, list[list[dict[str, Any]]]] = {}
    per_method: dict[str, list[dict[str, Any]]] = {}
    for run, outcome in zip(runs, outcomes):
        values = _metric_values(outcome.history, metric)
        if not values:
            raise ConfigError(f"run.stop_metric: the task reports no {metric!r} "
                              f"(it reports {', '.join(sorted(outcome.metrics)) or 'nothing'})")
        summary = outcome.summary
        histories.setdefault(run.method, []).append(with_round_zero(outcome.history, outcome.summary.get("initial")))
        per_method.setdefault(run.method, []).append({
            "seed": run.cfg.run.seed, "final": values[-1], "best": max(values) if higher_is_better(metric) else min(values),
            "bytes_up": summary["bytes_up"], "bytes_down": summary["bytes_down"], "time": summary["time"]["total"],
            **{key: summary.get(key) for key in PRIVACY_KEYS}, "partition": partition_digest(sweep.partition(run.cfg)),
            "collapse": run_collapse(outcome.history), "remedies": summary.get("remedies", {}),
            "sampling": hashlib.sha256(json.dumps([r["clients"] for r in outcome.history]).encode()).hexdigest()[:16],
            **({"run_dir": str(run.run_dir)} if out else {})})
    setup = setup_of(runs[0].cfg, sweep.task(runs[0].cfg).describe(), seed_list)
    rows = []
    for name in names:
        cfg0, method_runs = next(r.cfg for r in runs if r.method == name), per_method[name]
        rows.append({
            "method": name, "lr": cfg0.train.lr, "head_lr": cfg0.train.head_lr, "optimizer": cfg0.train.optimizer,
            "weighting": cfg0.server.weighting, "settings": settings[name][1:],
            "in_force": settings_in_force(base, name, overrides, chosen.get(name)),
            "reference_row": method_class(name).reference, "runs": method_runs,
            "final": mean_interval([r["final"] for r in method_runs]).to_dict(),
            "best": mean_interval([r["best"] for r in method_runs]).to_dict(),
            "bytes_up": float(np.mean([r["bytes_up"] for r in method_runs])),
            "bytes_down": float(np.mean([r["bytes_down"] for r in method_runs])),
            "time": float(np.mean([r["time"] for r in method_runs])),
            **{key: max((r[key] for r in method_runs if r.get(key) is not None), default=None) for key in PRIVACY_KEYS},
            **({"codec": codec_of(cfg0)} if cfg0.uplink.active or cfg0.downlink.active else {}),
        })
    for row in rows:
        line = collapse_summary(row)
        if line and log is not None:
            log(line)
    paired = paired_against(rows, reference, higher_is_better(metric))
    described = metric_description(metric, [r for o in outcomes for r in o.history])
    results = {"metric": metric, "metric_description": described, "higher_is_better": higher_is_better(metric),
               "confidence": CONFIDENCE,
               "alpha": ALPHA, "setup": setup, "seeds": seed_list, "reference": reference,
               "tuned": str(tuned) if tuned else None, "rows": rows, "paired": paired, "command": command}
    if out is not None:
        from ..runtime.rundir import own
        from .plots import plot_comparison

        out.mkdir(parents=True, exist_ok=True)
        own(out, "results.json", "results.md", REPORT, *(f"{metric}_vs_{x}.png" for x in ("round", "bytes")))
        results["plots"] = [str(p) for p in plot_comparison(histories, out, metric, plot_title(setup),
                                                              {r["method"] for r in rows if r["reference_row"]})]
        (out / "results.json").write_text(json.dumps(results, indent=1))
        (out / "results.md").write_text(results_markdown(results))
        write_report(out, results)
    return results


REPORT = "report.html"


def write_report(out: Path, results: dict[str, Any]) -> Path:
    """``out/report.html``: one self-contained page (:func:`fedlowrank.reporting.html.html_page`) of ``results.md``
    (setup, table, paired statistics), the plots ``results`` lists, the label histogram of the reference's first
    run (``partition.png``: the partition every method trained on with that seed), and the command."""
    from ..reporting.html import html_page

    figures = [(Path(p).stem.replace("_", " "), Path(p).read_bytes()) for p in results.get("plots", [])
               if Path(p).is_file()]
    reference = next(r for r in results["rows"] if r["method"] == results["reference"])
    first = reference["runs"][0]
    histogram = Path(first.get("run_dir", "")) / "partition.png"
    if first.get("run_dir") and histogram.is_file():
        figures.append((f"labels per client, seed {first['seed']} (the same partition for every method)",
                        histogram.read_bytes()))
    command = results.get("command") or "from Python: fedlowrank.compare(...) (no command line)"
    title = f"{', '.join(r['method'] for r in results['rows'])}: {plot_title(results['setup'])}"
    path = out / REPORT
    path.write_text(html_page(title, results_markdown(results), figures, command))
    return path


def check_reference(reference: str, names: list[str]) -> str:
    """``reference`` when it is one of the compared methods ``names``, else a :class:`ConfigError` naming them."""
    if reference not in names:
        raise ConfigError(f"--reference: {reference!r} is not one of the compared methods ({', '.join(names)})")
    return reference


def paired_against(rows: list[dict[str, Any]], reference: str, higher: bool) -> list[dict[str, Any]]:
    """Per method other than ``reference``: :func:`paired_statistics` of its final and best values per seed against
    the reference's (``rows`` as in ``results["rows"]``, every row's runs in the same seed order)."""
    ref = next(r for r in rows if r["method"] == reference)
    paired = []
    for row in rows:
        if row["method"] == reference:
            continue
        entry: dict[str, Any] = {"method": row["method"], "reference": reference}
        for key in ("final", "best"):
            entry[key] = paired_statistics([r[key] for r in row["runs"]], [r[key] for r in ref["runs"]], higher)
        paired.append(entry)
    return paired


def against_reference(results: dict[str, Any], reference: str) -> dict[str, Any]:
    """The same runs' ``results`` (as :func:`run_comparison` returns and writes them) with the paired differences
    taken against ``reference`` instead: no run is made."""
    check_reference(reference, [r["method"] for r in results["rows"]])
    return {**results, "reference": reference,
            "paired": paired_against(results["rows"], reference, results["higher_is_better"])}


def paired_statistics(values: list[float], reference: list[float], higher_is_better: bool) -> dict[str, Any]:
    """Per seed ``values − reference`` and what is reported of them: the mean with its paired t-interval
    (``mean``, ``half_width``, ``low``, ``high``...) and the t-interval's verdict (``t_verdict``); the ``median``;
    ``wins``/``losses``/``ties`` of the method; the paired bootstrap interval of the mean (``bootstrap``, seed
    ``BOOTSTRAP_SEED``); the Wilcoxon signed-rank test (``signed_rank``) and the ``verdict`` it gives
    (:func:`~fedlowrank.experiments.stats.rank_verdict`)."""
    diffs, iv = paired_interval(values, reference)
    test = wilcoxon_signed_rank(diffs)
    boot = bootstrap_interval(diffs, BOOTSTRAP_SEED)
    return {"differences": diffs, **iv.to_dict(), "t_verdict": verdict(iv, higher_is_better),
            "median": median(diffs), **wins_losses(diffs, higher_is_better),
            "bootstrap": None if boot is None else {"low": boot[0], "high": boot[1], "seed": BOOTSTRAP_SEED,
                                                    "resamples": BOOTSTRAP_RESAMPLES, "confidence": CONFIDENCE},
            "signed_rank": test.to_dict(), "verdict": rank_verdict(test, higher_is_better)}


def paired_explanation(results: dict[str, Any]) -> list[str]:
    """What the paired table shows and the verdict rule, in words (results.md, docs/comparison.md)."""
    ref, n, conf = results["reference"], len(results["seeds"]), f"{results['confidence']:.0%}"
    alpha = results.get("alpha", ALPHA)
    lines = [f"Per seed, method − {ref} on the same partition, client sampling and data order. Shown: the mean ± "
             f"half-width of the paired {conf} t-interval; the median; the {conf} paired bootstrap percentile "
             f"interval of the mean ({BOOTSTRAP_RESAMPLES:,} resamples of the seeds, seed {BOOTSTRAP_SEED}); the "
             f"seeds where the method did better than {ref} (wins), the same (ties) or worse (losses); the two-sided "
             "p-value of the Wilcoxon signed-rank test (exact up to 100 non-zero differences; a seed where the two "
             "methods tie exactly is dropped from it, equal magnitudes share their mean rank).",
             "",
             f"Verdict: \"better\" or \"worse\" only where the signed-rank test gives p < {alpha:g} (in the direction "
             "of the larger rank sum), else \"undecided\". The test does not assume normal differences, only that "
             "without a real difference each seed's difference would be as likely positive as negative; a method "
             "that sometimes collapses cannot win it with one or two large differences. The t-interval measures the "
             "mean effect; where it alone excludes 0 the verdict cell says so: the mean rests on few seeds."]
    if n <= 5:
        lines += ["", f"With {n} seed{'s' if n > 1 else ''} no verdict is possible: the smallest two-sided "
                      f"signed-rank p-value is 2/2ⁿ = {min(1.0, 2 / 2 ** n):g}; 6 or more seeds are needed."]
    return lines


def paired_cells(stats: dict[str, Any]) -> str:
    """The median, bootstrap, wins–ties–losses, p and verdict cells of one paired row of results.md."""
    boot = stats.get("bootstrap")
    test = stats["signed_rank"]
    p = f"{test['p']:.3g}" + ("" if test["exact"] else " (normal approx.)")
    verdict_cell = stats["verdict"] + (f" (t-interval alone: {stats['t_verdict']})"
                                       if stats["t_verdict"] != stats["verdict"] else "")
    return " | ".join([f"{stats['median']:+.4f}", f"[{boot['low']:+.4f}, {boot['high']:+.4f}]" if boot else "–",
                       f"{stats['wins']}–{stats['ties']}–{stats['losses']}", p, verdict_cell])


def results_markdown(results: dict[str, Any]) -> str:
    """``results.md``: the setup as run, what ± means, the table per method and the paired differences."""
    metric, setup, ref = results["metric"], results["setup"], results["reference"]
    n = len(results["seeds"])
    direction = "higher is better" if results["higher_is_better"] else "lower is better"
    lines = [f"# Comparison: {', '.join(r['method'] for r in results['rows'])}", "", "## Setup (as run)", "", *setup_lines(setup),
             "- paired by seed: for a given seed every method has the same partition (checked), client sampling "
             "and local data order", ""]
    lines += ["| method | train.lr | head lr | optimizer | weighting | settings applied: the value in force and "
              "where it comes from (preset, compare.overrides, tuned, --set) |", "|---|---|---|---|---|---|"]
    for r in results["rows"]:
        head = f"{r['head_lr']:g}" if r["head_lr"] else "= lr"
        lines.append(f"| {method_cell(r)} | {r['lr']:g} | {head} | {r['optimizer']} | {r['weighting']} | "
                     f"{settings_cell(r['in_force'])} |")
    references = [r for r in results["rows"] if r.get("reference_row")]
    if references:
        lines += ["", "Reference rows, not federated methods: " + "; ".join(
            f"{r['method']}: {r['reference_row']}" for r in references) + "."]
    if results.get("tuned"):
        lines += ["", f"Learning rates chosen on a validation split of the training data by `fedlowrank tune`: "
                      f"{results['tuned']}."]
    conf = f"{results['confidence']:.0%}"
    pm = (f"mean ± half-width of the {conf} Student-t confidence interval of the mean over the {n} seeds "
          f"(t_{{{0.5 + results['confidence'] / 2:g}, n−1}} · sd / √n, sample sd with ddof = 1)" if n > 1
          else "a single seed (n = 1): no interval")
    named = results.get("metric_description", metric)
    if named != metric:  # own-task evaluation (fedlowrank.runtime.evaluation)
        where = "(each client scored on the test examples of its own task, by its own model or the global one)"
    elif setup.get("num_test"):
        where = f"on the {setup['num_test']:,} test examples"
    else:
        where = "as the task evaluates it"
    private = [k for k in PRIVACY_KEYS if any(r.get(k) is not None for r in results["rows"])]
    coded = any("codec" in r for r in results["rows"])  # bytes are the coded messages' (docs/codecs.md)
    lines += ["", "## Results", "", f"Metric: {named} {where} ({direction}); final = after the last round, "
              f"best = the best evaluated round. Values are {pm}.", "",
              f"| method | final {named} | best {named} | bytes up | bytes down | time (s) |"
              + (" codec (up / down) |" if coded else "") + "".join(f" {PRIVACY_KEYS[k]} |" for k in private),
              "|---|---|---|---|---|---|" + "---|" * (len(private) + coded)]
    for r in results["rows"]:
        eps = "".join(f" {r[k]:.3g} |" if r.get(k) is not None else " – |" for k in private)
        codec = f" {r.get('codec', 'fp32 / fp32')} |" if coded else ""
        lines.append(f"| {method_cell(r)} | {interval_cell(_interval(r['final']), metric)} | "
                     f"{interval_cell(_interval(r['best']), metric)} | "
                     f"{format_bytes(r['bytes_up'])} | {format_bytes(r['bytes_down'])} | {r['time']:.1f} |{codec}{eps}")
    collapses = [line for line in map(collapse_summary, results["rows"]) if line]
    if collapses:
        lines += ["", *(f"- {line}" for line in collapses)]
    if results["paired"]:
        lines += ["", f"## Paired differences against {ref}", "", *paired_explanation(results), "",
                  f"| method | Δ {named} | mean ± {conf} t | median | {conf} bootstrap | wins–ties–losses | "
                  "signed-rank p | verdict |", "|---|---|---|---|---|---|---|---|"]
        rows = {r["method"]: r for r in results["rows"]}
        for p in results["paired"]:
            for key in ("final", "best"):
                lines.append(f"| {method_cell(rows[p['method']])} | {key} | {_interval(p[key]).format(signed=True)} | "
                             f"{paired_cells(p[key])} |")
        lines += ["", f"Δ final {named} per seed:", "", "| method | " + " | ".join(
            f"seed {s}" for s in results["seeds"]) + " |", "|---|" + "---|" * n]
        for p in results["paired"]:
            lines.append(f"| {p['method']} | " + " | ".join(f"{d:+.4f}" for d in p["final"]["differences"]) + " |")
    return "\n".join(lines) + "\n"

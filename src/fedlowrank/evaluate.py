"""Score a run's checkpoint, or an export, after training: ``fedlowrank evaluate``.

``evaluate_run(path, round, client, data)`` rebuilds the model of the run in ``path`` from its newest intact
checkpoint (or that of ``round``) read-only (:meth:`~fedlowrank.runtime.server_run.ServerRun.from_checkpoint`), and
evaluates it with the run's own evaluation (:class:`~fedlowrank.runtime.evaluation.Evaluator`): the global model
(``method.load_global``), or for a personalised method the mean over its evaluated clients' own models, on the
task's test split; so the metrics equal the checkpoint's round's row of ``metrics.jsonl`` (``recorded``) exactly.
With ``client`` (an index, or ``"all"``: every client with a state; personalised methods, checked by
:func:`fedlowrank.export.chosen_clients`), each client's own model (``method.load_personal``), on its own-task
examples when the run evaluates them so. With ``data`` (a file of the run's task kind), the same models on that
file instead of the test split: it is read as ``data.train`` and ``data.test`` of ``data.source = "files"`` with the
run's columns and header (and its class names, so label ids agree; :func:`data_task`).

``path`` may also be an export (``fedlowrank export``): its model is loaded from its files as its users load it
(:func:`fedlowrank.export.load_export`) over the base of the run's config, which every export keeps
(:data:`~fedlowrank.export.RUN_CONFIG`); ``recorded`` is then the export's own check of the test split.

The report: ``path``, ``kind`` (``run`` or ``export``), ``method``, ``round`` and ``rounds``, ``task``, ``data``
(``None``: the run's test split), ``model`` (what was evaluated, in words), ``metrics`` (the task's evaluation:
accuracy or exact match, loss, per-class recall in ``predictions``, per-domain metrics, ``by_task`` of an own-task
evaluation), ``recorded``, ``collapse`` (:func:`~fedlowrank.runtime.evaluation.collapse_of`), and with ``client``
``clients``: per client its ``metrics`` and ``recorded``. Nothing is written into the run; the command line
writes the report, its table (:func:`evaluation_table`) and the harness's results (:mod:`fedlowrank.harness`)
into ``--out`` only, a folder it claims (:func:`write_evaluation`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .runtime.evaluation import Evaluator, collapse_of, mean_metrics, scalar_metrics

REPORT_JSON, REPORT_TABLE = "evaluation.json", "evaluation.md"
DATA_FILE_KINDS = ("text-classification", "causal-lm")  # tasks that read data.source = "files"


def runner_class(run_dir: Path):
    """The runner that wrote ``run_dir``: the vectorised runner for ``run.vectorized``, else the simulator (Flower's
    and torch.distributed's checkpoints are the simulator's)."""
    from .runtime.simulator import Simulation
    from .runtime.vectorized import Vectorized

    try:
        vectorized = json.loads((run_dir / "config.json").read_text())["run"].get("vectorized") is True
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        vectorized = False  # from_checkpoint says what is wrong with config.json
    return Vectorized if vectorized else Simulation


def data_task(cfg, task, path: str | Path):
    """The task of ``cfg`` on the examples of the file ``path`` (every one of them is a test example): read with
    ``data.source = "files"``, the run's columns, header and, for text classification, class names (``task``: the
    run's task, whose label ids the file's must keep)."""
    from .config import from_dict
    from .tasks import build_task

    if cfg.task.kind not in DATA_FILE_KINDS:
        raise ValueError(f"--data: a file of examples applies to task.kind {' or '.join(map(repr, DATA_FILE_KINDS))}; "
                         f"this run's task.kind is {cfg.task.kind!r}")
    if not Path(path).is_file():
        raise FileNotFoundError(f"--data {path}: no such file")
    raw = cfg.to_dict()
    raw["data"].update(source="files", train=str(path), test=str(path), path="", hf_name="", max_train_examples=0,
                       max_test_examples=0)
    if cfg.task.kind == "text-classification":
        raw["data"]["labels"] = list(task.data.label_names)
    raw["partition"].update(kind="iid", partition_by="")  # nothing is partitioned: the file is evaluated whole
    return build_task(from_dict(raw))


def _recorded(row: dict[str, Any], metrics: tuple[str, ...]) -> dict[str, float] | None:
    """The test metrics a metrics ``row`` recorded (``None`` when its round was not evaluated)."""
    found = {k: row[k] for k in metrics if k in row}
    return found or None


def _evaluate_checkpoint(run_dir: Path, round: int | None, client, data, warn) -> dict[str, Any]:
    from .export import chosen_clients, recorded_client_test
    from .reporting.progress import Progress

    sim = runner_class(run_dir).from_checkpoint(run_dir, round=round, warn=warn)
    clients = chosen_clients(sim, client)
    evaluator = sim.evaluator
    if data is not None:
        task = data_task(sim.cfg, sim.task, data)
        evaluator = Evaluator(sim.cfg, task, sim.method, sim.model, Progress(None, sim.method.name, sim.cfg.run.rounds))
    row = sim.history[-1] if sim.history else {}
    report: dict[str, Any] = {"path": str(run_dir), "kind": "run", "method": sim.method.name, "round": sim.round,
                              "rounds": sim.cfg.run.rounds, "task": sim.cfg.task.kind,
                              "data": None if data is None else str(data)}
    if clients:
        per = {}
        for k in clients:
            metrics = evaluator.evaluate_client(sim.server, sim.store[k], k)
            per[str(k)] = {"metrics": metrics,
                           "recorded": recorded_client_test(sim.history, k) if data is None else None}
        report.update(model=f"client {clients[0]}'s own model" if len(clients) == 1 else
                      f"the own models of clients {', '.join(map(str, clients))}", clients=per)
        metrics = per[str(clients[0])]["metrics"] if len(clients) == 1 else \
            mean_metrics([p["metrics"] for p in per.values()])
        recorded = per[str(clients[0])]["recorded"] if len(clients) == 1 else None
    else:
        personal = sim.method.personalized and len(sim.store)
        metrics = evaluator.evaluate(sim.server, sim.store)
        report["model"] = (f"the mean of the own models of clients "
                           f"{', '.join(map(str, sim.personal_eval_clients()))}" if personal else "the global model")
        recorded = _recorded(row, sim.task.metrics) if data is None and row.get("round") == sim.round else None
    report.update(metrics=metrics, recorded=recorded, collapse=collapse_of({"round": sim.round, **metrics}))
    return report


def _evaluate_export(folder: Path, round: int | None, client, data) -> dict[str, Any]:
    from .config import ConfigError, from_dict
    from .export import REPORT_FILE, RUN_CONFIG, export_base, load_export
    from .tasks import build_task

    if round is not None or client is not None:
        raise ValueError(f"{folder} is an export (one model of one round): --round and --client apply to a run "
                         f"directory; a client's export is its own folder (client-N)")
    try:
        exported = json.loads((folder / REPORT_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{folder}: {REPORT_FILE} unreadable ({exc}); is it a complete export?") from None
    if "clients" in exported:
        raise ValueError(f"{folder} holds one export per client (folders client-N): evaluate {folder}/client-N")
    try:
        cfg = from_dict(json.loads((folder / RUN_CONFIG).read_text()))
    except (OSError, ValueError, ConfigError) as exc:
        raise ValueError(f"{folder}: {RUN_CONFIG} unreadable ({exc}); export the run again to evaluate the "
                         f"export") from None
    task = build_task(cfg)
    net = load_export(folder, exported["format"], export_base(task))
    scored = task if data is None else data_task(cfg, task, data)
    metrics = scored.evaluate(net)
    what = f"client {exported['client']}'s own model" if "client" in exported else "the global model"
    return {"path": str(folder), "kind": "export", "method": exported["method"], "round": exported["round"],
            "rounds": cfg.run.rounds, "task": cfg.task.kind, "data": None if data is None else str(data),
            "model": f"{what}, exported with --format {exported['format']}", "metrics": metrics,
            "recorded": exported["check"]["exported"] if data is None else None,
            "collapse": collapse_of({"round": exported["round"], **metrics})}


def evaluate_run(path: str | Path, round: int | None = None, client: int | str | None = None,
                 data: str | Path | None = None, warn=None) -> dict[str, Any]:
    """The report of the evaluation of the run (or export) in ``path`` (see the module docstring); ``warn`` gets a
    line when a damaged checkpoint is skipped. Reads only."""
    from .runtime.rundir import read_claim

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such directory (RUN_DIR: a run directory or an export)")
    claim = read_claim(path)
    if claim is not None and claim.kind == "export":
        return _evaluate_export(path, round, client, data)
    if claim is not None and claim.kind != "run":
        raise ValueError(f"{path} is the output of `fedlowrank {claim.kind}`, not one run: evaluate one of the run "
                         f"directories in it")
    return _evaluate_checkpoint(path, round, client, data, warn)


# -- output ---------------------------------------------------------------------------------------------------
def _cell(value: Any) -> str:
    return "" if value is None else f"{value:.6g}" if isinstance(value, float) else str(value)


def evaluation_table(report: dict[str, Any]) -> str:
    """The report for people (markdown): what was evaluated on what, then one row per metric with the value and
    what the run recorded (one column pair per client with ``--client all``)."""
    data = report["data"] or ("the run's test split" if report["kind"] == "run" else "the test split")
    lines = [f"{report['model']} of `{report['path']}` ({report['method']}, round {report['round']} of "
             f"{report['rounds']}) on {data}", ""]
    columns = ({f"client {k}": c for k, c in report["clients"].items()} if len(report.get("clients", {})) > 1
               else {"": {"metrics": report["metrics"], "recorded": report["recorded"]}})
    names = list(dict.fromkeys(k for c in columns.values() for k in scalar_metrics(c["metrics"])))
    head = [f"{label} {part}".strip() for label in columns for part in ("value", "recorded")]
    lines += ["| metric | " + " | ".join(head) + " |", "|---" * (1 + len(head)) + "|"]
    for name in names:
        cells = [_cell(c[part].get(name) if c[part] else None) for c in columns.values()
                 for part in ("metrics", "recorded")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    metrics = report["metrics"]
    for task_name, values in metrics.get("by_task", {}).items():
        lines.append(f"\ntask {task_name}: " + ", ".join(f"{k} {_cell(v)}" for k, v in values.items()))
    if "predictions" in metrics:
        p = metrics["predictions"]
        lines.append(f"\nmost predicted: class {p['top_label']!r}, {100 * p['top_share']:.1f} % of the test set "
                     f"(chance level {100 * p['majority_share']:.1f} %)")
    if report["collapse"]:
        lines.append("collapsed: one class takes at least 95 % of the predictions")
    return "\n".join(lines) + "\n"


def check_evaluation_dir(out: str | Path) -> None:
    """Refuse an ``--out`` that is, or is inside, a run directory or an export: evaluate never writes into a run."""
    from .runtime.rundir import read_claim

    resolved = Path(out).resolve()
    for folder in (resolved, *resolved.parents):
        claim = read_claim(folder) if folder.is_dir() else None
        if claim is not None and claim.kind != "evaluate":
            where = "is" if folder == resolved else "is inside"
            raise ValueError(f"--out {out} {where} the output of `fedlowrank {claim.kind}` {folder}: evaluate never "
                             f"writes into a run or an export; choose a folder outside it")


def write_evaluation(out: Path, report: dict[str, Any], files: dict[str, str]) -> None:
    """Write the report (:data:`REPORT_JSON`), its table (:data:`REPORT_TABLE`) and ``files`` (name → text) into
    ``out``, each recorded in ``out``'s claim first (the caller claimed it)."""
    from .runtime.rundir import own

    for name, text in {REPORT_JSON: json.dumps(report, indent=1), REPORT_TABLE: evaluation_table(report),
                       **files}.items():
        own(out, name).write_text(text)


__all__ = ["DATA_FILE_KINDS", "REPORT_JSON", "REPORT_TABLE", "check_evaluation_dir", "data_task", "evaluate_run",
           "evaluation_table", "write_evaluation"]

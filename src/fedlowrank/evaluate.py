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
writes the report, its table (:func:`evaluation_table`) and the harness's results into ``--out`` only, a folder it
claims (:func:`write_evaluation`).

**lm-evaluation-harness** (``--lm-eval TASKS``, the optional extra ``fedlowrank[eval]``, :data:`LM_EVAL_PIN`):
:func:`run_harness` gives the run's causal LM as it is, its adapters attached (nothing merged), on the run's device,
to the harness's Python API (``simple_evaluate`` over its ``HFLM``), for the harness's own task names (hub-backed:
they need its data sets, online or cached) and for local tasks, a YAML file with a local JSON/JSONL data file
(offline). The report's ``lm_eval`` holds the harness's metrics and, for each generation task, fedlowrank's own
exact match of the same generations (:func:`own_exact_match`); docs/evaluate.md compares that rule with the
harness's ``gsm8k`` strict-match.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .runtime.evaluation import Evaluator, collapse_of, mean_metrics, scalar_metrics
from .schema import check_choice

REPORT_JSON, REPORT_TABLE = "evaluation.json", "evaluation.md"
DATA_FILE_KINDS = ("text-classification", "causal-lm")  # tasks that read data.source = "files"
LM_EVAL_PIN = "lm-eval==0.4.13"  # the optional extra fedlowrank[eval]
HARNESS_RESULTS, HARNESS_SAMPLES = "lm_eval_results.json", "lm_eval_samples_{task}.jsonl"
HARNESS_DTYPES = ("fp32", "bf16")


@dataclass
class HarnessRequest:
    """What ``--lm-eval`` asks of lm-evaluation-harness: ``tasks`` (the harness's task names, or YAML files of local
    tasks), ``limit`` (examples per task, ``None``: all), ``num_fewshot`` (``None``: each task's own), ``dtype``
    (the model's, :data:`HARNESS_DTYPES`)."""

    tasks: list[str]
    limit: int | None = None
    num_fewshot: int | None = None
    dtype: str = "fp32"


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


def check_harness(cfg, harness: HarnessRequest | None, client=None) -> None:
    """Refuse ``--lm-eval`` for a run that is no causal LM, or with ``--client all`` (the harness scores one
    model)."""
    if harness is None:
        return
    if cfg.task.kind != "causal-lm":
        raise ValueError(f"--lm-eval scores causal language models; this run's task.kind is {cfg.task.kind!r}")
    if client == "all":
        raise ValueError("--lm-eval scores one model: give --client N (or no --client: the global model)")


def _evaluate_checkpoint(run_dir: Path, round: int | None, client, data, warn,
                         harness: HarnessRequest | None) -> dict[str, Any]:
    from .export import chosen_clients, recorded_client_test
    from .reporting.progress import Progress

    sim = runner_class(run_dir).from_checkpoint(run_dir, round=round, warn=warn)
    clients = chosen_clients(sim, client)
    check_harness(sim.cfg, harness, client)
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
    if harness is not None:  # the model the report names first: the global model or the client's own
        if clients:
            sim.method.load_personal(sim.model, sim.server, sim.store[clients[0]])
        else:
            sim.method.load_global(sim.model, sim.server)
        report["lm_eval"] = run_harness(sim.model.net, sim.task.tokenizer, harness, sim.task.generation_batch_size)
    return report


def _evaluate_export(folder: Path, round: int | None, client, data, harness: HarnessRequest | None) -> dict[str, Any]:
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
    check_harness(cfg, harness)
    task = build_task(cfg)
    net = load_export(folder, exported["format"], export_base(task))
    scored = task if data is None else data_task(cfg, task, data)
    metrics = scored.evaluate(net)
    what = f"client {exported['client']}'s own model" if "client" in exported else "the global model"
    report = {"path": str(folder), "kind": "export", "method": exported["method"], "round": exported["round"],
              "rounds": cfg.run.rounds, "task": cfg.task.kind, "data": None if data is None else str(data),
              "model": f"{what}, exported with --format {exported['format']}", "metrics": metrics,
              "recorded": exported["check"]["exported"] if data is None else None,
              "collapse": collapse_of({"round": exported["round"], **metrics})}
    if harness is not None:
        report["lm_eval"] = run_harness(net, task.tokenizer, harness, task.generation_batch_size)
    return report


def evaluate_run(path: str | Path, round: int | None = None, client: int | str | None = None,
                 data: str | Path | None = None, warn=None, harness: HarnessRequest | None = None) -> dict[str, Any]:
    """The report of the evaluation of the run (or export) in ``path`` (see the module docstring); ``warn`` gets a
    line when a damaged checkpoint is skipped; ``harness``: also score the model with lm-evaluation-harness
    (:func:`run_harness`, the report's ``lm_eval``). Reads only."""
    from .runtime.rundir import read_claim

    if harness is not None:
        require_lm_eval()
        check_choice("--dtype", harness.dtype, HARNESS_DTYPES)
        harness_tasks(harness.tasks)  # the YAML files are there and name their tasks
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such directory (RUN_DIR: a run directory or an export)")
    claim = read_claim(path)
    if claim is not None and claim.kind == "export":
        return _evaluate_export(path, round, client, data, harness)
    if claim is not None and claim.kind != "run":
        raise ValueError(f"{path} is the output of `fedlowrank {claim.kind}`, not one run: evaluate one of the run "
                         f"directories in it")
    return _evaluate_checkpoint(path, round, client, data, warn, harness)


# -- lm-evaluation-harness ------------------------------------------------------------------------------------
def require_lm_eval() -> None:
    """One line naming the extra to install when lm-evaluation-harness is not installed."""
    try:
        import lm_eval  # noqa: F401
    except ModuleNotFoundError:
        raise ValueError(f"--lm-eval needs lm-evaluation-harness, the optional extra fedlowrank[eval]: pip install "
                         f"'fedlowrank[eval]' ({LM_EVAL_PIN})") from None


def harness_tasks(specs: list[str]) -> tuple[list[str], list[str]]:
    """``(task names, folders to include)`` of ``--lm-eval``'s items: a harness task name as it is, a YAML file
    (a local task) as the name its ``task:`` line gives, with its folder included (where the harness finds it)."""
    names, folders = [], []
    for spec in specs:
        path = Path(spec)
        if path.suffix not in (".yaml", ".yml"):
            names.append(spec)
            continue
        if not path.is_file():
            raise FileNotFoundError(f"--lm-eval {spec}: no such file")
        found = re.search(r"^task:\s*['\"]?([^'\"\s#]+)", path.read_text(), re.M)
        if found is None:
            raise ValueError(f"--lm-eval {spec}: no 'task: NAME' line (a harness task file names its task)")
        names.append(found.group(1))
        folders.append(str(path.resolve().parent))
    return names, list(dict.fromkeys(folders))


def own_exact_match(samples: list[dict[str, Any]]) -> float | None:
    """fedlowrank's exact match (:func:`~fedlowrank.tasks.causal_lm.extract_answer` of the generation equals that of
    the target) over the harness's logged ``samples`` of a generation task; ``None`` when a target has no number."""
    from .tasks.causal_lm import extract_answer

    scored = []
    for sample in samples:
        resps = sample.get("resps") or [[None]]
        generation, target = resps[0][0], str(sample.get("target"))
        if not isinstance(generation, str) or extract_answer(target) is None:
            return None
        predicted = extract_answer(generation)
        scored.append(predicted is not None and predicted == extract_answer(target))
    return sum(scored) / len(scored) if scored else None


def run_harness(net, tokenizer, request: HarnessRequest, batch_size: int) -> dict[str, Any]:
    """lm-evaluation-harness's ``simple_evaluate`` of the model ``net`` (the run's model as it is, adapters
    attached: nothing merged) with ``tokenizer``, through the harness's own Hugging Face model (``HFLM``): prompts
    in the tokenizer's chat template when it has one (as the run trains and generates), else plain with the
    tokenizer's BOS. Returns ``{"tasks", "results", "fedlowrank_exact_match", "harness", "samples"}``: the
    harness's per-task metrics, fedlowrank's exact match of each generation task's generations
    (:func:`own_exact_match`), the harness's full results and its logged samples per task."""
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable

    from .tasks.causal_lm import uses_chat_template

    names, folders = harness_tasks(request.tasks)
    manager = TaskManager(include_path=folders or None)
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise ValueError(f"--lm-eval {unknown[0]}: neither a task of lm-evaluation-harness nor a YAML file of one "
                         f"(`lm-eval ls tasks` lists them)")
    chat = uses_chat_template(tokenizer)
    net = net.to({"fp32": torch.float32, "bf16": torch.bfloat16}[request.dtype]).eval()
    lm = HFLM(pretrained=net, tokenizer=tokenizer, batch_size=batch_size, add_bos_token=not chat)
    out = simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=request.limit,
                          num_fewshot=request.num_fewshot, apply_chat_template=chat, log_samples=True)
    out = json.loads(json.dumps(out, default=handle_non_serializable))  # numpy scalars, sets, functions: as saved
    samples = out.pop("samples", {})
    return {"tasks": names, "results": out["results"],
            "fedlowrank_exact_match": {t: own_exact_match(s) for t, s in samples.items()},
            "harness": out, "samples": samples}


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
    if "lm_eval" in report:
        lm = report["lm_eval"]
        lines += ["", "lm-evaluation-harness:", "", "| task | metric | value | fedlowrank exact match |",
                  "|---|---|---|---|"]
        for task, metrics in lm["results"].items():
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and not key.startswith("sample") and "_stderr" not in key:
                    ours = _cell(lm["fedlowrank_exact_match"].get(task))
                    lines.append(f"| {task} | {key} | {_cell(value)} | {ours} |")
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


def report_files(report: dict[str, Any]) -> dict[str, str]:
    """What ``--out`` holds, name → text: the report (:data:`REPORT_JSON`, the harness's metrics in its
    ``lm_eval``), its table (:data:`REPORT_TABLE`) and, after ``--lm-eval``, the harness's results JSON as the
    harness writes it (:data:`HARNESS_RESULTS`) and its logged samples, one JSON line each, per task."""
    shown = dict(report)
    files = {}
    if "lm_eval" in report:
        lm = dict(report["lm_eval"])
        files[HARNESS_RESULTS] = json.dumps(lm.pop("harness"), indent=1)
        for task, samples in lm.pop("samples").items():
            files[HARNESS_SAMPLES.format(task=task)] = "".join(json.dumps(s) + "\n" for s in samples)
        shown["lm_eval"] = lm
    return {REPORT_JSON: json.dumps(shown, indent=1), REPORT_TABLE: evaluation_table(report), **files}


def write_evaluation(out: Path, report: dict[str, Any]) -> None:
    """Write :func:`report_files` into ``out``, each recorded in ``out``'s claim first (the caller claimed it)."""
    from .runtime.rundir import own

    for name, text in report_files(report).items():
        own(out, name).write_text(text)


__all__ = ["DATA_FILE_KINDS", "HARNESS_DTYPES", "HarnessRequest", "LM_EVAL_PIN", "REPORT_JSON", "REPORT_TABLE",
           "check_evaluation_dir", "data_task", "evaluate_run", "evaluation_table", "harness_tasks", "own_exact_match",
           "report_files", "require_lm_eval", "run_harness", "write_evaluation"]

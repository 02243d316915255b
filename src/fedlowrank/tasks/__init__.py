"""Task registry: every module of this package registers its tasks with :func:`register_task`, as the methods do.

A task class declares (:class:`~fedlowrank.tasks.base.Task`): its kind (``name``, the value of ``task.kind``), the
metrics :meth:`~Task.evaluate` returns, the primary one and those where higher is better, its options
(``Options``: declared settings, the keys of ``task.options``), the ``data.source`` values it reads and the
``[data]`` keys each uses, whether it supports client cohorts, and how it is built from a run config
(:meth:`~Task.from_config`). Config validation, ``fedlowrank config``, ``run`` (its plot), ``compare`` and
``tune`` ask the registry: a new task is one file with a ``@register_task`` class.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import Task

_REGISTRY: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    """Class decorator: register a task under ``cls.name`` (its ``task.kind``; lower case, hyphens). Refused: a
    primary metric or a maximised metric that the task does not report, or a metric that another task declares
    with the other direction (``higher_is_better`` is one answer per metric name)."""
    name = cls.name
    if not name or name != name.lower() or " " in name or "_" in name:
        raise ValueError(f"task name must be lower case with hyphens, got {name!r}")
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"task {name!r} registered twice")
    if cls.primary_metric not in cls.metrics or not set(cls.maximize) <= set(cls.metrics):
        raise ValueError(f"task {name!r}: primary_metric {cls.primary_metric!r} and maximize {cls.maximize} must be "
                         f"among its metrics {cls.metrics}")
    for other in _REGISTRY.values():
        for metric in set(cls.metrics) & set(other.metrics):
            if (metric in cls.maximize) != (metric in other.maximize):
                raise ValueError(f"task {name!r}: metric {metric!r} is maximised by one of {name!r} and "
                                 f"{other.name!r} and minimised by the other; give it another name")
    _REGISTRY[name] = cls
    return cls


def _load_all() -> None:
    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")


def available_tasks() -> dict[str, type[Task]]:
    """Every registered task, by kind."""
    _load_all()
    return dict(sorted(_REGISTRY.items()))


def task_kinds() -> tuple[str, ...]:
    """The values ``task.kind`` allows."""
    return tuple(available_tasks())


def task_class(kind: str) -> type[Task]:
    """The :class:`Task` class of ``task.kind``."""
    tasks = available_tasks()
    if kind not in tasks:
        raise ValueError(f"task.kind: unknown task {kind!r}; allowed: {', '.join(tasks)}")
    return tasks[kind]


def build_task(cfg, cohorts: bool = False) -> Task:
    """The task of a :class:`~fedlowrank.config.RunConfig` (data loaded and tokenised once); ``cohorts``: the run
    trains clients in cohorts whose batches ``task.options.pack = auto`` packs together (the run's plan decides it,
    :func:`fedlowrank.runtime.plan.packs_cohorts`)."""
    return task_class(cfg.task.kind).from_config(cfg, cohorts)


def headline_metric(cfg) -> str:
    """The metric a run of ``cfg`` is judged, tabulated and plotted by: ``run.stop_metric``, else its task's
    primary metric."""
    return cfg.run.stop_metric or task_class(cfg.task.kind).primary_metric


def higher_is_better(metric: str) -> bool:
    """Whether a registered task maximises ``metric`` (accuracy, exact_match); every other metric is minimised."""
    return any(metric in cls.maximize for cls in available_tasks().values())


def metric_range(metric: str) -> tuple[float, float]:
    """The values ``metric`` can take: a maximised metric is a share of examples, in ``[0, 1]``; every other
    metric a task reports (losses, errors) is ``>= 0``."""
    return (0.0, 1.0) if higher_is_better(metric) else (0.0, float("inf"))


__all__ = ["Task", "available_tasks", "build_task", "headline_metric", "higher_is_better", "metric_range",
           "register_task",
           "task_class", "task_kinds"]

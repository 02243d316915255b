"""Mirror each round's metrics row to an experiment tracker (``run.tracking``).

* ``tensorboard``: event files in ``<run dir>/tensorboard`` (``tensorboard --logdir <run dir>``);
* ``wandb``: a Weights & Biases run in ``<run dir>/wandb``, offline unless ``WANDB_MODE`` says otherwise
  (upload later with ``wandb sync``);
* ``mlflow``: an MLflow run in the SQLite store ``<run dir>/mlflow.db`` unless ``MLFLOW_TRACKING_URI`` is set
  (``mlflow ui --backend-store-uri sqlite:///<run dir>/mlflow.db``).

Each row's scalars are logged at step = round, flattened (:func:`row_scalars`); the resolved config goes
along as the run's parameters. Each package is imported only when chosen; a missing one is a one-line error.

A run's tracker (:class:`RunTracker`) opens at the first round it mirrors and closes when the run closes (a later
round opens it again). It is off without ``run.tracking`` or without a run directory (the tracker's files live
there).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

from ..schema import ConfigError

# run.tracking value -> (module to import, pip requirement)
TRACKERS = {
    "tensorboard": ("tensorboard", "tensorboard==2.21.0"),
    "wandb": ("wandb", "wandb==0.31.0"),
    "mlflow": ("mlflow", "mlflow-skinny==3.17.2 sqlalchemy==2.1.9 alembic==1.20.1"),
}
TRACKER_FILES = {"tensorboard": ("tensorboard",), "wandb": ("wandb",), "mlflow": ("mlflow.db",)}  # in the run dir


def row_scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics row, flattened: ``accuracy``, ``loss``, ``train_loss``, ``bytes_up``,
    ``cum_bytes_down``, ``peak_rss_mb``..., ``time/total``, ``time/client_compute``..., ``diagnostics/<name>``.
    The round is the step, not a scalar; lists (clients, per-client rows) are left out."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key == "round" or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[key] = float(value)
        elif isinstance(value, dict):
            out.update({f"{key}/{k}": float(v) for k, v in value.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out


def flat_config(cfg) -> dict[str, str]:
    """``section.key`` -> value as text, for a tracker's run parameters."""
    return {f"{section}.{key}": str(value) for section, values in cfg.to_dict().items() for key, value in values.items()}


def require_package(kind: str) -> None:
    """Raise :class:`ConfigError` (one line, with the pip command) when ``run.tracking``'s package is missing."""
    module, requirement = TRACKERS[kind]
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"run.tracking = {kind!r} needs the {module} package, which is not installed: "
                          f"pip install {requirement}")


class TensorBoardTracker:
    def __init__(self, cfg, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.writer.add_text("config", "    " + cfg.to_json().replace("\n", "\n    "))

    def log(self, row: dict[str, Any]) -> None:
        for key, value in row_scalars(row).items():
            self.writer.add_scalar(key, value, row["round"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, cfg, run_dir: Path):
        import wandb

        self.run = wandb.init(project="fedlowrank", name=run_dir.name, dir=str(run_dir), config=cfg.to_dict(),
                              mode=os.environ.get("WANDB_MODE", "offline"), reinit="create_new")

    def log(self, row: dict[str, Any]) -> None:
        self.run.log(row_scalars(row), step=row["round"])

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, cfg, run_dir: Path):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # not its INFO lines about creating the store
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(cfg.run.name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(cfg.run.name)
        self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
        params = [Param(k, v[:500]) for k, v in flat_config(cfg).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def log(self, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, stamp, row["round"])
                                                    for k, v in row_scalars(row).items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def open_tracker(cfg, run_dir: Path):
    """The tracker named by ``cfg.run.tracking`` writing for ``run_dir`` (``None`` when tracking is off)."""
    kind = cfg.run.tracking
    if not kind:
        return None
    require_package(kind)
    return {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}[kind](cfg, run_dir)


class RunTracker:
    """Mirrors each metrics row of the run in ``run_dir`` to the tracker ``cfg.run.tracking`` names; ``own(run_dir,
    *names)`` records the names the tracker writes there before it writes them (the run directory's claim)."""

    def __init__(self, cfg, run_dir: Path | None, own: Callable[..., Any]):
        self.cfg, self.run_dir, self.own = cfg, run_dir, own
        self._tracker = None

    @property
    def on(self) -> bool:
        return bool(self.cfg.run.tracking) and self.run_dir is not None

    def log(self, row: dict[str, Any]) -> None:
        if not self.on:
            return
        if self._tracker is None:
            self.own(self.run_dir, *TRACKER_FILES[self.cfg.run.tracking])
            self._tracker = open_tracker(self.cfg, self.run_dir)
        self._tracker.log(row)

    def close(self) -> None:
        if self._tracker is not None:
            self._tracker.close()
            self._tracker = None

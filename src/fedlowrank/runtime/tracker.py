"""A run's experiment tracker (``run.tracking``: TensorBoard, W&B or MLflow, :mod:`fedlowrank.reporting.tracking`):
opened at the first round it mirrors, closed when the run closes (a later round opens it again). Off without
``run.tracking`` or without a run directory (the tracker's files live there)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..reporting.tracking import TRACKER_FILES, open_tracker
from .rundir import own


class RunTracker:
    """Mirrors each metrics row of the run in ``run_dir`` to the tracker ``cfg.run.tracking`` names."""

    def __init__(self, cfg, run_dir: Path | None):
        self.cfg, self.run_dir = cfg, run_dir
        self._tracker = None

    @property
    def on(self) -> bool:
        return bool(self.cfg.run.tracking) and self.run_dir is not None

    def log(self, row: dict[str, Any]) -> None:
        if not self.on:
            return
        if self._tracker is None:
            own(self.run_dir, *TRACKER_FILES[self.cfg.run.tracking])
            self._tracker = open_tracker(self.cfg, self.run_dir)
        self._tracker.log(row)

    def close(self) -> None:
        if self._tracker is not None:
            self._tracker.close()
            self._tracker = None

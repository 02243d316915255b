"""What a run writes in its run directory (``docs/runs.md``), for every runtime.

* at the start (:meth:`RunFiles.start`): ``config.json`` (the resolved config), ``partition.json`` (task, client
  sizes, per-client counts of what the partition split on), ``partition.png``, and empty ``metrics.jsonl`` and
  ``ledger.jsonl``;
* after each round (:meth:`RunFiles.append_round`): its metrics row to ``metrics.jsonl``, its ledger rows to
  ``ledger.jsonl``, and the task's sample generations (a causal LM's answers) to ``generations-roundN.jsonl``;
* on resume (:meth:`RunFiles.rewrite`): both ``.jsonl`` files cut back to the checkpoint's rows;
* at the end (:meth:`RunFiles.write_summary`): ``summary.json``.

Claiming and locking the directory is :mod:`.rundir`'s business; checkpoints are :mod:`.checkpointing`'s. A run
without a directory (``path`` ``None``) writes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from ..reporting.plots import plot_label_histograms
from ..tasks.partition import format_histograms, label_histograms
from .rundir import own


class RunFiles:
    """The files of the run directory ``path`` (``None``: no directory, nothing is written)."""

    def __init__(self, path: Path | None):
        self.path = path

    def start(self, run, log: Callable[[str], None] | None = None) -> None:
        """Write the start files of ``run`` (a :class:`~.run.Run`); ``log`` gets the per-client counts."""
        if self.path is None:
            return
        own(self.path, "config.json", "partition.json", "metrics.jsonl", "ledger.jsonl")
        (self.path / "config.json").write_text(run.cfg.to_json())
        report: dict[str, Any] = {"task": run.task.describe(), "client_sizes": [len(p) for p in run.parts]}
        report.update(run.task.describe_partition(run.parts))
        if run.split is not None:  # per-client counts of what the partition split on (labels, column, clusters)
            hist = label_histograms(run.split.values, run.parts, len(run.split.names))
            report.update(split_on=run.split.what, split_names=run.split.names, label_histograms=hist.tolist())
            domains = report.get("client_domains")
            plot_label_histograms(hist, own(self.path, "partition.png"), run.split.names, domains, run.split.what)
            if log is not None:
                log(f"per-client counts of each {run.split.what}:\n"
                    + format_histograms(hist, run.split.names, domains))
        (self.path / "partition.json").write_text(json.dumps(report, indent=1))
        for name in ("metrics.jsonl", "ledger.jsonl"):
            (self.path / name).write_text("")

    def _append(self, name: str, rows: list[dict[str, Any]]) -> None:
        with (self.path / name).open("a") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")

    def append_round(self, row: dict[str, Any], ledger: list[dict[str, int]],
                     generations: list[dict[str, Any]] | None = None) -> None:
        if self.path is None:
            return
        self._append("metrics.jsonl", [row])
        self._append("ledger.jsonl", ledger)
        if generations:
            own(self.path, f"generations-round{row['round']}.jsonl").write_text(
                "".join(json.dumps(g) + "\n" for g in generations))

    def rewrite(self, history: list[dict[str, Any]], ledger: list[dict[str, int]]) -> None:
        """``metrics.jsonl`` and ``ledger.jsonl`` holding exactly ``history`` and ``ledger`` (a resumed run's)."""
        if self.path is None:
            return
        for name, rows in (("metrics.jsonl", history), ("ledger.jsonl", ledger)):
            (self.path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.path is not None:
            own(self.path, "summary.json").write_text(json.dumps(summary, indent=1))

"""The Python API: :func:`run` and :func:`compare`, what ``fedlowrank run`` and ``fedlowrank compare`` do, returning
their results instead of printing them. ``config`` is a TOML file, a bundled config name (``main``, ``tiny``...)
or a TOML-shaped dict; ``overrides`` are ``"section.key=value"`` strings as after ``--set``. Bad input raises
:class:`~fedlowrank.config.ConfigError` (a ``ValueError``) naming the field, before any work.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(config: str | Path | dict[str, Any] | None, overrides: list[str] | tuple[str, ...] = (),
        out: str | Path | None = None, quiet: bool = True, overwrite: bool = False, *, history: bool = False,
        state: bool = False) -> dict[str, Any]:
    """Run one method (``method.name``; with ``run.vectorized``, the vectorised runner) and return its summary:
    ``method``, ``rounds``, the last evaluation's metrics (``accuracy``, ``loss``; ``rel_error``...),
    ``best_accuracy``, ``bytes_up``, ``bytes_down``, ``time`` (seconds by part) and ``peak_rss_mb``. Stopped by
    Ctrl-C or SIGTERM, it saves the state after its last finished round in ``out`` and raises
    ``KeyboardInterrupt``.

    Args:
        out: the run directory to write (``config.json``, ``metrics.jsonl``, checkpoints...); ``None`` writes
            nothing. A directory that is not empty is refused unless ``overwrite`` (docs/runs.md).
        quiet: ``False`` prints progress lines on stderr.
        history: add ``"history"``, the run's metrics rows (those of ``metrics.jsonl``: per round its clients,
            bytes up and down, seconds by part, and the metrics of an evaluated round).
        state: add ``"state"``, the global model's state after the last round (the method's server
            :class:`~fedlowrank.message.State`: flat name → tensor or scalar).
    """
    from .config import check_writable, load_config
    from .runtime import runner_for

    cfg = load_config(config, overrides)
    if out is not None:
        check_writable(out, "out")
    runner = runner_for(cfg)(cfg, run_dir=out, log=None if quiet else _stderr, overwrite=overwrite)
    summary = runner.run()
    if history:
        summary["history"] = list(runner.history)
    if state:
        summary["state"] = runner.server
    return summary


def compare(config: str | Path | dict[str, Any] | None, methods: list[str] | None = None,
            seeds: list[int] | None = None, overrides: list[str] | tuple[str, ...] = (),
            out: str | Path | None = None, quiet: bool = True, *, reference: str | None = None,
            tuned: str | Path | None = None, resume: bool = False, jobs: int = 1) -> dict[str, Any]:
    """Run several methods on the same partition, seeds and budget and return the results of
    :func:`fedlowrank.experiments.compare.run_comparison`: ``metric``, ``seeds``, ``setup``, ``rows`` (per method: its
    settings, ``runs`` per seed with ``final`` and ``best`` metric and bytes, their means with 95% intervals) and
    ``paired`` (differences against ``reference`` per seed); :func:`fedlowrank.experiments.compare.results_markdown`
    renders them as ``results.md``.

    Args:
        methods, seeds: default ``compare.methods`` and ``compare.seeds`` of the config.
        out: folder for the run directories, ``results.json``, ``results.md``, the plots and ``report.html``;
            ``None`` writes nothing.
        quiet: ``False`` prints progress lines on stderr.
        reference: the method the others are compared with (default: the first); ``tuned``: a ``tune.json``.
        resume: reuse each run in ``out`` that ended with the same config (the others run from the start).
        jobs: worker processes for the runs (``> 1`` needs ``out``).
    """
    from .experiments.compare import run_comparison
    from .config import check_writable

    if out is not None:
        check_writable(out, "out")
    return run_comparison(config, methods, seeds, overrides, out, None if quiet else _stderr, reference=reference,
                          tuned=tuned, resume=resume, jobs=jobs)

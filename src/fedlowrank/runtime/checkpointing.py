"""When a run checkpoints, and how a run and a checkpoint map to each other (the files: :mod:`.checkpoint`).

A run saves a checkpoint (:class:`Checkpointer`) after a round when ``run.checkpoint_seconds`` have passed since its
last one (but never sooner than 50 times what the last one took, so that checkpoints cost at most 2 % of the run),
every ``run.checkpoint_every`` rounds, at its last round (every finished run can be exported), and when it is
stopped (:mod:`.stopping`: the state after its last finished round). A checkpoint holds the round counter, the server state, the client
states the run holds (none on the Flower server: they stay on the nodes; the checkpoint says so), the metrics
history and the ledger; every random stream is a function of the round counter (:mod:`fedlowrank.seeding`).

:func:`read_run_checkpoint` reads the checkpoint a run continues from and checks that it belongs to the run
directory's ``config.json`` (method, config fingerprint, rounds); :func:`restore` puts it into a run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from .checkpoint import (Checkpoint, CheckpointError, checkpoint_folders, config_fingerprint, find_checkpoint,
                         save_checkpoint)


MAX_COST = 0.02  # the share of a run's time that checkpoints saved for run.checkpoint_seconds may take


class Checkpointer:
    """Saves the checkpoints of the run in ``run_dir`` (``None``: never) configured by ``cfg``.

    Attributes:
        saved_round: the round of the last checkpoint it saved (``None``: none yet).
        seconds: the time its saves took, in all.
    """

    def __init__(self, cfg, run_dir: Path | None, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.run_dir, self.clock = cfg, run_dir, clock
        self.saved_round: int | None = None
        self.seconds = 0.0
        self._last_save, self._last_cost = clock(), 0.0

    def due(self, rnd: int) -> bool:
        """Whether the state after round ``rnd`` is saved (see the module docstring)."""
        r = self.cfg.run
        if self.run_dir is None:
            return False
        if rnd == r.rounds or (r.checkpoint_every and rnd % r.checkpoint_every == 0):
            return True
        wait = max(r.checkpoint_seconds, self._last_cost / MAX_COST)
        return r.checkpoint_seconds > 0 and self.clock() - self._last_save >= wait

    def save(self, run) -> Path:
        """Save ``run`` (a :class:`~.server_run.ServerRun`) as it is now."""
        assert self.run_dir is not None
        t0 = self.clock()
        ck = Checkpoint(run.round, run.method.name, run.server, run.store, run.history, run.ledger.rows,
                        config_fingerprint(run.cfg), run.client_states)
        path = save_checkpoint(self.run_dir, ck)
        self._last_save = self.clock()
        self._last_cost = self._last_save - t0
        self.seconds += self._last_cost
        self.saved_round = run.round
        return path


def read_run_checkpoint(run_dir: str | Path, round: int | None = None, warn: Callable[[str], None] | None = None,
                        fits: Callable[[Any], Callable[[Path, Checkpoint], None]] | None = None
                        ) -> tuple[Any, Checkpoint]:
    """``(config, checkpoint)`` of the run in ``run_dir``: its ``config.json`` and its newest intact checkpoint (or
    that of ``round``; ``warn`` gets a line when a damaged one is skipped), after checking that the checkpoint is
    of that config. ``fits(config)``: a check ``(folder, checkpoint)`` raising :class:`CheckpointError` when the
    checkpoint does not fit the run (its history, its server state); such a checkpoint counts as damaged. Reads
    only."""
    from ..config import ConfigError, from_dict

    run_dir = Path(run_dir)
    if not checkpoint_folders(run_dir):
        find_checkpoint(run_dir, round, warn)  # says that there is none
    try:
        cfg = from_dict(json.loads((run_dir / "config.json").read_text()))
    except (OSError, ValueError, ConfigError) as exc:
        raise CheckpointError(f"{run_dir}: config.json unreadable ({exc})") from exc
    path, ck = find_checkpoint(run_dir, round, warn, None if fits is None else fits(cfg))
    if ck.method != cfg.method_name:
        raise CheckpointError(f"checkpoint {path} is of method {ck.method!r}, {run_dir / 'config.json'} says "
                              f"{cfg.method_name!r}: they are not of the same run")
    if ck.config_fingerprint and ck.config_fingerprint != config_fingerprint(cfg):
        raise CheckpointError(f"checkpoint {path} was written with another config (fingerprint "
                              f"{ck.config_fingerprint[:12]}) than {run_dir / 'config.json'} (fingerprint "
                              f"{config_fingerprint(cfg)[:12]}): they are not of the same run")
    if ck.round > cfg.run.rounds:
        raise CheckpointError(f"checkpoint {path} is of round {ck.round}, beyond run.rounds = {cfg.run.rounds} "
                              f"in {run_dir / 'config.json'}: they are not of the same run")
    return cfg, ck


def restore(run, ck: Checkpoint) -> None:
    """Put checkpoint ``ck`` into ``run`` (a :class:`~.server_run.ServerRun` of the checkpoint's config)."""
    run.server, run.round, run.client_states = ck.server, ck.round, ck.client_states
    run.store.restore(ck.clients, ck.spilled)
    run.history, run.ledger.rows = ck.history, ck.ledger
    metrics = run.task.metrics
    evals = [r for r in ck.history if any(k in r for k in metrics)]
    run.last_eval = {k: v for k, v in evals[-1].items() if k in metrics or k == "predictions"} if evals else {}

"""The Flower ``ServerApp``: builds the run from the Flower run config and drives it with :class:`MethodStrategy`.

The run directory (``flower.run-dir``, else ``run.out_dir/<run.name>-flower-<run id>``) gets what a simulated
run writes (``config.json``, ``partition.json``, ``metrics.jsonl``, ``ledger.jsonl``, ``summary.json``,
``checkpoints/`` every ``run.checkpoint_every`` rounds and at the last round) plus ``server_state.safetensors``,
the method's final server state (the global model). The checkpoints are the simulator's, with the server state,
history and ledger but not the clients' states (they stay on the SuperNodes), so ``fedlowrank export`` and
``fedlowrank resume`` (in the simulator) work on the directory. As for a simulated run, the directory must be
empty unless ``flower.overwrite`` is true, and is locked while the ServerApp writes it.
With ``flower.secagg = true`` the rounds run under Flower's SecAgg+ (:mod:`.secagg`).
"""

from __future__ import annotations

import json
from logging import ERROR, INFO
from pathlib import Path

from flwr.app import Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    # torch and the run are imported here, not at module level: `flwr run` imports this module to validate
    # the app, and needs neither.
    from ...config import ConfigError
    from ..run import build_run
    from ..rundir import own
    from ..server_run import ServerRun
    from .settings import load_run_config
    from .strategy import MethodStrategy, state_arrays

    try:
        cfg, settings = load_run_config(context.run_config)
    except ConfigError as exc:  # Flower adds its own traceback after this line; ours says what to fix
        log(ERROR, "fedlowrank: error: %s", exc)
        raise
    run_dir = Path(settings.run_dir or Path(cfg.run.out_dir) / f"{cfg.run.name}-flower-{context.run_id}")
    ServerRun.check(cfg, run_dir, settings.overwrite, flag="flower.overwrite=true")
    run = ServerRun(build_run(cfg), run_dir=run_dir, log=lambda line: log(INFO, "%s", line),
                    overwrite=settings.overwrite, client_states=False)
    log(INFO, "fedlowrank: run directory %s", run_dir)
    strategy = MethodStrategy(run, settings)
    strategy.connect(grid)
    if settings.secagg:
        from .secagg import run_secagg

        run_secagg(strategy, grid, context, settings.secagg_clipping_range, settings.round_timeout)
    else:
        strategy.start(grid, state_arrays(run.server), num_rounds=cfg.run.rounds, timeout=settings.round_timeout,
                       evaluate_fn=strategy.evaluate)
    own(run_dir, "server_state.safetensors").write_bytes(run.server.to_bytes())
    log(INFO, "fedlowrank: summary %s", json.dumps(run.summary()))
    run.close()

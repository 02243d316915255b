"""The runtimes: each runner is a :class:`~.server_run.ServerRun` over the same :func:`~.run.build_run`, and
:func:`runner_for` picks the one a config asks for. Runners are imported when chosen, so that importing a module of
this package (the run directories, the checkpoints) stays light."""

from __future__ import annotations


def runner_for(cfg, one_process: bool = False) -> type:
    """The runner class of ``cfg``: :class:`~.distributed.Distributed` in a rank of a ``torch.distributed`` job
    (``torchrun``'s environment; ``run.devices`` outside one is refused) unless ``one_process`` (a sweep's run, each
    in one rank), :class:`~.vectorized.Vectorized` with ``run.vectorized``, else :class:`~.simulator.Simulation`;
    each is called as ``runner(cfg, run_dir=..., log=..., overwrite=...)``."""
    from .distributed import under_torchrun

    if under_torchrun() and not one_process:
        from .distributed import Distributed

        return Distributed
    if cfg.run.devices:
        raise ValueError(f"run.devices = {cfg.run.devices}: `fedlowrank run` and `fedlowrank resume` spawn one rank "
                         f"per device; in Python, launch the script with torchrun (docs/distributed.md)")
    if cfg.run.vectorized:
        from .vectorized import Vectorized

        return Vectorized
    from .simulator import Simulation

    return Simulation

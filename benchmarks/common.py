"""What every benchmark prints beside its figures: the command, load and versions."""

from __future__ import annotations

import os
import platform
import sys


def provenance(argv: list[str] | None = None) -> str:
    """The command (the script and ``argv``, else the process's arguments), the load average, the versions and
    the torch threads, as lines to print before a benchmark's figures."""
    import numpy
    import torch

    args = sys.argv[1:] if argv is None else argv
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"command: {' '.join([os.path.basename(sys.argv[0]), *args])}\nload average (1, 5, 15 min): {load}\n"
            f"python {platform.python_version()}, torch {torch.__version__}, numpy {numpy.__version__}, "
            f"threads {torch.get_num_threads()}, cpus {os.cpu_count()}")


def setup_line(cfg, task) -> str:
    """The data and budget of a run as it was run: data source, the training and test examples actually used,
    partition, rounds, local steps, batch, the run's method, learning rate and seed (one line)."""
    from fedlowrank.experiments.compare import describe_partition, setup_of

    s = setup_of(cfg, task.describe(), [cfg.run.seed])
    local = f"{s['local_epochs']:g} local epochs" if s["local_epochs"] > 0 else f"{s['local_steps']} local steps"
    return (f"setup as run: {s['data_source']}: {s['num_train']:,} training / {s['num_test']:,} test examples used; "
            f"{s['model'] or cfg.task.kind}; {describe_partition(s['partition'])}, {s['clients_per_round']} per round; "
            f"{s['rounds']} rounds of {local} of batch {s['batch_size']}; {cfg.method_name} at lr {cfg.train.lr:g}; "
            f"seed {cfg.run.seed}")

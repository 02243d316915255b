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

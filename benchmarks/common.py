"""What every benchmark prints beside its figures: the command, load and versions."""

from __future__ import annotations

import os
import platform
import sys


def provenance() -> str:
    import numpy
    import torch

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"command: {' '.join(sys.argv)}\nload average (1, 5, 15 min): {load}\n"
            f"python {platform.python_version()}, torch {torch.__version__}, numpy {numpy.__version__}, "
            f"threads {torch.get_num_threads()}, cpus {os.cpu_count()}")

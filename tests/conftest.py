"""Suite-wide setting: one torch thread. The tests use tiny models, where more threads only add contention on a
shared 2-core machine, and every comparison then sums floats in the same order."""

import torch

torch.set_num_threads(1)

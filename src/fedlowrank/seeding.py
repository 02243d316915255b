"""Seeded random streams, derived from the run seed and names, never from global state.

Every stream is a pure function of ``(seed, stream name, keys...)``: the partition, client sampling in round t,
client k's training in round t, a method's projector in round t... This makes runs reproducible, independent
of the order in which clients are simulated, and resumable without saving generator states.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch


def derive_seed(seed: int, stream: str, *keys: int) -> int:
    """A 63-bit seed for ``(seed, stream, *keys)`` (stable across runs, platforms and Python versions)."""
    h = hashlib.blake2b(f"{seed}|{stream}|{'|'.join(map(str, keys))}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def numpy_rng(seed: int, stream: str, *keys: int) -> np.random.Generator:
    """``np.random.default_rng(derive_seed(...))``'s generator, built without its argument checks (a round builds
    several)."""
    return np.random.Generator(np.random.PCG64(derive_seed(seed, stream, *keys)))


def torch_generator(seed: int, stream: str, *keys: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(derive_seed(seed, stream, *keys))
    return g

"""Partitioners with flwr-datasets semantics, and the per-client label-histogram report.

* ``iid`` — a seeded permutation split into M near-equal parts.
* ``dirichlet`` — for each class, proportions ~ Dir(α·1_M) over clients (``self_balancing`` zeroes clients
  already above N/M); resampled until every client has ``min_partition_size`` examples (like flwr-datasets'
  ``DirichletPartitioner``). α→∞ approaches IID; small α gives few classes per client.
* ``shards`` — pathological: each client holds ``classes_per_client`` classes; classes are dealt round-robin
  after a seeded shuffle and each class is split evenly among its holders.
* ``quantity`` — quantity skew: sizes ∝ Dir(α·1_M) (floored at ``min_partition_size``), labels IID.
* ``domains`` — feature shift, as DomainNet's natural domains: the task's examples carry domain ids (the image
  task's ``task.options.domains``); client k holds domain ``k mod D`` only, each domain split IID among its
  ``⌈(M − d)/D⌉`` clients (needs M ≥ D).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .seeding import numpy_rng

PARTITIONS = ("iid", "dirichlet", "shards", "quantity", "natural", "domains")


@dataclass
class PartitionConfig:
    """Config section ``[partition]``."""

    kind: str = "dirichlet"
    num_clients: int = 10
    alpha: float = 0.5
    min_partition_size: int = 10
    classes_per_client: int = 2
    self_balancing: bool = False
    max_tries: int = 100


def partition(num_examples: int, labels: np.ndarray | None, cfg: PartitionConfig, seed: int,
              natural: np.ndarray | None = None) -> list[np.ndarray]:
    """Client index arrays (sorted, disjoint, covering every example) for ``cfg.num_clients`` clients."""
    m = cfg.num_clients
    if cfg.kind not in PARTITIONS:
        raise ValueError(f"partition.kind must be one of {PARTITIONS}, got {cfg.kind!r}")
    if m < 1:
        raise ValueError(f"partition.num_clients must be >= 1, got {m}")
    if m > num_examples:
        raise ValueError(f"partition.num_clients = {m} is more than the {num_examples} training examples")
    rng = numpy_rng(seed, "partition")
    if cfg.kind == "natural":
        if natural is None:
            raise ValueError("partition.kind = 'natural' needs a task with natural client ids")
        ids = np.unique(natural)
        if len(ids) != m:
            raise ValueError(f"partition.num_clients = {m} but the task has {len(ids)} natural clients")
        return [np.flatnonzero(natural == i) for i in ids]
    if cfg.kind == "domains":
        return _domains(natural, m, rng)
    if cfg.kind == "iid":
        return [np.sort(p) for p in np.array_split(rng.permutation(num_examples), m)]
    if cfg.kind == "quantity":
        return _quantity(num_examples, cfg, rng)
    if labels is None:
        raise ValueError(f"partition.kind = {cfg.kind!r} needs labels; this task has none (use iid or quantity)")
    if cfg.kind == "dirichlet":
        return _dirichlet(labels, cfg, rng)
    return _shards(labels, cfg, rng)


def _dirichlet(labels: np.ndarray, cfg: PartitionConfig, rng: np.random.Generator) -> list[np.ndarray]:
    if cfg.alpha <= 0:
        raise ValueError(f"partition.alpha must be > 0, got {cfg.alpha}")
    m, n = cfg.num_clients, len(labels)
    if cfg.min_partition_size * m > n:
        raise ValueError(f"partition.min_partition_size = {cfg.min_partition_size} × {m} clients exceeds "
                         f"the {n} training examples")
    classes = np.unique(labels)
    for _ in range(cfg.max_tries):
        parts: list[list[int]] = [[] for _ in range(m)]
        for c in classes:
            idx = np.flatnonzero(labels == c)
            rng.shuffle(idx)
            p = rng.dirichlet(np.full(m, cfg.alpha))
            if cfg.self_balancing:
                sizes = np.array([len(x) for x in parts])
                p = np.where(sizes < n / m, p, 0.0)
                p = p / p.sum() if p.sum() > 0 else np.full(m, 1.0 / m)
            cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].extend(chunk.tolist())
        if min(len(x) for x in parts) >= cfg.min_partition_size:
            return [np.sort(np.array(x, dtype=np.int64)) for x in parts]
    raise ValueError(f"partition: no Dirichlet(α={cfg.alpha}) draw in {cfg.max_tries} tries gave every client "
                     f">= {cfg.min_partition_size} examples; lower partition.min_partition_size or raise alpha")


def _shards(labels: np.ndarray, cfg: PartitionConfig, rng: np.random.Generator) -> list[np.ndarray]:
    m, k = cfg.num_clients, cfg.classes_per_client
    classes = rng.permutation(np.unique(labels))
    if not 1 <= k <= len(classes):
        raise ValueError(f"partition.classes_per_client must be in [1, {len(classes)}], got {k}")
    holders: dict[int, list[int]] = {int(c): [] for c in classes}
    for client in range(m):
        for j in range(k):
            holders[int(classes[(client * k + j) % len(classes)])].append(client)
    parts: list[list[int]] = [[] for _ in range(m)]
    for c, owners in holders.items():
        idx = rng.permutation(np.flatnonzero(labels == c))
        if not owners:
            continue  # more classes than clients × k: unassigned classes are dropped (as flwr-datasets does)
        for owner, chunk in zip(owners, np.array_split(idx, len(owners))):
            parts[owner].extend(chunk.tolist())
    if min(len(p) for p in parts) == 0:
        raise ValueError("partition: a client received no examples; use fewer clients or more classes_per_client")
    return [np.sort(np.array(p, dtype=np.int64)) for p in parts]


def _domains(domain_ids: np.ndarray | None, m: int, rng: np.random.Generator) -> list[np.ndarray]:
    if domain_ids is None:
        raise ValueError("partition.kind = 'domains' needs a task whose examples carry domains "
                         "(image-classification with task.options.domains)")
    domains = np.unique(domain_ids)
    if m < len(domains):
        raise ValueError(f"partition.num_clients = {m} is fewer than the task's {len(domains)} domains; "
                         f"each domain needs at least one client")
    parts: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * m
    for j, d in enumerate(domains):
        owners = list(range(j, m, len(domains)))
        idx = rng.permutation(np.flatnonzero(domain_ids == d))
        for owner, chunk in zip(owners, np.array_split(idx, len(owners))):
            parts[owner] = np.sort(chunk).astype(np.int64)
    return parts


def _quantity(n: int, cfg: PartitionConfig, rng: np.random.Generator) -> list[np.ndarray]:
    m = cfg.num_clients
    if cfg.alpha <= 0:
        raise ValueError(f"partition.alpha must be > 0, got {cfg.alpha}")
    floor = min(cfg.min_partition_size, n // m)
    extra = rng.dirichlet(np.full(m, cfg.alpha)) * (n - floor * m)
    sizes = floor + np.floor(extra).astype(int)
    sizes[np.argsort(-(extra - np.floor(extra)))[: n - sizes.sum()]] += 1
    cuts = np.cumsum(sizes)[:-1]
    return [np.sort(p) for p in np.split(rng.permutation(n), cuts)]


def label_histograms(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """``[M, C]`` counts of each label on each client."""
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts])


def format_histograms(hist: np.ndarray, label_names: list[str] | None = None,
                      client_names: list[str] | None = None) -> str:
    """A plain-text table of per-client label counts (and each client's ``client_names`` entry, e.g. its domain)."""
    names = label_names or [str(i) for i in range(hist.shape[1])]
    short = [n[:8] for n in names]
    width = max(6, *(len(s) for s in short))
    lines = ["client " + " ".join(s.rjust(width) for s in short) + "   total" + ("  domain" if client_names else "")]
    for k, row in enumerate(hist):
        lines.append(f"{k:6d} " + " ".join(str(int(v)).rjust(width) for v in row) + f"  {int(row.sum()):6d}"
                     + (f"  {client_names[k]}" if client_names else ""))
    return "\n".join(lines)

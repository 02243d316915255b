"""Partitioners with flwr-datasets semantics, and the per-client label-histogram report.

* ``iid`` — a seeded permutation split into M near-equal parts.
* ``dirichlet`` — for each class, proportions ~ Dir(α·1_M) over clients (``self_balancing`` zeroes clients
  already above N/M); resampled until every client has ``min_partition_size`` examples (like flwr-datasets'
  ``DirichletPartitioner``). α→∞ approaches IID; small α gives few classes per client.
* ``shards`` — pathological: each client holds ``classes_per_client`` classes; classes are dealt round-robin
  after a seeded shuffle and each class is split evenly among its holders.
* ``quantity`` — quantity skew: sizes ∝ Dir(α·1_M) (floored at ``min_partition_size``), labels IID.
* ``natural`` — one client per natural id: the task's own ids, or each value of the column ``partition_by``.
* ``clusters`` — for data without labels: k-means (:func:`kmeans`) of sentence embeddings of the training
  examples into ``num_clusters`` clusters, then ``dirichlet`` over the cluster ids.
* ``domains`` — feature shift, as DomainNet's natural domains: the task's examples carry domain ids (the image
  task's ``task.options.domains``); client k holds domain ``k mod D`` only, each domain split IID among its
  ``⌈(M − d)/D⌉`` clients (needs M ≥ D).

What is split on (:func:`split_on`): the task's labels, or the values of the data column ``partition_by`` (for
``dirichlet``/``shards``, like flwr-datasets' ``partition_by``), or the cluster ids. The per-client histogram
report counts those values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..schema import Schema, setting
from ..seeding import numpy_rng

PARTITIONS = ("iid", "dirichlet", "shards", "quantity", "natural", "domains", "clusters")
MAX_CLIENTS = 1_000_000


@dataclass
class PartitionConfig(Schema):
    """Config section ``[partition]``: how the training examples are dealt to clients (module docstring)."""

    prefix = "partition"

    kind: str = setting("dirichlet", "how examples are dealt to clients (see tasks/partition.py): clusters = "
                        "k-means of MiniLM embeddings, then dirichlet over the clusters", choices=PARTITIONS)
    num_clients: int = setting(10, "number of clients M", ge=1, le=MAX_CLIENTS,
                               reason="a simulation keeps a partition, a state and a report row per client")
    alpha: float = setting(0.5, "Dirichlet concentration α of dirichlet, quantity and clusters (smaller = more "
                           "skewed)", gt=0, le=1e6, reason="beyond, Dir(α) is IID to 0.1%: use partition.kind = iid")
    min_partition_size: int = setting(10, "redraw until every client holds at least this many examples", ge=0)
    classes_per_client: int = setting(2, "classes per client (shards)", ge=1)
    self_balancing: bool = setting(False, "dirichlet: give no more of a class to clients already above N/M")
    max_tries: int = setting(100, "redraws allowed to meet partition.min_partition_size", ge=1)
    partition_by: str = setting("", "a data column to split on instead of labels (dirichlet, shards) or one client "
                                "per value (natural); '' = labels")
    num_clusters: int = setting(8, "clusters of the clusters partition", ge=2)


def partition(num_examples: int, labels: np.ndarray | None, cfg: PartitionConfig, seed: int,
              natural: np.ndarray | None = None) -> list[np.ndarray]:
    """Client index arrays (sorted, disjoint, covering every example) for ``cfg.num_clients`` clients."""
    m = cfg.num_clients
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
        raise ValueError(f"partition.kind = {cfg.kind!r} needs labels; this task has none (use iid, quantity, "
                         "clusters, or partition.partition_by = a data column)")
    if cfg.kind in ("dirichlet", "clusters"):
        return _dirichlet(labels, cfg, rng)
    return _shards(labels, cfg, rng)


@dataclass
class SplitOn:
    """The per-example values a partition splits on, and what they are.

    Attributes:
        values: ``[N_train]`` int64 codes in ``[0, len(names))``.
        names: the name of each code (class names, column values, ``cluster 0``...).
        what: in words, e.g. ``"label"``, ``"column 'category'"``, ``"k-means cluster of MiniLM embeddings"``.
    """

    values: np.ndarray
    names: list[str] = field(default_factory=list)
    what: str = "label"


def encode_values(values: list[str]) -> tuple[np.ndarray, list[str]]:
    """Strings → (``[N]`` int64 codes, the sorted distinct values)."""
    names = sorted(set(values))
    index = {v: i for i, v in enumerate(names)}
    return np.array([index[v] for v in values], dtype=np.int64), names


def split_on(task, cfg: PartitionConfig, seed: int) -> SplitOn | None:
    """What ``cfg`` splits ``task``'s training set on (``None``: nothing, e.g. unlabelled data split IID).

    ``task`` provides ``train_labels`` (and ``data.label_names``), ``column_values(name) -> list[str]`` for
    ``partition_by``, and ``embedding_texts() -> list[str]`` for ``clusters``.
    """
    if cfg.kind == "clusters":
        if cfg.partition_by:
            raise ValueError("partition.partition_by: not used with partition.kind = 'clusters' (it splits on "
                             "cluster ids); leave it empty or use kind = 'dirichlet'")
        if cfg.num_clusters < 2:
            raise ValueError(f"partition.num_clusters must be >= 2, got {cfg.num_clusters}")
        from ..models.embeddings import sentence_embeddings

        texts = task.embedding_texts()
        if cfg.num_clusters > len(texts):
            raise ValueError(f"partition.num_clusters = {cfg.num_clusters} is more than the {len(texts)} "
                             "training examples")
        ids, _ = kmeans(sentence_embeddings(texts), cfg.num_clusters, seed)
        return SplitOn(ids, [f"cluster {c}" for c in range(cfg.num_clusters)],
                       f"k-means cluster (k = {cfg.num_clusters}) of MiniLM sentence embeddings")
    if cfg.partition_by:
        values, names = encode_values([str(v) for v in task.column_values(cfg.partition_by)])
        return SplitOn(values, names, f"column {cfg.partition_by!r}")
    if task.train_labels is None:
        return None
    names = getattr(getattr(task, "data", None), "label_names", None)
    labels = np.asarray(task.train_labels)
    return SplitOn(labels, list(names) if names else [str(c) for c in range(int(labels.max()) + 1)], "label")


def partition_task(task, cfg: PartitionConfig, seed: int) -> tuple[list[np.ndarray], SplitOn | None]:
    """Client index arrays of ``task``'s training set and what they were split on (see :func:`split_on`).

    ``natural`` with ``partition_by`` makes one client per value of that column (sorted by value)."""
    split = split_on(task, cfg, seed)
    natural = task.natural_partition
    if cfg.kind == "natural" and cfg.partition_by:
        natural = split.values
    return partition(task.num_train, None if split is None else split.values, cfg, seed, natural), split


def kmeans(x: np.ndarray, k: int, seed: int, max_iters: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd's k-means with k-means++ seeding from the stream ``(seed, "kmeans")``.

    Args:
        x: ``[N, d]`` points. k: number of clusters (``<= N``).
    Returns:
        ``([N] int64 cluster ids, [k, d] float64 centres)``. A cluster that empties is re-seeded with the point
        farthest from its centre, so every cluster keeps at least one point.
    """
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    if not 1 <= k <= n:
        raise ValueError(f"k-means: k must be in [1, {n}], got {k}")
    rng = numpy_rng(seed, "kmeans")
    sq = (x * x).sum(1)

    def dist2(centres: np.ndarray) -> np.ndarray:  # [N, k] squared distances
        return np.maximum(sq[:, None] - 2 * x @ centres.T + (centres * centres).sum(1)[None, :], 0.0)

    centres = [x[rng.integers(n)]]
    for _ in range(1, k):
        d = dist2(np.array(centres)).min(1)
        centres.append(x[rng.choice(n, p=d / d.sum())] if d.sum() > 0 else x[rng.integers(n)])
    centres = np.array(centres)
    ids = np.full(n, -1, dtype=np.int64)
    for _ in range(max_iters):
        d = dist2(centres)
        new = d.argmin(1)
        for c in range(k):
            if not (new == c).any():
                far = int(d[np.arange(n), new].argmax())
                new[far] = c
                d[far] = 0.0
        if np.array_equal(new, ids):
            break
        ids = new
        centres = np.stack([x[ids == c].mean(0) for c in range(k)])
    return ids, centres


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


TABLE_COLUMNS = 20  # the most values a per-client table shows as columns; beyond, each client's most frequent


def format_histograms(hist: np.ndarray, label_names: list[str] | None = None,
                      client_names: list[str] | None = None) -> str:
    """A plain-text table of per-client label counts (and each client's ``client_names`` entry, e.g. its domain);
    each column as wide as its whole name (at least 6). With more than :data:`TABLE_COLUMNS` values, one line per
    client instead: its examples, how many values it holds and its three most frequent (linear in the values)."""
    names = label_names or [str(i) for i in range(hist.shape[1])]
    if len(names) > TABLE_COLUMNS:
        lines = []
        for k, row in enumerate(hist):
            top = np.argsort(-row, kind="stable")[:3] if row.size <= 3 else np.argpartition(-row, 3)[:3]
            top = sorted(top, key=lambda c: (-row[c], c))
            most = ", ".join(f"{names[c]} ({int(row[c])})" for c in top if row[c] > 0)
            lines.append(f"client {k}: {int(row.sum())} examples of {int((row > 0).sum())} of the {len(names)} "
                         f"values" + (f"; most: {most}" if most else "") + (f"; {client_names[k]}" if client_names else ""))
        return "\n".join(lines)
    widths = [max(6, len(n)) for n in names]
    lines = ["client " + " ".join(n.rjust(w) for n, w in zip(names, widths)) + "   total"
             + ("  domain" if client_names else "")]
    for k, row in enumerate(hist):
        lines.append(f"{k:6d} " + " ".join(str(int(v)).rjust(w) for v, w in zip(row, widths))
                     + f"  {int(row.sum()):6d}" + (f"  {client_names[k]}" if client_names else ""))
    return "\n".join(lines)

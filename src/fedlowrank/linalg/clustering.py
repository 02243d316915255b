"""Clustering of clients by their trained LoRA ``B`` matrices (FedLEASE's allocation, Wang, Bian, Zhang, Xu,
"FedLEASE: Adaptive LoRA Experts Allocation and Selection in Federated Fine-Tuning", arXiv:2509.15087): the mean over
layers of the cosine distance, average-linkage agglomerative clustering on it, the number of clusters by the
silhouette. Computed in float64 on the CPU; deterministic (ties broken by the smallest indices).
"""

from __future__ import annotations

from typing import Sequence

import torch


def layer_cosine_distance(layers: Sequence[torch.Tensor], eps: float = 1e-8) -> torch.Tensor:
    """``D: [N, N]``, ``D[i, j] = (1/L) Σₗ (1 − ⟨bᵢˡ, bⱼˡ⟩ / (‖bᵢˡ‖ ‖bⱼˡ‖ + eps))`` over the L layers, each given as
    ``[N, ...]`` (client i's matrix of layer l in row i, flattened). Exactly symmetric, with a zero diagonal."""
    if not layers:
        raise ValueError("layer_cosine_distance needs at least one layer")
    D = 0
    for X in layers:
        X = X.reshape(X.shape[0], -1).to(torch.float64)
        norms = X.norm(dim=1)
        D = D + 1 - (X @ X.T) / (norms[:, None] * norms[None, :] + eps)
    D = (D + D.T) / (2 * len(layers))              # exactly symmetric (the product's rounding need not be)
    return D.fill_diagonal_(0.0)


def average_linkage(D: torch.Tensor, k: int) -> list[int]:
    """Agglomerative clustering of ``N`` points with distances ``D: [N, N]`` (symmetric) into ``k`` clusters:
    repeatedly merge the two clusters with the smallest mean pairwise distance (UPGMA). Labels ``[N]`` in
    ``0 .. k−1``, numbered by each cluster's smallest member."""
    n = D.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"the number of clusters must be in [1, {n}], got {k}")
    D = D.to(torch.float64)
    clusters = [[i] for i in range(n)]
    while len(clusters) > k:
        best, pair = float("inf"), (0, 1)
        for a in range(len(clusters)):
            for b in range(a + 1, len(clusters)):
                d = float(D[clusters[a]][:, clusters[b]].mean())
                if d < best:
                    best, pair = d, (a, b)
        a, b = pair
        clusters[a] = sorted(clusters[a] + clusters[b])
        del clusters[b]
    labels = [0] * n
    for c, members in enumerate(sorted(clusters)):
        for i in members:
            labels[i] = c
    return labels


def silhouette(D: torch.Tensor, labels: Sequence[int]) -> float:
    """Mean silhouette ``s(i) = (b − a) / max(a, b)`` with ``a`` the mean distance of i to the rest of its cluster and
    ``b`` the smallest mean distance to another cluster; ``s(i) = 0`` in a cluster of one. Needs 2 ≤ k ≤ N − 1."""
    labels_t = torch.tensor(list(labels))
    ks = sorted(set(labels_t.tolist()))
    if not 2 <= len(ks) <= len(labels_t) - 1:
        raise ValueError(f"the silhouette needs between 2 and N - 1 clusters, got {len(ks)} for N = {len(labels_t)}")
    D = D.to(torch.float64)
    scores = []
    for i in range(len(labels_t)):
        own = labels_t == labels_t[i]
        if int(own.sum()) == 1:
            scores.append(0.0)
            continue
        a = float(D[i][own].sum()) / (int(own.sum()) - 1)
        b = min(float(D[i][labels_t == c].mean()) for c in ks if c != int(labels_t[i]))
        scores.append((b - a) / max(a, b) if max(a, b) > 0 else 0.0)
    return sum(scores) / len(scores)


def cluster_by_silhouette(D: torch.Tensor, max_clusters: int) -> list[int]:
    """Labels ``[N]`` of :func:`average_linkage` with the number of clusters ``K ∈ 2 .. min(N − 1, max_clusters)``
    of the highest :func:`silhouette` (a tie keeps the smaller K); ``N ≤ 2`` (or ``max_clusters < 2``) gives one
    cluster."""
    n = D.shape[0]
    if n <= 2 or max_clusters < 2:
        return [0] * n
    best, labels = -float("inf"), [0] * n
    for k in range(2, min(n - 1, max_clusters) + 1):
        cand = average_linkage(D, k)
        score = silhouette(D, cand)
        if score > best:
            best, labels = score, cand
    return labels


__all__ = ["layer_cosine_distance", "average_linkage", "silhouette", "cluster_by_silhouette"]

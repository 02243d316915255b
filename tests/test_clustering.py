"""FedLEASE's client clustering kernels (linalg/clustering.py): the per-layer cosine distance against its formula,
average linkage on a hand-checked example, the silhouette against a direct computation, and a planted 3-group
problem recovered with its number of groups."""

from __future__ import annotations

import itertools

import pytest
import torch

from fedlowrank.linalg.clustering import average_linkage, cluster_by_silhouette, layer_cosine_distance, silhouette


def _planted(sizes=(3, 4, 2), layers=((6, 2), (5, 2)), noise=0.05, seed=0):
    """Clients' B matrices per layer: a group's direction plus small noise, each client at its own scale."""
    g = torch.Generator().manual_seed(seed)
    truth = [c for c, s in enumerate(sizes) for _ in range(s)]
    perm = torch.randperm(len(truth), generator=g).tolist()
    truth = [truth[i] for i in perm]
    out = []
    for shape in layers:
        centres = torch.randn(len(sizes), *shape, generator=g, dtype=torch.float64)
        scale = torch.rand(len(truth), generator=g, dtype=torch.float64) * 3 + 0.1
        out.append(torch.stack([scale[i] * (centres[c] + noise * torch.randn(*shape, generator=g, dtype=torch.float64))
                                for i, c in enumerate(truth)]))
    return out, truth


def test_distance_is_the_mean_over_layers_of_one_minus_the_cosine():
    layers, _ = _planted()
    D = layer_cosine_distance(layers)
    n = layers[0].shape[0]
    for i, j in itertools.product(range(n), range(n)):
        ref = 0.0 if i == j else sum(
            1 - float(torch.dot(X[i].flatten(), X[j].flatten()) / (X[i].norm() * X[j].norm() + 1e-8))
            for X in layers) / len(layers)
        assert float(D[i, j]) == pytest.approx(ref, abs=1e-12)
    assert torch.equal(D, D.T)
    zero = layer_cosine_distance([torch.zeros(3, 4)])          # untrained B = 0: every pair at distance 1
    assert torch.equal(zero, 1 - torch.eye(3, dtype=torch.float64))


def test_average_linkage_merges_by_mean_distance():
    # points on a line: {0, 1} and {10, 11} merge first; then 3 joins {0, 1} (mean distance 2.5 < 7.5)
    x = torch.tensor([0.0, 1.0, 3.0, 10.0, 11.0])
    D = (x[:, None] - x[None, :]).abs()
    assert average_linkage(D, 5) == [0, 1, 2, 3, 4]
    assert average_linkage(D, 3) == [0, 0, 1, 2, 2]
    assert average_linkage(D, 2) == [0, 0, 0, 1, 1]
    assert average_linkage(D, 1) == [0] * 5
    # average, not single, linkage: after {2, 2.5} and {4.4, 4.9}, the middle pair is 1.9 from 4.4 (single linkage
    # would merge it right) but 2.4 on average from the right pair, against 2.25 from 0: 0 joins it
    y = torch.tensor([0.0, 2.0, 2.5, 4.4, 4.9], dtype=torch.float64)
    Dy = (y[:, None] - y[None, :]).abs()
    assert average_linkage(Dy, 3) == [0, 1, 1, 2, 2]
    assert average_linkage(Dy, 2) == [0, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="number of clusters"):
        average_linkage(D, 0)


def test_silhouette_equals_the_direct_formula():
    layers, truth = _planted()
    D = layer_cosine_distance(layers)
    n = len(truth)
    scores = []
    for i in range(n):
        same = [j for j in range(n) if truth[j] == truth[i] and j != i]
        a = sum(float(D[i, j]) for j in same) / len(same)
        b = min(sum(float(D[i, j]) for j in range(n) if truth[j] == c) / truth.count(c)
                for c in set(truth) if c != truth[i])
        scores.append((b - a) / max(a, b))
    assert silhouette(D, truth) == pytest.approx(sum(scores) / n, abs=1e-12)
    assert silhouette(D, [0] + [1] * (n - 1)) < silhouette(D, truth)
    with pytest.raises(ValueError, match="between 2 and N - 1"):
        silhouette(D, [0] * n)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_planted_three_group_problem_is_recovered_with_three_clusters(seed):
    layers, truth = _planted(seed=seed)
    labels = cluster_by_silhouette(layer_cosine_distance(layers), max_clusters=8)
    assert len(set(labels)) == 3
    pairs = itertools.combinations(range(len(truth)), 2)
    assert all((labels[i] == labels[j]) == (truth[i] == truth[j]) for i, j in pairs)


def test_two_clients_or_fewer_make_one_cluster():
    assert cluster_by_silhouette(torch.zeros(2, 2), 8) == [0, 0]
    assert cluster_by_silhouette(torch.zeros(1, 1), 8) == [0]
    layers, _ = _planted()
    assert cluster_by_silhouette(layer_cosine_distance(layers), 1) == [0] * 9

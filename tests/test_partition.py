import numpy as np
import pytest

from fedlowrank.partition import PartitionConfig, format_histograms, label_histograms, partition

LABELS = np.repeat(np.arange(5), [300, 200, 250, 150, 100])  # 1000 examples, 5 classes


def _check_cover(parts, n):
    allidx = np.concatenate(parts)
    assert len(allidx) == n and len(np.unique(allidx)) == n  # every example assigned exactly once


@pytest.mark.parametrize("kind", ["iid", "dirichlet", "shards", "quantity"])
def test_every_example_once_and_reproducible(kind):
    cfg = PartitionConfig(kind=kind, num_clients=10, alpha=0.5, min_partition_size=5, classes_per_client=2)
    parts = partition(len(LABELS), LABELS, cfg, seed=3)
    _check_cover(parts, len(LABELS))
    again = partition(len(LABELS), LABELS, cfg, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = partition(len(LABELS), LABELS, cfg, seed=4)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))


def _skew(parts):
    """Mean total-variation distance between client label distributions and the global one."""
    hist = label_histograms(LABELS, parts, 5).astype(float)
    glob = np.bincount(LABELS) / len(LABELS)
    return np.mean(0.5 * np.abs(hist / hist.sum(1, keepdims=True) - glob).sum(1))


def test_dirichlet_approaches_iid_as_alpha_grows():
    skews = [_skew(partition(len(LABELS), LABELS, PartitionConfig(num_clients=10, alpha=a, min_partition_size=1), 0))
             for a in (0.1, 1.0, 1000.0)]
    assert skews[0] > skews[1] > skews[2]
    assert skews[2] < 0.06
    assert skews[2] < 2.5 * _skew(partition(len(LABELS), LABELS, PartitionConfig(kind="iid", num_clients=10), 0)) + 0.02


def test_dirichlet_min_partition_size_honoured_or_clear_error():
    parts = partition(len(LABELS), LABELS, PartitionConfig(num_clients=20, alpha=0.5, min_partition_size=10), 1)
    assert min(len(p) for p in parts) >= 10
    with pytest.raises(ValueError, match="min_partition_size"):
        partition(len(LABELS), LABELS, PartitionConfig(num_clients=20, alpha=0.3, min_partition_size=60), 1)


def test_shards_give_k_classes_per_client():
    parts = partition(len(LABELS), LABELS, PartitionConfig(kind="shards", num_clients=10, classes_per_client=2), 0)
    hist = label_histograms(LABELS, parts, 5)
    assert ((hist > 0).sum(1) <= 2).all()
    _check_cover(parts, len(LABELS))


def test_quantity_skew_sizes_vary_labels_iid():
    parts = partition(len(LABELS), LABELS, PartitionConfig(kind="quantity", num_clients=10, alpha=0.5,
                                                           min_partition_size=10), 0)
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 10 and sizes.max() > 2 * sizes.min()


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="num_clients"):
        partition(5, np.zeros(5, dtype=int), PartitionConfig(kind="iid", num_clients=6), 0)
    with pytest.raises(ValueError, match="partition.kind"):
        partition(5, None, PartitionConfig(kind="nope"), 0)
    with pytest.raises(ValueError, match="needs labels"):
        partition(50, None, PartitionConfig(kind="dirichlet", num_clients=2), 0)


def test_histogram_report():
    parts = partition(len(LABELS), LABELS, PartitionConfig(kind="iid", num_clients=3), 0)
    hist = label_histograms(LABELS, parts, 5)
    assert hist.sum() == len(LABELS) and hist.shape == (3, 5)
    text = format_histograms(hist, ["a", "b", "c", "d", "e"])
    assert text.splitlines()[0].split()[:3] == ["client", "a", "b"] and len(text.splitlines()) == 4

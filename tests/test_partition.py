import numpy as np
import pytest

from fedlowrank.tasks.partition import PartitionConfig, format_histograms, label_histograms, partition

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
    long = format_histograms(hist, ["entertainment", "cluster 10", "cluster 11", "d", "e"]).splitlines()
    assert "entertainment" in long[0] and "cluster 10" in long[0] and "cluster 11" in long[0]  # whole names
    assert all(len(line) == len(long[0]) for line in long)  # each column as wide as its name


# -- data without labels: a column, natural clients from a column, k-means clusters ------------------------------
class UnlabelledTask:
    """A task without labels: a ``topic`` column, texts to embed, no natural ids."""

    train_labels = None
    natural_partition = None

    def __init__(self, topics: list[str]):
        self.topics = topics
        self.num_train = len(topics)

    def column_values(self, name):
        assert name == "topic"
        return self.topics

    def embedding_texts(self):
        return [f"{t} {i}" for i, t in enumerate(self.topics)]


TOPICS = [name for name, n in (("algebra", 300), ("geometry", 200), ("money", 250), ("time", 150), ("rates", 100))
          for _ in range(n)]


def _blobs(texts: list[str]) -> np.ndarray:
    """Synthetic sentence embeddings: 5 well-separated Gaussian blobs, one per topic, 16 dimensions."""
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(5, 16)) * 10
    topics = sorted({t.split()[0] for t in texts})
    return np.stack([centres[topics.index(t.split()[0])] + rng.normal(size=16) for t in texts])


def test_partition_by_a_column_splits_on_its_values():
    from fedlowrank.tasks.partition import partition_task

    task = UnlabelledTask(TOPICS)
    cfg = PartitionConfig(kind="dirichlet", num_clients=10, alpha=0.1, min_partition_size=5, partition_by="topic")
    parts, split = partition_task(task, cfg, seed=0)
    _check_cover(parts, len(TOPICS))
    assert split.what == "column 'topic'" and split.names == sorted(set(TOPICS))
    assert [split.names[v] for v in split.values] == TOPICS
    hist = label_histograms(split.values, parts, 5)
    assert (hist > 0).sum(1).mean() < 3.5  # α = 0.1: most clients hold few topics
    shards, _ = partition_task(task, PartitionConfig(kind="shards", num_clients=5, classes_per_client=1,
                                                     partition_by="topic"), seed=0)
    assert sorted(len(set(TOPICS[i] for i in p)) for p in shards) == [1] * 5


def test_natural_clients_from_a_column():
    from fedlowrank.tasks.partition import partition_task

    parts, split = partition_task(UnlabelledTask(TOPICS), PartitionConfig(kind="natural", num_clients=5,
                                                                          partition_by="topic"), seed=0)
    assert [sorted({TOPICS[i] for i in p}) for p in parts] == [[n] for n in split.names]
    _check_cover(parts, len(TOPICS))
    with pytest.raises(ValueError, match="natural clients"):
        partition_task(UnlabelledTask(TOPICS), PartitionConfig(kind="natural", num_clients=4, partition_by="topic"), 0)


def test_kmeans_recovers_separated_blobs_and_is_seeded():
    from fedlowrank.tasks.partition import kmeans

    x = _blobs(UnlabelledTask(TOPICS).embedding_texts())
    ids, centres = kmeans(x, 5, seed=1)
    assert centres.shape == (5, 16)
    truth = np.array([sorted(set(TOPICS)).index(t) for t in TOPICS])
    for c in range(5):  # each cluster is exactly one topic (up to renaming)
        assert len(set(truth[ids == c])) == 1
    assert np.array_equal(ids, kmeans(x, 5, seed=1)[0])


def test_clusters_partition_assigns_every_example_once_with_dirichlet_skew(monkeypatch):
    import fedlowrank.models.embeddings as embeddings
    from fedlowrank.tasks.partition import partition_task

    monkeypatch.setattr(embeddings, "sentence_embeddings", _blobs)
    task = UnlabelledTask(TOPICS)

    def skew(alpha):
        cfg = PartitionConfig(kind="clusters", num_clients=10, num_clusters=5, alpha=alpha, min_partition_size=5)
        parts, split = partition_task(task, cfg, seed=2)
        _check_cover(parts, len(TOPICS))
        assert split.names == [f"cluster {c}" for c in range(5)] and "k-means" in split.what
        hist = label_histograms(split.values, parts, 5).astype(float)
        glob = hist.sum(0) / hist.sum()
        return np.mean(0.5 * np.abs(hist / hist.sum(1, keepdims=True) - glob).sum(1))

    assert skew(0.1) > 0.4 > 0.1 > skew(1000.0)
    with pytest.raises(ValueError, match="num_clusters"):
        partition_task(task, PartitionConfig(kind="clusters", num_clients=2, num_clusters=1), 0)


def test_sentence_embeddings_are_computed_once_and_cached(tmp_path, monkeypatch):
    import fedlowrank.models.embeddings as embeddings

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def fake_embed(texts, max_length):
        calls.append(list(texts))
        return np.arange(len(texts) * 3, dtype=np.float32).reshape(len(texts), 3)

    monkeypatch.setattr(embeddings, "embed", fake_embed)
    a = embeddings.sentence_embeddings(["x", "y"])
    b = embeddings.sentence_embeddings(["x", "y"])
    assert np.array_equal(a, b) and len(calls) == 1
    embeddings.sentence_embeddings(["y", "x"])  # other texts (order counts): computed again
    assert len(calls) == 2 and len(list((tmp_path / "fedlowrank" / "embeddings").glob("*.npy"))) == 2


def test_minilm_embeddings_put_similar_questions_closer():
    from fedlowrank.models.embeddings import embed

    e = embed(["How many apples does Tom have left?", "How many apples are left with Tom?",
               "The train departs at noon from the station."])
    assert e.shape == (3, 384) and np.allclose(np.linalg.norm(e, axis=1), 1, atol=1e-5)
    assert e[0] @ e[1] > e[0] @ e[2] + 0.2

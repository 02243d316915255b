"""A data set of many classes: set-up and evaluation are linear in the classes (docs/data.md). The per-client table,
the label plot, the stratified split and the predictions' summary each handle tens of thousands of classes in
seconds, where a bar per class, a mask per class or a [C, C] confusion matrix took minutes or tens of gigabytes."""

import time

import numpy as np
import torch

from fedlowrank.reporting.plots import BARS_UP_TO, plot_label_histograms
from fedlowrank.tasks.base import prediction_counts, prediction_summary
from fedlowrank.tasks.data import _stratified_split
from fedlowrank.tasks.partition import TABLE_COLUMNS, format_histograms

CLASSES = 20_000


def _hist(clients=10, classes=CLASSES, seed=0):
    return np.random.default_rng(seed).poisson(0.3, size=(clients, classes))


def test_the_per_client_table_of_many_classes_is_a_line_per_client_with_its_most_frequent():
    hist = np.zeros((3, TABLE_COLUMNS + 1), dtype=int)
    hist[0, [4, 7, 9, 2]] = [5, 9, 5, 1]
    hist[1, 0] = 3
    names = [f"class-{c}" for c in range(TABLE_COLUMNS + 1)]
    lines = format_histograms(hist, names).splitlines()
    assert lines == [f"client 0: 20 examples of 4 of the {TABLE_COLUMNS + 1} values; most: class-7 (9), class-4 (5), "
                     "class-9 (5)", f"client 1: 3 examples of 1 of the {TABLE_COLUMNS + 1} values; most: class-0 (3)",
                     f"client 2: 0 examples of 0 of the {TABLE_COLUMNS + 1} values"]
    t0 = time.perf_counter()
    assert len(format_histograms(_hist()).splitlines()) == 10
    assert time.perf_counter() - t0 < 5
    assert format_histograms(hist[:, :TABLE_COLUMNS]).splitlines()[0].startswith("client ")  # a table up to there


def test_the_label_plot_of_many_classes_is_one_image(tmp_path):
    t0 = time.perf_counter()
    path = plot_label_histograms(_hist(), tmp_path / "partition.png", what="label")
    assert time.perf_counter() - t0 < 30 and path.stat().st_size > 1000
    assert plot_label_histograms(_hist(classes=BARS_UP_TO), tmp_path / "bars.png").stat().st_size > 1000


def test_the_stratified_split_is_linear_in_the_classes():
    rng = np.random.default_rng(0)
    labels = [f"c{c}" for c in rng.integers(0, 50_000, size=100_000)]
    texts = [f"t{i}" for i in range(len(labels))]
    t0 = time.perf_counter()
    data = _stratified_split(texts, labels, 0.2, 0)
    assert time.perf_counter() - t0 < 10
    assert len(data.train_texts) + len(data.test_texts) == len(labels)
    # stratified: every class keeps round(0.2 · its count) test examples
    counts = {name: labels.count(name) for name in ("c0", "c1", "c2")}
    test = [data.label_names[y] for y in data.test_labels]
    assert all(test.count(name) == round(0.2 * n) for name, n in counts.items())


def test_the_predictions_summary_needs_per_class_counts_only():
    predicted = torch.randint(0, CLASSES, (5000,), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, CLASSES, (5000,), generator=torch.Generator().manual_seed(1))
    counts = prediction_counts(predicted, labels, CLASSES)
    assert counts.shape == (3, CLASSES) and int(counts[0].sum()) == int(counts[1].sum()) == 5000
    s = prediction_summary(counts)
    assert len(s["recall"]) == CLASSES and s["top_share"] == float(counts[1].max()) / 5000

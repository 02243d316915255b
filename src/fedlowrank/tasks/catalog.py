"""What the project knows of each data set by its ``data.source`` name: its short title (plot titles, reports) and
where a run read it from, in words (``compare``'s and ``tune``'s ``setup``). A data set registers one
:class:`DataSet` with :func:`register_data` in the file that reads it; ``files`` and ``hf`` (the user's own data)
are described from their ``[data]`` keys, and a task that makes its data from ``task.options`` (no
``data_sources``) by its :meth:`~fedlowrank.tasks.base.Task.own_data`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DataSet:
    """A data set known by name.

    Attributes:
        source: its ``data.source`` value.
        title: its short name (``"AG News"``).
        describe: run config → where it is read from, in words (``"AG News files in /data/agnews"``).
    """

    source: str
    title: str
    describe: Callable[[object], str]


_DATA: dict[str, DataSet] = {}


def register_data(data: DataSet) -> DataSet:
    """Register ``data`` under its ``source`` (once)."""
    if data.source in _DATA and _DATA[data.source] != data:
        raise ValueError(f"data set {data.source!r} registered twice")
    _DATA[data.source] = data
    return data


def known_data() -> dict[str, DataSet]:
    """Every registered data set, by ``data.source``."""
    from . import available_tasks

    available_tasks()  # imports every module of the package, and so every registration
    return dict(sorted(_DATA.items()))


def held_out(d) -> str:
    """`` (test: a 0.2 stratified split)`` of ``[data]`` section ``d``: a test set held out of the training data."""
    return f" (test: a {d.test_fraction:g} stratified split)"


def data_source(cfg) -> str:
    """Where the data of run config ``cfg`` came from, in words."""
    from . import task_class

    d, cls = cfg.data, task_class(cfg.task.kind)
    if not cls.data_sources:
        return cls.own_data(cfg)[1]
    known = known_data()
    if d.source in known:
        return known[d.source].describe(cfg)
    if d.source == "files":
        return f"files {d.train}" + (f" and {d.test}" if d.test else held_out(d))
    if d.source in ("hf", "hf-images"):
        return f"Hugging Face dataset {d.hf_name}"
    return f"{d.source}{held_out(d)}"


def data_name(cfg) -> str:
    """The data set's short name, for plot titles: ``AG News``, ``GSM8K``, ``Fashion-MNIST``, a Hugging Face
    dataset name; for files, the data set they hold, not a file: ``reviews.tsv`` → ``reviews``, ``sst2/train.tsv``
    → ``sst2``."""
    from . import task_class

    d, cls = cfg.data, task_class(cfg.task.kind)
    if not cls.data_sources:
        return cls.own_data(cfg)[0]
    if d.source in ("hf", "hf-images"):
        return d.hf_name
    known = known_data()
    if d.source in known:
        return known[d.source].title
    path = Path(d.train)
    if path.stem.lower() in ("train", "training", "data", "dataset", "all", "full"):  # a split's file or folder
        path = path.absolute().parent
    return path.stem or d.source


__all__ = ["DataSet", "register_data", "known_data", "data_source", "data_name", "held_out"]

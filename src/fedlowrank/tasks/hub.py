"""Data sets from the Hugging Face hub (through ``datasets``), and where the data sets known by name come from.

:func:`hub_splits` is the one place that calls ``datasets.load_dataset`` (``data.source`` = ``hf``, ``hf-images``
and the known sets below); every failure is one ``ValueError`` line naming the setting that asked.

The known sets (``data.source = "agnews"``, ``"gsm8k"``) are read, in this order, from

1. the folder ``data.path`` (it must hold the set's files);
2. ``$FEDLOWRANK_DATA/<source>``, when it holds them (``FEDLOWRANK_DATA`` names a folder holding ``agnews/`` and
   ``gsm8k/``);
3. the hub, by id (``fancyzhx/ag_news``; ``openai/gsm8k``, config ``main``): the ``datasets`` cache, else the
   network.

A local copy has the layout of :attr:`KnownSet.files`; its class names are the hub's, so both give the same label
ids (the hub's AG News training split has 120,000 examples where a local copy may hold a sample).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .catalog import DataSet, register_data

ENV = "FEDLOWRANK_DATA"


class HubUnavailable(ValueError):
    """``datasets`` is not installed, or it cannot load the data set (offline, unknown id); one line."""


def hub_splits(name: str, who: str, config: str | None = None, data_files: dict[str, str] | None = None,
               splits: tuple[str, ...] = ("train", "test")) -> list:
    """The ``splits`` (``datasets.Dataset`` objects) of ``datasets.load_dataset(name, config, data_files=...)``.

    ``who`` is the setting that asked (``"data.source = 'hf'"``), named by every error: :class:`HubUnavailable`
    when the package is missing or the load fails, ``ValueError`` when a split is missing."""
    try:
        import datasets
    except ImportError:
        raise HubUnavailable(f"{who} needs the package `datasets`: pip install datasets") from None
    try:
        loaded = datasets.load_dataset(name, config, data_files=data_files)
    except Exception as exc:  # offline, unknown name, bad config: one line naming the setting
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise HubUnavailable(f"{who}: cannot load {name!r}{f' (config {config!r})' if config else ''} with "
                             f"`datasets` ({type(exc).__name__}: {reason})") from None
    for split in splits:
        if split not in loaded:
            raise ValueError(f"{who}: {name!r} has no split {split!r}; splits: {', '.join(loaded)}")
    return [loaded[split] for split in splits]


@dataclass(frozen=True)
class KnownSet:
    """A data set known by name.

    Attributes:
        source: its ``data.source`` value, also the folder name under ``FEDLOWRANK_DATA``.
        title: its name in messages.
        hub_id, hub_config: what ``datasets.load_dataset`` takes.
        files: the training and test file of a local copy.
        layout: what those files hold, in words.
    """

    source: str
    title: str
    hub_id: str
    hub_config: str | None
    files: tuple[str, str]
    layout: str

    def where(self) -> str:
        """How to provide the set, for error messages."""
        return (f"set data.path to a folder holding {' and '.join(self.files)} ({self.layout}), or {ENV} to a "
                f"folder holding {self.source}/, or go online for the hub's {self.hub_id} (docs/data.md)")


KNOWN_SETS = {k.source: k for k in (
    KnownSet("agnews", "AG News", "fancyzhx/ag_news", None, ("train.tsv", "test.tsv"),
             "text<TAB>label, no header; labels World, Sports, Business, Sci/Tech"),
    KnownSet("gsm8k", "GSM8K", "openai/gsm8k", "main", ("train.jsonl", "test.jsonl"),
             'one JSON object a line: {"question": ..., "answer": ...}'),
)}


def local_copy(known: KnownSet, path: str) -> Path | None:
    """The folder of a local copy of ``known``: ``data.path`` (``path``; refused when it lacks a file), else
    ``$FEDLOWRANK_DATA/<source>`` when it holds both files; ``None``: there is none, use the hub."""
    if path:
        folder = Path(path)
        missing = [f for f in known.files if not (folder / f).is_file()]
        if missing:
            raise FileNotFoundError(f"data.path: {path!r} holds no {known.title} {' and '.join(missing)} (looked in "
                                    f"{folder.resolve()}); {known.where()}")
        return folder
    root = os.environ.get(ENV)
    if root and all((Path(root) / known.source / f).is_file() for f in known.files):
        return Path(root) / known.source
    return None


def looked_in(known: KnownSet) -> str:
    """Where :func:`local_copy` looked without finding a copy, in words."""
    root = os.environ.get(ENV)
    if not root:
        return f"data.path is empty and {ENV} is not set"
    return (f"data.path is empty and {Path(root) / known.source} ({ENV}) holds no "
            f"{' and '.join(known.files)}")


def known_hub_splits(known: KnownSet) -> list:
    """The hub's ``train`` and ``test`` splits of ``known`` (no local copy), announced on stderr; one error line
    naming the hub id, where it looked and how to provide the set when ``datasets`` cannot load it."""
    print(f"data.source = {known.source!r}: no local copy ({looked_in(known)}); loading {known.hub_id} with "
          "`datasets` (its cache or the Hugging Face hub; offline, HF_HUB_OFFLINE=1 skips the hub's retries)",
          file=sys.stderr, flush=True)
    try:
        return hub_splits(known.hub_id, f"data.source = {known.source!r}", known.hub_config)
    except HubUnavailable as exc:
        raise HubUnavailable(f"{exc}; no local copy: {looked_in(known)}; {known.where()}") from None


def describe(source: str, path: str) -> str:
    """Where the known set ``source`` is read from with ``data.path = path``, in words (for reports)."""
    known = KNOWN_SETS[source]
    folder = local_copy(known, path)
    if folder is None:
        return f"{known.title} from the Hugging Face hub ({known.hub_id})"
    return f"{known.title} files in {folder.resolve()}" + ("" if path else f" ({ENV})")


for _known in KNOWN_SETS.values():
    register_data(DataSet(_known.source, _known.title,
                          lambda cfg, source=_known.source: describe(source, cfg.data.path)))

"""Instruction data (prompt → response pairs) for the causal-LM task: the packaged arithmetic word problems, GSM8K,
any TSV/CSV/JSONL with a prompt and a response column (read by :func:`~fedlowrank.tasks.table.read_table`), or a
Hugging Face dataset.

Every loader returns an :class:`InstructionData`; extra columns (``partition.partition_by``) are kept per training
example for partitioners.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..seeding import numpy_rng
from .catalog import DataSet, register_data
from .hub import KNOWN_SETS, hub_splits, known_hub_splits, local_copy
from .table import column_spec, read_table


@dataclass
class InstructionData:
    """Prompts and responses of a train and a test split; ``train_columns[name][i]`` is column ``name`` of
    training example ``i`` (the columns asked for besides prompt and response). ``test_columns[name][i]`` is column
    ``name`` of test example ``i``, for the columns the data set declares on every example of both splits (a task
    or group, e.g. task-mix's ``task``): a client partitioned on such a column is evaluated on its own values' test
    examples (:func:`fedlowrank.runtime.evaluation.own_groups`)."""

    train_prompts: list[str]
    train_responses: list[str]
    test_prompts: list[str]
    test_responses: list[str]
    train_columns: dict[str, list[str]] = field(default_factory=dict)
    test_columns: dict[str, list[str]] = field(default_factory=dict)

    def select(self, train: np.ndarray, test: np.ndarray) -> "InstructionData":
        """The examples at the given train and test indices."""
        return InstructionData([self.train_prompts[i] for i in train], [self.train_responses[i] for i in train],
                               [self.test_prompts[i] for i in test], [self.test_responses[i] for i in test],
                               {k: [v[i] for i in train] for k, v in self.train_columns.items()},
                               {k: [v[i] for i in test] for k, v in self.test_columns.items()})


def _read(path: str | Path, prompt: str, response: str, extra: list[str], header: str) -> list[list[str]]:
    columns = [column_spec(c) for c in (prompt, response, *extra)]
    names = ["data.prompt_column", "data.response_column", *(["partition.partition_by"] if extra else [])]
    table = read_table(path, columns, header, names)
    return [table.column(j) for j in range(len(columns))]


def load_instruction_files(train: str | Path, test: str | Path | None, prompt: str = "question",
                           response: str = "answer", extra: list[str] | None = None, test_fraction: float = 0.2,
                           seed: int = 0, header: str = "auto") -> InstructionData:
    """Read prompt and response columns (names or 0-based indices) of a train file and an optional test file;
    without a test file, a seeded ``test_fraction`` of the train file is held out."""
    extra = list(extra or [])
    cols = _read(train, prompt, response, extra, header)
    if test is None:
        n = len(cols[0])
        order = numpy_rng(seed, "train-test-split").permutation(n)
        n_test = int(round(test_fraction * n))
        if n_test == 0 or n_test == n:
            raise ValueError(f"{train}: data.test_fraction = {test_fraction} of its {n} examples leaves an empty "
                             "split; change data.test_fraction or give a data.test file")
        te, tr = np.sort(order[:n_test]), np.sort(order[n_test:])
        return InstructionData(cols[0], cols[1], cols[0], cols[1],
                               {c: v for c, v in zip(extra, cols[2:])}).select(tr, te)
    test_cols = _read(test, prompt, response, [], header)
    return InstructionData(cols[0], cols[1], test_cols[0], test_cols[1], {c: v for c, v in zip(extra, cols[2:])})


def load_gsm8k(path: str = "", extra: list[str] | None = None) -> InstructionData:
    """GSM8K (``question``/``answer``): a local copy's ``train.jsonl`` and ``test.jsonl`` (``data.path``, else
    ``$FEDLOWRANK_DATA/gsm8k``) or the hub's ``openai/gsm8k``, config ``main`` (:mod:`~fedlowrank.tasks.hub`)."""
    known = KNOWN_SETS["gsm8k"]
    folder = local_copy(known, path)
    if folder is not None:
        return load_instruction_files(folder / "train.jsonl", folder / "test.jsonl", "question", "answer", extra)
    return _hub_instruction_data(*known_hub_splits(known), known.hub_id, "question", "answer", extra)


register_data(DataSet("arithmetic", "arithmetic",
                      lambda cfg: "arithmetic word problems packaged with fedlowrank (train.jsonl, test.jsonl)"))


def load_arithmetic(extra: list[str] | None = None) -> InstructionData:
    """The packaged arithmetic word problems (:mod:`~fedlowrank.tasks.arithmetic`: 400 train, 100 test;
    ``question``/``answer``, column ``skill``)."""
    from .arithmetic import PACKAGED

    return load_instruction_files(PACKAGED / "train.jsonl", PACKAGED / "test.jsonl", "question", "answer", extra)


def load_instruction_hf(name: str, prompt: str, response: str, extra: list[str] | None = None,
                        data_files: dict[str, str] | None = None, train_split: str = "train",
                        test_split: str = "test") -> InstructionData:
    """A Hugging Face dataset by name (``datasets``: its cache or the hub) or a builder with local ``data_files``
    (``load_dataset("json", data_files={"train": ..., "test": ...})``)."""
    train, test = hub_splits(name, "data.source = 'hf'", data_files=data_files, splits=(train_split, test_split))
    return _hub_instruction_data(train, test, name, prompt, response, extra)


def _hub_instruction_data(train, test, name: str, prompt: str, response: str,
                          extra: list[str] | None) -> InstructionData:
    """Prompts, responses and the ``extra`` columns (training split) of two ``datasets`` splits."""
    for column, where in ((prompt, "data.prompt_column"), (response, "data.response_column"),
                          *((c, "partition.partition_by") for c in extra or [])):
        if column not in train.column_names:
            raise ValueError(f"{where} = {column!r} is not a column of {name!r}; columns: "
                             f"{', '.join(train.column_names)}")
    return InstructionData([str(x) for x in train[prompt]], [str(x) for x in train[response]],
                           [str(x) for x in test[prompt]], [str(x) for x in test[response]],
                           {c: [str(x) for x in train[c]] for c in extra or []})


INSTRUCTION_SOURCES: dict[str, tuple[str, ...]] = {}
"""Each registered ``data.source`` of instruction data and the ``[data]`` keys it reads (the causal-LM task's
``data_sources``)."""
_LOADERS: dict[str, Callable[..., InstructionData]] = {}


def register_instructions(source: str, keys: tuple[str, ...],
                          load: Callable[[object, list[str], int], InstructionData]) -> None:
    """Make ``data.source = source`` instruction data for the causal-LM task: ``load(d, extra, seed)`` reads it
    from the ``[data]`` section ``d`` with the ``extra`` columns (``partition.partition_by``), and it reads the
    ``[data]`` keys ``keys`` besides ``data.max_train_examples`` and ``data.max_test_examples``."""
    if source in _LOADERS and _LOADERS[source] is not load:
        raise ValueError(f"instruction data {source!r} registered twice")
    INSTRUCTION_SOURCES[source] = ("max_train_examples", "max_test_examples", *keys)
    _LOADERS[source] = load


register_instructions("arithmetic", (), lambda d, extra, seed: load_arithmetic(extra))
register_instructions("gsm8k", ("path",), lambda d, extra, seed: load_gsm8k(d.path, extra))
register_instructions("files", ("train", "test", "prompt_column", "response_column", "test_fraction", "header"),
                      lambda d, extra, seed: load_instruction_files(d.train, d.test or None, d.prompt_column,
                                                                    d.response_column, extra, d.test_fraction, seed,
                                                                    d.header))
register_instructions("hf", ("hf_name", "prompt_column", "response_column", "train", "test"),
                      lambda d, extra, seed: load_instruction_hf(
                          d.hf_name, d.prompt_column, d.response_column, extra,
                          {k: v for k, v in (("train", d.train), ("test", d.test)) if v} or None))


def load_instructions(d, partition_by: str, seed: int) -> InstructionData:
    """The instruction data of a config's ``[data]`` section (``d``), subsampled to ``data.max_*_examples``;
    ``partition_by`` (a column name, or ``""``) is read as well."""
    extra = [partition_by] if partition_by else []
    if d.source not in _LOADERS:
        raise ValueError(f"data.source = {d.source!r} is not instruction data; for task.kind = 'causal-lm' use "
                         f"{', '.join(INSTRUCTION_SOURCES)}")
    data = _LOADERS[d.source](d, extra, seed)

    def pick(n: int, k: int, stream: str) -> np.ndarray:
        if k <= 0 or k >= n:
            return np.arange(n)
        return np.sort(numpy_rng(seed, stream).choice(n, size=k, replace=False))

    return data.select(pick(len(data.train_prompts), d.max_train_examples, "subsample-train"),
                       pick(len(data.test_prompts), d.max_test_examples, "subsample-test"))

"""Tasks: data source + model builder + loss + metrics. ``build_task(cfg)`` makes the configured one."""

from __future__ import annotations

import inspect

from .base import Task


def task_class(kind: str) -> type[Task]:
    """The :class:`Task` class of ``task.kind``."""
    if kind == "text-classification":
        from .text import TextClassification

        return TextClassification
    if kind == "matrix-regression":
        from .matrix_regression import MatrixRegression

        return MatrixRegression
    if kind == "image-classification":
        from .image import ImageClassification

        return ImageClassification
    if kind == "causal-lm":
        from .causal_lm import CausalLM

        return CausalLM
    raise ValueError(f"task.kind: unknown task {kind!r}")


def build_task(cfg) -> Task:
    """The task of a :class:`~fedlowrank.config.RunConfig` (data loaded and tokenised once)."""
    if cfg.task.kind == "text-classification":
        from .data import agnews_folder, load_bbc_news, load_hf, load_text_files, subsample, use_label_names
        from .table import column_spec

        d = cfg.data
        if d.source == "gsm8k":
            raise ValueError("data.source = 'gsm8k' is instruction data (no labels); use task.kind = 'causal-lm'")
        if d.source == "bbc-news":
            data = load_bbc_news(d.test_fraction, cfg.run.seed)
        elif d.source == "agnews":
            folder = agnews_folder(d.path)
            data = load_text_files(folder / "train.tsv", folder / "test.tsv", header="false", label_names=d.labels)
        elif d.source == "files":
            columns = [column_spec(c) for c in (d.text_column, d.label_column)]
            data = load_text_files(d.train, d.test or None, *columns, d.test_fraction, cfg.run.seed, d.header,
                                   d.labels)
        else:
            data = load_hf(d.hf_name, d.text_column, d.label_column)
        if d.labels and d.source in ("bbc-news", "hf"):
            data = use_label_names(data, d.labels, f"data.source = {d.source!r}")
        data = subsample(data, d.max_train_examples, d.max_test_examples, cfg.run.seed)
        return _text_task(cfg, data)
    if cfg.task.kind == "matrix-regression":
        from .matrix_regression import MatrixRegression

        allowed = set(inspect.signature(MatrixRegression).parameters)
        unknown = sorted(set(cfg.task.options) - allowed)
        if unknown:
            raise ValueError(f"task.options.{unknown[0]} is not an option of matrix-regression; "
                             f"allowed: {', '.join(sorted(allowed))}")
        return MatrixRegression(**cfg.task.options)
    if cfg.task.kind == "causal-lm":
        from .causal_lm import CausalLM
        from .instructions import load_instructions

        allowed = set(inspect.signature(CausalLM).parameters) - {"data", "model", "max_length", "targets",
                                                                  "eval_batch_size", "length_buckets"}
        unknown = sorted(set(cfg.task.options) - allowed)
        if unknown:
            raise ValueError(f"task.options.{unknown[0]} is not an option of causal-lm; "
                             f"allowed: {', '.join(sorted(allowed))}")
        data = load_instructions(cfg.data, cfg.partition.partition_by, cfg.run.seed)
        return CausalLM(data, cfg.task.model, cfg.task.max_length, cfg.lora.targets or None,
                        cfg.task.eval_batch_size, length_buckets=cfg.task.length_buckets, **cfg.task.options)
    if cfg.task.kind == "image-classification":
        from .image import build_image_task

        return build_image_task(cfg)
    raise ValueError(f"task.kind: unknown task {cfg.task.kind!r}")


def _text_task(cfg, data) -> Task:
    from .text import TextClassification

    return TextClassification(data, cfg.task.model, cfg.task.max_length, cfg.lora.targets or None,
                              cfg.task.eval_batch_size, cfg.task.length_buckets, **cfg.task.options)


def node_data(cfg, path: str, key: str = "data-train"):
    """The :class:`~fedlowrank.tasks.data.TextData` of a Flower node that brings its own training file ``path``
    (node config ``key``): all of it is training data, read like ``data.train`` with the run's ``data.*``
    columns and header, labels numbered by ``data.labels``; no test set (the server evaluates)."""
    if cfg.task.kind != "text-classification":
        raise ValueError(f"node config {key}: a node's own data is supported for task.kind = "
                         f"'text-classification' only; this run has {cfg.task.kind!r}")
    if not cfg.data.labels:
        raise ValueError(f"node config {key}: set data.labels (the class names, e.g. data.labels=[\"a\",\"b\"]) "
                         "in the run config, so that every node and the server number the classes alike")
    from .data import load_node_file
    from .table import column_spec

    d = cfg.data
    columns = [column_spec(c) for c in (d.text_column, d.label_column)]
    return load_node_file(path, *columns, d.header, d.labels, key)


def build_node_task(cfg, path: str, key: str = "data-train") -> Task:
    """The task of a node that brings its own training file (see :func:`node_data`): the run's model and
    settings on the node's examples."""
    return _text_task(cfg, node_data(cfg, path, key))


__all__ = ["Task", "build_node_task", "build_task", "node_data", "task_class"]

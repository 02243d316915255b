"""The rules between keys, checked after each key's own declaration and before any work; each error names the
fields it relates. Also the configured task's options and ``[data]`` keys, and the method's options and support."""

from __future__ import annotations

import tempfile
from pathlib import Path

from ..codecs.settings import check_codec
from ..privacy.settings import check_privacy
from ..schema import ConfigError, declared
from ..tasks import available_tasks, task_class
from .sections import DataSection, RunConfig


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def validate(cfg: RunConfig, method_checks: bool = True) -> None:
    """The checks that need no data or model (those come when the task and model are built); each section's own
    keys were checked when it was made. ``method_checks=False`` leaves out those of ``method.name`` (its options,
    heterogeneous ranks, privacy modes): ``compare`` and ``tune`` read their shared settings that way, since the
    user's ``--set`` may suit only the compared methods; each compared method's own config is checked in full.
    Checked values are stored back (``task.options``, the method's options)."""
    try:
        _check_run(cfg)
        _check_codecs(cfg)
        _check_task_and_data(cfg)
        lo, t = cfg.lora, cfg.train
        _need(len(lo.ranks) <= cfg.partition.num_clients,
              f"lora.ranks gives {len(lo.ranks)} ranks for partition.num_clients = {cfg.partition.num_clients} "
              "clients; give at most one per client")
        _need(t.local_steps >= 1 or t.local_epochs > 0, "train.local_steps must be >= 1 (or train.local_epochs > 0)")
        if method_checks:
            _check_method(cfg)
    except ConfigError:
        raise
    except ValueError as exc:  # a task's or method's own rule, already naming its fields
        raise ConfigError(str(exc)) from None


def _check_run(cfg: RunConfig) -> None:
    r, m = cfg.run, cfg.partition.num_clients
    _need(r.clients_per_round <= m,
          f"run.clients_per_round must be in [1, partition.num_clients = {m}], got {r.clients_per_round}")
    _need(0 <= r.personal_eval_clients <= m, f"run.personal_eval_clients must be in [0, partition.num_clients = {m}] "
                                        f"(0 = every client), got {r.personal_eval_clients}")
    _need(len(r.devices) <= r.clients_per_round,
          f"run.devices lists {len(r.devices)} devices, more than run.clients_per_round = {r.clients_per_round}: "
          f"every rank trains at least one client a round")
    _need(not (r.devices and r.vectorized), "run.devices and run.vectorized: the vectorised runner runs in one "
          "process; set one of them")
    _need(r.min_replies <= r.clients_per_round,
          f"run.min_replies must be in [1, run.clients_per_round = {r.clients_per_round}], got {r.min_replies}")
    for rnd, client in r.dropout_schedule:
        _need(1 <= rnd <= r.rounds and client < m,
              f"run.dropout_schedule: [{rnd}, {client}] is not a [round, client] pair of this run (rounds 1 to "
              f"run.rounds = {r.rounds}, clients 0 to partition.num_clients - 1 = {m - 1})")
    _need(r.cohort <= 1 or not cfg.privacy.dpsgd,
          f"run.cohort = {r.cohort} with privacy.dpsgd: DP-SGD clips per example within one client's step, which a "
          f"joint step of several clients does not do; use run.cohort = 1, or 0 (automatic: one at a time)")


def _check_codecs(cfg: RunConfig) -> None:
    """Each direction's codec options (:func:`~fedlowrank.codecs.settings.check_codec`); none with the vectorised
    runner, which sends no messages."""
    for section in (cfg.uplink, cfg.downlink):
        check_codec(section)
        _need(not (section.active and cfg.run.vectorized),
              f"{section.prefix}.codec / {section.prefix}.lossless with run.vectorized: the vectorised runner sends no "
              f"messages to code; leave [{section.prefix}] unset or run the simulator")


def _check_task_and_data(cfg: RunConfig) -> None:
    kind, d = cfg.task.kind, cfg.data
    task = task_class(kind)
    _need(all(b <= cfg.task.max_length for b in cfg.task.length_buckets),
          f"task.length_buckets must lie in [2, task.max_length = {cfg.task.max_length}], got {cfg.task.length_buckets}")
    _need(cfg.run.stop_metric in ("", *task.metrics),
          f"run.stop_metric must be one of {', '.join(task.metrics)} for task.kind = {kind!r} ('' = "
          f"{task.primary_metric}); got {cfg.run.stop_metric!r}")
    if cfg.task.quantize and not task.supports_quantize:
        kinds = [name for name, cls in available_tasks().items() if cls.supports_quantize]
        raise ConfigError(f"task.quantize = {cfg.task.quantize!r} is for task.kind = {' or '.join(map(repr, kinds))}; "
                          f"this run has {kind!r}")
    options = task.checked_options(cfg)
    cfg.task.options = {k: getattr(options, k) for k in cfg.task.options}
    check_data_keys(cfg)
    _need(d.text_column != d.label_column,
          f"data.text_column and data.label_column must differ, both are {d.text_column!r}")
    _need(d.source != "files" or bool(d.train), "data.train: a file path is required when data.source = 'files'")
    _need(d.source != "hf" or bool(d.hf_name), "data.hf_name: a dataset name is required when data.source = 'hf'")
    task.check_config(cfg)


def check_data_keys(cfg: RunConfig) -> None:
    """``data.source`` is one the task reads, and every ``[data]`` key it does not read (with that source) keeps
    its default: a value set there would be ignored (:attr:`~fedlowrank.tasks.base.Task.data_sources`)."""
    kind, d = cfg.task.kind, cfg.data
    task = task_class(kind)
    sources = task.data_sources
    if sources and d.source not in sources:
        others = [name for name, cls in available_tasks().items() if d.source in cls.data_sources]
        hint = f" (for {d.source} use task.kind = {' or '.join(map(repr, others))})" if others else ""
        raise ConfigError(f"data.source = {d.source!r} is not {task.data_description}; for task.kind = {kind!r} use "
                          f"one of {', '.join(sources)}{hint}")
    reads = {"validation_fraction"} | ({"source", *sources[d.source]} if sources else set())
    for key, decl in declared(DataSection).items():
        if key in reads or getattr(d, key) == decl.default:
            continue
        where = [s for s, keys in sources.items() if key in keys]
        if where:
            raise ConfigError(f"data.{key} is for data.source = {' or '.join(map(repr, where))}; task.kind = {kind!r} "
                              f"does not read it with data.source = {d.source!r}, so leave it unset")
        kinds = [name for name, cls in available_tasks().items()
                 if cls.data_sources and (key == "source" or any(key in keys for keys in cls.data_sources.values()))]
        why = "does not read it" if sources else "makes its data from task.options"
        raise ConfigError(f"data.{key} is for task.kind = {' or '.join(map(repr, kinds))}; task.kind = {kind!r} {why}, "
                          "so leave it unset")


def _check_method(cfg: RunConfig) -> None:
    from ..methods import get_method

    method = get_method(cfg.method_name, **cfg.method_options)
    cfg.method = {"name": cfg.method_name, **{k: getattr(method, k) for k in cfg.method_options}}
    cls = type(method)
    listed, options = cls.listed_options(), declared(cls)
    for key, value in cfg.method_options.items():
        _need(key in listed or value == options[key].default,
              f"method.{key} = {value!r} changes nothing in method {cfg.method_name!r} (`fedlowrank methods "
              f"{cfg.method_name}` lists the options that do); leave it unset")
    check_requirements(cfg, method)
    check_privacy(cfg, cls)
    check_server(cfg, cls)
    why = method.unequal_replies()
    if why:
        _need(cfg.privacy.mode != "central", f"privacy.mode = 'central' adds one noise draw to equally shaped replies, "
                                             f"and the replies of method {cfg.method_name!r} differ: {why}")
        _need(cfg.server.aggregate == "mean",
              f"server.aggregate = {cfg.server.aggregate!r} combines replies coordinate by coordinate, and the replies "
              f"of method {cfg.method_name!r} differ: {why}")


def check_requirements(cfg: RunConfig, method) -> None:
    """What ``method`` declares it needs of the run, the one place these are checked: equal client ranks
    (``supports_heterogeneous_ranks``, ``heterogeneous_ranks_refusal``), a local optimizer
    (``optimizer_requirement()``) and a bound on the server step (``max_server_lr``); each error names the key, the
    allowed values and the method's reason."""
    cls, name = type(method), cfg.method_name
    _need(not cfg.lora.ranks or cls.supports_heterogeneous_ranks or len(set(cfg.client_ranks())) == 1,
          f"lora.ranks: method {name!r} does not support heterogeneous ranks"
          + (f": {cls.heterogeneous_ranks_refusal}" if cls.heterogeneous_ranks_refusal else ""))
    allowed, why = method.optimizer_requirement()
    _need(not allowed or cfg.train.optimizer in allowed,
          f"train.optimizer = {cfg.train.optimizer!r}: method {name!r} needs one of {', '.join(allowed)}"
          + (f" ({why})" if why else ""))
    top = cls.max_server_lr
    if top is not None:
        _need(cfg.server.lr <= top, f"server.lr = {cfg.server.lr:g}: method {name!r} needs server.lr <= {top:g}"
                                    + (f" ({cls.server_lr_refusal})" if cls.server_lr_refusal else ""))


def check_server(cfg: RunConfig, method_cls) -> None:
    """``server.aggregate`` other than ``mean`` replaces a weighted mean of the replies (runtime/robust.py): refuse
    it for a method that declares no such server step (``"central"`` among its privacy modes: a fixed-weight sum
    of the replies), with unequal ranks, or with central DP."""
    name = cfg.server.aggregate
    if name == "mean":
        return
    if "central" not in method_cls.supported_privacy_modes():
        why = ("its server step needs individual replies (needs_individual_replies)" if method_cls.needs_individual_replies
               else method_cls.privacy_refusal or "its server step is not a weighted mean of the replies")
        raise ConfigError(f"server.aggregate = {name!r} replaces a weighted mean of the replies, and method "
                          f"{method_cls.name!r} has none: {why}; use server.aggregate = 'mean'")
    _need(len(set(cfg.client_ranks())) == 1, f"server.aggregate = {name!r} needs equal client ranks (lora.ranks): "
                                             f"it combines equally shaped replies coordinate by coordinate")
    _need(cfg.privacy.mode != "central", f"server.aggregate = {name!r} with privacy.mode = 'central': the noise is "
                                         f"calibrated to a mean of clipped updates, not to a {name}; use one or the other")


def check_writable(path: str | Path, field: str) -> None:
    """``path`` is, or can be made as, a writable directory: a file can be made in its nearest existing ancestor
    (tried with a temporary file, removed at once). ``field`` names the setting in the error (``run.out_dir``)."""
    target = Path(path).absolute()
    existing = next(p for p in (target, *target.parents) if p.exists())
    _need(existing.is_dir(), f"{field}: {str(path)!r} cannot be a directory: {existing} is a file")
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as exc:
        raise ConfigError(f"{field}: {str(path)!r} is not writable ({existing}: {exc.strerror or exc})") from None

"""Run configuration: TOML files plus ``--set section.key=value`` overrides, validated before any work.

Sections: ``[run]``, ``[task]``, ``[data]``, ``[partition]``, ``[lora]``, ``[train]``, ``[server]``,
``[method]`` (``name`` plus the method's own options) and ``[compare]``. A wrong value raises
:class:`ConfigError` naming the field and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from .partition import PARTITIONS, PartitionConfig
from .tasks.data import SOURCES
from .tasks.table import HEADER_MODES
from .tracking import TRACKERS
from .training.local import OPTIMIZERS, SCHEDULES, TrainConfig
from .adapters.lora import SCALING_RULES
from .device import DTYPES, check_device_spec

WEIGHTINGS = ("num_examples", "uniform")
TASKS = ("text-classification", "matrix-regression", "causal-lm")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message names the field."""


@dataclass
class RunSection:
    name: str = "run"
    seed: int = 0
    rounds: int = 10
    clients_per_round: int = 5
    eval_every: int = 1
    out_dir: str = "runs"
    threads: int = 0
    checkpoint_every: int = 0
    min_replies: int = 1
    dropout: float = 0.0
    dropout_schedule: list[list[int]] = field(default_factory=list)
    stop_metric: str = ""
    stop_above: float = float("inf")
    tracking: str = ""
    device: str = "auto"


@dataclass
class TaskSection:
    kind: str = "text-classification"
    model: str = "minilm"
    max_length: int = 64
    eval_batch_size: int = 64
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataSection:
    source: str = "bbc-news"
    path: str = ""  # folder of the agnews/gsm8k source; "" = ../shared/data/<source>
    train: str = ""
    test: str = ""
    text_column: str = "0"
    label_column: str = "1"
    header: str = "auto"
    test_fraction: float = 0.2
    max_train_examples: int = 0
    max_test_examples: int = 0
    hf_name: str = ""
    prompt_column: str = "question"
    response_column: str = "answer"
    validation_fraction: float = 0.1  # `fedlowrank tune`: share of each client's examples held out for validation


@dataclass
class LoRASection:
    rank: int = 8
    ranks: list[int] = field(default_factory=list)
    server_rank: int = 0
    alpha: float = 16.0
    scaling: str = "standard"
    dropout: float = 0.0
    targets: list[str] | str = field(default_factory=list)  # peft target_modules: names, "all-linear" or a regex


@dataclass
class ServerSection:
    weighting: str = "num_examples"
    lr: float = 1.0


@dataclass
class CompareSection:
    methods: list[str] = field(default_factory=lambda: ["fedit", "fedavg-full"])
    seeds: list[int] = field(default_factory=lambda: [0])
    overrides: dict[str, list[str]] = field(default_factory=dict)
    tuned: str = ""  # a tune.json whose chosen learning rates compare applies (as train.lr per method)


@dataclass
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    task: TaskSection = field(default_factory=TaskSection)
    data: DataSection = field(default_factory=DataSection)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    lora: LoRASection = field(default_factory=LoRASection)
    train: TrainConfig = field(default_factory=TrainConfig)
    server: ServerSection = field(default_factory=ServerSection)
    method: dict[str, Any] = field(default_factory=lambda: {"name": "fedit"})
    compare: CompareSection = field(default_factory=CompareSection)

    @property
    def method_name(self) -> str:
        return str(self.method.get("name", ""))

    @property
    def method_options(self) -> dict[str, Any]:
        return {k: v for k, v in self.method.items() if k != "name"}

    def client_ranks(self) -> list[int]:
        """Each client's LoRA rank: ``lora.ranks`` (length M, or shorter and dealt round-robin), else ``lora.rank``."""
        m = self.partition.num_clients
        if not self.lora.ranks:
            return [self.lora.rank] * m
        return [self.lora.ranks[k % len(self.lora.ranks)] for k in range(m)]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


_SECTIONS = {f.name: f for f in dataclasses.fields(RunConfig)}


_STRING_OR_BOOL = {"data.header"}  # string keys that also take a TOML true/false (stored as "true"/"false")


def _coerce(section: str, key: str, value: Any, default: Any) -> Any:
    where = f"{section}.{key}"
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if isinstance(default, int) and not isinstance(default, bool):
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if isinstance(default, tuple):
        if not isinstance(value, (list, tuple)) or len(value) != len(default):
            raise ConfigError(f"{where} must be a list of {len(default)} numbers, got {value!r}")
        return tuple(float(v) for v in value)
    if isinstance(default, list):
        if where == "lora.targets" and isinstance(value, str):
            return value  # "all-linear" or a regular expression (peft semantics)
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return value
    if isinstance(default, dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a table, got {value!r}")
        return value
    if isinstance(default, str):
        if isinstance(value, bool) and where in _STRING_OR_BOOL:
            return str(value).lower()
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return str(value)
    return value


def from_dict(raw: dict[str, Any]) -> RunConfig:
    """Build and validate a :class:`RunConfig` from a (TOML-shaped) dict."""
    cfg = RunConfig()
    for section, values in raw.items():
        if section not in _SECTIONS:
            raise ConfigError(f"unknown config section [{section}]; allowed: {', '.join(_SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{section}] must be a table")
        if section == "method":
            cfg.method = {**cfg.method, **values} if "name" not in values else dict(values)
            continue
        obj = getattr(cfg, section)
        fields = {f.name: f for f in dataclasses.fields(obj)}
        for key, value in values.items():
            if key not in fields:
                raise ConfigError(f"{section}.{key} is not a config key; allowed: {', '.join(fields)}")
            setattr(obj, key, _coerce(section, key, value, getattr(obj, key)))
    validate(cfg)
    return cfg


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _choice(where: str, value: Any, allowed: tuple) -> None:
    _need(value in allowed, f"{where} must be one of {', '.join(map(str, allowed))}; got {value!r}")


def validate(cfg: RunConfig) -> None:
    """Checks that need no data or model (those come when the task and model are built)."""
    from .methods import method_class

    r, p, lo, t = cfg.run, cfg.partition, cfg.lora, cfg.train
    _need(r.rounds >= 1, f"run.rounds must be >= 1, got {r.rounds}")
    _need(p.num_clients >= 1, f"partition.num_clients must be >= 1, got {p.num_clients}")
    _need(1 <= r.clients_per_round <= p.num_clients,
          f"run.clients_per_round must be in [1, partition.num_clients = {p.num_clients}], got {r.clients_per_round}")
    _need(r.eval_every >= 1, f"run.eval_every must be >= 1, got {r.eval_every}")
    _need(1 <= r.min_replies <= r.clients_per_round,
          f"run.min_replies must be in [1, run.clients_per_round = {r.clients_per_round}], got {r.min_replies}")
    _need(0 <= r.dropout < 1, f"run.dropout must be in [0, 1), got {r.dropout}")
    _need(all(isinstance(x, list) and len(x) == 2 and all(isinstance(v, int) for v in x) for x in r.dropout_schedule),
          f"run.dropout_schedule must be a list of [round, client] pairs, got {r.dropout_schedule}")
    _need(r.threads >= 0, f"run.threads must be >= 0 (0 = torch default), got {r.threads}")
    _need(r.tracking in ("", *TRACKERS),
          f"run.tracking must be one of \"\" (off), {', '.join(TRACKERS)}; got {r.tracking!r}")
    _choice("task.kind", cfg.task.kind, TASKS)
    _choice("train.dtype", t.dtype, tuple(DTYPES))
    try:
        check_device_spec(r.device)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _choice("data.source", cfg.data.source, SOURCES)
    d = cfg.data
    _choice("data.header", d.header, HEADER_MODES)
    _need(0 < d.test_fraction < 1, f"data.test_fraction must be in (0, 1), got {d.test_fraction}")
    _need(d.max_train_examples >= 0, f"data.max_train_examples must be >= 0 (0 = all), got {d.max_train_examples}")
    _need(d.max_test_examples >= 0, f"data.max_test_examples must be >= 0 (0 = all), got {d.max_test_examples}")
    _need(d.text_column != d.label_column,
          f"data.text_column and data.label_column must differ, both are {d.text_column!r}")
    _need(d.source != "files" or bool(d.train), "data.train: a file path is required when data.source = 'files'")
    _need(d.source != "hf" or bool(d.hf_name), "data.hf_name: a dataset name is required when data.source = 'hf'")
    _need(0 < d.validation_fraction < 1,
          f"data.validation_fraction must be in (0, 1), got {d.validation_fraction}")
    _choice("partition.kind", p.kind, PARTITIONS)
    _need(p.alpha > 0, f"partition.alpha must be > 0, got {p.alpha}")
    _need(p.kind != "clusters" or p.num_clusters >= 2, f"partition.num_clusters must be >= 2, got {p.num_clusters}")
    _need(p.min_partition_size >= 0, f"partition.min_partition_size must be >= 0, got {p.min_partition_size}")
    _need(lo.rank >= 1, f"lora.rank must be >= 1, got {lo.rank}")
    _need(lo.server_rank >= 0, f"lora.server_rank must be >= 0 (0 = max(lora.ranks)), got {lo.server_rank}")
    _need(all(isinstance(x, int) and x >= 1 for x in lo.ranks), f"lora.ranks must be positive integers, got {lo.ranks}")
    _need(lo.alpha > 0, f"lora.alpha must be > 0, got {lo.alpha}")
    _need(0 <= lo.dropout < 1, f"lora.dropout must be in [0, 1), got {lo.dropout}")
    _choice("lora.scaling", lo.scaling, SCALING_RULES)
    _choice("train.optimizer", t.optimizer, OPTIMIZERS)
    _choice("train.schedule", t.schedule, SCHEDULES)
    _need(t.lr > 0, f"train.lr must be > 0, got {t.lr}")
    _need(t.batch_size >= 1, f"train.batch_size must be >= 1, got {t.batch_size}")
    _need(t.local_steps >= 1 or t.local_epochs > 0, "train.local_steps must be >= 1 (or train.local_epochs > 0)")
    _choice("server.weighting", cfg.server.weighting, WEIGHTINGS)
    _need(cfg.server.lr > 0, f"server.lr must be > 0, got {cfg.server.lr}")
    _need(all(isinstance(v, list) and all(isinstance(x, str) for x in v) for v in cfg.compare.overrides.values()),
          "compare.overrides must map a method name to a list of \"section.key=value\" strings")
    try:
        cls = method_class(cfg.method_name)
        allowed = cls.options()
        unknown = sorted(set(cfg.method_options) - set(allowed))
        _need(not unknown, f"method.{unknown[0] if unknown else ''} is not an option of {cfg.method_name!r}; "
                           f"allowed: {', '.join(sorted(allowed)) or 'none'}")
        _need(not lo.ranks or cls.supports_heterogeneous_ranks or len(set(cfg.client_ranks())) == 1,
              f"lora.ranks: method {cfg.method_name!r} does not support heterogeneous ranks")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"section.key=value"`` → (path, value); the value is read as TOML (``5``, ``0.1``, ``[2,4]``, ``true``)
    and as a plain string when it is not valid TOML."""
    if "=" not in text:
        raise ConfigError(f"--set expects section.key=value, got {text!r}")
    key, value = text.split("=", 1)
    path = key.strip().split(".")
    if len(path) < 2 or not all(path):
        raise ConfigError(f"--set key must be section.key, got {key!r}")
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value
    return path, parsed


def bundled_configs() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("fedlowrank.configs").iterdir() if p.name.endswith(".toml"))


def read_toml(source: str | Path | None) -> dict[str, Any]:
    """Load a TOML file, or a bundled config by name (``main``, ``tiny``...); ``None`` = empty."""
    if source is None:
        return {}
    path = Path(source)
    if path.exists():
        text = path.read_text()
    else:
        bundled = resources.files("fedlowrank.configs") / f"{source}.toml"
        if not bundled.is_file():
            raise ConfigError(f"config: no file {source!r} and no bundled config of that name "
                              f"(bundled: {', '.join(bundled_configs())})")
        text = bundled.read_text()
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {source}: invalid TOML: {exc}") from exc


def load_config(source: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """TOML file (or bundled name) + ``--set`` overrides → validated :class:`RunConfig`."""
    raw = read_toml(source)
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {text}: {part} is not a table")
        node[path[-1]] = value
    return from_dict(raw)

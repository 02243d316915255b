"""Run configuration: TOML files plus ``--set section.key=value`` overrides, validated before any work.

Sections: ``[run]``, ``[task]``, ``[data]``, ``[partition]``, ``[lora]``, ``[train]``, ``[server]``,
``[method]`` (``name`` plus the method's own options), ``[compare]`` and ``[privacy]``. A wrong value raises
:class:`ConfigError` naming the field and what is allowed.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from .tasks.partition import PARTITIONS, PartitionConfig
from .privacy.settings import PrivacySection, check_privacy
from .tasks.data import SOURCES
from .tasks.image_data import IMAGE_SOURCES
from .tasks.table import HEADER_MODES
from .reporting.tracking import TRACKERS
from .training.local import OPTIMIZERS, SCHEDULES, TrainConfig
from .adapters.lora import SCALING_RULES
from .device import DTYPES, check_device_spec

WEIGHTINGS = ("num_examples", "uniform")
TASKS = ("text-classification", "matrix-regression", "image-classification", "causal-lm")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message names the field."""


@dataclass
class RunSection:
    name: str = "run"
    seed: int = 0
    rounds: int = 10
    clients_per_round: int = 5
    eval_every: int = 1
    personal_eval_clients: int = 0  # personalised methods: clients whose own model is evaluated (0 = all)
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
    state_memory_mb: float = 0.0  # client states kept in memory (MiB); beyond it they spill to disk (0 = no limit)
    cohort: int = 0  # clients trained together (0 = automatic: as many as fit on CUDA, 1 on the CPU)
    compile: bool = False  # torch.compile of the client step
    gpu_memory_fraction: float = 0.9  # run.cohort = 0 on CUDA: share of free memory a cohort may use


@dataclass
class TaskSection:
    kind: str = "text-classification"
    model: str = "minilm"
    max_length: int = 64
    eval_batch_size: int = 64
    options: dict[str, Any] = field(default_factory=dict)
    length_buckets: list[int] = field(default_factory=list)  # training batches padded to one of these lengths


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
    labels: list[str] = field(default_factory=list)  # class names in label-id order; [] = the data's, sorted


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
    tuned: str = ""  # a tune.json whose chosen values (train.lr, ...) compare applies per method


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
    privacy: PrivacySection = field(default_factory=PrivacySection)

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

# What every config key means, in one place: `fedlowrank config` prints it, docs/configuration.md is made from it,
# and a test checks that it names exactly the keys of the dataclasses above.
MEANINGS: dict[str, str] = {
    "run.name": "name of the run: prefix of its run directory",
    "run.seed": "seed of every random stream (split, partition, sampling, initialisation, batches)",
    "run.rounds": "federated rounds",
    "run.clients_per_round": "clients sampled per round (at most partition.num_clients)",
    "run.eval_every": "evaluate every this many rounds (and after the last)",
    "run.personal_eval_clients": "personalised methods (fedsa-lora): evaluate the own models of this many clients, "
                                 "the first with a state in a fixed order drawn from run.seed (0 = every client "
                                 "with a state); each costs one pass over the test set. The simulator only",
    "run.out_dir": "folder in which run directories are made",
    "run.threads": "torch threads (0 = torch's default)",
    "run.device": "where to compute: auto (a CUDA GPU when there is one), cpu, cuda or cuda:N",
    "run.checkpoint_every": "save a checkpoint every this many rounds (0 = never); resume and export read them",
    "run.min_replies": "fewest usable replies for a round to be aggregated; fewer and the round is skipped",
    "run.dropout": "probability that a sampled client does not reply (fault injection)",
    "run.dropout_schedule": "[round, client] pairs that do not reply (fault injection)",
    "run.stop_metric": "metric the run watches for divergence and compare tabulates ('' = accuracy or rel_error)",
    "run.stop_above": "stop the run as diverged when run.stop_metric exceeds this",
    "run.tracking": "mirror each metrics row to an experiment tracker: tensorboard, wandb or mlflow ('' = off)",
    "run.state_memory_mb": "MiB of client states kept in memory; beyond it the least recently used spill to disk "
                           "(RUN_DIR/client_states/) and are read back on demand (0 = keep all in memory)",
    "run.cohort": "clients trained together, one forward/backward per step over the shared backbone for methods "
                  "and tasks that support it (others: one at a time); 0 = automatic (on CUDA the most of a round's "
                  "clients whose estimated peak memory fits run.gpu_memory_fraction of the free memory, 1 on the "
                  "CPU), 1 = one at a time (docs/architecture.md)",
    "run.compile": "torch.compile the local step's network (CUDA graphs on CUDA; with task.length_buckets each "
                   "bucket compiles once for the whole run); pays off after some hundreds of steps "
                   "(docs/models.md); a run that cannot compile goes on eagerly, saying so in one line",
    "run.gpu_memory_fraction": "run.cohort = 0 on CUDA: the share of the device's free memory a cohort's estimated "
                               "peak may take, in (0, 1]",
    "task.kind": "text-classification, causal-lm, image-classification or matrix-regression",
    "task.model": "a bundled model name or a local Hugging Face model folder",
    "task.max_length": "tokens per example (longer texts are truncated)",
    "task.eval_batch_size": "examples per evaluation forward pass",
    "task.length_buckets": "sequence lengths a training batch is padded to: the smallest that holds its longest "
                           "example, task.max_length beyond the largest ([] = the longest example: dynamic shapes)",
    "task.options": "options of the task (matrix-regression: num_clients, dim, outputs, samples, het, objective)",
    "data.source": "bbc-news (packaged), agnews (data.path), files (data.train, data.test) or hf (data.hf_name)",
    "data.path": "folder of the agnews (train.tsv, test.tsv) or gsm8k (train.jsonl, test.jsonl) source ('' = "
                 "../shared/data/<source>)",
    "data.train": "training file, .tsv, .csv or .jsonl (data.source = 'files')",
    "data.test": "test file ('' = hold out data.test_fraction of the training file)",
    "data.text_column": "text column: an index, or a header name (a key for JSONL)",
    "data.label_column": "label column: an index, or a header name (a key for JSONL)",
    "data.header": "whether line 1 of a .tsv/.csv is a header: auto, true or false (docs/data.md)",
    "data.test_fraction": "share of the training file held out, stratified, when there is no test file",
    "data.labels": "text-classification: the class names, in label-id order ([] = the data's, sorted); required "
                   "when Flower nodes bring their own data (node config data-train)",
    "data.validation_fraction": "`fedlowrank tune`: share of each client's examples held out for validation",
    "data.max_train_examples": "keep at most this many training examples, seeded (0 = all)",
    "data.max_test_examples": "keep at most this many test examples, seeded (0 = all)",
    "data.hf_name": "Hugging Face dataset name (data.source = 'hf'; needs `datasets` and a network), or a "
                    "builder such as json with data.train/data.test as its data_files",
    "data.prompt_column": "causal-lm: the prompt column (a name, a key for JSONL, or an index)",
    "data.response_column": "causal-lm: the response column (a name, a key for JSONL, or an index)",
    "partition.kind": "how examples are dealt to clients: iid, dirichlet, shards, quantity, natural, domains or "
                      "clusters (k-means of MiniLM embeddings, then dirichlet over the clusters)",
    "partition.num_clients": "number of clients M",
    "partition.alpha": "Dirichlet concentration α of dirichlet and quantity (smaller = more skewed)",
    "partition.min_partition_size": "redraw until every client holds at least this many examples",
    "partition.classes_per_client": "classes per client (shards)",
    "partition.self_balancing": "dirichlet: give no more of a class to clients already above N/M",
    "partition.max_tries": "redraws allowed to meet partition.min_partition_size",
    "partition.partition_by": "a data column to split on instead of labels (dirichlet, shards) or one client per "
                              "value (natural); '' = labels",
    "partition.num_clusters": "clusters of the clusters partition",
    "lora.rank": "LoRA rank r of every client",
    "lora.ranks": "per-client ranks, dealt round-robin (heterogeneous-rank methods; [] = lora.rank)",
    "lora.server_rank": "rank of the global adapter with heterogeneous ranks (0 = max(lora.ranks))",
    "lora.alpha": "LoRA α: the update is scaled by α/r (α/√r with rslora)",
    "lora.scaling": "standard (α/r) or rslora (α/√r)",
    "lora.dropout": "dropout on the LoRA path's input",
    "lora.targets": "suffixes of the nn.Linear modules to adapt ([] = the architecture's default)",
    "train.local_steps": "optimizer steps per client per round (when train.local_epochs is 0)",
    "train.local_epochs": "passes over the client's data per round (> 0 overrides train.local_steps)",
    "train.batch_size": "examples per local step",
    "train.optimizer": "local optimizer: sgd, momentum, adam or adamw",
    "train.lr": "local learning rate (of round 1; train.schedule decays it over rounds)",
    "train.head_lr": "learning rate of the classifier head (0 = train.lr)",
    "train.momentum": "momentum of the momentum optimizer",
    "train.weight_decay": "weight decay of the local optimizer",
    "train.betas": "Adam β1, β2",
    "train.eps": "Adam ε",
    "train.max_grad_norm": "clip the gradient norm to this (0 = no clipping)",
    "train.schedule": "learning rate over rounds: constant, cosine or linear",
    "train.warmup_rounds": "rounds of linear learning-rate warm-up",
    "train.gradient_checkpointing": "recompute each layer's activations during backward (transformers' "
                                    "gradient checkpointing): far less activation memory for about a third more "
                                    "compute, for long sequences and large cohorts",
    "train.dtype": "compute dtype: fp32, bf16 or fp16 (CUDA); the frozen backbone is stored in it, what is trained "
                   "(adapters, head, optimizer state) stays fp32",
    "server.weighting": "client weights in aggregation: num_examples or uniform",
    "server.lr": "server step β: global ← old + β·(average − old)",
    "method.name": "the method (`fedlowrank methods`); its own options are method.OPTION",
    "compare.methods": "methods that `fedlowrank compare` runs",
    "compare.seeds": "seeds that `fedlowrank compare` runs each method with",
    "compare.overrides": "per-method settings, e.g. {fedgalore = [\"train.lr=1e-4\"]}",
    "compare.tuned": "a tune.json from `fedlowrank tune` whose chosen values (learning rates, ...) compare applies "
                     "('' = none)",
    "privacy.mode": "client-level DP: '' (off), central (server clips each update, noise on the sum) or local "
                    "(each client noises its own reply)",
    "privacy.clip": "C, the L2 bound of a client's update (inf = no clipping); the initial C when adaptive",
    "privacy.noise_multiplier": "σ: noise std σ·C (ignored when privacy.target_epsilon > 0)",
    "privacy.target_epsilon": "> 0: σ is the smallest noise multiplier whose ε after run.rounds rounds is at most this",
    "privacy.delta": "δ of the reported (ε, δ); 0 = 1/partition.num_clients",
    "privacy.clipping": "fixed, or adaptive (C tracks privacy.target_quantile of the update norms; central only)",
    "privacy.target_quantile": "adaptive clipping: the quantile of update norms C tracks",
    "privacy.clip_lr": "adaptive clipping: learning rate of log C",
    "privacy.clip_noise": "adaptive clipping: noise std on the count of unclipped updates (0 = clients_per_round/20)",
    "privacy.dpsgd": "record-level DP-SGD in every client's local training (per-example clipping, noise per step)",
    "privacy.dpsgd_clip": "DP-SGD per-example clipping norm",
    "privacy.dpsgd_noise": "DP-SGD noise multiplier",
}


def config_keys(cfg: "RunConfig") -> list[tuple[str, Any]]:
    """Every ``section.key`` of ``cfg`` with its value, in section order (``method``: the name and the method's
    options, configured or default)."""
    rows: list[tuple[str, Any]] = []
    for section in _SECTIONS:
        if section == "method":
            from .methods import method_class

            options = {**method_class(cfg.method_name).options(), **cfg.method_options}
            rows += [("method.name", cfg.method_name), *((f"method.{k}", v) for k, v in options.items())]
            continue
        obj = getattr(cfg, section)
        rows += [(f"{section}.{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    return rows


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


def from_dict(raw: dict[str, Any], method_checks: bool = True) -> RunConfig:
    """Build and validate a :class:`RunConfig` from a (TOML-shaped) dict (``method_checks``: see :func:`validate`)."""
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
    validate(cfg, method_checks)
    return cfg


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _choice(where: str, value: Any, allowed: tuple) -> None:
    _need(value in allowed, f"{where} must be one of {', '.join(map(str, allowed))}; got {value!r}")


def validate(cfg: RunConfig, method_checks: bool = True) -> None:
    """Checks that need no data or model (those come when the task and model are built). ``method_checks=False``
    leaves out those of ``method.name`` (its options, heterogeneous ranks, privacy modes): ``compare`` and
    ``tune`` read their shared settings that way, since the user's ``--set`` may suit only the compared
    methods; each compared method's own config is checked in full."""
    from .methods import method_class

    r, p, lo, t = cfg.run, cfg.partition, cfg.lora, cfg.train
    _need(r.rounds >= 1, f"run.rounds must be >= 1, got {r.rounds}")
    _need(p.num_clients >= 1, f"partition.num_clients must be >= 1, got {p.num_clients}")
    _need(1 <= r.clients_per_round <= p.num_clients,
          f"run.clients_per_round must be in [1, partition.num_clients = {p.num_clients}], got {r.clients_per_round}")
    _need(r.eval_every >= 1, f"run.eval_every must be >= 1, got {r.eval_every}")
    _need(0 <= r.personal_eval_clients <= p.num_clients,
          f"run.personal_eval_clients must be in [0, partition.num_clients = {p.num_clients}] (0 = every client), "
          f"got {r.personal_eval_clients}")
    _need(1 <= r.min_replies <= r.clients_per_round,
          f"run.min_replies must be in [1, run.clients_per_round = {r.clients_per_round}], got {r.min_replies}")
    _need(0 <= r.dropout < 1, f"run.dropout must be in [0, 1), got {r.dropout}")
    _need(all(isinstance(x, list) and len(x) == 2 and all(isinstance(v, int) for v in x) for x in r.dropout_schedule),
          f"run.dropout_schedule must be a list of [round, client] pairs, got {r.dropout_schedule}")
    _need(r.threads >= 0, f"run.threads must be >= 0 (0 = torch default), got {r.threads}")
    _need(r.tracking in ("", *TRACKERS),
          f"run.tracking must be one of \"\" (off), {', '.join(TRACKERS)}; got {r.tracking!r}")
    _need(r.checkpoint_every >= 0, f"run.checkpoint_every must be >= 0 (0 = never), got {r.checkpoint_every}")
    _need(r.state_memory_mb >= 0, f"run.state_memory_mb must be >= 0 (0 = keep every client state in memory), "
          f"got {r.state_memory_mb}")
    _need(r.cohort >= 0, f"run.cohort must be an integer >= 0 (0 = automatic, 1 = one client at a time, N = up to N "
                         f"clients together), got {r.cohort}")
    _need(r.cohort <= 1 or not cfg.privacy.dpsgd,
          f"run.cohort = {r.cohort} with privacy.dpsgd: DP-SGD clips per example within one client's step, which a "
          f"joint step of several clients does not do; use run.cohort = 1, or 0 (automatic: one at a time)")
    _need(0 < r.gpu_memory_fraction <= 1, f"run.gpu_memory_fraction must be in (0, 1], got {r.gpu_memory_fraction}")
    buckets = cfg.task.length_buckets
    _need(all(isinstance(b, int) and not isinstance(b, bool) and 2 <= b <= cfg.task.max_length for b in buckets)
          and buckets == sorted(set(buckets)),
          f"task.length_buckets must be increasing integers in [2, task.max_length = {cfg.task.max_length}] "
          f"([] = no buckets), got {buckets}")
    _need(not (cfg.privacy.dpsgd and cfg.task.options.get("pack")),
          "task.options.pack with privacy.dpsgd: DP-SGD clips each example's gradient, and a packed row holds "
          "several examples; set task.options.pack = 0")
    _choice("task.kind", cfg.task.kind, TASKS)
    _choice("train.dtype", t.dtype, tuple(DTYPES))
    try:
        check_device_spec(r.device)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    from .tasks import task_class

    metrics = task_class(cfg.task.kind).metrics
    _need(r.stop_metric in ("", *metrics), f"run.stop_metric must be one of {', '.join(metrics)} for task.kind = "
                                           f"{cfg.task.kind!r} ('' = none); got {r.stop_metric!r}")
    if cfg.task.kind == "text-classification":
        check_model(cfg.task.model)
    _need(cfg.task.max_length >= 2, f"task.max_length must be >= 2, got {cfg.task.max_length}")
    _need(cfg.task.eval_batch_size >= 1, f"task.eval_batch_size must be >= 1, got {cfg.task.eval_batch_size}")
    if cfg.task.kind == "image-classification":
        _choice("data.source", cfg.data.source, IMAGE_SOURCES)
    else:
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
    _need(all(isinstance(x, str) and x.strip() == x and x for x in d.labels),
          f"data.labels must be a list of non-empty class names without surrounding spaces, got {d.labels!r}")
    _need(len(set(d.labels)) == len(d.labels), f"data.labels lists a class twice: {d.labels!r}")
    _need(not d.labels or len(d.labels) >= 2, f"data.labels needs at least 2 classes, got {d.labels!r}")
    _need(not d.labels or cfg.task.kind == "text-classification",
          f"data.labels is for task.kind = 'text-classification'; this run has {cfg.task.kind!r}")
    _need(0 < d.validation_fraction < 1,
          f"data.validation_fraction must be in (0, 1), got {d.validation_fraction}")
    _choice("partition.kind", p.kind, PARTITIONS)
    _need(p.alpha > 0, f"partition.alpha must be > 0, got {p.alpha}")
    _need(p.kind != "clusters" or p.num_clusters >= 2, f"partition.num_clusters must be >= 2, got {p.num_clusters}")
    _need(p.min_partition_size >= 0, f"partition.min_partition_size must be >= 0, got {p.min_partition_size}")
    _need(p.classes_per_client >= 1, f"partition.classes_per_client must be >= 1, got {p.classes_per_client}")
    _need(p.max_tries >= 1, f"partition.max_tries must be >= 1, got {p.max_tries}")
    _need(lo.rank >= 1, f"lora.rank must be >= 1, got {lo.rank}")
    _need(lo.server_rank >= 0, f"lora.server_rank must be >= 0 (0 = max(lora.ranks)), got {lo.server_rank}")
    _need(all(isinstance(x, int) and x >= 1 for x in lo.ranks), f"lora.ranks must be positive integers, got {lo.ranks}")
    _need(len(lo.ranks) <= p.num_clients, f"lora.ranks gives {len(lo.ranks)} ranks for partition.num_clients = "
                                          f"{p.num_clients} clients; give at most one per client")
    _need(lo.alpha > 0, f"lora.alpha must be > 0, got {lo.alpha}")
    _need(0 <= lo.dropout < 1, f"lora.dropout must be in [0, 1), got {lo.dropout}")
    _choice("lora.scaling", lo.scaling, SCALING_RULES)
    _choice("train.optimizer", t.optimizer, OPTIMIZERS)
    _choice("train.schedule", t.schedule, SCHEDULES)
    _need(t.lr > 0, f"train.lr must be > 0, got {t.lr}")
    _need(t.batch_size >= 1, f"train.batch_size must be >= 1, got {t.batch_size}")
    _need(t.local_epochs >= 0, f"train.local_epochs must be >= 0 (0 = use train.local_steps), got {t.local_epochs}")
    _need(t.local_steps >= 1 or t.local_epochs > 0, "train.local_steps must be >= 1 (or train.local_epochs > 0)")
    _need(t.head_lr >= 0, f"train.head_lr must be >= 0 (0 = train.lr), got {t.head_lr}")
    _need(t.weight_decay >= 0, f"train.weight_decay must be >= 0, got {t.weight_decay}")
    _need(t.momentum >= 0, f"train.momentum must be >= 0, got {t.momentum}")
    _need(all(0 <= b < 1 for b in t.betas), f"train.betas must both be in [0, 1), got {list(t.betas)}")
    _need(t.eps > 0, f"train.eps must be > 0, got {t.eps}")
    _need(t.max_grad_norm >= 0, f"train.max_grad_norm must be >= 0 (0 = no clipping), got {t.max_grad_norm}")
    _need(t.warmup_rounds >= 0, f"train.warmup_rounds must be >= 0, got {t.warmup_rounds}")
    _choice("server.weighting", cfg.server.weighting, WEIGHTINGS)
    _need(cfg.server.lr > 0, f"server.lr must be > 0, got {cfg.server.lr}")
    _need(all(isinstance(v, list) and all(isinstance(x, str) for x in v) for v in cfg.compare.overrides.values()),
          "compare.overrides must map a method name to a list of \"section.key=value\" strings")
    if not method_checks:
        return
    try:
        cls = method_class(cfg.method_name)
        allowed = cls.options()
        unknown = sorted(set(cfg.method_options) - set(allowed))
        _need(not unknown, f"method.{unknown[0] if unknown else ''} is not an option of {cfg.method_name!r}; "
                           f"allowed: {', '.join(sorted(allowed)) or 'none'}")
        _need(not lo.ranks or cls.supports_heterogeneous_ranks or len(set(cfg.client_ranks())) == 1,
              f"lora.ranks: method {cfg.method_name!r} does not support heterogeneous ranks")
        check_privacy(cfg, cls)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_model(model: str) -> None:
    """``task.model`` given as a path (starting with ``/``, ``.`` or ``~``) is an existing folder. Bundled names
    and hub ids are resolved, with their own one-line errors, when the model is loaded (:mod:`fedlowrank.models.loading`)."""
    from .models.loading import BUNDLED

    if model.startswith(("/", ".", "~")):
        _need(Path(model).expanduser().is_dir(),
              f"task.model: no folder {model!r} (a local model is a Hugging Face model folder, as written by "
              f"save_pretrained; bundled models: {', '.join(BUNDLED)})")


def check_writable(path: str | Path, field: str) -> None:
    """``path`` is, or can be made as, a writable directory: a file can be made in its nearest existing ancestor
    (tried with a temporary file, removed at once). ``field`` names the setting in the error (``run.out_dir``)."""
    import tempfile

    target = Path(path).absolute()
    existing = next(p for p in (target, *target.parents) if p.exists())
    _need(existing.is_dir(), f"{field}: {str(path)!r} cannot be a directory: {existing} is a file")
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as exc:
        raise ConfigError(f"{field}: {str(path)!r} is not writable ({existing}: {exc.strerror or exc})") from None


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


def read_toml(source: str | Path | dict[str, Any] | None) -> dict[str, Any]:
    """Load a TOML file, or a bundled config by name (``main``, ``tiny``...); a dict is copied; ``None`` = empty."""
    if source is None:
        return {}
    if isinstance(source, dict):
        return copy.deepcopy(source)
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


def load_config(source: str | Path | dict[str, Any] | None = None,
                overrides: list[str] | tuple[str, ...] = (), method_checks: bool = True) -> RunConfig:
    """TOML file (or bundled name, or a TOML-shaped dict) + ``--set`` overrides → validated :class:`RunConfig`
    (``method_checks``: see :func:`validate`)."""
    raw = read_toml(source)
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {text}: {part} is not a table")
        node[path[-1]] = value
    lora = raw.get("lora")
    if isinstance(lora, dict) and lora.get("ranks") == []:
        raise ConfigError("lora.ranks is empty: give one rank per client (fewer are dealt round-robin), "
                          "or leave it out to use lora.rank")
    return from_dict(raw, method_checks)

"""The run configuration's sections: each key declared once (type, default, bounds or allowed values, meaning).

``[train]``, ``[partition]``, ``[privacy]``, ``[uplink]`` and ``[downlink]`` are declared beside the code that reads
them (:class:`~fedlowrank.training.local.TrainConfig`, :class:`~fedlowrank.tasks.partition.PartitionConfig`,
:class:`~fedlowrank.privacy.settings.PrivacySection`, :class:`~fedlowrank.codecs.settings.UplinkSection` and
:class:`~fedlowrank.codecs.settings.DownlinkSection`); ``[method]`` is the method's name plus its own declared
options (:mod:`fedlowrank.methods`); ``task.options`` are the configured task's declared options.
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..adapters.lora import SCALING_RULES
from ..codecs.settings import DownlinkSection, UplinkSection
from ..device import check_device_spec
from ..privacy.settings import PrivacySection
from ..reporting.tracking import TRACKERS
from ..schema import Declared, Schema, Setting, declared, distinct, increasing, setting
from ..models.quantize import QUANTIZE_MODES
from ..tasks import task_kinds
from ..tasks.partition import PartitionConfig
from ..tasks.table import HEADER_MODES
from ..training.local import TrainConfig

AGGREGATES = ("mean", "median", "trimmed-mean")  # server.aggregate (runtime/robust.py)

MAX_THREADS = 1024
MAX_TOKENS = 1 << 17


def method_names() -> tuple[str, ...]:
    """Every registered method's name."""
    from ..methods import available_methods

    return tuple(available_methods())


def data_sources() -> tuple[str, ...]:
    """Every ``data.source`` some registered task reads."""
    from ..tasks import available_tasks

    return tuple(dict.fromkeys(s for cls in available_tasks().values() for s in cls.data_sources))


def check_devices(devices: list[str], key: str = "run.devices") -> None:
    """``run.devices``: each entry a device spec (:func:`~fedlowrank.device.check_device_spec`, ``auto`` excluded),
    all CPUs or all GPUs (one backend: gloo or NCCL). No hardware query: the launcher checks the devices are
    there."""
    for i, spec in enumerate(devices):
        if spec == "auto":
            raise ValueError(f"{key}[{i}] must be cpu, cuda or cuda:N, got 'auto' (name each rank's device)")
        check_device_spec(spec, f"{key}[{i}]")
    if len({spec == "cpu" for spec in devices}) > 1:
        raise ValueError(f"{key} mixes CPUs and GPUs ({devices}): list only cpu entries (gloo) or only cuda "
                         f"entries (NCCL)")


def check_model(model: str, key: str = "task.model") -> None:
    """``task.model`` given as a path (starting with ``/``, ``.`` or ``~``) is an existing folder. Bundled names
    and hub ids are resolved, with their own one-line errors, when the model is loaded
    (:mod:`fedlowrank.models.loading`)."""
    if model.startswith(("/", ".", "~")) and not Path(model).expanduser().is_dir():
        from ..models.bundled import BUNDLED

        raise ValueError(f"{key}: no folder {model!r} (a local model is a Hugging Face model folder, as written by "
                         f"save_pretrained; bundled models: {', '.join(BUNDLED)})")


LABELS_FORM = "a list of non-empty class names without surrounding spaces"


RUN_NAME_MAX = 64  # characters; the run directory adds -<method>-<time stamp> (+ 30)


def check_run_name(name: str, key: str = "run.name") -> None:
    """A plain name: the start of a directory name inside ``run.out_dir`` (no separator, no ``..``, bounded)."""
    if not (0 < len(name) <= RUN_NAME_MAX and re.fullmatch(r"[A-Za-z0-9_.+=,@-]+", name)
            and not name.startswith(".")):
        raise ValueError(f"{key} must be a plain name of 1 to {RUN_NAME_MAX} letters, digits and _.+=,@- not "
                         f"starting with '.' (it names a directory inside run.out_dir), got {name!r}")


def check_labels(labels: list[str], key: str) -> None:
    """``data.labels``: distinct, non-empty class names without surrounding spaces, at least two (or none)."""
    if not all(x and x.strip() == x for x in labels):
        raise ValueError(f"{key} must be {LABELS_FORM}, got {labels!r}")
    if len(set(labels)) != len(labels):
        raise ValueError(f"{key} lists a class twice: {labels!r}")
    if len(labels) == 1:
        raise ValueError(f"{key} needs at least 2 classes, got {labels!r}")


@dataclass
class RunSection(Schema):
    """Config section ``[run]``: rounds, sampling, evaluation, checkpoints, faults, where and how it runs."""

    prefix = "run"

    name: str = setting("run", "name of the run: prefix of its run directory in run.out_dir", check=check_run_name,
                        form=f"a plain name of 1 to {RUN_NAME_MAX} letters, digits and _.+=,@- (no '/', not "
                             f"starting with '.')")
    seed: int = setting(0, "seed of every random stream (split, partition, sampling, initialisation, batches)")
    rounds: int = setting(10, "federated rounds", ge=1)
    clients_per_round: int = setting(5, "clients sampled per round (at most partition.num_clients)", ge=1)
    eval_every: int = setting(1, "evaluate every this many rounds (and after the last)", ge=1)
    personal_eval_clients: int = setting(
        0, "personalised methods (fedsa-lora): evaluate the own models of this many clients, the first with a state "
        "in a fixed order drawn from run.seed (0 = every client with a state); each costs one pass over the test "
        "set; in [0, partition.num_clients]. The simulator only")
    out_dir: str = setting("runs", "folder in which run directories are made")
    threads: int = setting(0, "torch threads (0 = torch's default)", ge=0, le=MAX_THREADS,
                           reason="more than any machine's cores; a huge count exhausts OpenMP's memory")
    checkpoint_every: int = setting(0, "save a checkpoint every this many rounds (0 = only as run.checkpoint_seconds "
                                    "says, at the last round and when stopped); resume and export read them", ge=0)
    checkpoint_seconds: float = setting(60.0, "also save a checkpoint after a round when this many seconds have "
                                        "passed since the last one, never sooner than 50 times what the last one "
                                        "took (checkpoints cost at most 2 % of the run); 0 = off", ge=0)
    min_replies: int = setting(1, "fewest usable replies for a round to be aggregated; fewer and the round is "
                               "skipped", ge=1)
    dropout: float = setting(0.0, "probability that a sampled client does not reply (fault injection)", ge=0, lt=1)
    dropout_schedule: list[tuple[int, int]] = setting(
        [], "[round, client] pairs that do not reply (fault injection): rounds from 1, clients from 0", ge=0)
    stop_metric: str = setting("", "metric the run watches for divergence and compare tabulates ('' = the task's "
                               "primary metric)")
    stop_above: float = setting(float("inf"), "stop the run as diverged when run.stop_metric exceeds this",
                                allow_inf=True)
    tracking: str = setting("", "mirror each metrics row to an experiment tracker ('' = off)",
                            choices=("", *TRACKERS))
    device: str = setting("auto", "where to compute: auto (a CUDA GPU when there is one), cpu, cuda or cuda:N",
                          check=check_device_spec, form="one of auto, cpu, cuda, cuda:N")
    devices: list[str] = setting(
        [], "one process per listed device, the round's clients spread over them (runtime/distributed.py; "
        "docs/distributed.md; compare and tune: their runs dealt over them): cpu, cuda or cuda:N each, all CPUs or "
        "all GPUs; [] = one process (torchrun launches its own ranks)", check=check_devices, form="a list of cpu, cuda or cuda:N, all CPUs or all GPUs")
    collective_timeout_s: float = setting(600.0, "run.devices / torchrun: the longest a rank waits in a collective "
                                          "for the others (a rank that died stops the job after it; compare and tune: longer than "
                                          "one run)", gt=0)
    state_memory_mb: float = setting(0.0, "MiB of client states kept in memory; beyond it the least recently used "
                                     "spill to disk (RUN_DIR/client_states/) and are read back on demand (0 = keep "
                                     "all in memory)", ge=0)
    cohort: int = setting(0, "clients trained together, one forward/backward per step over the shared backbone for "
                          "methods and tasks that support it (others: one at a time); 0 = automatic (on CUDA the most "
                          "of a round's clients whose estimated peak memory fits run.gpu_memory_fraction of the free "
                          "memory, 1 on the CPU), 1 = one at a time (docs/architecture.md)", ge=0,
                          reason="0 = automatic, 1 = one client at a time, N = up to N clients together")
    gpu_memory_fraction: float = setting(0.9, "run.cohort = 0 on CUDA: the share of the device's free memory a "
                                         "cohort's estimated peak may take", gt=0, le=1)
    compile: str = setting("auto", "torch.compile the local step's network (CUDA graphs on CUDA; with "
                           "task.length_buckets each bucket compiles once for the whole run); auto = on CUDA with "
                           "length buckets when the run's planned steps per bucket repay the measured warm-up "
                           "(docs/models.md), the rule logged once; a run that cannot compile goes on eagerly, "
                           "saying so in one line", choices=("auto", "true", "false"))
    vectorized: bool = setting(False, "run every round's clients as one batched step (closed-form tasks such as "
                               "matrix-regression, methods with a batched_round: ssf, fedsub, fedavg-full); "
                               "`fedlowrank run --vectorized` sets it")


@dataclass
class TaskSection(Schema):
    """Config section ``[task]``: which task (the registry's kind), its model and options."""

    prefix = "task"

    kind: str = setting("text-classification", "the task (`fedlowrank config` of a config lists its options)",
                        choices=task_kinds)
    model: str = setting("minilm", "a bundled model name, a local Hugging Face model folder or a hub id",
                         check=check_model)
    max_length: int = setting(64, "tokens per example (longer texts are truncated; text classification pads to it)",
                              ge=2, le=MAX_TOKENS, reason="longer than any bundled model's context")
    eval_batch_size: int = setting(64, "examples per evaluation forward pass", ge=1)
    quantize: str = setting("", "QLoRA: store the frozen backbone's linear layers in 4bit (NF4) or 8bit (int8) with "
                            "bitsandbytes (extra fedlowrank[qlora]), adapters and head unquantised; '' = off. "
                            "causal-lm and text-classification, LoRA-family methods", choices=QUANTIZE_MODES)
    length_buckets: list[int] = setting([], "sequence lengths a training batch is padded to: the smallest that holds "
                                        "its longest example, task.max_length beyond the largest ([] = the longest "
                                        "example: dynamic shapes)", ge=2, check=increasing)
    options: dict[str, Any] = setting({}, "options of the task: task.options.<key> (listed below for the "
                                      "configured task)")


@dataclass
class DataSection(Schema):
    """Config section ``[data]``: where the task's data come from (the task says which keys it reads)."""

    prefix = "data"

    source: str = setting("bbc-news", "where the task's data come from (which sources and [data] keys each task.kind "
                          "reads: docs/configuration.md, Tasks)", choices=data_sources)
    path: str = setting("", "folder of a local copy of agnews (train.tsv, test.tsv) or gsm8k (train.jsonl, "
                        "test.jsonl); '' = $FEDLOWRANK_DATA/<source> when it holds them, else the hub "
                        "(fancyzhx/ag_news, openai/gsm8k)")
    train: str = setting("", "training file, .tsv, .csv or .jsonl (data.source = 'files'), or folder of images")
    test: str = setting("", "test file ('' = hold out data.test_fraction of the training file)")
    text_column: str = setting("0", "text column: an index, or a header name (a key for JSONL)")
    label_column: str = setting("1", "label column: an index, or a header name (a key for JSONL)")
    header: str = setting("auto", "whether line 1 of a .tsv/.csv is a header (docs/data.md)", choices=HEADER_MODES)
    test_fraction: float = setting(0.2, "share of the training file held out, stratified, when there is no test "
                                   "file", gt=0, lt=1)
    max_train_examples: int = setting(0, "keep at most this many training examples, seeded (0 = all)", ge=0)
    max_test_examples: int = setting(0, "keep at most this many test examples, seeded (0 = all)", ge=0)
    hf_name: str = setting("", "Hugging Face dataset name (data.source = 'hf'; needs `datasets` and a network), or "
                           "a builder such as json with data.train/data.test as its data_files")
    prompt_column: str = setting("question", "causal-lm: the prompt column (a name, a key for JSONL, or an index)")
    response_column: str = setting("answer", "causal-lm: the response column (a name, a key for JSONL, or an index)")
    validation_fraction: float = setting(0.1, "`fedlowrank tune`: share of each client's examples held out for "
                                         "validation", gt=0, lt=1)
    labels: list[str] = setting([], "text-classification: the class names, in label-id order ([] = the data's, "
                                "sorted); required when Flower nodes bring their own data (node config data-train)",
                                check=check_labels, form=LABELS_FORM)


@dataclass
class LoRASection(Schema):
    """Config section ``[lora]``: the adapters' rank(s), scale and target modules."""

    prefix = "lora"

    rank: int = setting(8, "LoRA rank r of every client (at most the adapted layers' sizes)", ge=1)
    ranks: list[int] = setting([], "per-client ranks, dealt round-robin (heterogeneous-rank methods; [] = "
                               "lora.rank)", ge=1)
    server_rank: int = setting(0, "rank of the global adapter with heterogeneous ranks (0 = max(lora.ranks))", ge=0)
    alpha: float = setting(16.0, "LoRA α: the update is scaled by α/r (α/√r with rslora)", gt=0)
    scaling: str = setting("standard", "standard (α/r) or rslora (α/√r)", choices=SCALING_RULES)
    dropout: float = setting(0.0, "dropout on the LoRA path's input", ge=0, lt=1)
    targets: list[str] | str = setting([], "peft target_modules: suffixes of the nn.Linear modules to adapt, "
                                       "\"all-linear\" or a regular expression ([] = the architecture's default)")


@dataclass
class ServerSection(Schema):
    """Config section ``[server]``: client weights and the server step."""

    prefix = "server"

    weighting: str = setting("num_examples", "client weights in aggregation", choices=("num_examples", "uniform"))
    lr: float = setting(1.0, "server step β: global ← old + β·(average − old)", gt=0)
    update_clip: float = setting(float("inf"), "bound on the L2 norm of each reply's update (what it sends minus "
                                 "what it was sent); larger updates are scaled down to it on the server (inf = off)",
                                 gt=0, allow_inf=True, reason="inf = off")
    outlier_ratio: float = setting(10.0, "reject a reply whose update's L2 norm (what it sends minus what it was "
                                   "sent) per local step exceeds this many times the median of the round's other "
                                   "replies; a round's only reply: the median of the newest earlier round's, or in "
                                   "the first round the norm of what it was sent (off under central DP; inf = off)",
                                   ge=1, allow_inf=True, reason="inf = off")
    aggregate: str = setting("mean", "how the server combines the replies of methods whose server step is a weighted "
                             "mean: mean, median or trimmed-mean (coordinate-wise; robust to a few bad clients)",
                             choices=AGGREGATES)
    trim_fraction: float = setting(0.1, "trimmed-mean: share of the largest and of the smallest values dropped per "
                                   "coordinate", ge=0, lt=0.5)
    max_examples_per_node: int = setting(0, "Flower nodes with their own data (node config data-train): the most "
                                         "examples a node's reply may weigh (0 = the largest client of the server's "
                                         "partition)", ge=0)


@dataclass
class CompareSection(Schema):
    """Config section ``[compare]``: what ``fedlowrank compare`` runs."""

    prefix = "compare"

    methods: list[str] = setting(["fedit", "fedavg-full"], "methods that `fedlowrank compare` runs",
                                 choices=method_names, check=distinct)
    seeds: list[int] = setting([0], "seeds that `fedlowrank compare` runs each method with", check=distinct)
    overrides: dict[str, list[str]] = setting({}, "per-method settings, e.g. {fedgalore = [\"train.lr=1e-4\"]}")
    tuned: str = setting("", "a tune.json from `fedlowrank tune` whose chosen values (learning rates, ...) compare "
                         "applies ('' = none)")


METHOD_NAME = Declared("name", str, Setting("the method (`fedlowrank methods`); its own options are method.OPTION",
                                            choices=method_names), "fedit")


@dataclass
class RunConfig:
    """The whole run configuration; ``cfg.<section>.<key>``, ``cfg.method_name``, ``cfg.method_options``."""

    run: RunSection = field(default_factory=RunSection)
    task: TaskSection = field(default_factory=TaskSection)
    data: DataSection = field(default_factory=DataSection)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    lora: LoRASection = field(default_factory=LoRASection)
    train: TrainConfig = field(default_factory=TrainConfig)
    server: ServerSection = field(default_factory=ServerSection)
    method: dict[str, Any] = field(default_factory=lambda: {"name": METHOD_NAME.default})
    compare: CompareSection = field(default_factory=CompareSection)
    privacy: PrivacySection = field(default_factory=PrivacySection)
    uplink: UplinkSection = field(default_factory=UplinkSection)
    downlink: DownlinkSection = field(default_factory=DownlinkSection)

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


SECTIONS: dict[str, type[Schema]] = {name: hint for name, hint in typing.get_type_hints(RunConfig).items()
                                     if name != "method"}
"""The schema of each section but ``[method]``, in order."""

MEANINGS: dict[str, str] = {f"{name}.{key}": d.meaning for name, cls in SECTIONS.items()
                            for key, d in declared(cls).items()} | {"method.name": METHOD_NAME.meaning}
"""What every ``section.key`` means (``method.name`` included; a method's own options are on its class)."""


def config_rows(cfg: RunConfig) -> list[tuple[str, Any, Declared]]:
    """Every key of ``cfg`` with its value and declaration, in section order: after ``task.options`` the
    configured task's options (``task.options.KEY``), after ``method.name`` the method's options (configured
    value or default)."""
    from ..methods import method_class
    from ..tasks import task_class

    rows: list[tuple[str, Any, Declared]] = []
    for name in (f.name for f in dataclasses.fields(RunConfig)):
        if name == "method":
            rows.append(("method.name", cfg.method_name, METHOD_NAME))
            given = cfg.method_options
            rows += [(f"method.{k}", given.get(k, d.default), d)
                     for k, d in declared(method_class(cfg.method_name)).items()]
            continue
        section = getattr(cfg, name)
        for key, d in declared(type(section)).items():
            rows.append((f"{name}.{key}", getattr(section, key), d))
            if (name, key) == ("task", "options"):
                options = task_class(cfg.task.kind).Options
                rows += [(f"task.options.{k}", cfg.task.options.get(k, o.default), o)
                         for k, o in declared(options).items()]
    return rows


def config_keys(cfg: RunConfig) -> list[tuple[str, Any]]:
    """Every ``section.key`` of ``cfg`` with its value (see :func:`config_rows`)."""
    return [(key, value) for key, value, _ in config_rows(cfg)]

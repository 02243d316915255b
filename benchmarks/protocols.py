"""The decisive protocols of the claims in docs/methods/*.md and docs/vision.md, one command each.

A protocol is: each method's learning rate tuned on a validation split of the clients' training data
(``fedlowrank tune``, on ``--tune-seeds``, the grid below or the method's paper grid, extended by up to two values
where the best sits at an edge: ``--extend 2``), then ``fedlowrank compare`` of the methods over paired seeds at
their tuned rates: per paired difference against the reference its mean with the 95 % t-interval, its median,
wins and losses, a bootstrap interval and the Wilcoxon signed-rank test, whose p < 0.05 alone gives a verdict
(docs/comparison.md). Every step writes under ``--out/<protocol>/`` (``tune/``, ``compare/``) and is resumable:
running the same command again reuses every run that ended there with the same config, so an interrupted protocol
continues, and runs made by separate processes combine. ``--records DIR`` carries the finished runs between machines
(four small files a run, sealed, e.g. kept with the docs in ``benchmarks/records``): copied from ``DIR`` into ``--out``
before, and from ``--out`` to ``DIR`` after, so a protocol longer than one machine's stay goes on elsewhere.

    python benchmarks/protocols.py --list
    python benchmarks/protocols.py rpca --out runs/protocols --jobs 2
    python benchmarks/protocols.py vision-label vision-domains --out runs/protocols --jobs 2
    python benchmarks/protocols.py ilora --smoke --out /tmp/protocols      # tiny models, 1 round: checks the script
    python benchmarks/protocols.py florg --device cuda --seeds 24 --jobs 4 --out runs/protocols
    python benchmarks/protocols.py fedalt-tasks --records benchmarks/records --out runs/protocols --jobs 2
    python benchmarks/protocols.py fedalt-tasks --records benchmarks/records --out runs/protocols --sync

Sizes: about an hour per protocol with 2 processes of 1 thread on a 2-core CPU; ``fedalt-tasks`` (SmolLM2, 12 to
16 tuning and 24 compared runs of an estimated 15–20 minutes) about 5 hours.
``--device cuda`` runs the same protocol on a GPU at a larger budget (:func:`gpu_sets`: 3× the rounds, every test
example; the clients of a round train together, ``run.cohort = 0``), tunes on seeds 0, 1, 2 and writes under
``--out/<protocol>-cuda/``; ``--seeds N`` compares on seeds 0..N−1. The IID half of FedGaLore's claim
(``galore-iid``) reuses ``galore-noniid``'s tuned rates, as the paper keeps one rate across heterogeneity levels;
FedRPCA's arms share FedIT's tuned rate, as its paper does. ``fedlease-tasks`` makes no runs: it reads the runs
``fedalt-tasks`` compared (the same methods, settings and seeds) against FedLEASE.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from common import keep_records, provenance, run_resumable  # noqa: E402

from fedlowrank.experiments.compare import (against_reference, results_markdown, run_comparison,  # noqa: E402
                                            write_report)
from fedlowrank.experiments.tune import run_tuning  # noqa: E402

# AG News, MiniLM-L6: 10 clients, all every round, 8 × 32 tokens per step, r = 4, 2,000 test examples
TEXT = ["partition.num_clients=10", "run.clients_per_round=10", "task.max_length=32", "train.batch_size=8",
        "run.eval_every=5", "data.max_test_examples=2000", "lora.rank=4", "run.threads=1"]
TEN = ["run.rounds=10", "train.local_steps=10"]
NONIID = ["partition.alpha=0.1"]
RANKS = ["lora.ranks=[2,4,8]"]  # dealt round-robin to the clients
SGD = ["train.optimizer=sgd", "train.head_lr=0"]  # plain SGD, one step size for every parameter
DOMAINS = ["partition.kind=domains", 'task.options={classes = [5, 6, 7, 8, 9], domains = ["clean", "rotate", '
           '"contrast", "blur", "noise", "invert"]}', "partition.num_clients=12",
           "run.clients_per_round=12"]
# the stand-in backbone fmnist-vit on Fashion-MNIST classes 5–9; AdamW for every method (ILoRA's AdamW columns)
VISION = ["run.rounds=20", "run.clients_per_round=10", "train.local_steps=5", "run.eval_every=10", "run.threads=1",
          "train.optimizer=adamw"]
LORA_GRID = "1e-3,3e-3,1e-2"  # the AdamW learning rates tried for LoRA-family methods unless a protocol says otherwise
# ILoRA's Table 2; FedIT with mixed ranks is its zero-padded form, HetLoRA (Table 14's "Zero-padding")
VISION_METHODS = ["ilora", "ilora-s", "hetlora", "flora", "lora-fair", "ffa-lora"]
# the task mix (data.source = task-mix), one task per client: 6 clients, 400 + 100 examples of each task, 4 rounds of
# 4 steps of 4 examples (a SmolLM2 step of ≤ 4 × 256 tokens takes about 6 s on one thread: a run should take
# 15–20 minutes with its two evaluations); every client scored on its own task's test examples (loss on the ~20 of
# each task among 60 fixed examples, exact match on the ~10 of each task among 30 fixed questions), the headline the
# mean over clients of their own-task exact match
TASKMIX = ["data.source=task-mix", "data.max_train_examples=0", "data.max_test_examples=0", "partition.kind=shards",
           "partition.partition_by=task", "partition.classes_per_client=1", "partition.num_clients=6",
           "run.clients_per_round=6", "task.max_length=256", "run.rounds=4", "train.local_steps=4",
           "train.local_epochs=0", "train.batch_size=4", "run.eval_every=4", "run.threads=1",
           "task.options={eval_examples=60, eval_generate=30, max_new_tokens=192, generation_batch_size=10, "
           "write_generations=5}", "run.stop_metric=exact_match"]
# the text protocol of the 2025–26 methods (Fed-SB, FSLoRA, FedMomentum, SDFLoRA): AG News, MiniLM-L6, 10 clients,
# 5 sampled per round, 30 rounds of 10 local steps of 8 × 32 tokens, Dirichlet α = 0.1 unless a protocol says
# otherwise; the rank comes from each protocol (compare.overrides where the methods' ranks differ)
TEXT5 = ([s for s in TEXT if not s.startswith(("run.clients_per_round", "lora.rank", "run.eval_every"))]
         + ["run.clients_per_round=5", "run.rounds=30", "train.local_steps=10", "run.eval_every=10"])
# record-level DP-SGD on every client, C = 1; Dirichlet α = 0.5 with at least 100 examples a client: at α = 0.1 the
# smallest clients hold tens of examples, and ε ≤ 3 for them would need σ ≥ 2.5. σ = 1.52 keeps every client of
# ≥ 100 examples at ε ≤ 3 (δ = 1/its examples) after 30 rounds of 10 steps of 8 examples even if it were sampled in
# every round (privacy.accountant.noise_for_epsilon(3, 8/100, 300, 1/100) = 1.512, rounded up); each run reports its
# worst client's ε
TEXT5_DP = ["partition.alpha=0.5", "partition.min_partition_size=100", "privacy.dpsgd=true", "privacy.dpsgd_clip=1",
            "privacy.dpsgd_noise=1.52"]
# FedASK's setting: BBC News (the main config), MiniLM-L6, 10 clients, 2 per round, 50 rounds of 5 local steps of 8
# examples; under DP Dirichlet α = 0.5 with at least 50 examples a client. σ = 1.59 (ε = 3) and 3.29 (ε = 1) keep
# a client of ≥ 50 examples within ε (δ = 1/its examples) for up to 20 participations (100 steps; a client is
# sampled 10 times in expectation, more than 20 with probability < 10⁻³): noise_for_epsilon(ε, 8/50, 100, 1/50) =
# 1.588 and 3.283, rounded up
BBC = ["run.clients_per_round=2", "run.rounds=50", "train.local_steps=5", "train.batch_size=8", "run.eval_every=10",
       "lora.rank=8", "run.threads=1"]
BBC_DP = ["partition.alpha=0.5", "partition.min_partition_size=50", "privacy.dpsgd=true", "privacy.dpsgd_clip=1"]
# FSLoRA's heterogeneous budgets of its code's "normal" distribution (mean 16.5, sd 31/6, rounded and clipped to
# [1, 32]) for the 10 clients, numpy.random.default_rng(42).normal(16.5, 31 / 6, 10), of a rank-32 global LoRA
FSLORA_RANKS = ["lora.ranks=[18,11,20,21,6,10,17,15,16,12]", "lora.server_rank=32"]
SMOKE_CONFIGS = {"agnews": "tiny", "gsm8k": "tiny-lm", "main": "tiny"}  # --smoke: the tiny model of each task


@dataclass(frozen=True)
class Protocol:
    """``methods`` compared on ``seeds`` after tuning; ``reference`` first unless named."""
    claim: str
    methods: list[str]
    sets: list[str]
    config: str = "agnews"
    seeds: str = "0,1,2"
    tune_seeds: str = "0"  # the validation splits the rates are chosen on (on a GPU: 0, 1, 2)
    grid: str | None = None  # None: each method's paper grid (fedlowrank methods)
    grids: dict[str, str] = field(default_factory=dict)  # per-method grid where it differs
    extend: int = 2  # tune --extend: values beyond a grid edge where the best sits
    shared_lr_from: str | None = None  # tune only this method; every method runs at its rate
    tuned_in: str | None = None  # reuse this protocol's tuning
    runs_of: str | None = None  # no runs of its own: this protocol's compared runs read against ``reference``
    reference: str | None = None


PROTOCOLS = {
    "florg": Protocol("FLoRG with Procrustes beats FLoRG without it (paper Table 3) and FedIT",
                      ["florg", "florg-no-procrustes", "fedit"], TEXT + TEN + NONIID, grid=LORA_GRID,
                      grids={"florg-no-procrustes": "3e-4,1e-3,3e-3"}, reference="florg", extend=2,
                      seeds="0,1,2,3,4,5"),  # 3 seeds left FLoRG − FedIT undecided; about 6 were estimated to decide
    # the FLoRG grid; no-Procrustes (8–27 min a run: its factor grows to r' = 384 rows) fell with the rate from
    # 1e-3 (0.318) to 3e-3 (0.253), so its grid moved one step down; its 1e-2 run was stopped after 2 rounds
    # "florg" runs each method's preset: FLoRG weights clients uniformly (eq. 4), FedIT by examples; at ρ = 0.1 the
    # weighting decides the seeds FLoRG "collapses" on (docs/methods/florg.md, "Why FLoRG collapsed on some seeds"),
    # so these two compare the methods under one weighting, each method at its rate tuned under that weighting on
    # three validation splits, not one (a decision at 24 seeds should not rest on one split's noise)
    "florg-uniform": Protocol("FLoRG vs FedIT, every client weighted 1/N (FLoRG's eq. 4) for both", ["florg", "fedit"],
                              TEXT + TEN + NONIID + ["server.weighting=uniform"], seeds="0,1,2,3,4,5",
                              grid=LORA_GRID, extend=2, tune_seeds="0,1,2", reference="florg"),
    "florg-examples": Protocol("FLoRG vs FedIT, clients weighted by their examples for both", ["florg", "fedit"],
                               TEXT + TEN + NONIID + ["server.weighting=num_examples"], seeds="0,1,2,3,4,5",
                               grid=LORA_GRID, extend=2, tune_seeds="0,1,2", reference="florg"),
    "galore-noniid": Protocol("FedGaLore's IID → non-IID drop is smaller than FedAvg-Full's and FedGaLore-'s "
                              "(α = 0.1 half)", ["fedgalore", "fedgalore-minus", "fedavg-full"], TEXT + TEN + NONIID,
                              grids={"fedgalore": "1e-5,3e-5,1e-4,3e-4,1e-3,3e-3",
                                     "fedavg-full": "1e-4,3e-4,1e-3,3e-3"},
                              extend=0),  # extended by hand before --extend existed: FedGaLore- was not (docs)
    "galore-iid": Protocol("the IID half, at the α = 0.1 tuned rates", ["fedgalore", "fedgalore-minus", "fedavg-full"],
                           TEXT + TEN + ["partition.kind=iid"], tuned_in="galore-noniid"),
    "rpca": Protocol("FedRPCA beats FedAvg (FedIT), Task Arithmetic and TIES at the same learning rate",
                     ["fedit", "fedrpca", "task-arithmetic", "ties"],
                     TEXT + NONIID + ["run.rounds=30", "train.local_steps=5", "server.weighting=uniform",
                                      "train.weight_decay=0.1",
                                      'compare.overrides={fedrpca = ["method.rpca_solver=admm"]}'],  # the paper's
                     grid="3e-4,1e-3,3e-3", shared_lr_from="fedit"),
    "ilora": Protocol("ILoRA beats FedIT+QR with client ranks {2, 4, 8}; ILoRA-S ≥ ILoRA (residual base)",
                      ["fedit-qr", "ilora", "ilora-s"], TEXT + TEN + NONIID + RANKS, seeds="0,1,2,3,4",
                      grid="3e-4,1e-3,3e-3"),
    "ilora-perclient": Protocol("the same with the per-client base W0 − s·Q0[:, :r_k]R0[:r_k]", ["ilora", "ilora-s"],
                                TEXT + TEN + NONIID + RANKS + ["method.hetero_base=per_client"], seeds="0,1,2",
                                grid="3e-4,1e-3,3e-3"),  # 3 seeds: paired with the residual base's first 3
    "ssf": Protocol("SSF beats Full-SCAFFOLD, Full-FedAvg and FedSub on a network at fewer bytes (plain SGD for all, "
                    "SSF's grid)", ["ssf", "scaffold-full", "fedavg-full", "fedsub"],
                    TEXT + TEN + NONIID + SGD, grid="1e-2,1e-1", extend=2,
                    seeds="0,1,2,3,4,5"),  # 3 seeds left Full-SCAFFOLD's 25–56-point losses "undecided"
    # one step size for every parameter, as SSF's SGD has (agnews' head_lr = 1e-2 is an AdamW setting: with it the
    # head never moved and 1e-3, 1e-2 and 1e-1 all scored 0.2575); SSF's grid {1e-4, ..., 1e-1} from its two
    # plain-SGD points up: --extend adds up to two decades (1e-3, 1e-4 or 1, 10) where the best sits at an edge
    # 30 rounds to fit a session; the grid starts at 1e-2 (at 1e-3 plain SGD left ResNet-20 untrained: train loss 2.28
    # of ln 10 = 2.30 after 30 rounds)
    "ssf-resnet": Protocol("SSF's Table 5 at CPU scale: ResNet-20 from scratch on Fashion-MNIST, 4 clients, α = 0.3",
                           ["ssf", "scaffold-full", "fedavg-full", "fedsub"],
                           ["run.rounds=30", "train.local_steps=5", "run.eval_every=10", "run.threads=1"],
                           config="resnet", grid="1e-2,3e-2,1e-1"),  # ratio 0.25: the resnet config's overrides
    "vision-label": Protocol("ILoRA's Table 2 at CPU scale, label skew (Dirichlet α = 0.3), client ranks {2, 4, 8}",
                             VISION_METHODS, VISION + RANKS + ["partition.alpha=0.3"], config="fmnist",
                             grid=LORA_GRID),
    "vision-domains": Protocol("the same under feature shift: 6 domains, one per client, 12 clients", VISION_METHODS,
                               VISION + RANKS + DOMAINS, config="fmnist", grid=LORA_GRID),
    # FedRot-LoRA's Table 1 (r = 4, Dirichlet α = 0.5): its gain over FedIT grows with the clients, +2.2 / +4.6 / +10.5
    # points at 3 / 10 / 50; the claim holds if the 50-client gain exceeds the 10-client one. The 50-client setting
    # runs at the rates tuned at 10 clients, so that only the number of clients changes between the two
    "fedrot-10": Protocol("FedRot-LoRA beats FedIT at 10 clients, Dirichlet α = 0.5", ["fedrot-lora", "fedit"],
                          TEXT + TEN + ["partition.alpha=0.5"], seeds="0,1,2,3,4,5", grid="3e-4,1e-3,3e-3",
                          reference="fedrot-lora"),
    "fedrot-50": Protocol("the same at 50 clients, 10 per round", ["fedrot-lora", "fedit"],
                          TEXT + TEN + ["partition.alpha=0.5", "partition.num_clients=50"], seeds="0,1,2,3,4,5",
                          tuned_in="fedrot-10", reference="fedrot-lora"),
    # FedSVD's claim, with and without DP. As in FedSVD's code, every method trains with plain SGD (FedSVD's and
    # FFA-LoRA's presets; FedIT's AdamW preset overridden) at one step size for every parameter (SGD, the note at ssf),
    # each at its own rate tuned on FedSVD's SGD grid. The DP half is FedSVD's own setting, record-level DP-SGD on
    # every client (its code's C = 2): σ = 0.7 keeps every client's ε at most 5.4 (at δ = 1/its examples) after
    # 10 rounds of 10 steps of 8 examples on seeds 0–5, whose smallest clients hold 155 examples. Client-level DP at
    # 10 clients is no test of the claim: at ε = 6 (central, C = 0.5) every rate tried left FedSVD and FFA-LoRA at
    # 0.24–0.32 validation accuracy, chance 0.25 (docs/methods/fedsvd.md)
    "fedsvd": Protocol("FedSVD beats FFA-LoRA and FedIT without DP (Dirichlet α = 0.5; SGD for all)",
                       ["fedsvd", "ffa-lora", "fedit"], TEXT + TEN + SGD + ["partition.alpha=0.5"],
                       grid="1e-2,3e-2,1e-1,5e-1", seeds="0,1,2,3,4,5", reference="fedsvd"),
    "fedsvd-dp": Protocol("FedSVD beats FFA-LoRA and FedIT under record-level DP-SGD at ε ≤ 6 (SGD for all)",
                          ["fedsvd", "ffa-lora", "fedit"],
                          TEXT + TEN + SGD + ["partition.alpha=0.5", "privacy.dpsgd=true", "privacy.dpsgd_clip=2",
                                              "privacy.dpsgd_noise=0.7"],
                          grid="1e-2,3e-2,1e-1,5e-1", seeds="0,1,2,3,4,5", reference="fedsvd"),
    # RAVAN at FedIT's trained parameters: MiniLM's 384×384 query/value at r = 4 train 4·(384 + 384) = 3,072 numbers
    # per target, as many as 3 heads of 32 × 32 cores (3·32²); the ranks come from compare.overrides, since the
    # protocol's own settings would override them
    "ravan-params": Protocol("RAVAN (3 heads, r = 32) vs FedIT (r = 4) at equal trained parameters, label skew α = 0.1",
                             ["ravan", "fedit"], [s for s in TEXT if not s.startswith("lora.rank")] + TEN + NONIID
                             + ['compare.overrides={fedit = ["lora.rank=4"], ravan = ["method.heads=3", '
                                '"lora.rank=32"]}'], seeds="0,1,2,3,4,5", reference="ravan"),
    # FedALT's and FedLEASE's task-level non-IID setting at CPU scale: SmolLM2-135M, 6 clients of one task each (2 per
    # task of the task mix: arithmetic word problems, GSM8K, AG News topics as instructions), all every round; equal
    # local budgets (the presets' local epochs and batch size overridden). Every method is scored on each client's
    # own task: the personalised methods by the client's own model, FedIT by its global model on that task's test
    # examples; the verdict is on the mean over clients of their own-task exact match
    "fedalt-tasks": Protocol("FedALT beats FedIT and local-only training on task-heterogeneous clients",
                             ["fedalt", "fedlease", "fedit", "local-only"], TASKMIX, config="gsm8k",
                             seeds="0,1,2,3,4,5", grid="3e-4,1e-3,3e-3", extend=2, reference="fedalt"),
    "fedlease-tasks": Protocol("FedLEASE beats FedIT and local-only training on task-heterogeneous clients",
                               ["fedlease", "fedalt", "fedit", "local-only"], TASKMIX, config="gsm8k",
                               seeds="0,1,2,3,4,5", runs_of="fedalt-tasks", reference="fedlease"),
    # Fed-SB at equal or lower uplink (arXiv:2502.15436, its Figure 1): r = 64 sends 64² = 4,096 numbers a MiniLM
    # projection, FedIT at r = 8 sends 8·(384 + 384) = 6,144 (r = 4: 3,072, less than Fed-SB's, so not a condition)
    "fed-sb-uplink": Protocol("Fed-SB (r = 64) beats FedIT at r = 8, whose uplink is 1.5× Fed-SB's",
                              ["fed-sb", "fedit"], TEXT5 + NONIID + ['compare.overrides={fedit = ["lora.rank=8"], '
                                                                     '"fed-sb" = ["lora.rank=64"]}'],
                              seeds="0,1,2,3,4,5", reference="fed-sb"),
    "fed-sb-dp": Protocol("Fed-SB (r = 32) beats FFA-LoRA (r = 8) under record-level DP-SGD at ε ≤ 3",
                          ["fed-sb", "ffa-lora"], TEXT5 + TEXT5_DP + ['compare.overrides={"ffa-lora" = ["lora.rank=8"],'
                                                                      ' "fed-sb" = ["lora.rank=32"]}'],
                          seeds="0,1,2,3,4,5", reference="fed-sb"),
    # FSLoRA against the zero-padding baseline at the same budgets: a client of budget k sends k·(in + out) numbers
    # in both, so the mean uplink is equal
    "fslora-budgets": Protocol("FSLoRA beats HetLoRA at equal heterogeneous budgets k_i ~ normal(1…32), r = 32",
                               ["fslora", "hetlora"], TEXT5 + NONIID + FSLORA_RANKS, seeds="0,1,2,3,4,5",
                               reference="fslora"),
    "fedmomentum": Protocol("FedMomentum beats FlexLoRA and FedIT (rank 4; the text protocol)",
                            ["fedmomentum", "flexlora", "fedit"], TEXT5 + NONIID + ["lora.rank=4"],
                            seeds="0,1,2,3,4,5", reference="fedmomentum"),
    # the paper's task at CPU scale: SmolLM2-135M on GSM8K, 8 IID clients, 4 a round, 10 rounds of 4 steps of 4
    "fedmomentum-gsm8k": Protocol("FedMomentum beats FlexLoRA and FedIT on GSM8K (SmolLM2-135M, 8 IID clients)",
                                  ["fedmomentum", "flexlora", "fedit"],
                                  ["partition.kind=iid", "partition.num_clients=8", "run.clients_per_round=4",
                                   "run.rounds=10", "train.local_steps=4", "run.eval_every=5", "run.threads=1",
                                   "run.stop_metric=exact_match"],
                                  config="gsm8k", seeds="0,1,2,3,4,5", grid="3e-4,1e-3,3e-3",
                                  reference="fedmomentum"),
    "fedask-dp3": Protocol("FedASK beats FFA-LoRA and FedIT at equal r under record-level DP-SGD at ε ≤ 3",
                           ["fedask", "ffa-lora", "fedit"], BBC + BBC_DP + ["privacy.dpsgd_noise=1.59"],
                           config="main", seeds="0,1,2,3,4,5", reference="fedask"),
    "fedask-dp1": Protocol("the same at ε ≤ 1", ["fedask", "ffa-lora", "fedit"],
                           BBC + BBC_DP + ["privacy.dpsgd_noise=3.29"], config="main", seeds="0,1,2,3,4,5",
                           reference="fedask"),
    "fedask": Protocol("without DP FedASK loses at most 1 point to FedIT (Dirichlet α = 0.1)",
                       ["fedask", "fedit", "ffa-lora"], BBC + NONIID, config="main", seeds="0,1,2,3,4,5",
                       reference="fedask"),
    # personalised accuracy: each client's own model (the global module with its local module, gates and head),
    # FedSA-LoRA's (shared A, own B) and FedIT's global model, all on the test set; rank 4 for the global part
    "sdflora-personal": Protocol("SDFLoRA's clients' own models beat FedIT and FedSA-LoRA (Dirichlet α = 0.1)",
                                 ["sdflora", "fedit", "fedsa-lora"], TEXT5 + NONIID + ["lora.rank=4"],
                                 seeds="0,1,2,3,4,5", reference="sdflora"),
    "sdflora-dp": Protocol("SDFLoRA (every trained tensor noised) keeps up with FedIT under DP-SGD at ε ≤ 3",
                           ["sdflora", "fedit"], TEXT5 + TEXT5_DP + ["lora.rank=4"], seeds="0,1,2,3,4,5",
                           reference="sdflora"),
}


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def gpu_sets(p: Protocol) -> list[str]:
    """The larger budget of ``--device cuda``: 3× the protocol's rounds, every test example, the clients of a round
    trained together (``run.cohort = 0``: automatic, all of them on CUDA)."""
    from fedlowrank.config import load_config

    rounds = load_config(p.config, p.sets).run.rounds
    return ["run.device=cuda", "run.cohort=0", f"run.rounds={3 * rounds}", "data.max_test_examples=0"]


def device_suffix(device: str) -> str:
    """What ``--device`` adds to a protocol's folder name: ``-cuda`` on a GPU, nothing on the CPU."""
    return "-cuda" if device == "cuda" else ""


def run_protocol(name: str, out: Path, jobs: int, smoke: bool, device: str = "cpu", seeds: int | None = None,
                 tune_seeds: str | None = None, command: str | None = None) -> dict:
    """Tune (unless reused), write the rates each method runs at, compare; returns compare's results (``command``:
    the command line, which ``report.html`` quotes)."""
    p = PROTOCOLS[name]
    if p.runs_of:
        return read_against_reference(name, out, device, seeds, command)
    config, sets, compare_seeds = (p.config, p.sets, p.seeds) if not smoke else (
        SMOKE_CONFIGS.get(p.config, p.config), p.sets + ["run.rounds=1", "train.local_steps=1"], "0,1")
    if smoke and p.config != "agnews":
        sets = sets + ["data.max_train_examples=600", "data.max_test_examples=100"]
        sets += ["task.model=tiny-vit"] if p.config == "fmnist" else []
    if smoke and p.config == "agnews":
        sets = [s for s in sets if not s.startswith(("partition.num_clients", "run.clients_per_round"))]
    suffix = device_suffix(device)
    if device == "cuda":
        sets = sets + (gpu_sets(p) if not smoke else ["run.device=cuda", "run.cohort=0"])
    tune_seeds = tune_seeds or ("0,1,2" if device == "cuda" else p.tune_seeds)
    compare_seeds = ",".join(map(str, range(seeds))) if seeds else compare_seeds
    home = out / (name + suffix)
    tune_name = "tune" if tune_seeds == "0" else "tune-seeds" + tune_seeds.replace(",", "-")
    tune_dir = out / ((p.tuned_in or name) + suffix) / tune_name
    if not p.tuned_in:
        groups: dict[str | None, list[str]] = {}  # methods sharing a grid are tuned (and extended) in one sweep
        for m in [p.shared_lr_from] if p.shared_lr_from else p.methods:
            groups.setdefault(p.grids.get(m, p.grid), []).append(m)
        for grid, methods in groups.items():
            if smoke:
                grid = ",".join((grid or "1e-3,1e-2").split(",")[:2])
            run_tuning(config, methods, grid, tune_seeds, sets, tune_dir, log, resume=True, jobs=jobs,
                       extend=p.extend)
    tuned = tune_dir / "tune.json"
    if p.tuned_in and not tuned.is_file():
        raise SystemExit(f"protocol {name} runs at the rates protocol {p.tuned_in} tuned, and {tuned} is not there: "
                         f"run protocol {p.tuned_in} first (the same --out, --device and --tune-seeds)")
    if p.shared_lr_from:
        chosen = json.loads(tuned.read_text())["chosen"][p.shared_lr_from]
        tuned = home / "shared-lr.json"
        tuned.parent.mkdir(parents=True, exist_ok=True)
        tuned.write_text(json.dumps({"chosen": {m: {**chosen, "shared_from": p.shared_lr_from} for m in p.methods}}))
    return run_comparison(config, p.methods, compare_seeds, sets, home / "compare", log, reference=p.reference,
                          tuned=tuned, resume=True, jobs=jobs, command=command)


def read_against_reference(name: str, out: Path, device: str, seeds: int | None, command: str | None = None) -> dict:
    """Protocol ``name``'s verdict from the compared runs of protocol ``runs_of`` (the same methods, settings and
    seeds) read against ``name``'s reference; writes ``results.json``, ``results.md`` and ``report.html`` (with the
    plots of ``runs_of``'s comparison) under ``--out/<name>/``."""
    p = PROTOCOLS[name]
    suffix = device_suffix(device)
    done = out / (p.runs_of + suffix) / "compare" / "results.json"
    if not done.is_file():
        raise SystemExit(f"protocol {name} reads the runs of protocol {p.runs_of} against {p.reference}, and {done} "
                         f"is not there: run protocol {p.runs_of} first (the same --out and --device)")
    results = against_reference(json.loads(done.read_text()), p.reference)
    if seeds is not None and results["seeds"] != list(range(seeds)):
        raise SystemExit(f"--seeds {seeds}: protocol {p.runs_of} compared seeds {results['seeds']} in {done.parent}; "
                         f"run it with --seeds {seeds} first")
    home = out / (name + suffix)
    home.mkdir(parents=True, exist_ok=True)
    results["command"] = command
    (home / "results.json").write_text(json.dumps(results, indent=1))
    (home / "results.md").write_text(results_markdown(results))
    write_report(home, results)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("protocols", nargs="*", help="protocol names (--list shows them)")
    ap.add_argument("--out", default="runs/protocols", help="the protocols' directory (reused on a second run)")
    ap.add_argument("--jobs", type=int, default=1, help="runs side by side (processes of run.threads = 1)")
    ap.add_argument("--list", action="store_true", help="list the protocols and their claims")
    ap.add_argument("--smoke", action="store_true", help="tiny models, 1 round, 2 seeds: checks the script runs")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the protocol at a larger budget on a GPU, clients of a round trained together, "
                    "written under OUT/NAME-cuda")
    ap.add_argument("--seeds", type=int, default=None, metavar="N",
                    help="compare on seeds 0..N-1 (default: the protocol's)")
    ap.add_argument("--tune-seeds", default=None, metavar="S",
                    help="comma-separated seeds the rates are tuned on (default: 0; 0,1,2 with --device cuda)")
    ap.add_argument("--records", default=None, metavar="DIR",
                    help="finished runs kept between machines: copied from DIR/NAME into --out before the protocols "
                    "run, and every finished run of --out copied to DIR/NAME after (also when stopped)")
    ap.add_argument("--sync", action="store_true", help="with --records: only copy the finished runs both ways")
    args = ap.parse_args(argv)
    if args.seeds is not None and args.seeds < 1:
        ap.error(f"--seeds must be >= 1, got {args.seeds}")
    if args.sync and not args.records:
        ap.error("--sync copies finished runs to and from --records DIR: give --records")
    if args.records and Path(args.records).exists() and not Path(args.records).is_dir():
        ap.error(f"--records {args.records}: not a directory (a folder of finished runs, created when absent)")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            ap.error("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False)")
    unknown = [n for n in args.protocols if n not in PROTOCOLS]
    if args.list or not args.protocols or unknown:
        if unknown:
            print(f"unknown protocol: {', '.join(unknown)}", file=sys.stderr)
        for n, p in PROTOCOLS.items():
            print(f"{n:16s} {p.claim}\n{'':16s} {p.config}: {' '.join(p.methods)}; seeds {p.seeds}; "
                  f"--set {' '.join(p.sets)}")
        return 2 if unknown else 0
    homes = list(dict.fromkeys(n + device_suffix(args.device) for name in args.protocols  # with those they read
                               for n in (PROTOCOLS[name].tuned_in or PROTOCOLS[name].runs_of, name) if n))
    if args.records:
        keep_records(Path(args.records), Path(args.out), homes, into_out=True)
    if args.sync:
        keep_records(Path(args.records), Path(args.out), homes, into_out=False)
        return 0
    print(provenance(argv))
    command = shlex.join(["python", "benchmarks/protocols.py", *(sys.argv[1:] if argv is None else argv)])
    try:
        for name in args.protocols:
            results = run_protocol(name, Path(args.out), args.jobs, args.smoke, args.device, args.seeds,
                                   args.tune_seeds, command)
            print(f"\n# Protocol {name}: {PROTOCOLS[name].claim}\n")
            print(results_markdown(results))
    finally:
        if args.records:
            keep_records(Path(args.records), Path(args.out), homes, into_out=False)
    return 0


if __name__ == "__main__":
    sys.exit(run_resumable(main))

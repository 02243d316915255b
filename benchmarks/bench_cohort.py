"""Client cohorts: round time, tokens per second, padding and peak memory of one cohort against one client at a time.

FedIT with ``--clients`` clients per round × ``--steps`` local steps of ``--batch-size`` examples, run with the same
seed one client at a time (``run.cohort = 1``) and as one cohort (``run.cohort = --clients``; ``--cohort 0`` asks
for the automatic, memory-planned size instead). ``--config main`` is MiniLM-L6 on BBC News (text
classification); ``--config gsm8k`` is SmolLM2-135M-Instruct on GSM8K (causal LM, response-only loss). For each
mode it reports the mean round time without evaluation over the rounds after the first (which compiles and builds
the cohort's model views), real (unpadded) and computed (padded) tokens per second, the padding's share of the
computed tokens, the peak device memory (CUDA) and, for the cohort, the planner's estimate of that peak
(``runtime.plan.cohort_memory``). Last, the largest difference between the two runs' global states: float
rounding without dropout; MiniLM trains with dropout 0.1, whose masks a cohort draws from its own stream.

    python benchmarks/bench_cohort.py [--config main] [--device auto] [--rounds 3] [--clients 10] [--steps 5]
        [--batch-size 16] [--dtype fp32] [--buckets ""] [--pack 0] [--compile] [--gradient-checkpointing] [--cohort N]
        [--threads 0] [--model M] [--max-length N] [--json FILE] [--set section.key=value ...]

On a GPU (see the report of branch ``gpu`` for the exact commands): SmolLM2 bf16, 32 clients × 5 steps × 4 GSM8K
examples; targets ≥ 150k real tokens/s as one cohort and a peak ≤ 12 GiB. On the CPU a joint step gains ≈ nothing.
Builds the simulator itself: it times the cohort engine round by round after a warm-up and counts its tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from common import provenance, setup_line  # noqa: E402

import torch  # noqa: E402

from fedlowrank.config import load_config  # noqa: E402
from fedlowrank.runtime.plan import cohort_memory  # noqa: E402
from fedlowrank.runtime.simulator import Simulation  # noqa: E402
from fedlowrank.tasks import build_task  # noqa: E402


class TokenCount:
    """Counts the tokens of a task's training batches: real ones (attention mask), computed ones (the padded batch
    each forward pass sees: a cohort's joined batch, or a client's own)."""

    def __init__(self, task):
        self.real = self.alone = self.joined = 0
        batch, join = task.batch, task.join_batches

        def counted_batch(indices):
            out = batch(indices)
            self.real += (int(out["attention_mask"].sum()) if "attention_mask" in out else  # packed: its examples
                          sum(len(task.train[int(i)].ids) for i in out["example_index"]))
            self.alone += out["input_ids"].numel()
            return out

        def counted_join(batches):
            joined, rows = join(batches)
            self.joined += joined["input_ids"].numel()
            return joined, rows

        task.batch, task.join_batches = counted_batch, counted_join

    def reset(self) -> None:
        self.real = self.alone = self.joined = 0


def round_seconds(sim: Simulation) -> float:
    """Mean wall time of the rounds after the first, evaluation excluded."""
    rows = sim.history[1:] or sim.history
    return sum(r["time"]["total"] - r["time"]["evaluation"] for r in rows) / len(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="main", help="main (MiniLM, BBC News) or gsm8k (SmolLM2, GSM8K)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=0, help="examples per step (0: the config's)")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--buckets", default="", help="task.length_buckets, e.g. 128,192,256,320,384")
    ap.add_argument("--pack", type=int, default=0, help="gsm8k: task.options.pack (rows of N tokens; 0: padding)")
    ap.add_argument("--compile", action="store_true", help="run.compile")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--cohort", type=int, default=-1, help="the cohort run's run.cohort (-1: --clients; 0: automatic)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--model", default="", help="task.model (default: the config's)")
    ap.add_argument("--max-length", type=int, default=0, help="task.max_length (0: the config's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="append one JSON line per mode to this file")
    ap.add_argument("--set", action="append", default=[], help="any further section.key=value (repeatable)")
    args = ap.parse_args(argv)
    sets = ["method.name=fedit", f"run.rounds={args.rounds}", f"run.eval_every={args.rounds}",
            f"partition.num_clients={args.clients}", f"run.clients_per_round={args.clients}",
            f"train.local_steps={args.steps}", f"run.device={args.device}", f"train.dtype={args.dtype}",
            f"run.threads={args.threads}", f"run.seed={args.seed}", "run.checkpoint_every=0",
            f"run.compile={str(args.compile).lower()}",
            f"train.gradient_checkpointing={str(args.gradient_checkpointing).lower()}"]
    if args.config == "gsm8k":
        sets += ["partition.kind=iid", f"task.options={{eval_examples = 8, eval_generate = 0, pack = {args.pack}}}",
                 f"data.max_train_examples={max(1000, 10 * args.clients * args.batch_size)}"]
    sets += [f"task.model={args.model}"] if args.model else []
    sets += [f"train.batch_size={args.batch_size}"] if args.batch_size else []
    sets += [f"task.max_length={args.max_length}"] if args.max_length else []
    sets += [f"task.length_buckets=[{args.buckets}]"] if args.buckets else []
    sets += args.set
    print(provenance(argv))
    task = build_task(load_config(args.config, sets))
    tokens = TokenCount(task)
    joint_cohort = args.clients if args.cohort < 0 else args.cohort
    results, sims = [], {}
    for name, cohort in (("one client at a time", 1), ("cohort", joint_cohort)):
        cfg = load_config(args.config, [*sets, f"run.cohort={cohort}"])
        sim = Simulation(cfg, task=task)
        cuda = sim.device.type == "cuda"
        size = sim.cohort_size()
        estimate = cohort_memory(cfg, task, sim.model).peak(size) if name == "cohort" else None
        sim.run_round()  # warm-up: compilation, the cohort's views
        tokens.reset()
        if cuda:
            torch.cuda.synchronize(sim.device)
            torch.cuda.reset_peak_memory_stats(sim.device)
        sim.run()
        seconds = round_seconds(sim) * (args.rounds - 1)
        computed = tokens.joined if size > 1 else tokens.alone
        row = {"mode": name, "cohort": size, "s_per_round": round_seconds(sim),
               "real_tokens_per_s": tokens.real / seconds, "computed_tokens_per_s": computed / seconds,
               "padding_share": 1 - tokens.real / max(computed, 1),
               "peak_gib": torch.cuda.max_memory_allocated(sim.device) / 2**30 if cuda else None,
               "estimated_peak_gib": estimate / 2**30 if estimate is not None else None}
        results.append(row)
        sims[name] = sim
    one, joint = sims["one client at a time"], sims["cohort"]
    diff = max(float((one.server[k] - joint.server[k]).abs().max()) for k in one.server.tensors())
    dropout = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in one.model.net.modules())
    print(setup_line(one.cfg, task))
    name = torch.cuda.get_device_name(joint.device) if joint.device.type == "cuda" else "cpu"
    print(f"device {joint.device} ({name}), dtype {args.dtype}, compile {args.compile}, buckets [{args.buckets}], "
          f"pack {args.pack}, "
          f"gradient checkpointing {args.gradient_checkpointing}; rounds 2..{args.rounds}, evaluation excluded")
    for row in results:
        memory = (f"peak {row['peak_gib']:.2f} GiB" if row["peak_gib"] is not None else "peak n/a (CPU)") + (
            f", estimated {row['estimated_peak_gib']:.2f} GiB" if row["estimated_peak_gib"] is not None else "")
        print(f"  {row['mode']:<21s} (cohort {row['cohort']:>2d}): {row['s_per_round']:8.3f} s/round, "
              f"{row['real_tokens_per_s']:10.0f} real / {row['computed_tokens_per_s']:10.0f} computed tokens/s "
              f"(padding {100 * row['padding_share']:.1f} %), {memory}")
        if args.json:
            with open(args.json, "a") as fh:
                fh.write(json.dumps({**row, "config": args.config, "dtype": args.dtype, "compile": args.compile,
                                     "buckets": args.buckets, "pack": args.pack, "clients": args.clients,
                                     "steps": args.steps,
                                     "device": name, "command": " ".join(sys.argv)}) + "\n")
    t1, tc = results[0]["s_per_round"], results[1]["s_per_round"]
    print(f"  -> speed-up {t1 / tc:.2f}x; max |global state difference| {diff:.2e} "
          f"({'dropout: different mask streams' if dropout else 'no dropout: float rounding'})")


if __name__ == "__main__":
    main()

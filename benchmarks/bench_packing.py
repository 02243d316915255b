"""Padded share of packed steps in static shapes (:class:`~fedlowrank.tasks.causal_lm.PackShapes`) against
packing without static shapes and against padding without packing, on the packaged problems.

For each data set (GSM8K from ``$FEDLOWRANK_DATA/gsm8k`` and the packaged arithmetic problems, SmolLM2's tokenizer
and chat template), ``--steps`` steps of ``--cohort`` members × ``--batch`` random training examples each: the
padded tokens over all tokens, the shapes used, and the share of steps that needed the bound (the last shape).
No model runs: only the layouts.

    python benchmarks/bench_packing.py [--cohort 32] [--batch 4] [--pack 768] [--buckets 512,640,768]
"""

from __future__ import annotations

import argparse
import collections
import json

import numpy as np

from fedlowrank.models.bundled import smollm2_tokenizer
from fedlowrank.tasks.causal_lm import PackShapes, encode_example, pack_rows
from fedlowrank.tasks.instructions import load_arithmetic, load_gsm8k


def measure(lengths: list[int], cohort: int, batch: int, capacity: int, buckets: list[int], steps: int) -> dict:
    shapes = PackShapes.of(lengths, capacity, buckets)
    rng = np.random.default_rng(0)
    real = static = dynamic = padded = 0
    used: collections.Counter = collections.Counter()
    for _ in range(steps):
        members = [rng.choice(len(lengths), batch, replace=False) for _ in range(cohort)]
        step = [lengths[i] for m in members for i in m]
        real += sum(step)
        _, width, count = shapes.layout(step)
        static += width * count
        used[f"{count}x{width}"] += 1
        rows = pack_rows(step, capacity)
        dynamic += len(rows) * max(sum(step[i] for i in row) for row in rows)
        padded += len(members) * batch * max(step)
    return {"examples": len(lengths), "mean_length": round(float(np.mean(lengths)), 1), "cohort": cohort,
            "batch": batch, "pack": capacity, "buckets": buckets,
            "shapes": shapes.shapes(cohort * batch), "used": dict(used),
            "padded_share_static": round(1 - real / static, 4), "padded_share_packed": round(1 - real / dynamic, 4),
            "padded_share_unpacked": round(1 - real / padded, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cohort", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--pack", type=int, default=768)
    ap.add_argument("--buckets", default="512,640,768")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    tok = smollm2_tokenizer()
    buckets = [int(b) for b in args.buckets.split(",")]
    for name, data in (("gsm8k", load_gsm8k()), ("arithmetic", load_arithmetic())):
        lengths = [len(encode_example(tok, p, r, args.max_length).ids)
                   for p, r in zip(data.train_prompts, data.train_responses)]
        for cohort in args.cohort:
            print(json.dumps({"data": name, **measure(lengths, cohort, args.batch, args.pack, buckets,
                                                      args.steps)}), flush=True)


if __name__ == "__main__":
    main()

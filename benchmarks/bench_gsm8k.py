"""SmolLM2-135M-Instruct on GSM8K: base model vs federated LoRA tuning, and our client step vs plain peft + torch.

1. Base model: held-out loss/perplexity on the answers of ``--eval-examples`` test questions and exact match of
   the final number of greedy answers to ``--questions`` test questions (chat template, ``--max-new-tokens``).
2. Federated tuning from the bundled ``gsm8k`` config (clusters partition, ``--clients`` clients,
   ``--per-round`` per round, ``--rounds`` rounds of ``--steps`` local steps) with each of ``--methods``
   (default FedIT, FLoRG, FedGaLore and ILoRA with mixed client ranks ``--ilora-ranks``), then the same metrics.
3. Step time per token: FedIT's client step (``method.train``, i.e. our LocalTrainer) against a plain
   ``peft`` + ``torch.optim.AdamW`` loop, both LoRA r = 8 on q_proj/v_proj, on the same batch.

    python benchmarks/bench_gsm8k.py [--questions 200] [--rounds 10] [--threads 2] [--smoke]

``--smoke`` runs a seconds-to-minutes version (2 questions, 1 round, 1 step, 16 new tokens) to check the script.
A 135M model gains little on GSM8K: the held-out loss separates methods better than exact match does.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import Grid, provenance, run_resumable, sweep_options  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fedlowrank.config import load_config  # noqa: E402


def versions() -> str:
    import peft
    import transformers

    return f"transformers {transformers.__version__}, peft {peft.__version__}"


def task_sets(args) -> list[str]:
    opts = (f"{{ eval_examples = {args.eval_examples}, eval_generate = {args.questions}, "
            f"max_new_tokens = {args.max_new_tokens}, generation_batch_size = 8, write_generations = 5 }}")
    return [f"task.model={args.model}", f"task.options={opts}", f"run.threads={args.threads}", f"data.max_train_examples={args.train_examples}",
            f"partition.num_clients={args.clients}", f"run.clients_per_round={args.per_round}",
            f"run.rounds={args.rounds}", f"run.eval_every={args.rounds}", f"train.local_steps={args.steps}",
            f"train.batch_size={args.batch_size}", "run.checkpoint_every=0", f"run.seed={args.seed}"]


def method_sets(name: str, args) -> list[str]:
    if name == "ilora":
        ranks = "[" + ",".join(args.ilora_ranks.split(",")) + "]"
        return ["method.name=ilora", f"lora.ranks={ranks}"]
    return [f"method.name={name}"]


def fmt(m: dict) -> str:
    return (f"loss {m['loss']:.4f}  perplexity {m['perplexity']:.2f}  "
            f"exact match {m.get('exact_match', float('nan')):.4f}")


class FixedBatch:
    """A task whose every batch is ``batch`` (so that both loops time the same tokens)."""

    def __init__(self, task, batch):
        self.task, self.fixed = task, batch

    def batch(self, indices):
        return self.fixed

    def loss(self, net, batch):
        return self.task.loss(net, batch)


def step_time(task, cfg, steps: int, repeats: int) -> None:
    """Seconds per token of FedIT's client step and of a plain peft + torch loop on one batch of 4 examples, timed
    alternately ``repeats`` times (``steps`` steps each)."""
    from peft import LoraConfig, get_peft_model

    from fedlowrank.methods import get_method
    from fedlowrank.runtime.engine import setup_info
    from fedlowrank.training.local import LocalTrainer

    batch = task.batch(np.arange(cfg.train.batch_size))
    tokens = int(batch["attention_mask"].sum())
    # ours: FedIT's client step (load the message, LocalTrainer.fit, reply)
    model = task.build_model()
    method = get_method("fedit")
    server = method.setup(model, setup_info(cfg, [len(task.train)] * cfg.partition.num_clients))
    fixed = FixedBatch(task, batch)

    def ours(n: int) -> float:
        trainer = LocalTrainer(fixed, np.arange(len(task.train)), dataclasses.replace(cfg.train, local_steps=n), 0, 1,
                               cfg.run.rounds, cfg.run.seed)
        t0 = time.perf_counter()
        method.train(model, method.broadcast(server, 0, 1), method.init_client(0), trainer)
        return (time.perf_counter() - t0) / n

    # plain peft + torch on the same batch
    net = get_peft_model(copy.deepcopy(task.loaded.net),
                         LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, target_modules=["q_proj", "v_proj"],
                                    lora_dropout=0.0))
    net.train()
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=cfg.train.lr)

    def peft(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            net(**batch).loss.backward()  # transformers' own loss: every position's logits, mean over the labels
            opt.step()
        return (time.perf_counter() - t0) / n

    ours(1), peft(1)  # warm-up
    pairs = [(ours(steps), peft(steps)) for _ in range(repeats)]  # alternated, so load changes hit both alike
    ours_s, peft_s = (float(np.median([p[i] for p in pairs])) for i in (0, 1))
    ratios = [o / p for o, p in pairs]
    print(f"step time, batch {cfg.train.batch_size} × {batch['input_ids'].shape[1]} ({tokens} tokens), "
          f"{repeats} alternated repeats of {steps} steps each after a warm-up (medians):")
    print(f"  fedlowrank FedIT client step: {ours_s:.3f} s/step = {1e3 * ours_s / tokens:.2f} ms/token")
    print(f"  plain peft + torch AdamW:     {peft_s:.3f} s/step = {1e3 * peft_s / tokens:.2f} ms/token")
    print(f"  ratio ours / peft: median {float(np.median(ratios)):.3f}, range {min(ratios):.3f}–{max(ratios):.3f} "
          f"(target <= 1.1)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="task.model (tiny-llama for a quick check)")
    p.add_argument("--questions", type=int, default=200, help="test questions for exact match")
    p.add_argument("--eval-examples", type=int, default=200, help="test answers for loss/perplexity")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--train-examples", type=int, default=2000, help="GSM8K training questions used")
    p.add_argument("--clients", type=int, default=5)
    p.add_argument("--per-round", type=int, default=2)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=5, help="local steps per round")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--methods", default="fedit,florg,fedgalore,ilora")
    p.add_argument("--ilora-ranks", default="4,8,16", help="ILoRA's client ranks, dealt round-robin")
    p.add_argument("--step-steps", type=int, default=5, help="steps timed in the step-time comparison")
    p.add_argument("--step-repeats", type=int, default=5, help="alternated repeats of the step-time comparison")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-base", action="store_true")
    p.add_argument("--skip-methods", action="store_true")
    p.add_argument("--skip-step-time", action="store_true")
    p.add_argument("--smoke", action="store_true", help="2 questions, 1 round of 1 step, 16 new tokens")
    sweep_options(p)
    args = p.parse_args()
    if args.smoke:
        args.questions, args.eval_examples, args.max_new_tokens, args.train_examples = 2, 4, 16, 400
        args.rounds, args.steps, args.step_steps, args.per_round = 1, 1, 1, 2
    torch.set_num_threads(args.threads)
    print(provenance())
    print(versions())
    t0 = time.perf_counter()
    cfg = load_config("gsm8k", task_sets(args))
    grid = Grid(args, metric="loss")
    task = grid.task(cfg)  # the methods' runs in this process share it
    print(f"load: task built ({args.model} loaded, {task.num_train} training examples tokenised) in "
          f"{time.perf_counter() - t0:.1f} s; {json.dumps(task.describe()['truncation'])}")
    results = {}
    if not args.skip_base:
        t0 = time.perf_counter()
        base = task.evaluate(task.build_model().net)
        results["base"] = base
        print(f"base {args.model}: {fmt(base)}  ({time.perf_counter() - t0:.0f} s)")
    if not args.skip_methods:
        names = args.methods.split(",")
        for name in names:
            grid.add(name, load_config("gsm8k", [*task_sets(args), *method_sets(name, args)]))

        def done(i: int, outcome) -> None:
            summary = results[names[i]] = outcome.summary
            print(f"{names[i]:10s} after {args.rounds} rounds: {fmt(summary)}  up {summary['bytes_up'] / 1e6:.2f} MB  "
                  f"({grid.seconds(outcome):.0f} s; ranks {grid.runs[i].cfg.client_ranks()})", flush=True)

        grid.run(done)
    if not args.skip_step_time:
        step_time(task, cfg, args.step_steps, args.step_repeats)
    print("results: " + json.dumps({k: {m: v[m] for m in ("loss", "perplexity", "exact_match") if m in v}
                                    for k, v in results.items()}))


if __name__ == "__main__":
    sys.exit(run_resumable(main))

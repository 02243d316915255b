"""Framework overhead and memory of the simulator (targets below), and what a local step costs.

1. Overhead: FedIT on MiniLM (BBC News, 10 clients, 5 per round, 5 local steps, 10 rounds). Everything that
   is not forward/backward/optimizer steps, aggregation or evaluation ("other") as a share of wall time.
   Target ≤ 5 %.
2. Memory: AG News (10,001 examples), ``--clients`` clients (100), ``--per-round`` per round (10), a stateful
   method (SCAFFOLD: a control variate per client). Peak RSS against base model + activations + the client
   states held in memory (all of them, or at most ``--state-memory-mb`` with spilling to disk) + 300 MB.
   Target: within that bound; for 1,000 clients also within 2 GB. Builds the simulator itself: it reads the
   memory between rounds and the client store's states.

3. Step (``--step``; the GPU path's figures that a CPU can give, on tiny-llama in seconds): host reads
   (``aten::item``) and dispatched operations of our FedIT client step against a plain peft + torch step on the
   same batch (torch's per-tensor optimizer loop and CUDA's fused kernel); the operations of a cohort's joint step
   of 8 members against 1; the cohort memory planner's estimate against the measured step peak (1, 2 and 4
   members; fp32, bf16, gradient checkpointing); and the padding share of GSM8K training steps padded, bucketed and
   packed, one client and cohorts of 8 and 32 (``--padding-model``'s tokenizer; smollm2-135m needs its asset).
   Measures the client step and the cohort engine themselves, on the simulator's model and task.

    python benchmarks/bench_overhead.py [--rounds 10] [--threads 2] [--skip-overhead] [--skip-memory]
    python benchmarks/bench_overhead.py --skip-overhead --skip-memory --step [--padding-model smollm2-135m] \
        [--set data.path=DIR]    # a local GSM8K copy (else $FEDLOWRANK_DATA/gsm8k or the hub)
    python benchmarks/bench_overhead.py --skip-overhead --clients 1000 --per-round 10 --memory-rounds 2 \
        --state-memory-mb 64 --model tiny-bert --partition iid    # reduced 1,000-client run (full: --model minilm)
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from common import provenance  # noqa: E402

import fedlowrank  # noqa: E402
from fedlowrank.config import load_config  # noqa: E402
from fedlowrank.runtime.simulator import Simulation, peak_rss_mb  # noqa: E402
from fedlowrank.runtime.store import state_bytes  # noqa: E402


def overhead(rounds: int, threads: int) -> None:
    summary = fedlowrank.run("main", ["method.name=fedit", f"run.rounds={rounds}", "run.eval_every=5",
                                      f"run.threads={threads}"])
    t = summary["time"]
    print(f"overhead: FedIT MiniLM BBC News, 10 clients, 5/round, 5 steps, {rounds} rounds, seed 0")
    for k in ("client_compute", "aggregation", "evaluation", "other", "total"):
        print(f"  {k:15s} {t[k]:8.2f} s  ({100 * t[k] / t['total']:5.2f} %)")
    print(f"  -> framework overhead = {100 * t['other'] / t['total']:.2f} % of wall time (target <= 5 %); "
          f"final accuracy {summary.get('accuracy', float('nan')):.4f}")


def memory(threads: int, clients: int = 100, per_round: int = 10, rounds: int = 12, state_memory_mb: float = 0.0,
           model: str = "minilm", partition: str = "dirichlet") -> None:
    cfg = load_config("main", ["method.name=scaffold", f"run.rounds={rounds}", "run.eval_every=1000000",
                               f"partition.num_clients={clients}", "data.source=agnews", "data.max_test_examples=200",
                               "partition.min_partition_size=5", f"run.clients_per_round={per_round}",
                               "train.local_steps=1", f"run.threads={threads}", f"task.model={model}",
                               f"run.state_memory_mb={state_memory_mb}",
                               f"partition.kind={partition}"])
    sim = Simulation(cfg)
    loaded = peak_rss_mb()
    sim.run_round()
    with_activations = peak_rss_mb()  # model + data + one round's activations, optimizer state and messages
    sim.run()
    store = sim.store
    state_mb = max(state_bytes(store[k]) for k in store) / 2**20
    held_mb = store.memory_bytes / 2**20
    peak = peak_rss_mb()
    bound = with_activations + (min(len(store) * state_mb, state_memory_mb) if state_memory_mb else
                                len(store) * state_mb) + 300
    print(f"memory: SCAFFOLD {model}, AG News, {clients} clients, {per_round}/round, {rounds} rounds "
          f"({len(store)} clients hold state; {len(store.spilled_files())} spilled to disk, {held_mb:.1f} MB in "
          f"memory; run.state_memory_mb = {state_memory_mb:g})")
    print(f"  peak RSS after model + data load {loaded:.0f} MB; after round 1 (+ activations) {with_activations:.0f} MB; "
          f"one client's state {state_mb:.2f} MB; peak RSS after {rounds} rounds {peak:.0f} MB; "
          f"{sum(r['time']['total'] for r in sim.history) / len(sim.history):.2f} s per round")
    print(f"  bound = base model + activations + states in memory + 300 MB = {bound:.0f} MB -> "
          f"{'within' if peak <= bound else 'ABOVE'}; 2 GB -> {'within' if peak <= 2048 else 'ABOVE'}")


def plain_peft_step(task, batch, fused: bool):
    """A plain peft + torch step on ``batch``: LoRA r = 2 on q/v, the model's own loss, clipping, AdamW."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    net = get_peft_model(copy.deepcopy(task.loaded.net), LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                                                                  target_modules=["q_proj", "v_proj"])).train()
    trained = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-3, **({"fused": True} if fused else {}))

    def step():
        opt.zero_grad(set_to_none=True)
        net(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
    return step


def step_costs(padding_model: str, sets: list[str]) -> None:
    import numpy as np
    import torch

    from fedlowrank.execution import measure
    from fedlowrank.runtime import cohort
    from fedlowrank.runtime.cohort import Joint
    from fedlowrank.runtime.plan import cohort_memory
    from fedlowrank.tasks import build_task
    from fedlowrank.tasks.base import padded_length
    from fedlowrank.tasks.causal_lm import pack_rows
    from fedlowrank.training import local
    from fedlowrank.training.local import Alone, Fit, LocalSteps, LocalTrainer, MemberFit

    def simulation(*extra):
        return Simulation(load_config("tiny-lm", ["task.options.eval_generate=0", *sets, *extra]))

    def fit_run(sim, client=0, model=None):
        model = model or sim.model
        sim.method.load_global(model, sim.server)
        params = sim.method.trainable(model, ("A", "B"))
        model.set_trainable(params)
        trainer = LocalTrainer(sim.task, sim.parts[client % len(sim.parts)], sim.cfg.train, client, 1, 2, 0)
        return MemberFit(trainer, Fit(model, params))

    def joint(sim, size, batch=None):
        members = [fit_run(sim, k, sim.model.shared_copy()) for k in range(size)]
        if batch is not None:
            for m in members:
                m.batches = iter([batch] * 3)
        return LocalSteps(members, Joint(sim.model, members, seed=0))

    print("step: tiny-llama (tiny-lm config), FedIT r = 2 on q/v, batch 4, seed 0; torch profiler on the CPU")
    for kernel in ("loop", "fused"):
        local.optimizer_kernel = cohort.optimizer_kernel = lambda d, k=kernel: k
        sim = simulation("train.max_grad_norm=1.0")
        run = fit_run(sim)
        batch = sim.task.batch(sim.parts[0][:4])
        run.batches = iter([batch] * 2)
        alone = LocalSteps([run], Alone(run))
        ours = measure.dispatched_ops(lambda: alone.step(0))
        plain = measure.dispatched_ops(plain_peft_step(sim.task, batch, kernel == "fused"))
        ops = [sum(v for k, v in c.items() if k.startswith("aten::")) for c in (ours, plain)]
        print(f"  optimizer kernel {kernel:5s}, clipping: host reads (aten::item) ours {ours['aten::item']}, plain "
              f"peft {plain['aten::item']}; dispatched aten ops ours {ops[0]}, plain peft {ops[1]} "
              f"({ops[0] / ops[1]:.2f}x)")
    sim = simulation()
    totals = {}
    for size in (1, 8):
        fit = joint(sim, size)
        counts = measure.dispatched_ops(lambda: fit.step(0))
        totals[size] = sum(v for k, v in counts.items() if k.startswith("aten::"))
    print(f"  cohort joint step (fused kernel): {totals[1]} aten ops with 1 member, {totals[8]} with 8 "
          f"({totals[8] / totals[1]:.2f}x), {counts['Optimizer.step#AdamW.step']} optimizer step")
    for extra in ([], ["train.dtype=bf16"], ["train.gradient_checkpointing=true"]):
        sim = simulation(*extra)
        memory = cohort_memory(sim.cfg, sim.task, sim.model)
        longest = np.argsort([-len(e.ids) for e in sim.task.train], kind="stable")[:sim.cfg.train.batch_size]
        line = []
        for size in (1, 2, 4):
            fit = joint(sim, size, sim.task.batch(longest))
            fit.step(0)
            measured = measure.measured_peak_bytes(lambda: fit.step(1), torch.device("cpu"))
            line.append(f"{size}: {memory.step(size) / 2**20:.2f} / {measured / 2**20:.2f} MiB")
        print(f"  planner, estimated / measured step peak ({' '.join(extra) or 'fp32'}): " + "; ".join(line))
    task = build_task(load_config("gsm8k", ["partition.kind=iid", "data.max_train_examples=3000",
                                            f"task.model={padding_model}", *sets]))
    lengths = [len(e.ids) for e in task.train]
    rng = np.random.default_rng(0)
    buckets = list(range(64, task.max_length + 1, 64))
    print(f"  GSM8K padding share of computed tokens ({padding_model}'s tokenizer, {len(lengths)} training "
          f"examples, task.max_length {task.max_length}, steps of 4 examples, 300 draws, seed 0):")
    for clients in (1, 8, 32):
        shares = {}
        for name, capacity, buckets_ in (("padded", 0, []), ("buckets of 64", 0, buckets), ("packed 768", 768, []),
                                         ("packed 1024", 1024, [])):
            real = computed = 0
            for _ in range(300):
                items = [lengths[i] for i in rng.choice(len(lengths), 4 * clients)]
                real += sum(items)
                if capacity:
                    rows = pack_rows(items, capacity)
                    computed += len(rows) * max(sum(items[i] for i in row) for row in rows)
                else:
                    computed += len(items) * padded_length(max(items), buckets_, task.max_length)
            shares[name] = 100 * (1 - real / computed)
        print(f"    {clients:>2d} client(s): " + ", ".join(f"{k} {v:.1f} %" for k, v in shares.items()))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--clients", type=int, default=100, help="memory part: number of clients")
    ap.add_argument("--per-round", type=int, default=10, help="memory part: clients per round")
    ap.add_argument("--memory-rounds", type=int, default=12, help="memory part: rounds")
    ap.add_argument("--state-memory-mb", type=float, default=0.0,
                    help="memory part: run.state_memory_mb (0 = every client state in memory)")
    ap.add_argument("--model", default="minilm", help="memory part: task.model (minilm, tiny-bert)")
    ap.add_argument("--step", action="store_true", help="part 3: what a local step costs (CPU, tiny-llama)")
    ap.add_argument("--padding-model", default="tiny-llama", help="part 3: the tokenizer of the padding shares")
    ap.add_argument("--set", action="append", default=[], help="part 3: more section.key=value (data.path)")
    ap.add_argument("--partition", default="dirichlet", help="memory part: partition.kind (iid for 1,000 clients: "
                    "a Dirichlet draw rarely gives 1,000 clients of AG News 5 examples each)")
    args = ap.parse_args()
    print(provenance())
    if not args.skip_overhead:
        overhead(args.rounds, args.threads)
    if not args.skip_memory:
        memory(args.threads, args.clients, args.per_round, args.memory_rounds, args.state_memory_mb, args.model,
               args.partition)
    if args.step:
        step_costs(args.padding_model, args.set)
    print(provenance().splitlines()[1] + " (at the end)")

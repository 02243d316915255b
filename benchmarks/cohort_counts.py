"""What a cohort's round dispatches on the CPU, per joint step and per member outside the steps.

FedIT (LoRA r = 2 on q_proj/v_proj: 60 targets, 120 factors per member on SmolLM2's 30 layers) on short
instruction pairs (a few byte tokens each, so that the CPU runs K = 32 in seconds: the counts do not depend on the
tokens, the time does), ``--steps`` local steps of ``--batch`` examples per client, one cohort of K clients
(``run.cohort = K``, its examples packed together into rows of 2 × ``task.max_length`` as a run does; K = 1 is one
client alone), ``train.dtype`` bf16 by default, per-member clipping (``train.max_grad_norm = 1``). One round warms up, the next is
profiled (the torch profiler over every thread). Printed for each K:

* ``step_ops``: top-level aten operations inside one joint step (``fedlowrank.local_step``: forward, loss,
  backward, clipping, corrections, optimizer), a multi-tensor optimizer kernel counted once;
* ``member_ops``: top-level aten operations of the round outside the steps (broadcast, wire, load, reply, checks,
  aggregation), per member;
* ``member_reads``: scalar reads of tensors (``aten::_local_scalar_dense``) outside the steps, per member;
* ``member_moves``: calls of fedlowrank's code in the clients' updates outside their steps that would move a
  tensor between host and device on CUDA (``.to(device)``, ``.cpu()``, ``pin_memory``, ``copy_`` into the model),
  per member (:func:`fedlowrank.execution.measure.client_transfers`);
* ``saved_kb``: with ``--saved``, the activations one joint step's forward saves for its backward
  (``torch.autograd.graph.saved_tensors_hooks``, each storage once, the model's parameters and the stacked factors
  left out), in KB per position (the joined batch's tokens) per decoder layer;
* ``peft_ops``: with ``--peft``, the same count for a plain peft step (``get_peft_model`` r = 2 on q/v, its own
  loss, clipping, AdamW) on one client's batch, the K = 1 reference.

    PYTHONPATH=src python benchmarks/cohort_counts.py --sizes 1,2,8,32 --peft
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from common import provenance  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from fedlowrank.config import load_config  # noqa: E402
from fedlowrank.execution.measure import client_transfers  # noqa: E402
from fedlowrank.runtime.plan import packs_cohorts  # noqa: E402
from fedlowrank.runtime.simulator import Simulation  # noqa: E402
from fedlowrank.tasks import build_task  # noqa: E402

LOCAL_STEP = "fedlowrank.local_step"
READ = "aten::_local_scalar_dense"


def pairs(folder: Path, count: int) -> list[str]:
    """``count`` short prompt/response pairs as train/test jsonl files in ``folder``; the config lines."""
    rows = [{"prompt": f"q{i} " + "w " * (i % 3), "completion": f"a{i} #### {i}"} for i in range(count + 4)]
    for split, part in (("train", rows[:count]), ("test", rows[count:])):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    return ["data.source=files", f"data.train={folder / 'train.jsonl'}", f"data.test={folder / 'test.jsonl'}",
            "data.prompt_column=prompt", "data.response_column=completion", "data.max_train_examples=0"]


def config(args, k: int, data: list[str]):
    return load_config("tiny-lm", [*data, f"task.model={args.model}", f"train.dtype={args.dtype}",
                                   f"method.name={args.method}", "partition.kind=iid", f"partition.num_clients={k}",
                                   f"run.clients_per_round={k}", f"run.cohort={k}", f"train.local_steps={args.steps}",
                                   f"train.batch_size={args.batch}", "partition.min_partition_size=1",
                                   "train.max_grad_norm=1.0", "run.rounds=3", "run.eval_every=100",
                                   "run.checkpoint_every=0", "task.max_length=64",
                                   "task.options.eval_generate=0", "task.options.eval_examples=1",
                                   *args.set])


def inside(event, name: str) -> bool:
    while event is not None:
        if event.name == name:
            return True
        event = event.cpu_parent
    return False


def top_level(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(("aten::", "Optimizer.step")):
            return False
        parent = parent.cpu_parent
    return True


def round_counts(sim: Simulation, k: int) -> dict:
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    moves = {}
    with profile(activities=[ProfilerActivity.CPU],
                 experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        t0 = time.perf_counter()
        moves = client_transfers(sim.run_round)
        seconds = time.perf_counter() - t0
    steps = outside = reads = step_ops = 0
    for e in prof.events():
        if e.name == LOCAL_STEP:
            steps += 1
            continue
        if not (e.name.startswith("aten::") or e.name.startswith("Optimizer.step")):
            continue
        step = inside(e, LOCAL_STEP)
        if not step and e.name == READ:
            reads += 1
        if not top_level(e):
            continue
        if step:
            step_ops += 1
        else:
            outside += 1
    return {"K": k, "steps": steps, "step_ops": round(step_ops / max(steps, 1)), "member_ops": round(outside / k),
            "member_reads": round(reads / k, 1), "member_moves": round(moves["moves"] / k, 1),
            "round_s": round(seconds, 2)}


def saved_kb(sim: Simulation, k: int) -> float:
    """KB saved for the backward per position per decoder layer by one joint step of ``k`` members (``saved_kb``)."""
    from fedlowrank.message import State
    from fedlowrank.runtime.cohort import Cohort, Joint, cohort_members
    from fedlowrank.training.local import LocalSteps

    clients = list(range(k))
    cohort = Cohort(sim.model, k)
    members = cohort_members(sim.method, cohort, [sim.method.broadcast(sim.server, c, 1) for c in clients],
                             [State() for _ in clients], sim.task, [sim.parts[c] for c in clients], sim.cfg, clients,
                             1, sim.training_plan())
    steps = LocalSteps(members, Joint(cohort, members, seed=0))
    inputs = steps.group.stage(clients)
    kept = {p.untyped_storage().data_ptr() for p in (*sim.model.parameters(), *cohort.stacks.groups.values())}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in kept:
            seen[ptr] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        steps.group.forward_backward(clients, inputs)
    positions = inputs[1]["input_ids"].numel()
    return sum(seen.values()) / positions / sim.model.net.config.num_hidden_layers / 1000


def peft_ops(args, data: list[str]) -> int:
    """Top-level aten ops of one plain peft step (after a warm-up step) on one client's batch."""
    from peft import LoraConfig, get_peft_model
    from torch.profiler import ProfilerActivity, profile

    cfg = config(args, 1, data)
    task = build_task(cfg)
    net = copy.deepcopy(task.loaded.net).to(torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    net = get_peft_model(net, LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                                         target_modules=["q_proj", "v_proj"])).train()
    trained = [p for p in net.parameters() if p.requires_grad]
    for p in trained:
        p.data = p.data.float()
    opt = torch.optim.AdamW(trained, lr=1e-3)
    batch = task.batch(list(range(args.batch)))
    batch = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "labels")}

    def step():
        opt.zero_grad(set_to_none=True)
        net(**batch).loss.backward()
        nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sum(1 for e in prof.events() if (e.name.startswith("aten::") or e.name.startswith("Optimizer.step"))
               and top_level(e))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,2,8,32")
    p.add_argument("--model", default="arch:smollm2-135m")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--method", default="fedit")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--peft", action="store_true")
    p.add_argument("--saved", action="store_true")
    p.add_argument("--set", action="append", default=[])
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(provenance(argv))
    with tempfile.TemporaryDirectory() as folder:
        sizes = [int(s) for s in args.sizes.split(",")]
        data = pairs(Path(folder), max(sizes) * args.batch * args.steps)
        tasks = {}
        for k in sizes:
            cfg = config(args, k, data)
            packs = packs_cohorts(cfg)  # as a run builds it: a cohort's examples packed together
            if packs not in tasks:
                tasks[packs] = build_task(cfg, cohorts=packs)
            sim = Simulation(cfg, task=tasks[packs])
            sim.run_round()
            row = round_counts(sim, k)
            if args.saved and k > 1:
                row["saved_kb"] = round(saved_kb(sim, k), 2)
            print(json.dumps(row), flush=True)
        if args.peft:
            print(json.dumps({"peft_ops": peft_ops(args, data)}))


if __name__ == "__main__":
    main()

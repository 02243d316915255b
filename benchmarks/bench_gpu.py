"""LLM federated fine-tuning speed and memory on one GPU.

FedIT (LoRA r = 8 on q_proj/v_proj, AdamW) on GSM8K with a random-weight architecture (``arch:``: speed and memory
only, no quality figure), ``--clients`` clients × ``--steps`` local steps × ``--batch`` examples per round, in three
modes over the same clients and minibatches:

* ``cohort``: the round's clients as one cohort (``run.cohort = clients``: one forward/backward per step);
* ``one``: one client at a time (``run.cohort = 1``); ``one-compiled`` adds ``run.compile`` over ``--buckets``;
* ``peft``: a plain peft + torch loop (``get_peft_model`` on the same backbone stored in ``train.dtype``, peft's
  fp32 adapters, a fresh AdamW per client (fused on CUDA), the same batches, transformers' own loss), the reference
  "one at a time" is measured against.

Each figure is a JSON line (``--out``/bench_gpu.jsonl and stdout) and a row of a Markdown table
(``--out``/bench_gpu.md): round seconds (mean over the rounds after the first, evaluation excluded), tokens/s real
(attention-mask ones) and padded (positions computed, a cohort's joint padding included), MFU = 4·N·real tokens/s
÷ the measured dense matmul peak of the dtype (N = the parameters that multiply each token: every weight but the
input embeddings, the tied output layer counted once; 2N forward, 2N backward to the activations, frozen weights
get no gradient; attention scores left out), peak memory (CUDA: ``max_memory_allocated``; CPU: the rise of the
process's peak RSS over the round) beside the runtime's own estimate
(:func:`fedlowrank.runtime.plan.cohort_memory`, which sizes ``run.cohort = 0``: the planned peak on CUDA, what a
step allocates on the CPU; none for plain peft), and from one profiled extra round
the dispatched aten ops, scalar reads, host syncs (CUDA runtime calls that wait), host-to-device copies, CUDA kernel
launches and CUDA-graph replays per client step (:func:`event_counts`).

On a GPU (the targets are set for an H100)::

    python benchmarks/bench_gpu.py --models smollm2-135m --dtypes bf16,fp32 --tokenizer TOKDIR --out OUT
    python benchmarks/bench_gpu.py --models llama-3.2-1b --dtypes bf16 --modes cohort,one --tokenizer TOKDIR --out OUT

On the CPU it runs a small version (tiny-llama on the packaged arithmetic problems, 4 clients × 2 steps × 2
examples, fp32) and prints the proxies::

    python benchmarks/bench_gpu.py --device cpu --out /tmp/bench-gpu-cpu

``TOKDIR`` holds SmolLM2's tokenizer files (``--save-tokenizer TOKDIR`` writes them here, from the bundled
``smollm2-135m``), so that token counts are SmolLM2's on a machine without the model package.

Carrying it to a lent GPU machine (at most 64 MiB per call; ``bench_out/`` is git-ignored): the repository
(≈ 2 MB), ``bench_out/smollm2-tokenizer`` (3.5 MB, ``--save-tokenizer``), ``bench_out/gsm8k`` (4.7 MB, a copy of
the GSM8K jsonl files, ``--data``) and ``bench_out/whl`` with the transformers 5.23.0 and peft 0.21.2 wheels
(14 MB; the image's transformers is older), plus ``bench_out/whl-bnb`` (bitsandbytes 0.50.2, 43 MB) for QLoRA
figures (``--set task.quantize=4bit``). The random-weight models are built there; nothing else travels. Each
figure set of a model and dtype is one call of a few minutes; ``run.compile`` adds its warm-up (≈ 100 s measured).
FedRPCA's share on the GPU: ``--method fedrpca --set method.rpca_device=cuda --modes cohort``.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from common import provenance  # noqa: E402

import torch  # noqa: E402

from fedlowrank.config import load_config  # noqa: E402
from fedlowrank.device import DTYPES, resolve_device
from fedlowrank.execution.measure import PHASE_PREFIX  # noqa: E402
from fedlowrank.runtime.plan import cohort_memory  # noqa: E402
from fedlowrank.runtime.simulator import Simulation  # noqa: E402
from fedlowrank.tasks import build_task  # noqa: E402
from fedlowrank.training.local import LocalTrainer  # noqa: E402

MODES = ("cohort", "one", "one-compiled", "peft")
GPU_MODELS = {"smollm2-135m": "arch:smollm2-135m", "llama-3.2-1b": "arch:llama-3.2-1b",
              "qwen2.5-0.5b": "arch:qwen2.5-0.5b", "llama-3.1-8b": "arch:llama-3.1-8b"}
READ_OPS = ("aten::_local_scalar_dense",)  # .item(), float(t), bool(t) of any tensor (on CUDA: a device read)
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")  # the host waits
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
GRAPH_REPLAYS = ("cudaGraphLaunch", "cuGraphLaunch")  # one replay of a captured CUDA graph (many kernels)
GIB = 2 ** 30


# -- what a round processed ----------------------------------------------------------------------------------------
class TokenCounter:
    """Wraps a task's ``batch`` and ``join_batches`` to count the tokens each round computes."""

    def __init__(self, task):
        self.task = task
        self._batch, self._join = task.batch, task.join_batches
        task.batch, task.join_batches = self.batch, self.join_batches
        self.reset()

    def reset(self) -> None:
        self.real = self.padded = self.steps = 0
        self.largest = (0, 0)  # (rows, width) of the largest batch a forward saw

    def _see(self, ids: torch.Tensor) -> None:
        if ids.numel() > self.largest[0] * self.largest[1]:
            self.largest = tuple(ids.shape)

    def batch(self, indices):
        out = self._batch(indices)
        if "attention_mask" in out:
            self.real += int(out["attention_mask"].sum())
        else:  # packed rows (task.options.pack): no mask, the examples' own lengths
            self.real += sum(len(self.task.train[int(i)].ids) for i in out["example_index"])
        self.padded += out["input_ids"].numel()
        self.steps += 1
        self._see(out["input_ids"])
        return out

    def join_batches(self, batches):
        joint, rows = self._join(batches)
        self.padded += joint["input_ids"].numel() - sum(b["input_ids"].numel() for b in batches)
        self._see(joint["input_ids"])
        return joint, rows


def measured_peak_tflops(device: torch.device, dtype: str, seconds: float = 1.0) -> float:
    """Dense ``n × n`` matmul throughput (TFLOP/s) of ``dtype`` on ``device``: n = 8192 on CUDA, 512 on the CPU."""
    n = 8192 if device.type == "cuda" else 512
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    a, b = torch.randn(n, n, device=device, dtype=dt), torch.randn(n, n, device=device, dtype=dt)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
        if reps % 10 == 0:
            sync()
    sync()
    return 2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e12


def matmul_parameters(net: torch.nn.Module) -> int:
    """N of MFU: parameters that multiply each token (all but the input embeddings; a tied output layer once)."""
    seen, total = set(), 0
    emb = net.get_input_embeddings().weight
    out = net.get_output_embeddings()
    tied = out is not None and out.weight is emb
    for p in net.parameters():
        if id(p) not in seen and (p is not emb or tied):
            seen.add(id(p))
            total += p.numel()
    return total


class PeakRSS:
    """The rise of this process's peak RSS over a block (Linux: ``/proc/self/clear_refs`` resets the peak)."""

    def __enter__(self):
        try:  # hand freed heap back to the system first, else the round reuses it without raising the peak
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
        self.ok = os.path.exists("/proc/self/clear_refs")
        if self.ok:
            try:
                Path("/proc/self/clear_refs").write_text("5")
            except OSError:
                self.ok = False
        self.start = self._status("VmRSS")
        return self

    def __exit__(self, *exc):
        self.rise = (self._status("VmHWM") - self.start) if self.ok else float("nan")

    @staticmethod
    def _status(key: str) -> float:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return float(line.split()[1]) * 1024
        return float("nan")


def event_counts(events) -> dict[str, int]:
    """Counts of profiler ``events`` (each with ``name`` and ``cpu_parent``): top-level aten ops, scalar reads of
    tensors (``host_reads``; on the CPU these wait for nothing), CUDA runtime calls that make the host wait
    (``syncs``), host-to-device copies (``copies_h2d``, of which ``pageable_h2d`` from pageable memory, which
    stall the host), kernel launches and CUDA-graph replays (each a whole captured graph of kernels)."""
    counts = dict.fromkeys(("aten_ops", "host_reads", "syncs", "copies_h2d", "pageable_h2d", "kernel_launches",
                            "graph_replays"), 0)
    for e in events:
        name = e.name
        if name.startswith("aten::"):
            parent = e.cpu_parent
            if parent is None or not parent.name.startswith("aten::"):
                counts["aten_ops"] += 1
            counts["host_reads"] += name in READ_OPS
        elif name.startswith("Memcpy HtoD"):
            counts["copies_h2d"] += 1
            counts["pageable_h2d"] += "Pageable" in name
        else:
            counts["syncs"] += name in SYNCS
            counts["kernel_launches"] += name in LAUNCHES
            counts["graph_replays"] += name in GRAPH_REPLAYS
    return counts


WAITS = (*SYNCS, "cudaMemcpyAsync", *READ_OPS)  # calls that may make the host wait, attributed to their caller


def caller(event) -> str:
    """The innermost Python frame outside torch around a profiler ``event`` (recorded with ``with_stack``), e.g.
    ``fedlowrank/adapters/lora.py(120): forward``; where no frame was recorded, the innermost part of the round
    (:func:`fedlowrank.execution.measure.phase`) and the operation around it, e.g. ``fedlowrank.reply_to_host: aten::to``;
    ``?`` when neither is."""
    part = op = None
    while event is not None:
        name = event.name
        if ".py(" in name and not name.startswith("torch/"):
            return name
        if part is None and name.startswith(PHASE_PREFIX):
            part = name
        if part is None and name.startswith("aten::"):
            op = name  # the outermost operation below the part: the one our code called
        event = event.cpu_parent
    if part is None:
        return "?"
    return f"{part}: {op}" if op else part


def waits_by_caller(events, top: int) -> list[tuple[int, str, str]]:
    """The ``top`` (count, call, caller) of the profiled calls in :data:`WAITS`, most frequent first."""
    counts = collections.Counter((e.name, caller(e.cpu_parent)) for e in events if e.name in WAITS)
    return [(n, name, where) for (name, where), n in counts.most_common(top)]


def profiled(fn, device: torch.device, stack: bool = False):
    """The torch profiler (CUDA activity too on CUDA; Python frames with ``stack``) over ``fn()``, on every thread
    (a backward's autograd threads on CUDA included)."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts, with_stack=stack,
                 experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        fn()
        sync(device)
    return prof


def profile_counts(fn, device: torch.device, top: int = 0) -> tuple[dict[str, int], str]:
    """Run ``fn`` under the torch profiler (CUDA activity too on CUDA) and count its events (:func:`event_counts`);
    with ``top`` > 0 also a text breakdown: the ``top`` operations by self device (CUDA) or CPU time, and the
    ``top`` callers of the calls that may make the host wait (:func:`waits_by_caller`)."""
    prof = profiled(fn, device, stack=top > 0)
    events = prof.events()
    if top <= 0:
        return event_counts(events), ""
    averages = prof.key_averages()
    parts = [averages.table(sort_by=key, row_limit=top, max_name_column_width=60)
             for key in (["self_device_time_total"] if device.type == "cuda" else []) + ["self_cpu_time_total"]]
    parts.append("calls that may make the host wait, by caller:\n" + "\n".join(
        f"{n:8d}  {name:28s} {where}" for n, name, where in waits_by_caller(events, top)))
    return event_counts(events), "\n".join(parts)


# -- figures -------------------------------------------------------------------------------------------------------
def base_sets(args, spec: str, dtype: str, clients: int) -> list[str]:
    return [f"task.model={spec}", f"run.device={args.device}", f"train.dtype={dtype}", f"method.name={args.method}",
            "partition.kind=iid", f"partition.num_clients={clients}", f"run.clients_per_round={clients}",
            f"partition.min_partition_size={args.steps * args.batch}", f"train.local_steps={args.steps}",
            f"train.batch_size={args.batch}", f"run.rounds={args.rounds + 1}", f"run.eval_every={args.rounds + 1}",
            "run.checkpoint_every=0", f"run.seed={args.seed}", f"run.threads={args.threads}",
            f"task.max_length={args.max_length}", f"data.max_train_examples={args.max_train}",
            "task.options.eval_examples=8", "task.options.eval_generate=0", f"data.source={args.source}",
            *([f"data.path={args.data}"] if args.data else [])]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def simulate(cfg, task, counter: TokenCounter, device, rounds: int, profile: int | None) -> dict[str, Any]:
    """Rounds of the simulator: round 1 warms up, rounds 2..rounds+1 are timed, one more is profiled unless ``profile``
    is None (its value: the rows of the breakdown, :func:`profile_counts`)."""
    sim = Simulation(cfg, task=task)
    k = sim.cohort_size()
    memory = cohort_memory(cfg, task, sim.model)  # the runtime's planner (run.cohort = 0 sizes cohorts with it)
    times, real, padded, rises, aggregation = [], [], [], [], []
    for r in range(rounds):
        counter.reset()
        reset_peak(device)
        with PeakRSS() as rss:
            row = sim.run_round()
        sync(device)
        if r == 0:
            continue
        times.append(row["time"]["total"] - row["time"]["evaluation"])
        aggregation.append(row["time"]["aggregation"])
        real.append(counter.real)
        padded.append(counter.padded)
        rises.append(rss.rise)
    out = {"seconds": sum(times) / len(times), "real": sum(real) / len(real), "padded": sum(padded) / len(padded),
           "aggregation": sum(aggregation) / len(aggregation),
           "largest": counter.largest, "cohort": k,
           "estimate": {"resident": memory.resident(k), "step": memory.step(k), "total": memory.peak(k)},
           "peak_cuda": torch.cuda.max_memory_allocated(device) if device.type == "cuda"
           else None, "rss_rise": max(rises)}
    if profile is not None:
        counter.reset()
        out["profile"], out["breakdown"] = profile_counts(sim.run_round, device, profile)
        out["profile_steps"] = counter.steps
    return out


def plain_peft(args, cfg, task, counter: TokenCounter, device, dtype: str, rounds: int, profile: int | None) -> dict:
    """The same clients and batches through peft's LoRA and a fresh torch AdamW per client."""
    from peft import LoraConfig, get_peft_model

    from fedlowrank.adapters.targets import default_targets
    from fedlowrank.tasks.partition import partition_task

    parts = partition_task(task, cfg.partition, cfg.run.seed)[0]
    net = copy.deepcopy(task.loaded.net).to(DTYPES[dtype])  # the frozen backbone in the compute dtype
    lora_cfg = LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=0.0,
                          target_modules=cfg.lora.targets or default_targets(task.loaded.model_type))
    model = get_peft_model(net, lora_cfg).to(device)  # peft keeps the adapters in fp32 (autocast_adapter_dtype)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    clients = list(range(cfg.run.clients_per_round))

    def one_round(rnd: int) -> None:
        for k in clients:
            for n, m in model.named_modules():
                if hasattr(m, "reset_lora_parameters") and "default" in getattr(m, "lora_A", {}):
                    m.reset_lora_parameters("default", True)
            opt = torch.optim.AdamW(trainable, lr=cfg.train.lr, fused=device.type == "cuda")
            trainer = LocalTrainer(task, parts[k], cfg.train, k, rnd, cfg.run.rounds, cfg.run.seed)
            batches = trainer.batches()
            for _ in range(trainer.num_steps):
                batch = next(batches)
                inputs = {k: batch[k].to(device) for k in ("input_ids", "attention_mask", "position_ids", "labels")
                          if k in batch}  # packed rows: positions, no mask (transformers' packed sequences)
                model(**inputs).loss.backward()  # transformers' own loss: every position's logits
                opt.step()
                opt.zero_grad(set_to_none=True)
        sync(device)

    times, real, padded, rises = [], [], [], []
    for r in range(1, rounds + 1):
        counter.reset()
        reset_peak(device)
        with PeakRSS() as rss:
            t0 = time.perf_counter()
            one_round(r)
            t = time.perf_counter() - t0
        if r == 1:
            continue
        times.append(t)
        real.append(counter.real)
        padded.append(counter.padded)
        rises.append(rss.rise)
    out = {"seconds": sum(times) / len(times), "real": sum(real) / len(real), "padded": sum(padded) / len(padded),
           "largest": counter.largest, "cohort": 1, "peak_cuda": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
           "rss_rise": max(rises)}
    if profile is not None:
        counter.reset()
        out["profile"], out["breakdown"] = profile_counts(lambda: one_round(rounds + 1), device, profile)
        out["profile_steps"] = counter.steps
    return out


def figure(args, name: str, spec: str, dtype: str, mode: str, tasks: dict, peaks: dict, device, say) -> dict | None:
    clients = args.clients
    sets = base_sets(args, spec, dtype, clients) + list(args.set)
    if mode == "cohort":
        sets.append(f"run.cohort={clients}")
    elif mode in ("one", "one-compiled"):
        sets.append("run.cohort=1")
    if mode == "one-compiled":
        buckets = [b for b in args.buckets if b <= args.max_length]
        sets += ["run.compile=true", f"task.length_buckets={buckets}"]  # static shapes: one graph per bucket
    cfg = load_config("gsm8k", sets)
    key = (spec, dtype)
    if key not in tasks:
        tasks[key] = build_task(cfg)
        TokenCounter(tasks[key])
    task = tasks[key]
    counter = task.batch.__self__
    if dtype not in peaks:
        peaks[dtype] = measured_peak_tflops(device, dtype)
    profile = None if args.no_profile else args.breakdown
    t0 = time.perf_counter()
    if mode == "peft":
        res = plain_peft(args, cfg, task, counter, device, dtype, args.rounds + 1, profile)
    else:
        res = simulate(cfg, task, counter, device, args.rounds + 1, profile)
    wall = time.perf_counter() - t0
    n = matmul_parameters(task.loaded.net)
    rows, width = res["largest"]
    est = res.get("estimate")
    real_tps, padded_tps = res["real"] / res["seconds"], res["padded"] / res["seconds"]
    tflops = 4 * n * real_tps / 1e12
    label = f"{name} {dtype} {mode}" + ("" if mode == "peft" or cfg.method_name == "fedit" else f" {cfg.method_name}")
    row = {"figure": label, "model": name, "spec": spec, "dtype": dtype, "mode": mode,
           "clients": clients, "local_steps": args.steps, "batch": args.batch, "cohort": res["cohort"],
           "method": cfg.method_name, "rounds_timed": args.rounds, "seconds_per_round": res["seconds"],
           "aggregation_share": res["aggregation"] / res["seconds"] if "aggregation" in res else None,
           "real_tokens_per_round": res["real"],
           "padded_tokens_per_round": res["padded"], "real_tokens_per_s": real_tps,
           "padded_tokens_per_s": padded_tps, "matmul_parameters": n, "model_tflops": tflops,
           "peak_matmul_tflops": peaks[dtype], "mfu": tflops / peaks[dtype],
           "peak_memory_gib": None if res["peak_cuda"] is None else res["peak_cuda"] / GIB,
           "rss_rise_gib": res["rss_rise"] / GIB, "largest_batch": [rows, width],
           "memory_estimate_gib": None if est is None else {k: v / GIB for k, v in est.items()},
           "wall_seconds": wall,
           "sets": sets, "device": device_name(device), "load": list(os.getloadavg()), "seed": args.seed}
    if res.get("breakdown"):
        print(f"{label}: the profiled round\n{res['breakdown']}", flush=True)
    if "profile" in res:
        steps = max(res["profile_steps"], 1)
        row["per_client_step"] = {k: v / steps for k, v in res["profile"].items()}
    return row


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return "cpu"


# -- output --------------------------------------------------------------------------------------------------------
COUNTS = ("aten_ops", "host_reads", "syncs", "copies_h2d", "kernel_launches", "graph_replays")
COLUMNS = ("figure", "s/round", "aggregation", "real tok/s", "padded tok/s", "MFU", "peak GiB", "estimate GiB",
           "ops/step", "reads/step", "syncs/step", "H2D copies/step", "launches/step", "graph replays/step")


def markdown_row(r: dict) -> str:
    peak = r["peak_memory_gib"] if r["peak_memory_gib"] is not None else r["rss_rise_gib"]
    est = r["memory_estimate_gib"]  # CUDA: the planned peak; CPU: what a step allocates (the RSS rise)
    est = None if est is None else est["total" if r["peak_memory_gib"] is not None else "step"]
    prof = r.get("per_client_step", {})
    share = r["aggregation_share"]
    cells = [r["figure"], f"{r['seconds_per_round']:.3f}", "–" if share is None else f"{100 * share:.1f} %",
             f"{r['real_tokens_per_s']:,.0f}",
             f"{r['padded_tokens_per_s']:,.0f}", f"{100 * r['mfu']:.1f} %", f"{peak:.2f}", "–" if est is None else f"{est:.2f}",
             *(f"{prof[k]:.1f}" if k in prof else "–" for k in COUNTS)]
    return "| " + " | ".join(cells) + " |"


def target_checks(rows: list[dict]) -> list[tuple[str, str, bool | None]]:
    """The targets (H100) against the figures measured in this run: ``(target, measured, holds)``, ``holds`` None
    (and measured "–") when the figure is missing."""
    by = {r["figure"]: r for r in rows}
    checks: list[tuple[str, str, bool | None]] = []

    def get(fig: str, key: str):
        return by[fig][key] if fig in by else None

    def check(what: str, value, text: str, ok) -> None:
        checks.append((what, "–" if value is None else text, None if value is None else bool(ok)))

    s = "smollm2-135m bf16"
    tps = get(f"{s} cohort", "real_tokens_per_s")
    check("SmolLM2 bf16 cohort ≥ 150k real tokens/s", tps, f"{tps or 0:,.0f} tokens/s", tps and tps >= 150e3)
    peak = get(f"{s} cohort", "peak_memory_gib")
    check("SmolLM2 bf16 cohort peak ≤ 12 GiB", peak, f"{peak or 0:.2f} GiB", peak is not None and peak <= 12)
    one, peft = get(f"{s} one", "seconds_per_round"), get(f"{s} peft", "seconds_per_round")
    ratio = None if one is None or peft is None else one / peft
    check("SmolLM2 bf16 one at a time ≤ 1.1× plain peft", ratio, f"{ratio or 0:.2f}×", ratio and ratio <= 1.1)
    comp = get(f"{s} one-compiled", "real_tokens_per_s")
    check("SmolLM2 bf16 one at a time compiled ≥ 40k real tokens/s", comp, f"{comp or 0:,.0f} tokens/s",
          comp and comp >= 40e3)
    fp32 = get("smollm2-135m fp32 cohort", "real_tokens_per_s")
    speed = None if fp32 is None or tps is None else tps / fp32
    check("SmolLM2 cohort bf16 ≥ fp32 speed", speed, f"bf16/fp32 {speed or 0:.2f}×", speed and speed >= 1)
    peak = get("llama-3.2-1b bf16 cohort", "peak_memory_gib")
    size = get("llama-3.2-1b bf16 cohort", "cohort")
    check("1B cohort of 32 within 40 GiB", peak, f"{peak or 0:.2f} GiB at {size} clients",
          peak is not None and peak <= 40 and size >= 32)
    mfu = get("llama-3.2-1b bf16 cohort", "mfu")
    check("1B cohort ≥ 25 % MFU", mfu, f"{100 * (mfu or 0):.1f} %", mfu and mfu >= 0.25)
    for r in rows:
        if r.get("method") == "fedrpca" and r["mode"] != "peft":
            share = r["aggregation_share"]
            check(f"{r['figure']}: FedRPCA's aggregation ≤ 5 % of the round", share, f"{100 * share:.1f} %",
                  share <= 0.05)
    return checks


def targets(rows: list[dict]) -> list[str]:
    """:func:`target_checks` as Markdown list lines."""
    word = {None: "not measured", True: "met", False: "NOT met"}
    return [f"- {what}: {word[ok]}" for what, _, ok in target_checks(rows)]


def report(folder: str) -> str:
    """``benchmarks/gpu_check.sh``'s summary of ``folder``: its steps (``steps.tsv``: name, exit status, seconds)
    and figures (``raw/bench_gpu.jsonl``) as one Markdown table (target, measured, holds?) in ``gpu_check.md`` and
    a JSON line per figure and target in ``gpu_check.jsonl``. Returns the Markdown."""
    root = Path(folder)
    figures = root / "raw" / "bench_gpu.jsonl"
    rows = [json.loads(x) for x in figures.read_text().splitlines() if x.strip()] if figures.exists() else []
    steps = [line.split("\t") for line in (root / "steps.tsv").read_text().splitlines() if line.strip()] \
        if (root / "steps.tsv").exists() else []
    word = {None: "not measured", True: "yes", False: "**no**"}
    status = {"0": "ok", "124": "**timed out**"}
    lines = ["| target | measured | holds? |", "|---|---|---|"]
    lines += [f"| step {name} | {status.get(rc, f'**failed (exit {rc})**')} in {float(sec):.0f} s | "
              f"{'yes' if rc == '0' else '**no**'} |" for name, rc, sec in steps]
    checks = target_checks(rows)
    lines += [f"| {what} | {measured} | {word[ok]} |" for what, measured, ok in checks]
    device = rows[0]["device"] if rows else "no figure"
    md = "\n".join([f"GPU check on {device}; {len(rows)} figures", "", *lines]) + "\n"
    (root / "gpu_check.md").write_text(md)
    with (root / "gpu_check.jsonl").open("w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
        for what, measured, ok in checks:
            fh.write(json.dumps({"target": what, "measured": measured, "holds": ok}) + "\n")
    return md


def save_tokenizer(folder: str) -> None:
    from fedlowrank.models.bundled import smollm2_tokenizer

    smollm2_tokenizer().save_pretrained(folder)
    print(f"wrote SmolLM2's tokenizer to {folder}: {', '.join(sorted(p.name for p in Path(folder).iterdir()))}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--models", default="", help=f"comma-separated among {', '.join(GPU_MODELS)}, or any task.model "
                                                 f"(default: smollm2-135m,llama-3.2-1b on CUDA, tiny-llama on the CPU)")
    ap.add_argument("--dtypes", default="", help="comma-separated among fp32, bf16 (default: bf16,fp32 on CUDA, fp32 "
                                                 "on the CPU)")
    ap.add_argument("--modes", default="", help=f"comma-separated among {', '.join(MODES)} (default: all on CUDA; on "
                                                "the CPU all but one-compiled, whose inductor build takes minutes)")
    ap.add_argument("--method", default="fedit", help="the method of the cohort/one figures (e.g. fedrpca, with "
                                                      "--set method.rpca_device=cuda: its aggregation share)")
    ap.add_argument("--tokenizer", default="smollm2-135m",
                    help="the arch: models' tokenizer: bytes, smollm2-135m (bundled) or a folder")
    ap.add_argument("--clients", type=int, default=0, help="clients per round, all in one cohort (0: 32; CPU 4)")
    ap.add_argument("--steps", type=int, default=0, help="local steps (0: 5; CPU 2)")
    ap.add_argument("--batch", type=int, default=0, help="examples per step (0: 4; CPU 2)")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds after the warm-up round")
    ap.add_argument("--max-length", type=int, default=384)
    ap.add_argument("--max-train", type=int, default=0, help="GSM8K training examples kept (0: 64 per client)")
    ap.add_argument("--source", default="", help="data.source: gsm8k (a local copy: --data or $FEDLOWRANK_DATA; "
                                                 "default on CUDA) or arithmetic (packaged; default on the CPU)")
    ap.add_argument("--data", default="", help="GSM8K folder (data.path; default $FEDLOWRANK_DATA/gsm8k)")
    ap.add_argument("--buckets", type=lambda t: [int(x) for x in t.split(",")], default=[128, 192, 256, 320, 384],
                    help="task.length_buckets of one-compiled (static shapes: one compilation per bucket)")
    ap.add_argument("--set", action="append", default=[], help="extra config override for every figure "
                                                               "(e.g. train.gradient_checkpointing=true)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled extra round")
    ap.add_argument("--breakdown", type=int, default=0,
                    help="with the profiled round, print its N slowest operations and the N callers that most make "
                         "the host wait")
    ap.add_argument("--out", default="", help="folder for bench_gpu.jsonl and bench_gpu.md")
    ap.add_argument("--save-tokenizer", default="", help="write SmolLM2's tokenizer files to this folder and stop")
    ap.add_argument("--report", default="", help="write gpu_check.sh's table of this folder (report()) and stop")
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    cpu = device.type != "cuda"
    args.models = args.models or ("tiny-llama" if cpu else "smollm2-135m,llama-3.2-1b")
    args.source = args.source or ("arithmetic" if cpu else "gsm8k")
    args.dtypes = args.dtypes or ("fp32" if cpu else "bf16,fp32")
    args.clients = args.clients or (4 if cpu else 32)
    args.steps = args.steps or (2 if cpu else 5)
    args.batch = args.batch or (2 if cpu else 4)
    args.max_train = args.max_train or 64 * args.clients
    if cpu and args.max_length == 384:
        args.max_length = 768  # the byte-level tokenizer of tiny-llama: ≈ 3× SmolLM2's token counts
    return args, device


def main(argv: list[str] | None = None) -> list[dict]:
    args, device = parse_args(argv)
    if args.report:
        print(report(args.report))
        return []
    if args.save_tokenizer:
        save_tokenizer(args.save_tokenizer)
        return []
    if args.threads:
        torch.set_num_threads(args.threads)
    print(provenance(argv))
    print(f"device {device_name(device)}; seed {args.seed}; {args.clients} clients × {args.steps} steps × "
          f"{args.batch} {args.source} examples per round; {args.rounds} timed rounds after one warm-up")
    lines: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "bench_gpu.jsonl" if out else None
    rows, tasks, peaks = [], {}, {}
    for name in args.models.split(","):
        spec = GPU_MODELS.get(name, name)
        if spec.startswith("arch:") and args.tokenizer:
            spec = f"{spec}@{args.tokenizer}"
        for dtype in args.dtypes.split(","):
            modes = args.modes or ",".join(m for m in MODES if device.type == "cuda" or m != "one-compiled")
            for mode in modes.split(","):
                if mode not in MODES:
                    raise SystemExit(f"--modes: {mode!r} is not one of {', '.join(MODES)}")
                try:
                    row = figure(args, name, spec, dtype, mode, tasks, peaks, device, say)
                except torch.cuda.OutOfMemoryError as exc:
                    say(f"{name} {dtype} {mode}: CUDA out of memory ({str(exc).splitlines()[0]})")
                    torch.cuda.empty_cache()
                    continue
                if row is None:
                    continue
                rows.append(row)
                text = json.dumps(row)
                print(text, flush=True)
                if jsonl:
                    with jsonl.open("a") as fh:
                        fh.write(text + "\n")
    table = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS), *map(markdown_row, rows)]
    notes = [f"device {device_name(device)}; " + provenance(argv).replace("\n", "; "),
             "peak GiB: CUDA max_memory_allocated; on the CPU the rise of the peak RSS over a round (estimate: its "
             "transient part). ops/syncs/launches per client step from one profiled round."]
    goals = targets(rows) if device.type == "cuda" else ["- not checked: a CPU run (the proxies above); the targets "
                                                         "are an H100's"]
    md = "\n".join([*table, "", *notes, "", "Targets (H100):", *goals, *lines]) + "\n"
    print("\n" + md)
    if out:
        (out / "bench_gpu.md").write_text(md)
    return rows


if __name__ == "__main__":
    main()

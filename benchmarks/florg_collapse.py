"""Why FLoRG falls behind on some seeds of the FLoRG protocol, the diagnostics as commands
(docs/methods/florg.md, "Why FLoRG collapsed on some seeds"). Not part of CI.

The protocol (``benchmarks/protocols.py florg``): AG News, MiniLM-L6, 10 clients, Dirichlet ρ = 0.1, all clients
every round, 10 rounds × 10 local AdamW steps of 8 × 32 tokens, r = 4, 2,000 test examples; FLoRG at lr 1e-3 with
its preset (uniform weights), FedIT at 3e-3 (weights by examples).

    python benchmarks/florg_collapse.py mix --seeds 0-11
        per seed: each client's size, the label mix the server's average sees with uniform weights (with
        example weights it is the global one) and the classes that one client holds (no training; seconds)
    python benchmarks/florg_collapse.py trace --seed 4 [--method florg] [--set key=value ...] [--out DIR]
        one run, round by round: test accuracy, loss, per-class recall and the predicted-class histogram of the
        global model; the adapter ΔW (means over layers of ‖ΔW‖₂ and of σ₁/σ_r over its top r singular values,
        for FLoRG the condition number of the Gram matrix AᵀA; ‖ΔW‖_F/‖W0‖_F over all layers); the clients'
        updates ‖ΔWₙ − ΔWᵗ‖_F against the update the server applies, ‖ΔWᵗ⁺¹ − ΔWᵗ‖_F, and against the
        exact average of the clients' ΔWₙ (what a rank-unconstrained method would apply); the head
        (its weight's norm and bias); FLoRG's own diagnostics. ``--head-weighting`` averages the head with
        other weights than the adapter (``server.weighting``), to tell which of the two a weighting acts through;
        it builds the simulator itself, to read each round's replies and global state
    python benchmarks/florg_collapse.py runs --methods florg,fedit --seeds 0-11 --variant preset \\
        --variant "examples:server.weighting=num_examples" --jobs 2 --out runs/florg-collapse
        final and best test accuracy of each (method, variant, seed) at the method's protocol rate and preset;
        a variant is a name, then after ``:`` its ``key=value`` settings separated by ``;``; each run is kept
        under ``--out`` and read back when the command is repeated

Every command prints the command line, the load, the versions and the settings it ran with.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import provenance, run_resumable  # noqa: E402

from fedlowrank.experiments.stats import paired_interval, wilcoxon_signed_rank  # noqa: E402

PROTOCOL = ["partition.num_clients=10", "partition.alpha=0.1", "run.clients_per_round=10", "run.rounds=10",
            "train.local_steps=10", "train.batch_size=8", "task.max_length=32", "data.max_test_examples=2000",
            "lora.rank=4", "run.threads=1", "run.eval_every=5"]
RATES = {"florg": 1e-3, "fedit": 3e-3, "florg-no-procrustes": 1e-4, "florg-top-rows": 1e-3}


def seeds_of(text: str) -> list[int]:
    """``"0-3,7"`` → ``[0, 1, 2, 3, 7]`` (an ``--seeds`` argument type: anything else is one usage error)."""
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            out += list(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seeds like 0-3,7; got {text!r}") from None
    if not out or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"expected distinct seeds like 0-3,7; got {text!r}")
    return out


def settings(method: str, seed: int, extra: list[str]) -> list[str]:
    """The protocol's settings for ``method`` at its tuned rate with its preset, then ``extra`` (later wins)."""
    from fedlowrank.methods import preset_overrides

    return [*PROTOCOL, f"method.name={method}", *preset_overrides(method), f"train.lr={RATES.get(method, 1e-3)}",
            f"run.seed={seed}", *extra]


# -- mix -----------------------------------------------------------------------------------------------------------
def label_mix(seeds: list[int]) -> None:
    """Per seed: client sizes; each class's share of Σₙ pₙ·(client n's label fractions) with uniform pₙ = 1/N (with
    pₙ ∝ examples it is the global share, ≈ 0.25 on AG News); the classes that one client holds ≥ 80 % of."""
    from fedlowrank.config import load_config
    from fedlowrank.tasks import build_task
    from fedlowrank.tasks.partition import partition_task

    cfg = load_config("agnews", settings("florg", 0, []))
    task = build_task(cfg)
    labels = np.asarray(task.train_labels)
    names = task.describe()["labels"]
    print(f"classes: {', '.join(names)}")
    print("| seed | client sizes | class shares, uniform weights | smallest | classes ≥ 80 % on one client "
          "(that client's size) |")
    print("|---|---|---|---|---|")
    for seed in seeds:
        parts, _ = partition_task(task, cfg.partition, seed)
        hist = np.array([np.bincount(labels[p], minlength=task.num_labels) for p in parts], dtype=float)
        uniform = (hist / hist.sum(1, keepdims=True)).mean(0)  # Σₙ (1/N)·(client n's label fractions)
        holder = hist.argmax(0)
        held = hist.max(0) / hist.sum(0)
        single = [f"{names[c]} {held[c]:.0%} by client {holder[c]} ({len(parts[holder[c]])} ex.)"
                  for c in range(task.num_labels) if held[c] >= 0.8]
        print(f"| {seed} | {', '.join(str(int(s)) for s in hist.sum(1))} | "
              f"{', '.join(f'{x:.2f}' for x in uniform)} | {uniform.min():.3f} | {'; '.join(single) or '–'} |")


# -- trace ---------------------------------------------------------------------------------------------------------
@torch.no_grad()
def predictions(task, net) -> tuple[np.ndarray, np.ndarray, float]:
    """Predicted and true test labels, and the mean test cross-entropy."""
    net.eval()
    preds, total = [], 0.0
    for start in range(0, len(task.test_labels), task.eval_batch_size):
        sl = slice(start, start + task.eval_batch_size)
        ids, mask = task._trim(task.test_ids[sl], task.test_mask[sl])
        logits = net(input_ids=ids, attention_mask=mask).logits
        labels = torch.as_tensor(task.test_labels[sl])
        total += float(torch.nn.functional.cross_entropy(logits, labels, reduction="sum"))
        preds.append(logits.argmax(-1).numpy())
    return np.concatenate(preds), np.asarray(task.test_labels), total / len(task.test_labels)


@torch.no_grad()
def deltas(model) -> dict[str, torch.Tensor]:
    """Each adapter's dense ΔW: ``{module: [out, in]}`` (float64)."""
    return {n: m.adapter_delta().to(torch.float64) for n, m in model.adapters().items()}


def loaded_deltas(sim, msg) -> dict[str, torch.Tensor]:
    sim.method.load_global(sim.model, msg)
    return deltas(sim.model)


def head_vector(msg) -> torch.Tensor:
    return torch.cat([msg[k].reshape(-1).to(torch.float64) for k in sorted(msg) if k.startswith("head/")])


def frob(d: dict[str, torch.Tensor]) -> float:
    return float(sum(float(x.square().sum()) for x in d.values()) ** 0.5)


def head_weighted_by(sim, weighting: str) -> None:
    """Make ``sim``'s server average the head with ``weighting`` whatever ``server.weighting`` says (the adapter
    keeps ``server.weighting``): separates what the head's weights do from what the adapter's do."""
    from fedlowrank.methods.base import weighted_sum

    if sim.cfg.server.lr != 1.0:
        raise SystemExit("--head-weighting averages the head plainly: it needs server.lr = 1")
    aggregate = sim.method.aggregate

    def aggregate_with_head(server, replies, rnd):
        new = aggregate(server, replies, rnd)
        w = torch.tensor([1.0 if weighting == "uniform" else float(r.num_examples) for r in replies],
                         dtype=torch.float64)
        for key in (k for k in new if k.startswith("head/")):
            new[key] = weighted_sum((r.message[key] for r in replies), w / w.sum())
        return new

    sim.method.aggregate = aggregate_with_head


def trace(method: str, seed: int, extra: list[str], out: Path | None, label: str = "",
          head_weighting: str = "") -> list[dict]:
    """One run round by round with the diagnostics of the module docstring; returns the rows (also printed).
    ``head_weighting`` (``uniform`` or ``num_examples``): the head's weights, apart from the adapter's."""
    from fedlowrank.config import load_config
    from fedlowrank.message import Message
    from fedlowrank.runtime.simulator import Simulation

    sets = settings(method, seed, [*extra, f"run.eval_every={10**6}"])  # this script evaluates every round
    cfg = load_config("agnews", sets)
    replies: dict[int, Message] = {}

    def capture(rnd, client, reply):
        replies[client] = reply
        return reply

    sim = Simulation(cfg, tamper=capture)
    if head_weighting:
        head_weighted_by(sim, head_weighting)
    W0 = {n: m.base.weight.detach().to(torch.float64) for n, m in sim.model.adapters().items()}
    w0 = frob(W0)
    names = sim.task.describe()["labels"]
    rows = []
    print(f"settings: {' '.join(sets)}" + (f"; head averaged with {head_weighting} weights" if head_weighting else ""))
    print("| round | acc | loss | recall per class | predicted share per class | ‖ΔW‖₂ | σ₁/σ_r(ΔW) | ‖ΔW‖_F/‖W0‖_F | "
          "mean ‖ΔWₙ−ΔWᵗ‖ | ‖mean ΔWₙ − ΔWᵗ‖ | ‖ΔWᵗ⁺¹−ΔWᵗ‖ | cos(applied, mean) | ‖head‖ | head bias | method |")
    print("|" + "---|" * 15)
    for rnd in range(1, cfg.run.rounds + 1):
        before_msg = Message(dict(sim.server))
        before = loaded_deltas(sim, before_msg)
        head_before = head_vector(before_msg)
        replies.clear()
        row = sim.run_round()
        after_msg = Message(dict(sim.server))
        after = loaded_deltas(sim, after_msg)
        client_d = {k: loaded_deltas(sim, msg) for k, msg in sorted(replies.items())}
        p = sim.method.client_weights([type("R", (), {"client": k, "num_examples": len(sim.parts[k])})()
                                       for k in client_d]).tolist()
        mean_d = {n: sum(w * client_d[k][n] for w, k in zip(p, client_d)) for n in before}
        upd = {k: frob({n: d[n] - before[n] for n in before}) for k, d in client_d.items()}
        applied = {n: after[n] - before[n] for n in before}
        mean_upd = {n: mean_d[n] - before[n] for n in before}
        cos = (sum(float((applied[n] * mean_upd[n]).sum()) for n in before)
               / max(frob(applied) * frob(mean_upd), 1e-300))
        sim.method.load_global(sim.model, after_msg)
        pred, true, loss = predictions(sim.task, sim.model.net)
        k = len(names)
        recall = [float((pred[true == c] == c).mean()) for c in range(k)]
        share = np.bincount(pred, minlength=k) / len(pred)
        head = {n: v for n, v in after_msg.items() if n.startswith("head/")}
        bias = next((v for n, v in head.items() if n.endswith("bias") and v.numel() == k), None)
        r = cfg.lora.rank
        svals = [torch.linalg.svdvals(d)[:r] for d in after.values()]  # FLoRG: s·(eigenvalues of AᵀA), L, R orthogonal
        spec = [float(sv[0]) for sv in svals]
        info = {
            "round": rnd, "accuracy": float((pred == true).mean()), "loss": loss, "recall": recall,
            "predicted_share": share.tolist(), "dW_spec_mean": float(np.mean(spec)), "dW_rel_frob": frob(after) / w0,
            "dW_cond_mean": float(np.mean([float(sv[0] / sv[-1]) for sv in svals])),
            "dW_top_singular_values_mean": torch.stack(svals).mean(0).tolist(),
            "client_update": {str(k): v for k, v in upd.items()},
            "client_update_mean": float(np.mean(list(upd.values()))),
            "mean_update": frob(mean_upd), "applied_update": frob(applied), "cos_applied_mean": cos,
            "head_norm": float(head_vector(after_msg).norm()),
            "head_update": float((head_vector(after_msg) - head_before).norm()),
            "head_bias": None if bias is None else bias.tolist(), "train_loss": row["train_loss"],
            "client_train_loss": {str(c["client"]): c["train_loss"] for c in row["per_client"]},
            "method": row.get("diagnostics", {}),
        }
        rows.append(info)
        meth = ", ".join(f"{a}={b:.3g}" for a, b in info["method"].items())
        print(f"| {rnd} | {info['accuracy']:.4f} | {loss:.3f} | {' '.join(f'{x:.2f}' for x in recall)} | "
              f"{' '.join(f'{x:.2f}' for x in share)} | {info['dW_spec_mean']:.3f} | {info['dW_cond_mean']:.1f} | "
              f"{info['dW_rel_frob']:.4f} | "
              f"{info['client_update_mean']:.3f} | {info['mean_update']:.3f} | {info['applied_update']:.3f} | "
              f"{cos:.3f} | {info['head_norm']:.2f} | "
              f"{'' if bias is None else ' '.join(f'{x:+.2f}' for x in bias.tolist())} | {meth} |", flush=True)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            with (out / f"trace-{method}{label and '-' + label}-seed{seed}.jsonl").open("a" if rnd > 1 else "w") as fh:
                fh.write(json.dumps(info) + "\n")
    print(f"classes: {', '.join(names)}")
    return rows


# -- runs ----------------------------------------------------------------------------------------------------------
def runs(methods: list[str], seeds: list[int], variants: list[tuple[str, list[str]]], out: Path, jobs: int) -> None:
    """Final (and best) test accuracy of every (method, variant, seed), run by the project's sweep in ``jobs``
    processes, each kept in ``out/<method>-<variant>-seed<S>`` and read back when the command is repeated."""
    from fedlowrank.config import load_config
    from fedlowrank.experiments.sweep import Run, Sweep

    keys = [(s, m, name) for s in seeds for m in methods for name, _ in variants]  # seed-major: early seeds first
    extras = dict(variants)
    todo = [Run(m, f"[{m} {name}] seed {s}", load_config("agnews", settings(m, s, extras[name])),
                out / f"{m}-{name}-seed{s}", "accuracy") for s, m, name in keys]
    outcomes = Sweep(out, jobs, resume=True, log=lambda line: print(line, file=sys.stderr, flush=True)).run(
        todo, stop_on_divergence=True)
    results = {key: outcome for key, outcome in zip(keys, outcomes)}
    for m in methods:
        for name, extra in variants:
            print(f"{m} {name}: --set {' '.join(settings(m, -1, extra)[len(PROTOCOL):])}".replace(" run.seed=-1", ""))
    print("\n| method | variant | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |")
    print("|---|---|" + "---|" * (len(seeds) + 1))
    for m in methods:
        for name, _ in variants:
            summaries = [results[s, m, name].summary for s in seeds]
            acc = [s["accuracy"] for s in summaries]
            cells = " | ".join(f"{a:.4f} ({s.get('best_accuracy', a):.4f})" for a, s in zip(acc, summaries))
            print(f"| {m} | {name} | {cells} | {np.mean(acc):.4f} |")
    print("\ncells: final accuracy (best over the evaluated rounds)\n")
    print("| method | variant | swing per seed: max − min accuracy over the last 4 evaluated rounds | mean |")
    print("|---|---|---|---|")
    for m in methods:
        for name, _ in variants:
            swings = []
            for s in seeds:
                last = [r["accuracy"] for r in results[s, m, name].history if "accuracy" in r][-4:]
                swings.append(max(last) - min(last))
            print(f"| {m} | {name} | {', '.join(f'{x:.3f}' for x in swings)} | {np.mean(swings):.3f} |")
    print()
    final = {(m, name): [results[s, m, name].summary["accuracy"] for s in seeds] for m in methods
             for name, _ in variants}
    pairs = [((m, v), (methods[0], v)) for v, _ in variants for m in methods[1:]]
    pairs += [((m, v), (m, variants[0][0])) for m in methods for v, _ in variants[1:]]
    if pairs:
        print("| difference (final accuracy) | per seed | mean ± 95 % t half-width | median | ahead | Wilcoxon p |")
        print("|---|---|---|---|---|---|")
    for a, b in pairs:
        diffs, iv = paired_interval(final[a], final[b])
        print(f"| {' '.join(a)} − {' '.join(b)} | {', '.join(f'{d:+.3f}' for d in diffs)} | "
              f"{iv.format(4) if len(diffs) > 1 else f'{iv.mean:+.4f}'} | {np.median(diffs):+.4f} | "
              f"{sum(d > 0 for d in diffs)} of {len(diffs)} | {wilcoxon_signed_rank(diffs).p:.3f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("mix", help="label mix per seed under uniform and example weights")
    m.add_argument("--seeds", type=seeds_of, default="0-11")
    t = sub.add_parser("trace", help="one run round by round with the diagnostics")
    t.add_argument("--seed", type=int, default=4)
    t.add_argument("--method", default="florg")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    t.add_argument("--out", type=Path, help="also write trace-<method>[-<label>]-seed<S>.jsonl here")
    t.add_argument("--label", default="", help="names the settings in the file name")
    t.add_argument("--head-weighting", choices=("uniform", "num_examples"), default="",
                   help="average the head with these weights, the adapter with server.weighting's")
    r = sub.add_parser("runs", help="final accuracy of variants over seeds")
    r.add_argument("--seeds", type=seeds_of, default="0,4,5")
    r.add_argument("--methods", default="florg", help="comma-separated")
    r.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE;...",
                   help="a name and its settings separated by ';', e.g. examples:server.weighting=num_examples "
                        "('base' = none)")
    r.add_argument("--jobs", type=int, default=1)
    r.add_argument("--out", type=Path, default=Path("runs/florg-collapse"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(provenance(argv))
    try:
        dispatch(args)
    except ValueError as exc:  # a bad setting or method (ConfigError): one line
        ap.error(str(exc))
    return 0


def dispatch(args: argparse.Namespace) -> None:
    if args.command == "mix":
        label_mix(args.seeds)
    elif args.command == "trace":
        trace(args.method, args.seed, args.set, args.out, args.label, args.head_weighting)
    else:
        variants = []
        for v in args.variant or ["base"]:
            name, _, sets = v.partition(":")
            variants.append((name, [s for s in sets.split(";") if s]))
        runs(args.methods.split(","), args.seeds, variants, args.out, args.jobs)


if __name__ == "__main__":
    sys.exit(run_resumable(main))

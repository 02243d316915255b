"""FedRPCA server-step speed at MiniLM shapes (target: ≤ 0.2 s per round at one thread): the batched Gram/eigh ADMM
against the paper's plain one-SVD-per-iteration loop, the adaptive solver against the batched ADMM, and the whole
FedRPCA aggregate against FedIT's.

MiniLM-L6 with LoRA rank 4 on query/value: 12 modules, A ``4×384`` and B ``384×4``, i.e. 24 matrices of
``1536 × K`` per round (K = clients). The client updates are synthetic, a shared direction plus dense client noise
(the regime measured on real LoRA updates: S dense, L nearly rank one), ``Δᵢ = (0.5 + U(0,1))·u + noise·zᵢ``
per matrix, seeded. Prints, with the command, seed, load and versions:

* kernel: ``robust_pca`` on the 24-matrix batch vs ``robust_pca_reference`` matrix by matrix (per-round seconds,
  ratio, iterations, max relative difference of L and S);
* solvers: ``robust_pca(solver="adaptive")`` vs ``robust_pca(solver="admm")`` at ``--tol`` (timed alternately in
  the same run: per-round seconds, ratio, iterations, max relative difference of L and S), and both against the
  PCP optimum (both solvers run to ``--tight``, whose agreement is printed too);
* server step: ``FedRPCA.aggregate`` (RPCA, diagnostics, casts; both solvers) vs ``FedIT.aggregate`` on the same
  replies, on a hand-built model with MiniLM's 12 ``384×384`` target shapes.

    python benchmarks/bench_rpca.py                      # 20 clients, 1 thread
    python benchmarks/bench_rpca.py --clients 50 --reference 4   # reference on 4 matrices, extrapolated to 24
    python benchmarks/bench_rpca.py --reference 2 --repeats 5 --skip-server     # the solvers, quickly
    python benchmarks/bench_rpca.py --round-share main --share-rounds 3          # share of a real round (below)

``--round-share CONFIG`` runs FedRPCA on a bundled config (``main``, ``agnews``: MiniLM, 5 clients × 5 steps per
round) in the simulator and reports, per round, the clients' compute and the server's aggregation, whose share of
the round is the target (≤ 5 %), for the paper's ADMM (the run's own: it runs with ``rpca_solver = "admm"``) and,
on the same server state and replies in the same process, for the default ``rpca_solver = "adaptive"`` and FedIT's
plain average, with the largest relative difference of the two solvers' global states. It builds the simulator
itself: it times the method's server step inside the run, round by round.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from common import provenance  # noqa: E402

from fedlowrank.adapters.model import AdaptedModel  # noqa: E402
from fedlowrank.linalg.rpca import SOLVERS, robust_pca, robust_pca_reference  # noqa: E402
from fedlowrank.message import Message, Reply  # noqa: E402
from fedlowrank.methods import get_method  # noqa: E402
from fedlowrank.methods.base import SetupInfo  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--modules", type=int, default=12, help="LoRA modules (MiniLM-L6 q,v: 12)")
    p.add_argument("--width", type=int, default=384, help="hidden size (in = out features of each target)")
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--noise", type=float, default=0.7, help="client noise relative to the shared direction")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="timed repeats of the fast paths (min is printed)")
    p.add_argument("--reference", type=int, default=0,
                   help="run the reference on this many matrices and extrapolate (0 = all of them)")
    p.add_argument("--tol", type=float, default=1e-7, help="tolerance of the timed solver runs (FedRPCA's default)")
    p.add_argument("--tight", type=float, default=1e-12, help="tolerance of the optimum runs (0 = skip them)")
    p.add_argument("--skip-server", action="store_true", help="skip the aggregate timings")
    p.add_argument("--round-share", default="", help="a bundled config (main, agnews): FedRPCA's aggregation share "
                                                     "of real rounds instead of the synthetic timings")
    p.add_argument("--share-rounds", type=int, default=3)
    p.add_argument("--set", action="append", default=[], help="config override of --round-share (section.key=value)")
    return p.parse_args(argv)


def synthetic_updates(shapes: dict[str, tuple[int, ...]], K: int, noise: float, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    common = {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}
    return [{k: 1e-3 * ((0.5 + torch.rand(1, generator=g, dtype=torch.float64)) * u
                        + noise * torch.randn(u.shape, generator=g, dtype=torch.float64))
             for k, u in common.items()} for _ in range(K)]


def best_of(fn, repeats: int) -> tuple[float, float, object]:
    """(min wall seconds, min CPU seconds of this process, last result) over ``repeats`` calls."""
    out, wall, cpu = None, [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return min(wall), min(cpu), out


def alternately(fns: dict[str, object], repeats: int) -> dict[str, tuple[float, float, object]]:
    """:func:`best_of` for each function, the calls alternating so that a load change hits all of them alike."""
    out: dict[str, list] = {k: [[], [], None] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            wall, cpu, out[k][2] = best_of(fn, 1)
            out[k][0].append(wall)
            out[k][1].append(cpu)
    return {k: (min(w), min(c), r) for k, (w, c, r) in out.items()}


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max over the batch of ``‖a_i − b_i‖_F / ‖b_i‖_F``."""
    return float((torch.linalg.vector_norm(a - b, dim=(-2, -1)) / torch.linalg.vector_norm(b, dim=(-2, -1))).max())


def iteration_range(res) -> str:
    it = res.iterations.double()
    return f"mean {it.mean():.0f} min {it.min():.0f} max {it.max():.0f}"


def solvers(args, mats: torch.Tensor) -> None:
    """The adaptive solver against the batched exact ADMM, same run, same tolerance; both against the optimum."""
    B, n, K = mats.shape
    runs = alternately({s: (lambda s=s: robust_pca(mats, tol=args.tol, solver=s)) for s in SOLVERS}, args.repeats)
    (t_a, c_a, exact), (t_f, c_f, fast) = runs["admm"], runs["adaptive"]
    print(f"solvers {B} matrices {n}x{K}, tol {args.tol:g}: adaptive {t_f:.3f} s/round (CPU {c_f:.3f} s), "
          f"admm {t_a:.3f} s/round (CPU {c_a:.3f} s): ratio adaptive/admm {t_f / t_a:.2f} (CPU {c_f / c_a:.2f}); "
          f"load now {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"solvers iterations: adaptive {iteration_range(fast)}, admm {iteration_range(exact)} "
          f"(ratio of totals {float(fast.iterations.sum()) / float(exact.iterations.sum()):.2f}); all converged: "
          f"{bool(fast.converged.all())}/{bool(exact.converged.all())}")
    print(f"solvers adaptive vs admm at tol {args.tol:g}: max rel diff L {max_rel(fast.L, exact.L):.1e}, "
          f"S {max_rel(fast.S, exact.S):.1e}")
    if args.tight > 0:
        t = time.perf_counter()
        opt = robust_pca(mats, tol=args.tight, max_iter=100000)
        t_opt = time.perf_counter() - t
        t = time.perf_counter()
        opt_fast = robust_pca(mats, tol=args.tight, max_iter=100000, solver="adaptive")
        t_opt_fast = time.perf_counter() - t
        print(f"optimum (both solvers at tol {args.tight:g}; admm {iteration_range(opt)}, {t_opt:.2f} s; adaptive "
              f"{iteration_range(opt_fast)}, {t_opt_fast:.2f} s): they agree to max rel diff L "
              f"{max_rel(opt_fast.L, opt.L):.1e}, S {max_rel(opt_fast.S, opt.S):.1e}")
        print(f"optimum distance at tol {args.tol:g} (max rel diff to admm at {args.tight:g}): adaptive L "
              f"{max_rel(fast.L, opt.L):.1e} S {max_rel(fast.S, opt.S):.1e}; admm L {max_rel(exact.L, opt.L):.1e} "
              f"S {max_rel(exact.S, opt.S):.1e}")


def kernel(args, mats: torch.Tensor) -> float:
    B, n, K = mats.shape
    t_fast, c_fast, fast = best_of(lambda: robust_pca(mats), args.repeats)
    m = args.reference or B
    t, c = time.perf_counter(), time.process_time()
    refs = [robust_pca_reference(mats[i]) for i in range(m)]
    t_ref, c_ref = (time.perf_counter() - t) * B / m, (time.process_time() - c) * B / m
    dL = max(float((fast.L[i] - r.L).norm() / r.L.norm()) for i, r in enumerate(refs))
    dS = max(float((fast.S[i] - r.S).norm() / r.S.norm()) for i, r in enumerate(refs))
    same_iters = all(int(fast.iterations[i]) == int(r.iterations) for i, r in enumerate(refs))
    it = fast.iterations.double()
    print(f"kernel  {B} matrices {n}x{K}: batched admm {t_fast:.3f} s/round (CPU {c_fast:.3f} s)  reference "
          f"{t_ref:.3f} s/round (CPU {c_ref:.3f} s){'' if m == B else f' (extrapolated from {m})'}  speed-up {t_ref / t_fast:.1f}x "
          f"(CPU {c_ref / c_fast:.1f}x)")
    print(f"kernel  iterations mean {it.mean():.0f} min {it.min():.0f} max {it.max():.0f}; vs reference: "
          f"max rel diff L {dL:.1e}, S {dS:.1e}, same iteration counts: {same_iters}")


def server_step(args) -> None:
    W, K = args.width, args.clients
    net = nn.Sequential(*[nn.Linear(W, W) for _ in range(args.modules)], nn.Linear(W, 4))
    targets = [str(i) for i in range(args.modules)]
    info = SetupInfo(num_clients=K, client_sizes=[100] * K, client_ranks=[args.rank] * K, rank=args.rank,
                     alpha=2.0 * args.rank, weighting="uniform", seed=args.seed)
    times, cpu, diags = {}, {}, {}
    for name, opts in (("fedit", {}), ("fedrpca", {"rpca_solver": "admm"}),
                       ("fedrpca-adaptive", {"rpca_solver": "adaptive"})):
        model = AdaptedModel(net, targets, [f"{args.modules}.weight", f"{args.modules}.bias"])
        method = get_method(name.split("-")[0], **opts)
        server = method.setup(model, info)
        keys = method.lora_keys(server) + method.head_keys(server)
        deltas = synthetic_updates({k: tuple(server[k].shape) for k in keys}, K, args.noise, args.seed)
        replies = [Reply(i, 100, Message({**{k: server[k] + d[k].float() for k in keys},
                                          "num_examples": 100, "train_loss": 1.0})) for i, d in enumerate(deltas)]
        times[name], cpu[name], _ = best_of(lambda: method.aggregate(server, replies, 1), args.repeats)  # noqa: B023
        diags[name] = method.pop_metrics()
    diag = diags["fedrpca"]
    print(f"server  aggregate of {K} replies, {args.modules} modules rank {args.rank}: fedrpca with rpca_solver = admm "
          f"{times['fedrpca']:.3f} s "
          f"(CPU {cpu['fedrpca']:.3f} s), with rpca_solver = adaptive {times['fedrpca-adaptive']:.3f} s (CPU "
          f"{cpu['fedrpca-adaptive']:.3f} s; iterations mean {diags['fedrpca-adaptive']['rpca/iterations_mean']:.0f}), "
          f"fedit {times['fedit']:.4f} s (RPCA inside: {diag['rpca/seconds']:.3f} s; iterations mean "
          f"{diag['rpca/iterations_mean']:.0f}, E {diag['rpca/E_mean']:.3f}, beta {diag['rpca/beta_mean']:.2f}, "
          f"cos M/L/S {diag['rpca/cos_M_mean']:.2f}/{diag['rpca/cos_L_mean']:.2f}/{diag['rpca/cos_S_mean']:.2f}, "
          f"nnz S {diag['rpca/nnz_S_mean']:.2f}, rank L {diag['rpca/rank_L_mean']:.1f})")


def round_share(args) -> None:
    """FedRPCA on a real config: per round the clients' compute, the aggregation with the paper's ADMM (the run's),
    and on the same server state and replies the adaptive solver's and FedIT's."""
    import copy

    from common import setup_line

    from fedlowrank.config import load_config
    from fedlowrank.methods.fedit import FedIT
    from fedlowrank.runtime.simulator import Simulation

    cfg = load_config(args.round_share, ["method.name=fedrpca", "method.rpca_solver=admm",
                                         f"run.rounds={args.share_rounds}", f"run.threads={args.threads}",
                                         f"run.seed={args.seed}", *args.set])
    cfg.run.eval_every = 10 ** 6  # no evaluation: a round is client compute and aggregation
    sim = Simulation(cfg)
    exact = sim.method
    adaptive = copy.copy(exact)  # shares the set-up state; reports into its own metrics
    adaptive.rpca_solver = "adaptive"
    run_exact = exact.aggregate
    timed: dict[str, float] = {}
    diff: list[float] = []

    def aggregate(server, replies, rnd):
        t = time.perf_counter()
        FedIT.aggregate(adaptive, server, replies, rnd)                 # FedIT's plain average of the same replies
        timed["fedit"] = time.perf_counter() - t
        t = time.perf_counter()
        other = adaptive.aggregate(server, replies, rnd)
        timed["adaptive"] = time.perf_counter() - t
        adaptive.pop_metrics()
        t = time.perf_counter()
        out = run_exact(server, replies, rnd)
        timed["admm"] = time.perf_counter() - t
        diff.append(max(float((other[k] - out[k]).norm() / out[k].norm()) for k in out.tensors()
                        if float(out[k].norm()) > 0))
        return out

    exact.aggregate = aggregate
    print(setup_line(cfg, sim.task))
    for _ in range(args.share_rounds):
        row = sim.run_round()
        t = row["time"]
        base = t["total"] - t["aggregation"] - t["evaluation"]      # the round without its aggregation
        d = row.get("diagnostics", {})
        share = {k: v / (base + v) for k, v in timed.items()}
        print(f"round {row['round']}: clients {t['client_compute']:.2f} s, round without aggregation {base:.2f} s; "
              f"aggregation admm {timed['admm']:.2f} s = {100 * share['admm']:.1f} % of the round "
              f"(iterations mean {d.get('rpca/iterations_mean', float('nan')):.0f}, max "
              f"{d.get('rpca/iterations_max', float('nan')):.0f}), adaptive {timed['adaptive']:.2f} s = "
              f"{100 * share['adaptive']:.1f} % (adaptive/admm {timed['adaptive'] / timed['admm']:.2f}; global state "
              f"max rel diff {diff[-1]:.1e}), fedit {timed['fedit']:.4f} s = {100 * share['fedit']:.2f} %; "
              f"load {', '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(provenance(argv))
    print(f"seed {args.seed}")
    if args.round_share:
        round_share(args)
        return
    n = args.rank * args.width
    shapes = {f"{i}.{f}": (n,) for i in range(args.modules) for f in ("A", "B")}
    deltas = synthetic_updates(shapes, args.clients, args.noise, args.seed)
    mats = torch.stack([torch.stack([d[k] for d in deltas], dim=1) for k in shapes])   # [24, 1536, K]
    kernel(args, mats)
    solvers(args, mats)
    if not args.skip_server:
        server_step(args)


if __name__ == "__main__":
    main()

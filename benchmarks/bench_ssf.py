"""SSF performance and communication on the federated matrix regression (arXiv:2604.25467 §5.2).

1. Speed: one vectorised run of each method (default SSF at r = 20, het = 2, T = 25,000 rounds, S = 10 of
   N = 20, K = 5, b = 20, η_l = 1e-3), wall and CPU seconds. Target: SSF at r = 20 in ≤ 60 s.
2. Against a plain NumPy loop of the same algorithm (``--loop``; target ≤ 1.2×): CPU seconds of
   :func:`numpy_loop` (written here, NumPy/OpenBLAS, one generator for the whole run) and of the vectorised
   runner evaluated every 500 rounds and every round, and the runner with the loop's single random stream
   (:func:`one_stream`: what the per-round seeded streams cost), interleaved in one process, one thread; ratios
   and final RelErr printed (loop and runner differ by their random streams: same distribution, other draws).
   Calls the vectorised runner itself: :func:`one_stream` swaps its random streams.
3. Communication: a short run in the simulator (every message serialised and counted by the ledger); floats
   per participant per round, down and up, against the paper's 4rm (SSF) and 4dm (SCAFFOLD), with and without
   the catch-up of the model copy under partial participation.

    .venv/bin/python benchmarks/bench_ssf.py                       # both parts
    .venv/bin/python benchmarks/bench_ssf.py --rounds 2000 --methods ssf,fedsub --skip-comm
    .venv/bin/python benchmarks/bench_ssf.py --loop --skip-speed --skip-comm --methods ssf,scaffold --rounds 5000
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import provenance  # noqa: E402

import fedlowrank  # noqa: E402
from fedlowrank.config import from_dict  # noqa: E402
from fedlowrank.runtime import vectorized  # noqa: E402
from fedlowrank.runtime.vectorized import run_vectorized  # noqa: E402
from fedlowrank.tasks.matrix_regression import make_problem  # noqa: E402

METHODS = {"ssf": {"name": "ssf"}, "fedsub": {"name": "fedsub"}, "scaffold": {"name": "fedavg-full", "correction": "scaffold"},
           "fedavg": {"name": "fedavg-full"}}


def toy_config(method: dict, rounds: int, rank: int, het: float, lr: float, seed: int, per_round: int = 10,
               eval_every: int = 100, vectorized: bool = True) -> dict:
    """The matrix-regression run as a TOML-shaped dict (``fedlowrank.run``, ``from_dict``)."""
    return {
        "run": {"rounds": rounds, "clients_per_round": per_round, "eval_every": eval_every, "seed": seed,
                "threads": 1, "stop_metric": "rel_error", "stop_above": 1e6, "vectorized": vectorized},
        "task": {"kind": "matrix-regression", "options": {"het": het}},
        "partition": {"kind": "natural", "num_clients": 20},
        "train": {"optimizer": "sgd", "lr": lr, "local_steps": 5, "batch_size": 20},
        "server": {"weighting": "uniform"},
        "lora": {"rank": rank}, "method": dict(method)}


def speed(args) -> None:
    print(f"\n== speed: T={args.rounds}, r={args.rank}, het={args.het}, lr={args.lr}, S=10 of N=20, K=5, b=20 ==")
    for name in args.methods.split(","):
        cpu = time.process_time()
        summary = fedlowrank.run(toy_config(METHODS[name], args.rounds, args.rank, args.het, args.lr, args.seed))
        cpu = time.process_time() - cpu
        print(f"{name:9s} wall={summary['time']['total']:7.2f}s cpu={cpu:7.2f}s rounds={summary['rounds']} "
              f"final rel_error={summary.get('rel_error', float('nan')):.4e} loadavg={os.getloadavg()[0]:.2f}")


def numpy_loop(method: str, rounds: int, rank: int, het: float, lr: float, seed: int, eval_every: int,
               N: int = 20, S: int = 10, K: int = 5, b: int = 20, ridge: float = 0.1) -> list[float]:
    """The matrix-regression toy (``configs/matrix.toml``) as a plain NumPy loop: SSF (``"ssf"``: a new
    Haar projector per round, scaffold control update), Full-SCAFFOLD (``"scaffold"``) or Full-FedAvg
    (``"fedavg"``); uniform weights, η_g = 1. Returns RelErr every ``eval_every`` rounds (the reference's
    random streams are its own, so its numbers match the runner's in distribution, not bit for bit)."""
    A, B, x_star = make_problem(0, N, 100, 10, 50, het, ridge, 0.01)       # [N, n, d], [N, n, m], [d, m]
    n, d, m = A.shape[1], A.shape[2], B.shape[2]
    rng = np.random.default_rng(seed)
    W, c, ci = np.zeros((m, d)), np.zeros((m, d)), np.zeros((N, m, d))
    target, errors = x_star.T, []
    rows = np.arange(S)[:, None]
    for t in range(1, rounds + 1):
        clients = np.sort(rng.choice(N, S, replace=False))
        picks = rng.random((K, S, n)).argsort(-1)[..., :b]                 # [K, S, b]
        Ac, Bc = A[clients], B[clients]
        if method == "ssf":
            Q, R = np.linalg.qr(rng.standard_normal((d, rank)))
            P = (Q * np.sign(np.diag(R))).T                                # [r, d]
            corr = (c - ci[clients]) @ P.T                                 # [S, m, r]
            Y = np.zeros((S, m, rank))
        else:
            P, corr = None, (c - ci[clients] if method == "scaffold" else 0.0)
            Y = np.zeros((S, m, d))
        acc = np.zeros_like(Y)
        for k in range(K):
            Wi = W + (Y @ P if P is not None else Y)
            Ab, Bb = Ac[rows, picks[k]], Bc[rows, picks[k]]
            g = ((Ab @ Wi.transpose(0, 2, 1) - Bb).transpose(0, 2, 1) @ Ab) / b + ridge * Wi
            gp = g @ P.T if P is not None else g
            acc += gp
            Y -= lr * (gp + corr)
        W = W + (Y.mean(0) @ P if P is not None else Y.mean(0))
        if method != "fedavg":
            dc = acc / K - (ci[clients] @ P.T if P is not None else ci[clients])
            ci[clients] += dc @ P if P is not None else dc
            c = c + (dc.sum(0) @ P if P is not None else dc.sum(0)) / N
        if t % eval_every == 0 or t == rounds:
            errors.append(float(np.linalg.norm(W - target) / np.linalg.norm(target)))
    return errors


@contextlib.contextmanager
def one_stream(seed: int):
    """The runner with the loop's randomness: client sampling and minibatch draws from one NumPy generator for the
    whole run instead of a seeded stream per round (what resumable, order-independent runs pay for; same
    distributions, other draws)."""
    rng = np.random.default_rng(seed)

    def sample(seed, rnd, num_clients, per_round):
        return np.sort(rng.choice(num_clients, per_round, replace=False)).tolist()

    def draw(self, clients, rnd):
        picks = rng.random((self.steps, len(clients), self.size)).argsort(-1)[..., :self.batch]
        return vectorized.ClosedFormOracle(self.task, self.rows[np.asarray(clients)[:, None], picks],
                                           self.train.lr_at(rnd, self.rounds))

    saved = vectorized.sample_clients, vectorized.FreshBatches.__call__
    vectorized.sample_clients, vectorized.FreshBatches.__call__ = sample, draw
    try:
        yield
    finally:
        vectorized.sample_clients, vectorized.FreshBatches.__call__ = saved


def loop_ratio(args) -> None:
    """CPU seconds of the NumPy loop and of the vectorised runner evaluated every 500 rounds, evaluated every
    round, and with one random stream for the run (:func:`one_stream`); interleaved ``--repeats`` times, minimum
    kept."""
    print(f"\n== against a plain NumPy loop: T={args.rounds}, r={args.rank}, het={args.het}, lr={args.lr}, "
          f"S=10 of N=20, K=5, b=20, one thread, min of {args.repeats} interleaved repeats ==")
    for name in args.methods.split(","):
        best: dict[str, float] = {}
        relerr: dict[str, float] = {}
        for _ in range(args.repeats):
            cpu = time.process_time()
            errors = numpy_loop(name, args.rounds, args.rank, args.het, args.lr, args.seed, 500)
            best["loop"] = min(best.get("loop", np.inf), time.process_time() - cpu)
            relerr["loop"] = errors[-1]
            for label, every, streams in (("runner", 500, contextlib.nullcontext), ("runner/1", 1, contextlib.nullcontext),
                                          ("one stream", 500, lambda: one_stream(args.seed))):
                cfg = from_dict(toy_config(METHODS[name], args.rounds, args.rank, args.het, args.lr, args.seed,
                                           eval_every=every))
                with streams():
                    cpu = time.process_time()
                    run = run_vectorized(cfg)
                    best[label] = min(best.get(label, np.inf), time.process_time() - cpu)
                relerr[label] = run.final["rel_error"]
        ref = best["loop"]
        print(f"{name:9s} numpy loop {ref:6.2f}s (RelErr {relerr['loop']:.4e}) | runner {best['runner']:6.2f}s "
              f"= {best['runner'] / ref:.2f}x (RelErr {relerr['runner']:.4e}) | runner evaluated every round "
              f"{best['runner/1']:6.2f}s = {best['runner/1'] / ref:.2f}x | runner with one random stream "
              f"{best['one stream']:6.2f}s = {best['one stream'] / ref:.2f}x | loadavg {os.getloadavg()[0]:.2f}")


def kernels(repeat: int = 2000) -> None:
    """The four products of one SSF local step (S = 10, b = 20, d = 100, m = 10, r = 20, float64) with torch's BLAS
    and with NumPy's (the matrix-regression task's gradient kernels use NumPy's: the first two products)."""
    import timeit

    S, b, d, m, r = 10, 20, 100, 10, 20
    g = torch.Generator().manual_seed(0)
    A, W = torch.randn(S, b, d, generator=g, dtype=torch.float64), torch.randn(S, m, d, generator=g, dtype=torch.float64)
    R, P = torch.randn(S, b, m, generator=g, dtype=torch.float64), torch.randn(r, d, generator=g, dtype=torch.float64)
    Y = torch.randn(S, m, r, generator=g, dtype=torch.float64)
    An, Wn, Rn, Pn, Yn = (x.numpy() for x in (A, W, R, P, Y))
    cases = {"A Wᵀ [S,b,d]x[S,d,m]": (lambda: torch.bmm(A, W.mT), lambda: An @ Wn.transpose(0, 2, 1)),
             "Rᵀ A [S,m,b]x[S,b,d]": (lambda: torch.bmm(R.mT, A), lambda: Rn.transpose(0, 2, 1) @ An),
             "G Pᵀ [S·m,d]x[d,r]": (lambda: W @ P.T, lambda: Wn @ Pn.T),
             "Y P [S·m,r]x[r,d]": (lambda: Y @ P, lambda: Yn @ Pn)}
    blas = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())
    print(f"\n== the products of one SSF local step, torch (BLAS {blas.group(1) if blas else '?'}) vs NumPy "
          f"({np.show_config(mode='dicts')['Build Dependencies']['blas']['name']}), microseconds (best of 3 x {repeat}) ==")
    total = [0.0, 0.0]
    for name, (t, n) in cases.items():
        tt = min(timeit.repeat(t, number=repeat, repeat=3)) / repeat * 1e6
        tn = min(timeit.repeat(n, number=repeat, repeat=3)) / repeat * 1e6
        total[0] += tt
        total[1] += tn
        print(f"  {name:22s} torch {tt:7.1f}  numpy {tn:7.1f}  ratio {tt / tn:.2f}")
    print(f"  one local step's products: torch {total[0]:.1f} us, numpy {total[1]:.1f} us, ratio {total[0] / total[1]:.2f}")


def communication(args) -> None:
    d, m, r = 100, 10, args.rank
    print(f"\n== communication (simulator ledger): d={d}, m={m}, r={r}, {args.comm_rounds} rounds ==")
    for name, per_round in (("ssf", 20), ("ssf", 10), ("fedsub", 10), ("scaffold", 20)):
        summary = fedlowrank.run(toy_config(METHODS[name], args.comm_rounds, r, args.het, args.lr, args.seed,
                                            per_round, eval_every=args.comm_rounds, vectorized=False), history=True)
        rows = [row for row in summary["history"] if row["round"] > 1]
        messages = sum(len(row["clients"]) for row in rows)  # one down and one up per participant and round
        down = sum(row["bytes_down"] for row in rows) / messages / 8
        up = sum(row["bytes_up"] for row in rows) / messages / 8
        print(f"{name:9s} S={per_round:2d}/20: per participant per round down={down:8.1f} up={up:8.1f} "
              f"total={down + up:8.1f} floats (bytes/8, header included); 4rm={4 * r * m} 4dm={4 * d * m}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=25_000)
    ap.add_argument("--rank", type=int, default=20)
    ap.add_argument("--het", type=float, default=2.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default="ssf", help=f"comma-separated among {', '.join(METHODS)}")
    ap.add_argument("--comm-rounds", type=int, default=20)
    ap.add_argument("--loop", action="store_true", help="also time the plain NumPy loop against the runner")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of --loop (minimum kept)")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-comm", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(provenance())
    print(f"seed {args.seed}")
    if not args.skip_speed:
        speed(args)
    if args.loop:
        kernels()
        loop_ratio(args)
    if not args.skip_comm:
        communication(args)


if __name__ == "__main__":
    main()

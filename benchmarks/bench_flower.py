"""The same FedIT job in fedlowrank's simulator and in Flower's simulation engine (Ray), measured in one run.

Default job: MiniLM on AG News, 10 clients, 5 per round, 5 rounds::

    .venv/bin/python benchmarks/bench_flower.py
    .venv/bin/python benchmarks/bench_flower.py --smoke        # tiny random BERT, 2 rounds (seconds of work)

Flower side: a user-managed ``flower-superlink --simulation`` on a free port, then
``flwr run examples/flower_app`` with ``num-supernodes = --clients`` (each virtual SuperNode is the client
of its ``partition-id``) and one CPU per ClientApp. Wall time of Flower = from ``flwr run`` to its exit
(SuperLink already up), so it includes the Ray start, the ServerApp and every ClientApp. Both sides get the
same cores: Ray runs ``--ray-cpus`` ClientApps side by side with one torch thread each, our simulator runs the
clients one after another with ``--sim-threads`` (default ``--ray-cpus``) torch threads. Needs
``flwr[simulation]==1.41.0`` (Ray). Prints: wall times, their ratio, final accuracies, and whether the two
global models are equal.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import provenance  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "examples" / "flower_app"
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_sets(args) -> list[str]:
    sets = [f"method.name={args.method}", f"run.seed={args.seed}", f"run.rounds={args.rounds}",
            f"partition.num_clients={args.clients}", f"run.clients_per_round={args.per_round}", "run.threads=1"]
    if args.data_path:
        sets.append(f"data.path={Path(args.data_path).resolve()}")
    if not args.smoke:
        sets += ["task.model=minilm", "data.source=agnews", f"data.max_train_examples={args.max_train}",
                 f"data.max_test_examples={args.max_test}"]
    return sets + list(args.set)


def run_simulator(base: str, sets: list[str]):
    import fedlowrank

    t0 = time.perf_counter()
    summary = fedlowrank.run(base, sets, state=True)
    return time.perf_counter() - t0, summary, summary["state"]


def run_flower(base: str, sets: list[str], args, tmp: Path):
    from fedlowrank.message import State

    port = free_port()
    home = tmp / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\n'
                                      f'address = "127.0.0.1:{port}"\ninsecure = true\n')
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0",
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    superlink = subprocess.Popen([str(BIN / "flower-superlink"), "--insecure", "--simulation", "--port", str(port),
                                  "--disable-runtime-dependency-installation"], cwd=ROOT, env=env,
                                 stdout=(tmp / "superlink.log").open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or superlink.poll() is not None:
                    raise RuntimeError("flower-superlink did not start: " + (tmp / "superlink.log").read_text())
                time.sleep(0.2)
        run_dir = tmp / "flower-run"
        quoted = " ".join(shlex.quote(s) for s in sets)
        (tmp / "run.toml").write_text(f'config = "{base}"\nset = "{quoted}"\n"flower.run-dir" = "{run_dir}"\n')
        federation = (f"num-supernodes={args.clients} client-resources-num-cpus={args.client_cpus} "
                      f"init-args-num-cpus={args.ray_cpus}")
        cmd = [str(BIN / "flwr"), "run", str(APP), "bench", "--stream", "--run-config", str(tmp / "run.toml"),
               "--federation-config", federation]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
        wall = time.perf_counter() - t0
        (tmp / "flwr-run.log").write_text(out.stdout + out.stderr)
        if out.returncode != 0 or not (run_dir / "server_state.safetensors").exists():
            raise RuntimeError(f"flwr run failed ({out.returncode}):\n{(out.stdout + out.stderr)[-4000:]}")
        import json

        summary = json.loads((run_dir / "summary.json").read_text())
        return wall, summary, State.from_bytes((run_dir / "server_state.safetensors").read_bytes()), " ".join(cmd)
    finally:
        superlink.terminate()
        try:
            superlink.wait(timeout=20)
        except subprocess.TimeoutExpired:
            superlink.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny random BERT on 200 examples instead of MiniLM")
    p.add_argument("--method", default="fedit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--per-round", type=int, default=5)
    p.add_argument("--max-train", type=int, default=2000, help="AG News training examples (0 = all 10,001 of train.tsv)")
    p.add_argument("--max-test", type=int, default=1000)
    p.add_argument("--data-path", default="", help="a local AG News copy ('' = $FEDLOWRANK_DATA/agnews, else the hub)")
    p.add_argument("--client-cpus", type=int, default=1, help="Ray CPUs per ClientApp")
    p.add_argument("--ray-cpus", type=int, default=os.cpu_count() or 1, help="CPUs given to Ray")
    p.add_argument("--sim-threads", type=int, default=0,
                   help="torch threads of our simulator (0 = --ray-cpus: both sides get the same cores)")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--set", action="append", default=[], help="further fedlowrank --set overrides")
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.clients, args.per_round = min(args.rounds, 2), min(args.clients, 4), min(args.per_round, 2)
    torch.set_num_threads(1)
    import flwr

    base = "tiny" if args.smoke else "main"
    sets = job_sets(args)
    print(provenance())
    print(f"flwr {flwr.__version__}; job: config {base!r} + {sets}")
    sim_threads = args.sim_threads or args.ray_cpus
    print(f"simulator: {sim_threads} torch threads; Flower: up to {args.ray_cpus // args.client_cpus} ClientApps "
          f"side by side, 1 torch thread each")
    t_sim, s_sim, server_sim = run_simulator(base, [*sets, f"run.threads={sim_threads}"])
    print(f"load average after simulator: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="bench-flower-") as tmp:
        t_fl, s_fl, server_fl, cmd = run_flower(base, sets, args, Path(tmp))
    print(f"load average after Flower: {os.getloadavg()}")
    print(f"flower command: {cmd}")
    diff = max(float((server_sim[k].double() - server_fl[k].double()).abs().max()) for k in server_sim.tensors())
    print(f"simulator:          wall {t_sim:8.1f} s  accuracy {s_sim.get('accuracy', float('nan')):.4f}  "
          f"bytes up {s_sim['bytes_up']} down {s_sim['bytes_down']}")
    print(f"Flower simulation:  wall {t_fl:8.1f} s  accuracy {s_fl.get('accuracy', float('nan')):.4f}  "
          f"bytes up {s_fl['bytes_up']} down {s_fl['bytes_down']}")
    print(f"ratio Flower / simulator: {t_fl / t_sim:.2f}")
    print(f"global models: max |difference| = {diff:.3g}")


if __name__ == "__main__":
    main()

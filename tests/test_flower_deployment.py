"""Flower deployment end to end: a real ``flower-superlink`` and two ``flower-supernode`` processes on
127.0.0.1 (free ports, no TLS), ``flwr run examples/flower_app`` through fedlowrank's launcher (which exits non-zero
when the ServerApp fails; a run with an invalid config checks that); the global model must equal the in-process
simulator's for the same config: FedIT, and SCAFFOLD (control variates in the SuperNodes' ``context.state``)
with a SuperNode that leaves mid-round, whose round must aggregate the remaining reply (the simulator with
the same client dropping out in that round). Every process started here (and whatever it spawned) is killed at the end, also on failure.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

pytest.importorskip("flwr")
if sys.platform != "linux":
    pytest.skip("the process clean-up reads /proc", allow_module_level=True)

import torch  # noqa: E402
from helpers import run_tiny  # noqa: E402

from fedlowrank.message import State  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "examples" / "flower_app"
BIN = Path(sys.executable).parent  # flower-superlink, flower-supernode and flwr are installed next to python
SETS = ("partition.num_clients=2", "run.clients_per_round=2")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pids: list[int]) -> list[int]:
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry))
    out, todo = [], list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(proc: subprocess.Popen) -> list[int]:
    """SIGKILL ``proc`` and every process below it (SuperExec, ServerApp and ClientApp processes start their
    own sessions, so a process-group kill would miss them); returns the pids killed."""
    pids = [proc.pid, *descendants([proc.pid])]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=10)
    return pids


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Federation:
    """A SuperLink and one SuperNode per partition (``launch``), logs in ``tmp``; ``close()`` kills them all."""

    def __init__(self, tmp: Path):
        self.tmp, self.procs, self.logs, self.files, self.orphans = tmp, [], [], [], []
        # SuperLink and SuperNode start `flower-superexec` from PATH
        self.env = {**os.environ, "FLWR_HOME": str(tmp / "flwr-home"), "FLWR_TELEMETRY_ENABLED": "0",
                    "PYTHONUNBUFFERED": "1", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}

    def launch(self, num_nodes: int) -> None:
        tmp, port = self.tmp, free_port()
        (tmp / "flwr-home").mkdir()
        (tmp / "flwr-home" / "config.toml").write_text(
            f'[superlink]\ndefault = "test"\n\n[superlink.test]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')
        self.start("superlink", "flower-superlink", "--insecure", "--port", str(port),
                   "--disable-runtime-dependency-installation")
        deadline = time.monotonic() + 60
        while True:  # the SuperLink's API must be up before `flwr run` submits a run
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and self.procs[0].poll() is None, self.dump()
                time.sleep(0.2)
        for k in range(num_nodes):
            self.start(f"supernode-{k}", "flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{port}",
                       "--port", str(free_port()), "--node-config", f"partition-id={k} num-partitions={num_nodes}")

    def start(self, name: str, exe: str, *args: str) -> subprocess.Popen:
        log = self.tmp / f"{name}.log"
        self.logs.append(log)
        self.files.append(log.open("w"))
        self.procs.append(subprocess.Popen([str(BIN / exe), *args], cwd=ROOT, env=self.env, stdout=self.files[-1],
                                           stderr=subprocess.STDOUT))
        return self.procs[-1]

    def run(self, run_dir: Path, *sets: str, rounds: int, round_timeout: float = 120.0) -> subprocess.Popen:
        """Start ``flwr run`` of the tiny config with ``sets`` (``--set`` syntax); returns the CLI process."""
        overrides = self.tmp / f"{run_dir.name}.toml"
        quoted = " ".join(f"'{s}'" for s in (*SETS, *sets))
        overrides.write_text(f'config = "tiny"\nset = "{quoted}"\n"run.rounds" = {rounds}\n'
                             f'"flower.run-dir" = "{run_dir}"\n"flower.round-timeout" = {round_timeout}\n')
        return self.launch_app(run_dir.name, "--run-config", str(overrides))

    def launch_app(self, name: str, *args: str, app: Path = APP) -> subprocess.Popen:
        """``flwr run`` of ``app`` on the ``test`` connection through fedlowrank's launcher, which exits non-zero when
        the run did not complete (``flwr run`` itself exits 0 either way)."""
        log = self.tmp / f"{name}-flwr-run.log"
        self.logs.append(log)
        self.files.append(log.open("w"))
        self.procs.append(subprocess.Popen([sys.executable, "-m", "fedlowrank.runtime.flower.launch", str(app), "test",
                                            *args], cwd=ROOT, env=self.env, stdout=self.files[-1],
                                           stderr=subprocess.STDOUT))
        return self.procs[-1]

    def stop(self, i: int) -> None:
        """Stop process ``i`` as an operator would (SIGTERM: a SuperNode then tells the SuperLink it leaves);
        what it spawned is killed at ``close()``."""
        self.orphans += descendants([self.procs[i].pid])
        self.procs[i].terminate()
        self.procs[i].wait(timeout=30)

    def close(self) -> list[int]:
        """Kill every process started here and everything they spawned; returns the pids killed."""
        killed = [pid for proc in reversed(self.procs) for pid in kill_tree(proc)]
        for pid in self.orphans:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for f in self.files:
            f.close()
        return killed + self.orphans

    def dump(self) -> str:
        return "\n".join(f"===== {p.name}\n{p.read_text()[-3000:]}" for p in self.logs if p.exists())


def launched(fed: Federation):
    """Yield ``fed`` with a SuperLink and two SuperNodes running; afterwards every process it started is dead."""
    try:
        fed.launch(num_nodes=2)
        yield fed
    finally:
        killed = fed.close()
        time.sleep(0.5)
        assert not [pid for pid in killed if alive(pid)]


@pytest.fixture
def federation(tmp_path):
    yield from launched(Federation(tmp_path))


def load_state(run_dir: Path) -> State:
    return State.from_bytes((run_dir / "server_state.safetensors").read_bytes())


def assert_close(a: State, b: State) -> None:
    assert sorted(a.tensors()) == sorted(b.tensors())
    for k in a.tensors():
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


def train_messages(log: Path) -> int:
    return log.read_text().count("Receiving: train message")


def test_deployment_matches_simulator_and_survives_a_lost_node(federation, tmp_path):
    t0 = time.monotonic()
    # a ServerApp that fails (an invalid run config) fails the launcher: exit 1, saying so
    cli = federation.run(tmp_path / "invalid", "method.name=fedit", rounds='"x"')
    assert cli.wait(timeout=300) == 1, federation.dump()
    assert "ended as finished:failed" in federation.logs[-1].read_text(), federation.dump()
    # FedIT, 2 rounds: the global model equals the simulator's
    run_dir = tmp_path / "fedit"
    cli = federation.run(run_dir, "method.name=fedit", rounds=2)
    assert cli.wait(timeout=300) == 0, federation.dump()
    ref = run_tiny("fedit", *SETS, rounds=2)
    assert_close(load_state(run_dir), ref.server)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row, sim_row in zip(rows, ref.history, strict=True):
        assert (row["replied"], row["bytes_up"], row["bytes_down"]) == (sim_row["replied"], sim_row["bytes_up"],
                                                                        sim_row["bytes_down"])

    # SCAFFOLD (control variates in each SuperNode's context.state), 2 rounds; SuperNode 1 leaves while it
    # trains in round 2: that round aggregates client 0's reply alone (run.min_replies = 1), which is what the
    # simulator computes when client 1 drops out in round 2 (run.dropout_schedule = [[2, 1]])
    run_dir, node_log = tmp_path / "scaffold", federation.logs[2]
    seen = train_messages(node_log)
    cli = federation.run(run_dir, "method.name=fedit", "method.correction=scaffold", rounds=2)
    deadline = time.monotonic() + 120
    while train_messages(node_log) < seen + 2:
        assert time.monotonic() < deadline and cli.poll() is None, federation.dump()
        time.sleep(0.1)
    federation.stop(2)
    assert cli.wait(timeout=300) == 0, federation.dump()
    out = federation.logs[-1].read_text()
    assert "round 2: client 1 dropped (node " in out and "answered with an error" in out, federation.dump()
    assert "round 2: 1 usable replies of 2 sampled clients; run.min_replies = 1 is met, aggregated them" in out
    ref = run_tiny("fedit", *SETS, "method.correction=scaffold", "run.dropout_schedule=[[2, 1]]", rounds=2)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row, sim_row in zip(rows, ref.history, strict=True):
        for key in ("replied", "dropped", "train_loss", "accuracy", "bytes_up", "bytes_down"):
            assert row.get(key) == sim_row.get(key), key
    assert rows[1]["replied"] == [0] and rows[1]["dropped"] == [1]
    assert_close(load_state(run_dir), ref.server)
    print(f"deployment test: {time.monotonic() - t0:.1f} s")

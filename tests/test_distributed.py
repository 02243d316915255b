"""The distributed runner (runtime/distributed.py) on CPU gloo ranks spawned on this machine: two ranks equal one
process bit for bit for every registered method (and coded runs of each family), resume across rank counts, a rank
that dies, bad ``run.devices``.

Every spawned job runs many runs in each rank (spawning costs seconds); rank 0 writes what it got under tmp_path.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from fedlowrank.cli import error_line, main
from fedlowrank.config import ConfigError
from fedlowrank.message import State
from fedlowrank.methods import available_methods
from fedlowrank.runtime.distributed import Distributed, RankFailure, assign, spawn
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.tasks import build_task

from helpers import started, tiny_config, tiny_task

SETS = ("run.clients_per_round=3", "run.rounds=2")  # 4 clients, 3 a round: assignments change between rounds
METHODS = sorted(available_methods())
RESUMED = ("fedsa-lora", "scaffold")  # per-client states (personal adapters, control variates) that move
PLAIN_SGD = {"ssf": ("train.optimizer=sgd", "train.lr=0.05"), "fedsub": ("train.optimizer=sgd", "train.lr=0.05")}
CODED = {  # coded runs (docs/codecs.md), a method of each family: residuals move with their clients' states
    "fedit": ("uplink.codec=int4", "uplink.rounding=stochastic", "uplink.error_feedback=true", "downlink.codec=int8"),
    "fedavg-full": ("uplink.codec=topk", "uplink.error_feedback=true", "uplink.lossless=zlib"),
    "ssf": ("uplink.codec=int8", "uplink.error_feedback=true", "downlink.codec=int4"),
    "florg": ("uplink.codec=bf16", "downlink.codec=fp16"),
}


def _config(method: str, *sets: str):
    return tiny_config(f"method.name={method}", *SETS, *PLAIN_SGD.get(method, ()), *sets)


def _comparable(history: list[dict]) -> list[dict]:
    """The history rows without what depends on the machine: times (a method's diagnostics included), memory."""
    rows = []
    for row in history:
        row = {k: v for k, v in row.items() if k not in ("time", "peak_rss_mb")}
        if "diagnostics" in row:
            row["diagnostics"] = {k: v for k, v in row["diagnostics"].items() if not k.endswith("seconds")}
        rows.append(row)
    return rows


def _result(run) -> dict:
    return {"history": _comparable(run.history), "ledger": run.ledger.rows}


def _write(out: Path, name: str, run) -> None:
    (out / f"{name}.json").write_text(json.dumps(_result(run)))
    (out / f"{name}.server").write_bytes(run.server.to_bytes())


def _write_states(out: Path, name: str, run) -> None:
    states = State({f"{k}/{key}": v for k in run.store for key, v in run.store[k].items()})
    (out / f"{name}.states-{run.rank}").write_bytes(states.to_bytes())


def _read(out: Path, name: str) -> tuple[dict, bytes]:
    return json.loads((out / f"{name}.json").read_text()), (out / f"{name}.server").read_bytes()


CCVR = "task.options.ccvr_samples=20"  # the classifier calibrated after the last round, on rank 0


def _ccvr_task():
    return build_task(tiny_config(CCVR))


def _job(out: str, resume_dir: str) -> int:
    """Each rank of the 2-rank job: every method for 2 rounds, a 3-round run to resume on 1 rank, and the resume
    on 2 ranks of a 1-rank checkpoint."""
    out_path = Path(out)
    rank = int(os.environ["RANK"])
    moves = 0
    for method in METHODS:
        run = Distributed(_config(method), task=tiny_task())
        run.run()
        moves += run.moves
        _write_states(out_path, method, run)
        if rank == 0:
            _write(out_path, method, run)
    for method, sets in CODED.items():
        run = Distributed(_config(method, *sets), task=tiny_task())
        run.run()
        _write_states(out_path, f"coded-{method}", run)
        if rank == 0:
            _write(out_path, f"coded-{method}", run)
    run = Distributed(_config("fedit", CCVR), task=_ccvr_task())
    run.run()
    if rank == 0:
        _write(out_path, "ccvr-fedit", run)
    for method in RESUMED:
        run = Distributed(_config(method, "run.rounds=3", "run.checkpoint_every=1"), task=tiny_task(),
                          run_dir=out_path / f"two-ranks-{method}")
        run.run()
        run = Distributed.resume(Path(resume_dir) / method, task=tiny_task(), round=2)
        run.run()
        if rank == 0:
            _write(out_path, f"resumed-{method}", run)
    (out_path / f"moves-{rank}").write_text(str(moves))
    return 0


def _reference(method: str, *sets: str, run_dir: Path | None = None) -> Simulation:
    sim = Simulation(_config(method, *sets), task=tiny_task(), run_dir=run_dir)
    sim.run()
    return sim


def _assert_equal(got: tuple[dict, bytes], sim: Simulation, what: str = "") -> None:
    result, server = got
    assert result == json.loads(json.dumps(_result(sim))), what
    assert server == sim.server.to_bytes(), what


def test_assignment_is_balanced_deterministic_and_changes_between_rounds():
    assert assign({5: 10.0, 1: 10.0, 2: 30.0, 7: 5.0}, 2) == {2: 0, 1: 1, 5: 1, 7: 1}  # loads 30, 25
    assert assign({5: 10.0, 1: 10.0, 2: 30.0, 7: 5.0, 3: 20.0}, 2) == {2: 0, 3: 1, 1: 1, 5: 0, 7: 1}
    assert assign({3: 1.0}, 1) == {3: 0}
    from fedlowrank.runtime.engine import sample_clients

    cfg = _config("fedit")
    run_sizes = [len(p) for p in Simulation(cfg, task=tiny_task()).parts]
    owners = [assign({k: float(run_sizes[k]) for k in sample_clients(cfg.run.seed, rnd, 4, 3)}, 2) for rnd in (1, 2)]
    assert any(owners[0][k] != owners[1][k] for k in owners[0].keys() & owners[1].keys())


def test_two_gloo_ranks_equal_one_process_for_every_method_and_resume_across_rank_counts(tmp_path):
    resume_dir = tmp_path / "one-rank"
    uninterrupted = {}
    for method in RESUMED:  # 1-rank runs, a checkpoint a round (the newest two kept), resumed on 2 ranks from round 2
        uninterrupted[method] = _reference(method, "run.rounds=3", "run.checkpoint_every=1",
                                           run_dir=resume_dir / method)
    out = tmp_path / "out"
    out.mkdir()
    t0 = time.monotonic()
    assert spawn(_job, (str(out), str(resume_dir)), ["cpu", "cpu"], grace_s=60) == [0, 0]
    print(f"2-rank job: {time.monotonic() - t0:.1f} s")
    assert sum(int((out / f"moves-{r}").read_text()) for r in (0, 1)) > 0  # client states moved between ranks
    for method, name, sets in [*((m, m, ()) for m in METHODS), *((m, f"coded-{m}", s) for m, s in CODED.items())]:
        sim = _reference(method, *sets)
        _assert_equal(_read(out, name), sim, name)
        states = {}
        for r in (0, 1):
            states.update(State.from_bytes((out / f"{name}.states-{r}").read_bytes()))
        expected = {f"{k}/{key}": v for k in sim.store for key, v in sim.store[k].items()}
        assert states.keys() == expected.keys(), name
        if "uplink.error_feedback=true" in sets:  # the residuals are in the states compared
            assert any("/uplink.residual/" in key for key in expected), name
        for key, value in expected.items():
            assert (torch.equal(states[key], value) if isinstance(value, torch.Tensor)
                    else states[key] == value), (name, key)
    calibrated = Simulation(_config("fedit", CCVR), task=_ccvr_task())
    calibrated.run()
    assert "ccvr" in calibrated.history[-1]
    _assert_equal(_read(out, "ccvr-fedit"), calibrated, "ccvr-fedit")
    for method in RESUMED:
        _assert_equal(_read(out, f"resumed-{method}"), uninterrupted[method])  # 1 -> 2 ranks
        resumed = Simulation.resume(out / f"two-ranks-{method}", task=tiny_task(), round=2)  # 2 -> 1 rank
        resumed.run()
        assert _comparable(resumed.history) == _comparable(uninterrupted[method].history)
        assert resumed.ledger.rows == uninterrupted[method].ledger.rows
        assert resumed.server.to_bytes() == uninterrupted[method].server.to_bytes()


class _Dies(Distributed):
    def train_clients(self, rnd, sent, data, cfg):
        if self.rank == 1 and rnd == 2:
            os._exit(9)
        return super().train_clients(rnd, sent, data, cfg)


def _dying_job(out: str) -> int:
    rank = int(os.environ["RANK"])
    cfg = _config("scaffold", "run.rounds=3", "run.checkpoint_every=1", "run.collective_timeout_s=30")
    try:
        _Dies(cfg, task=tiny_task(), run_dir=Path(out) / "run").run()
    except RankFailure as exc:
        (Path(out) / f"error-{rank}").write_text(str(exc))
        return 1
    return 0


def test_a_rank_that_dies_stops_the_other_with_one_line_and_resume_continues(tmp_path):
    t0 = time.monotonic()
    codes = spawn(_dying_job, (str(tmp_path),), ["cpu", "cpu"], grace_s=60)
    assert time.monotonic() - t0 < 60 + 30  # within the collective timeout, with the start of two processes
    assert codes == [1, 9]
    line = (tmp_path / "error-0").read_text()
    assert "\n" not in line and "rank 1" in line and f"fedlowrank resume {tmp_path / 'run'}" in line
    resumed = Simulation.resume(tmp_path / "run", task=tiny_task())
    assert resumed.round == 1
    resumed.run()
    reference = _reference("scaffold", "run.rounds=3")
    assert _comparable(resumed.history) == _comparable(reference.history)
    assert resumed.server.to_bytes() == reference.server.to_bytes()


def test_a_stopped_rank_is_reported_as_such_not_as_a_bug():
    line = error_line(RankFailure("rank 0 of 2: rank 1 stopped or did not answer within run.collective_timeout_s"))
    assert line == "error: rank 0 of 2: rank 1 stopped or did not answer within run.collective_timeout_s"


@pytest.mark.parametrize("sets, message", [
    (["run.devices=[\"gpu\"]"], "run.devices[0] must be one of"),
    (["run.devices=[\"auto\"]"], "run.devices[0] must be cpu, cuda or cuda:N"),
    (["run.devices=[\"cpu\",\"cuda:0\"]"], "run.devices mixes CPUs and GPUs"),
    (["run.devices=[\"cpu\",\"cpu\",\"cpu\"]", "run.clients_per_round=2"], "more than run.clients_per_round = 2"),
])
def test_bad_devices_are_refused_by_the_config(sets, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        tiny_config(*sets)


@pytest.mark.skipif(torch.cuda.device_count() > 7, reason="this machine has a cuda:7")
def test_a_missing_device_is_one_error_line(tmp_path, capsys):
    status = main(["run", "tiny", "--out", str(tmp_path / "run"), "--set", "run.devices=[\"cuda:7\",\"cuda:7\"]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status != 0 and len(err) == 1 and err[0].startswith("error: run.devices[0] = 'cuda:7'")
    assert not (tmp_path / "run").exists()


def test_run_devices_outside_a_job_is_refused_by_the_python_api():
    from fedlowrank.runtime import runner_for

    with pytest.raises(ValueError, match="run.devices"):
        runner_for(tiny_config('run.devices=["cpu","cpu"]'))


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (Linux: /proc/PID/task/*/children)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                children = []
            found += children
            todo += children
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the ranks through /proc (Linux)")
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT to the group", "kill -9"])
def test_a_stopped_launcher_stops_every_rank_at_a_rounds_end_with_that_round_saved(tmp_path, how):
    """``run.devices`` with 2 ranks: SIGTERM to the launcher, Ctrl-C (SIGINT to its process group), or the launcher
    killed outright. Every rank stops at the end of the same round, rank 0 saving it, within 10 s (killed: within
    run.collective_timeout_s); one line says where and how to continue (none from rank 1); no rank runs on."""
    import signal

    run_dir, err_file = tmp_path / "run", tmp_path / "stderr.txt"
    proc = started(["run", "tiny", "--out", str(run_dir), "--set", 'run.devices=["cpu","cpu"]', "--set",
                    "run.rounds=2000", "--set", "run.checkpoint_seconds=0", "--set", "run.collective_timeout_s=30"],
                   err_file, lambda text: "round 3/2000" in text)
    ranks = _descendants(proc.pid)
    assert ranks
    limit = 30 if how == "kill -9" else 10  # run.collective_timeout_s; the bound after a round's end
    t0 = time.monotonic()
    {"SIGTERM": lambda: os.kill(proc.pid, signal.SIGTERM), "SIGINT to the group": lambda: os.killpg(proc.pid, signal.SIGINT),
     "kill -9": lambda: os.kill(proc.pid, signal.SIGKILL)}[how]()
    try:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # say where each rank is (faulthandler on SIGUSR1) before failing
            for p in ranks:
                if _alive(p):
                    os.kill(p, signal.SIGUSR1)
            time.sleep(2)
            pytest.fail(f"the launcher did not end within 60 s of {how}; its stderr and the ranks' stacks:\n"
                        f"{err_file.read_text()}")
        while any(_alive(p) for p in ranks):
            assert time.monotonic() - t0 < limit, "a rank runs on after its launcher stopped"
            time.sleep(0.2)
    finally:
        for p in [proc.pid, *ranks]:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    assert time.monotonic() - t0 < limit
    text = err_file.read_text()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    saved = int((run_dir / "checkpoints" / "latest").read_text().strip()[len("round-"):])
    assert 3 <= saved < 2000 and len(rows) == saved  # the last finished round, saved by rank 0
    if how != "kill -9":
        assert proc.returncode == {"SIGTERM": 143, "SIGINT to the group": 130}[how], text
        what = "stopped by SIGTERM" if how == "SIGTERM" else "interrupted"
        stops = [line for line in text.splitlines() if line.startswith(what)]
        assert stops == [f"{what} in round {saved + 1} of 2000; saved the state after round {saved}; continue with: "
                         f"fedlowrank resume {run_dir}"], text
        assert "error" not in text and "Traceback" not in text, text


def _fail_or_hold(seconds: float) -> int:
    """A rank's work for the test below: rank 0 fails at once, rank 1 holds SIGTERM (as a rank in a round does)
    and would run for ``seconds``."""
    import signal

    if os.environ["RANK"] == "0":
        return 3
    signal.signal(signal.SIGTERM, lambda *_: None)
    time.sleep(seconds)
    return 0


def test_a_rank_that_holds_sigterm_is_killed_once_the_grace_after_a_failure_ends():
    from fedlowrank.runtime.distributed import spawn

    t0 = time.monotonic()
    codes = spawn(_fail_or_hold, (120.0,), ["cpu", "cpu"], grace_s=1.0)
    assert codes == [3, -9] and time.monotonic() - t0 < 60

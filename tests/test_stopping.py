"""Runs that survive how people stop them: SIGTERM and Ctrl-C save the state after the last finished round and say
how to continue, and ``fedlowrank resume`` then finishes with the result of an uninterrupted run; checkpoints by time
interval, at a bounded cost; the vectorised runner writes a run like the others; the summary is a table for people.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import compare_rounds_begun, ended, started, tiny_config, tiny_task
from test_robustness import _assert_same_run

import fedlowrank
from fedlowrank.cli import main
from fedlowrank.config import load_config
from fedlowrank.message import State
from fedlowrank.runtime import engine, simulator
from fedlowrank.runtime.checkpoint import Checkpointer, checkpoint_folders, latest_checkpoint, load_checkpoint
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.runtime.stopping import StopRequested, check_stop, interruptible, stop_signals
from fedlowrank.runtime.vectorized import Vectorized

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
COMPARE_2000 = ["compare", "tiny", "--methods", "fedit,ffa-lora", "--seeds", "0", "--jobs", "2", "--set",
                "run.rounds=2000", "--set", "run.threads=1"]  # two runs that outlast any test, one per worker


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _cfg(*sets: str, rounds: int = 5):
    return tiny_config("method.name=scaffold", f"run.rounds={rounds}", "run.clients_per_round=3", *sets)


# -- a stop signal: the state after the last finished round is saved, resume finishes the run exactly ---------------
def test_sigterm_to_a_cli_run_leaves_a_run_that_resume_finishes_like_an_uninterrupted_one(tmp_path):
    out, rounds = tmp_path / "run", 12
    sets = ["--set", f"run.rounds={rounds}", "--set", "method.name=scaffold", "--set", "run.clients_per_round=3"]
    proc = subprocess.Popen([sys.executable, "-m", "fedlowrank", "run", "tiny", "--out", str(out), *sets], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    last = err.strip().splitlines()[-1]
    stopped = load_checkpoint(latest_checkpoint(out)).round
    assert 1 <= stopped < rounds and len(rows(out)) == stopped
    assert last.startswith("stopped by SIGTERM in round ") and last.endswith(
        f"saved the state after round {stopped}; continue with: fedlowrank resume {out}"), last
    assert main(["resume", str(out), "--quiet", "--json"]) == 0
    straight = Simulation(_cfg(rounds=rounds), task=tiny_task())
    straight.run()
    resumed = Simulation.from_checkpoint(out, task=tiny_task())
    _assert_same_run(straight, resumed)


@pytest.fixture(autouse=True)
def default_stop_handlers():
    """Python's own handlers for SIGINT and SIGTERM during each test, whatever the test process inherited (a job
    started in the background by a script ignores SIGINT), and the inherited ones afterwards."""
    inherited = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for s, handler in inherited.items():
        signal.signal(s, handler)


def _signal_in(monkeypatch, where, rnd: int, signum=signal.SIGINT):
    """Send ``signum`` to this process from inside ``where`` (``"training"``: a client's local training, interruptible;
    ``"commit"``: the round becoming the run's, not) in round ``rnd``."""
    if where == "training":
        real = simulator.client_update

        def update(method, model, msg, state, task, indices, cfg, client, r, *args, **kwargs):
            if r == rnd:
                os.kill(os.getpid(), signum)
            return real(method, model, msg, state, task, indices, cfg, client, r, *args, **kwargs)

        monkeypatch.setattr(simulator, "client_update", update)
    else:
        real_commit = simulator.Simulation.commit_round

        def commit(self, outcome, *args, **kwargs):
            if outcome.row["round"] == rnd:
                os.kill(os.getpid(), signum)
            return real_commit(self, outcome, *args, **kwargs)

        monkeypatch.setattr(simulator.Simulation, "commit_round", commit)


@pytest.mark.parametrize("where, saved", [("training", 2), ("commit", 3)])
def test_a_stop_signal_saves_the_last_finished_round_and_resume_is_exact(where, saved, tmp_path, monkeypatch):
    """In local training the run stops at once (round 3 is lost, the state after round 2 saved); while the round is
    being committed (state, files, checkpoint), it finishes that first. Either way the run resumed equals the run
    never stopped."""
    straight = Simulation(_cfg(), task=tiny_task())
    straight.run()
    _signal_in(monkeypatch, where, rnd=3)
    stopped = Simulation(_cfg(), task=tiny_task(), run_dir=tmp_path)
    with pytest.raises(StopRequested) as exc:
        stopped.run()
    monkeypatch.undo()
    assert exc.value.exit_status == 130 and stopped.round == saved
    assert load_checkpoint(latest_checkpoint(tmp_path)).round == saved and [r["round"] for r in rows(tmp_path)] == [
        *range(1, saved + 1)]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers are put back
    resumed = Simulation.resume(tmp_path, task=tiny_task())
    resumed.run()
    _assert_same_run(straight, resumed)


def test_ctrl_c_in_the_cli_says_how_to_resume_and_that_command_works(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    _signal_in(monkeypatch, "training", rnd=2)
    assert main(["run", "tiny", "--out", str(out), "--quiet", "--set", "run.rounds=3"]) == 130
    monkeypatch.undo()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"interrupted in round 2 of 3; saved the state after round 1; continue with: fedlowrank resume {out}"]
    assert main(["resume", str(out), "--quiet"]) == 0
    assert [r["round"] for r in rows(out)] == [1, 2, 3]


def test_a_stop_before_any_round_saves_round_0_and_resume_starts_over(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    _signal_in(monkeypatch, "training", rnd=1, signum=signal.SIGTERM)
    assert main(["run", "tiny", "--out", str(out), "--quiet"]) == 143
    monkeypatch.undo()
    assert "saved the state after round 0; continue with: fedlowrank resume" in capsys.readouterr().err
    assert main(["resume", str(out), "--quiet"]) == 0
    assert [r["round"] for r in rows(out)] == [1, 2]


def test_without_a_run_directory_a_stop_writes_nothing_and_raises(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _signal_in(monkeypatch, "training", rnd=1)
    with pytest.raises(KeyboardInterrupt):
        fedlowrank.run("tiny")
    assert list(tmp_path.iterdir()) == []


def test_interruptible_raises_at_once_and_elsewhere_the_signal_waits():
    order = []
    with stop_signals():
        os.kill(os.getpid(), signal.SIGTERM)  # outside interruptible: held
        order.append("after the signal")
        with pytest.raises(StopRequested) as exc:
            with interruptible():
                order.append("never")
    assert order == ["after the signal"] and exc.value.name == "SIGTERM" and exc.value.exit_status == 143
    with stop_signals():
        with pytest.raises(StopRequested):
            with interruptible():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)  # the handler raises here at once
                order.append("never")
    assert order == ["after the signal"]


def test_a_signal_inside_a_finalizer_is_noted_and_raised_by_the_next_check(monkeypatch):
    """A stop raised inside ``__del__`` or a weakref callback (weakref.py's) would be printed and dropped by Python:
    it is noted instead, and the next check raises it."""
    import sys

    from fedlowrank.runtime.stopping import check_stop, in_finalizer

    class Dropped:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)  # the handler runs here, inside the finalizer

    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", dropped.append)  # where Python puts an exception of a finalizer
    with stop_signals():
        with interruptible():
            obj = Dropped()
            del obj  # its finalizer gets the signal: nothing raised here
        with pytest.raises(StopRequested) as exc:
            check_stop()
    assert exc.value.name == "SIGTERM" and dropped == []
    scope: dict = {"sys": sys}
    exec(compile("def remove():\n    return sys._getframe()\n", "/usr/lib/python3/weakref.py", "exec"), scope)
    assert in_finalizer(scope["remove"]()) and not in_finalizer(sys._getframe())


def test_an_ignored_signal_stays_ignored_while_a_run_goes():
    """A job that a script starts with ``&`` has SIGINT ignored: a run keeps it so, and catches SIGTERM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with stop_signals():
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, signal.SIG_DFL)
        with interruptible():
            os.kill(os.getpid(), signal.SIGINT)  # ignored: nothing is raised
        check_stop()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


# -- checkpoints by time interval, at a bounded cost ------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_checkpoints_follow_the_interval_and_never_cost_more_than_2_percent(tmp_path):
    clock = Clock()
    cfg = tiny_config("run.rounds=100", "run.checkpoint_seconds=60")
    ck = Checkpointer(cfg, tmp_path, clock)
    clock.now = 59.0
    assert not ck.due(1)
    clock.now = 60.0
    assert ck.due(1)
    ck._last_save, ck._last_cost = 60.0, 2.0  # a save that took 2 s: the next one waits 100 s, not 60
    clock.now = 60.0 + 99.0
    assert not ck.due(2)
    clock.now = 60.0 + 100.0
    assert ck.due(2) and ck.due(100)  # the last round is always saved
    clock.now = 1e6
    assert Checkpointer(tiny_config("run.checkpoint_seconds=0"), tmp_path, clock).due(1) is False
    assert Checkpointer(cfg, None).due(100) is False
    assert tiny_config().run.checkpoint_seconds == 60.0


def test_a_slow_run_checkpoints_on_its_own_without_checkpoint_every(tmp_path, monkeypatch):
    clock = Clock()
    real = engine.client_update

    def slow(*args, **kwargs):  # every client takes 25 s of the fake clock: a round of 2 takes 50 s
        clock.now += 25.0
        return real(*args, **kwargs)

    monkeypatch.setattr(simulator, "client_update", slow)
    sim = Simulation(tiny_config("run.rounds=4"), task=tiny_task(), run_dir=tmp_path)
    sim.checkpoints = Checkpointer(sim.cfg, tmp_path, clock)
    sim.run()
    assert sorted(checkpoint_folders(tmp_path)) == [2, 4]  # 100 s after the start, and the last round
    assert sim.checkpoints.saved_round == 4


# -- the vectorised runner writes a run like the others ----------------------------------------------------------
VECTOR_SETS = ["--set", "run.rounds=40", "--set", "run.eval_every=10", "--set", "task.options.num_clients=4",
               "--set", "partition.num_clients=4", "--set", "run.clients_per_round=2", "--set", "task.options.dim=8",
               "--set", "task.options.outputs=3", "--set", "lora.rank=4"]


def test_vectorized_cli_run_writes_a_run_directory_and_the_same_lines(tmp_path, capsys):
    out = tmp_path / "vec"
    assert main(["run", "matrix", "--vectorized", "--out", str(out), *VECTOR_SETS]) == 0
    captured = capsys.readouterr()
    assert {"config.json", "partition.json", "metrics.jsonl", "summary.json", "curves.png", "checkpoints"} <= {
        p.name for p in out.iterdir()}
    assert json.loads((out / "config.json").read_text())["run"]["vectorized"] is True
    history = rows(out)
    assert [r["round"] for r in history] == [10, 20, 30, 40] and all(r["rounds"] == 10 for r in history)
    assert sorted(checkpoint_folders(out)) == [40]
    lines = [line for line in captured.err.splitlines() if line.startswith("[ssf] round ")]
    assert len(lines) == 4 and lines[-1].startswith("[ssf] round 40/40 | rel_error ") and "ETA 0:00:00" in lines[-1]
    assert captured.out.splitlines()[0].split() == ["method", "ssf,", "40", "rounds"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 40 and summary["rel_error"] == history[-1]["rel_error"]


def test_a_stopped_vectorized_run_resumes_exactly(tmp_path, monkeypatch):
    cfg = load_config("matrix", [s for s in VECTOR_SETS if s != "--set"] + ["run.vectorized=true"])
    straight = Vectorized(cfg)
    straight.run()
    real = Vectorized.run_round

    def stop_at_25(self):
        if self.round == 25:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self)

    monkeypatch.setattr(Vectorized, "run_round", stop_at_25)
    stopped = Vectorized(cfg, run_dir=tmp_path)
    with pytest.raises(StopRequested):
        stopped.run()
    monkeypatch.undo()
    assert load_checkpoint(latest_checkpoint(tmp_path)).round == 26  # the round in progress finished first
    assert main(["resume", str(tmp_path), "--quiet"]) == 0
    resumed = Vectorized.from_checkpoint(tmp_path)
    assert resumed.round == 40 and sorted(resumed.server) == sorted(straight.server)
    for k, v in straight.server.items():
        assert torch.equal(v, resumed.server[k]) if isinstance(v, torch.Tensor) else v == resumed.server[k], k
    assert [r["rel_error"] for r in rows(tmp_path)] == [r["rel_error"] for r in straight.history]


def test_the_simulator_refuses_a_vectorized_config():
    cfg = load_config("matrix", ["run.vectorized=true", "run.rounds=2"])
    with pytest.raises(ValueError, match="run.vectorized = true: this run is the vectorised runner's"):
        Simulation(cfg)


# -- the summary, for people --------------------------------------------------------------------------------
def test_run_prints_a_short_table_and_json_on_request(tmp_path, capsys):
    assert main(["run", "tiny", "--out", str(tmp_path / "a"), "--quiet"]) == 0
    table = capsys.readouterr().out.splitlines()
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert table[0].split() == ["method", "fedit,", "2", "rounds"]
    # the tiny random model predicts one class: the table says which, and that it collapsed
    assert [line.split()[0] for line in table[1:]] == ["accuracy", "loss", "most", "collapse", "best", "bytes",
                                                       "time", "peak"]
    assert table[1].split()[1] == f"{summary['accuracy']:.4g}" and len(table) == 9
    assert f"class {summary['predictions']['top_label']!r}" in table[3]
    assert main(["run", "tiny", "--out", str(tmp_path / "b"), "--quiet", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes_up"] == summary["bytes_up"]


def test_the_state_in_a_checkpoint_is_the_runs(tmp_path):
    sim = Simulation(_cfg(rounds=2), task=tiny_task(), run_dir=tmp_path)
    sim.run()
    saved: State = load_checkpoint(latest_checkpoint(tmp_path)).server
    assert all(torch.equal(v, saved[k]) for k, v in sim.server.tensors().items())


# -- a signal during the last round's checkpoint; compare stops and says how to continue ------------------------------
def _signal_while_saving(monkeypatch, rnd: int, signum=signal.SIGTERM):
    """Send ``signum`` to this process while the checkpoint of round ``rnd`` is being written (the signal is held)."""
    real = Checkpointer.save

    def save(self, run):
        if run.round == rnd:
            os.kill(os.getpid(), signum)
        return real(self, run)

    monkeypatch.setattr(Checkpointer, "save", save)


def test_a_signal_during_the_last_checkpoint_stops_the_run_once_it_is_written(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    _signal_while_saving(monkeypatch, rnd=2)
    assert main(["run", "tiny", "--out", str(out), "--quiet"]) == 143
    monkeypatch.undo()
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"stopped by SIGTERM after the last round; saved the state after round 2; continue with: fedlowrank resume {out}")
    assert load_checkpoint(latest_checkpoint(out)).round == 2 and not (out / "summary.json").exists()
    assert main(["resume", str(out), "--quiet"]) == 0
    assert [r["round"] for r in rows(out)] == [1, 2] and (out / "summary.json").is_file()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_compare_stopped_during_a_runs_last_checkpoint_does_not_start_the_next_and_says_how_to_continue(
        tmp_path, monkeypatch, capsys, signum):
    out = tmp_path / "cmp"
    argv = ["compare", "tiny", "--methods", "fedit,ffa-lora", "--seeds", "0", "--quiet", "--set", "run.rounds=2"]
    _signal_while_saving(monkeypatch, rnd=2, signum=signum)
    assert main([*argv, "--out", str(out)]) == 128 + signum
    monkeypatch.undo()
    what = "interrupted" if signum == signal.SIGINT else "stopped by SIGTERM"
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"{what}; the runs are in {out}; continue with: fedlowrank compare tiny --methods fedit,ffa-lora --seeds 0 "
        f"--quiet --set run.rounds=2 --out {out} --resume")
    assert not (out / "ffa-lora-seed0").exists() and load_checkpoint(latest_checkpoint(out / "fedit-seed0")).round == 2
    assert main([*argv, "--out", str(out), "--resume"]) == 0
    assert (out / "results.md").is_file() and [r["round"] for r in rows(out / "ffa-lora-seed0")] == [1, 2]


def test_compare_resume_continues_an_interrupted_run_from_its_checkpoint_as_if_never_stopped(tmp_path, monkeypatch,
                                                                                              capsys):
    """A run stopped in round 2 of 3 continues after round 1 under ``compare --resume``: round 1 is not trained
    again, and the results are those of an uninterrupted compare. A tune's run (on a validation split of the
    clients' data: other ``parts``) continues the same way."""
    argv = ["compare", "tiny", "--methods", "fedit", "--seeds", "0", "--set", "run.rounds=3"]
    assert main([*argv, "--out", str(tmp_path / "whole"), "--quiet"]) == 0
    out = tmp_path / "cmp"
    _signal_in(monkeypatch, "training", rnd=2, signum=signal.SIGTERM)
    assert main([*argv, "--out", str(out), "--quiet"]) == 143
    monkeypatch.undo()
    assert load_checkpoint(latest_checkpoint(out / "fedit-seed0")).round == 1
    trained: list[int] = []
    real = simulator.client_update
    monkeypatch.setattr(simulator, "client_update", lambda *a, **k: trained.append(a[8]) or real(*a, **k))
    capsys.readouterr()
    assert main([*argv, "--out", str(out), "--resume"]) == 0
    assert f"continuing the interrupted run in {out / 'fedit-seed0'} after round 1" in capsys.readouterr().err
    assert 1 not in trained and set(trained) == {2, 3}
    def runs(d):
        return [[{k: v for k, v in x.items() if k not in ("time", "run_dir")} for x in r["runs"]]
                for r in json.loads((d / "results.json").read_text())["rows"]]

    assert runs(tmp_path / "whole") == runs(out)
    # tune: the validation view's run continues to the same score as an uninterrupted tune
    tune = ["tune", "tiny", "--methods", "fedit", "--grid", "1e-3", "--seeds", "0", "--quiet", "--set", "run.rounds=3"]
    assert main([*tune, "--out", str(tmp_path / "tune-whole")]) == 0
    _signal_in(monkeypatch, "training", rnd=3, signum=signal.SIGTERM)
    assert main([*tune, "--out", str(tmp_path / "tune")]) == 143
    monkeypatch.undo()
    trained.clear()
    monkeypatch.setattr(simulator, "client_update", lambda *a, **k: trained.append(a[8]) or real(*a, **k))
    assert main([*tune, "--out", str(tmp_path / "tune"), "--resume"]) == 0
    assert set(trained) == {3}
    scores = [[r["score"] for r in json.loads((tmp_path / d / "tune.json").read_text())["runs"]]
              for d in ("tune-whole", "tune")]
    assert scores[0] == scores[1]


@pytest.mark.parametrize("signum, to", [(signal.SIGTERM, "command"), (signal.SIGINT, "group"),
                                        (signal.SIGTERM, "workers")])
def test_compare_with_jobs_stops_its_workers_which_save_their_runs(tmp_path, signum, to):
    """SIGTERM to ``compare --jobs 2``, Ctrl-C (which reaches its whole process group) or SIGTERM to its workers
    (``pkill``): each worker's round lines show as they come; the workers stop, each saves its run's state, no
    other run starts, and the command says how to continue."""
    out, err_file = tmp_path / "cmp", tmp_path / "stderr.txt"
    proc = started([*COMPARE_2000, "--out", str(out)], err_file, compare_rounds_begun,
                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal does
    workers = [int(p) for p in re.findall(r"\(worker process (\d+)\)", err_file.read_text())]
    assert len(workers) == 2
    if to == "workers":
        for pid in workers:
            os.kill(pid, signum)
    else:
        (os.killpg if to == "group" else os.kill)(proc.pid, signum)
    ended(proc)
    text = err_file.read_text()
    assert proc.returncode == 128 + signum, text
    what = "interrupted" if signum == signal.SIGINT else "stopped by SIGTERM"
    assert text.strip().splitlines()[-1].startswith(f"{what}; the runs are in {out}; continue with: fedlowrank "
                                                    f"compare tiny --methods fedit,ffa-lora") and "Traceback" not in text
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    for method in ("fedit", "ffa-lora"):
        stopped = load_checkpoint(latest_checkpoint(out / f"{method}-seed0")).round
        assert 1 <= stopped < 2000 and len(rows(out / f"{method}-seed0")) == stopped


def test_a_worker_killed_from_outside_stops_the_sweep_with_the_command_that_continues_it(tmp_path):
    """SIGKILL of one worker of ``compare --jobs 2`` (the out-of-memory killer, a user's kill -9): the command notices
    at once, stops the other worker (which saves its run) and ends with one ``error:`` line naming the run cut off
    and the ``--resume`` command, exit 1; no internal error."""
    out, err_file = tmp_path / "cmp", tmp_path / "stderr.txt"
    proc = started([*COMPARE_2000, "--out", str(out)], err_file, compare_rounds_begun)
    text = err_file.read_text()
    fedit_worker = int(re.search(r"\[fedit\] seed 0 \(worker process (\d+)\)", text).group(1))
    os.kill(fedit_worker, signal.SIGKILL)
    ended(proc)
    text = err_file.read_text()
    last = text.strip().splitlines()[-1]
    assert proc.returncode == 1, text
    assert last.startswith("error: the worker process of [fedit] seed 0 (killed by SIGKILL) ended before its run "
                           f"finished; the other runs saved their state; the runs are in {out}; continue with: "
                           "fedlowrank compare tiny --methods fedit,ffa-lora") and last.endswith("--resume"), last
    assert "internal error" not in text and "Traceback" not in text
    stopped = load_checkpoint(latest_checkpoint(out / "ffa-lora-seed0")).round
    assert 1 <= stopped < 2000 and len(rows(out / "ffa-lora-seed0")) == stopped


def _ended(pid: int) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie nobody has reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads process states from /proc (Linux)")
def test_workers_of_a_killed_command_save_their_runs_and_end(tmp_path):
    """SIGKILL leaves the command no chance to stop its workers: each sees its parent gone, saves its run's state
    and ends instead of training on unwatched (holding its run directory)."""
    out, err_file = tmp_path / "cmp", tmp_path / "stderr.txt"
    proc = started([*COMPARE_2000, "--out", str(out)], err_file, compare_rounds_begun)
    workers = [int(p) for p in re.findall(r"\(worker process (\d+)\)", err_file.read_text())]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 90
    try:
        while not all(_ended(pid) for pid in workers):
            assert time.monotonic() < deadline, "a worker trains on after its command was killed"
            time.sleep(0.2)
    finally:
        for pid in workers:
            if not _ended(pid):
                os.kill(pid, signal.SIGKILL)
    for method in ("fedit", "ffa-lora"):
        stopped = load_checkpoint(latest_checkpoint(out / f"{method}-seed0")).round
        assert 1 <= stopped < 2000 and len(rows(out / f"{method}-seed0")) == stopped


def test_a_sweep_whose_workers_fail_with_runs_left_raises_and_its_process_ends(tmp_path):
    """A worker's error ends the sweep even when the runs it never took fill the pipe to the workers (here 3 MB):
    the process raises the error and ends, rather than wait at exit to write them."""
    code = f"""
import sys
from pathlib import Path
import numpy as np
sys.path.insert(0, {str(ROOT / "tests")!r})
from helpers import tiny_config
from fedlowrank.experiments.sweep import run_in_processes
blocker = Path({str(tmp_path)!r}) / "a-file"
blocker.write_text("")
cfg = tiny_config("run.rounds=1", "run.threads=1")
parts = [np.arange(100_000)]
try:
    run_in_processes([(f"run {{i}}", cfg, blocker / str(i), parts, None) for i in range(4)], 1, False)
except Exception as exc:
    print("raised:", type(exc).__name__)
"""
    done = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().startswith("raised:"), done.stdout + done.stderr

"""benchmarks/common.py's ``Grid``: a script's runs through the project's sweep, with their run directories named
by their labels, resumption, and one error line for bad options."""

import argparse

import pytest
from helpers import benchmark_module

from fedlowrank.config import load_config


@pytest.fixture(scope="module")
def common():
    """benchmarks/common.py as a module."""
    return benchmark_module("common")


def options(common, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    common.sweep_options(parser)
    return parser.parse_args(list(argv))


def tiny(seed: int):
    return load_config("tiny", [f"run.seed={seed}", "run.rounds=1"])


def test_grid_runs_in_order_into_directories_named_by_label_and_resumes(common, tmp_path):
    heard: list[tuple[int, bool]] = []
    grid = common.Grid(options(common, "--runs-dir", str(tmp_path)))
    for seed in (0, 1):
        grid.add(f"fedit: seed {seed}", tiny(seed))
    first = grid.run(lambda i, outcome: heard.append((i, outcome.reused)))
    assert heard == [(0, False), (1, False)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fedit_seed_0", "fedit_seed_1"]
    again = common.Grid(options(common, "--runs-dir", str(tmp_path), "--resume"))
    for seed in (0, 1):
        again.add(f"fedit: seed {seed}", tiny(seed))
    second = again.run(lambda i, outcome: heard.append((i, outcome.reused)))
    assert heard[2:] == [(0, True), (1, True)]
    assert [o.summary["accuracy"] for o in second] == [o.summary["accuracy"] for o in first]
    assert [len(o.history) for o in second] == [1, 1]
    assert [common.Grid.seconds(o) for o in second] == [o.summary["time"]["total"] for o in second]
    assert all(common.Grid.seconds(o) == o.seconds > o.summary["time"]["total"] for o in first)


def test_grid_options_that_cannot_work_are_one_error_line(common, tmp_path):
    with pytest.raises(SystemExit, match=r"^error: --resume reads the runs in --runs-dir; give --runs-dir$"):
        common.Grid(options(common, "--resume"))
    with pytest.raises(SystemExit, match=r"^error: --jobs > 1 needs an output directory .*\(--runs-dir\)$"):
        common.Grid(options(common, "--jobs", "2"))
    grid = common.Grid(options(common, "--runs-dir", str(tmp_path)))
    grid.add("run", tiny(0))
    grid.run(lambda i, outcome: None)
    other = common.Grid(options(common, "--runs-dir", str(tmp_path), "--resume"))
    other.add("run", load_config("tiny", ["run.seed=0", "run.rounds=1", "train.lr=0.5"]))
    with pytest.raises(SystemExit, match=r"^error: --resume: .* holds a run of another config than this one"):
        other.run(lambda i, outcome: None)


def test_a_resumable_script_stopped_by_a_signal_prints_one_line_and_the_shell_status(common, capsys):
    import signal

    from fedlowrank.runtime.stopping import StopRequested

    def stopped():
        raise StopRequested(signal.SIGTERM)

    def interrupted():
        raise KeyboardInterrupt

    assert common.run_resumable(stopped) == 143
    assert capsys.readouterr().err.splitlines() == [
        "stopped by SIGTERM: the finished runs and the last checkpoint are kept; the same command continues from them"]
    assert common.run_resumable(interrupted) == 130
    assert capsys.readouterr().err.startswith("stopped by SIGINT:")
    assert common.run_resumable(lambda: 0) == 0


def test_a_resumable_script_turns_sigterm_into_a_stop_it_can_handle():
    """SIGTERM does not end the script at once (its worker processes left running): it stops as on Ctrl-C."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = ("import os, signal, sys, time; sys.path.insert(0, 'benchmarks'); from common import run_resumable\n"
            "def main():\n    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(30)\n    return 0\n"
            "sys.exit(run_resumable(main))")
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 143 and done.stderr.startswith("stopped by SIGTERM:"), done.stderr


def test_every_script_with_resumable_runs_stops_through_run_resumable():
    """A script that runs a sweep (``Grid``, ``run_comparison``, ``run_tuning``) stops on Ctrl-C or SIGTERM with
    one line and its workers stopped: its entry point goes through ``run_resumable``."""
    import re
    from pathlib import Path

    scripts = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))
    sweeping = [p for p in scripts if re.search(r"\bGrid\(|\brun_comparison\(|\brun_tuning\(", p.read_text())]
    assert len(sweeping) >= 10
    assert [p.name for p in sweeping if "sys.exit(run_resumable(main))" not in p.read_text()] == []

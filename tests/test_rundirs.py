"""Run directories: one run per directory, locked while written, resume only from a checkpoint of the
directory's own config, fall-back past a damaged checkpoint, and a final checkpoint that every run can export."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tiny_config, tiny_task

from fedlowrank import cli
from fedlowrank.cli import main
from fedlowrank.runtime.checkpoint import CheckpointError, checkpoint_folders
from fedlowrank.runtime.rundir import RunDirError
from fedlowrank.runtime.simulator import Simulation

SRC = Path(__file__).resolve().parents[1] / "src"


def rounds_in(run_dir: Path, name: str = "metrics.jsonl") -> list[int]:
    return [json.loads(line)["round"] for line in (run_dir / name).read_text().splitlines()]


def simulate(run_dir: Path, *sets: str, rounds: int = 3, every: int = 1) -> Simulation:
    """A finished tiny FedIT run in ``run_dir`` with a checkpoint every ``every`` rounds."""
    sim = Simulation(tiny_config(f"run.rounds={rounds}", f"run.checkpoint_every={every}", *sets), task=tiny_task(),
                     run_dir=run_dir)
    sim.run()
    return sim


def test_non_empty_run_dir_is_refused_and_overwrite_leaves_nothing_of_the_old_run(tmp_path, capsys):
    out = tmp_path / "run"
    simulate(out, rounds=2)
    assert main(["run", "tiny", "--out", str(out), "--quiet", "--set", "run.rounds=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(out) in err and "--overwrite" in err and "not empty" in err
    assert rounds_in(out) == [1, 2]  # the refused run touched nothing
    assert main(["run", "tiny", "--out", str(out), "--quiet", "--overwrite", "--set", "run.rounds=1"]) == 0
    assert rounds_in(out) == [1] and rounds_in(out, "ledger.jsonl") == [1, 1]
    assert sorted(checkpoint_folders(out)) == [1]
    assert json.loads((out / "config.json").read_text())["run"]["rounds"] == 1


def test_overwrite_never_deletes_a_directory_that_holds_no_run(tmp_path, capsys):
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("precious")
    assert main(["run", "tiny", "--out", str(home), "--quiet", "--overwrite", "--set", "run.rounds=1"]) == 2
    assert "holds no fedlowrank run" in capsys.readouterr().err
    assert (home / "thesis.tex").read_text() == "precious"


def test_default_run_dirs_started_in_the_same_second_differ(tmp_path, monkeypatch):
    monkeypatch.setattr(cli.time, "strftime", lambda fmt, *a: "20260101-000000")
    cfg = tiny_config(f"run.out_dir={tmp_path}")
    first, second = cli._run_dir(cfg, "fedit"), cli._run_dir(cfg, "fedit")
    assert first != second and first.is_dir() and second.is_dir()
    assert first.parent == second.parent == tmp_path


def _hold_lock(run_dir: Path) -> subprocess.Popen:
    """Another process that locks ``run_dir`` as a run writing it does, and keeps it until killed."""
    code = ("import sys, time; from fedlowrank.runtime.rundir import lock_run_dir; "
            "lock = lock_run_dir(sys.argv[1]); print('locked', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(SRC)})
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_run_or_resume_into_a_directory_being_written_is_refused(tmp_path, capsys):
    cmp = tmp_path / "cmp"
    assert main(["compare", "tiny", "--out", str(cmp), "--methods", "fedit", "--quiet"]) == 0
    out = cmp / "fedit-seed0"  # one method's run of the comparison
    holder = _hold_lock(out)
    capsys.readouterr()
    try:
        for argv in (["run", "tiny", "--out", str(out), "--overwrite"], ["resume", str(out)],
                     ["compare", "tiny", "--out", str(cmp), "--overwrite", "--methods", "fedit"]):
            assert main([*argv, "--quiet"]) == 2, argv
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and f"run directory {out} is in use by another run (pid " \
                f"{holder.pid})" in err, argv
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the kernel dropped the lock with the process: no stale lock after a crash
    assert main(["resume", str(out), "--quiet"]) == 0
    with pytest.raises(RunDirError, match="in use"):  # the same holds between two runs of one process
        first = Simulation(tiny_config(), task=tiny_task(), run_dir=tmp_path / "b")
        Simulation(tiny_config(), task=tiny_task(), run_dir=tmp_path / "b", overwrite=True)
    first.close()


def test_resume_refuses_a_checkpoint_of_another_config(tmp_path, capsys):
    simulate(tmp_path / "a", rounds=2)
    config = tmp_path / "a" / "config.json"
    raw = json.loads(config.read_text())
    raw["train"]["lr"] = 0.5
    config.write_text(json.dumps(raw))
    assert main(["resume", str(tmp_path / "a"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "another config" in err and str(config) in err and "round-00002" in err
    raw["train"]["lr"], raw["run"]["rounds"] = tiny_config().train.lr, 1  # a checkpoint "after round 2 of 1"
    config.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="not of the same run"):
        Simulation.resume(tmp_path / "a", task=tiny_task())
    raw["run"].update(rounds=3, name="renamed", checkpoint_every=5)  # what does not change the maths may change
    config.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="another config"):  # run.rounds does
        Simulation.resume(tmp_path / "a", task=tiny_task())
    raw["run"]["rounds"] = 2
    config.write_text(json.dumps(raw))
    assert Simulation.resume(tmp_path / "a", task=tiny_task()).round == 2


def test_corrupted_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, capsys):
    ref = simulate(tmp_path / "ref")
    out = tmp_path / "run"
    simulate(out)
    blob = out / "checkpoints" / "round-00003" / "clients.safetensors"
    blob.write_bytes(blob.read_bytes()[:-7])
    assert main(["resume", str(out), "--quiet"]) == 0
    warning = capsys.readouterr().err.splitlines()[0]
    assert "round-00003" in warning and "truncated" in warning and "using round-00002" in warning
    assert rounds_in(out) == [1, 2, 3]
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["accuracy"] == ref.summary()["accuracy"] and resumed["bytes_up"] == ref.ledger.total_up


def test_missing_latest_pointer_uses_the_newest_round_directory(tmp_path, capsys):
    out = tmp_path / "run"
    simulate(out, rounds=2)
    (out / "checkpoints" / "latest").unlink()
    assert main(["export", str(out), "--out", str(tmp_path / "exp")]) == 0
    err = capsys.readouterr().err
    assert "checkpoints/latest is missing; using round-00002" in err
    assert json.loads((tmp_path / "exp" / "export.json").read_text())["round"] == 2


def test_resume_from_a_chosen_round(tmp_path, capsys):
    out = tmp_path / "run"
    simulate(out, rounds=3)
    assert main(["resume", str(out), "--round", "1", "--quiet"]) == 2
    assert "no checkpoint of round 1; rounds with an intact checkpoint: 2, 3" in capsys.readouterr().err
    sim = Simulation.resume(out, task=tiny_task(), round=2)
    assert sim.round == 2 and rounds_in(out) == [1, 2] and sorted(checkpoint_folders(out)) == [2]
    assert (out / "checkpoints" / "latest").read_text() == "round-00002"
    sim.run()
    assert rounds_in(out) == [1, 2, 3] and sorted(checkpoint_folders(out)) == [2, 3]


def test_a_default_run_writes_its_final_checkpoint_and_exports(tmp_path, capsys):
    out = tmp_path / "run"
    assert tiny_config().run.checkpoint_every == 0
    assert main(["run", "tiny", "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    assert sorted(checkpoint_folders(out)) == [2]  # only the final one: checkpoint_every = 0
    assert main(["export", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["round"] == 2 and (out / "export-peft" / "adapter_model.safetensors").is_file()

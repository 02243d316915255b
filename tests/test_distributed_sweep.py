"""``fedlowrank compare`` and ``tune`` over several ranks (experiments/sweep.py: the runs dealt to the ranks,
rank 0 writing the results): ``run.devices`` and a torchrun-like job of 2 gloo ranks give the same runs as one
process; ``--resume`` reuses them; bad combinations are one error line."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from fedlowrank.cli import _rank_cli, main
from fedlowrank.config import ConfigError
from fedlowrank.experiments.sweep import Sweep, deal
from fedlowrank.runtime.distributed import spawn

COMPARE = ["compare", "tiny", "--methods", "fedit,florg", "--seeds", "0,1", "--quiet"]
TUNE = ["tune", "tiny", "--methods", "fedit", "--grid", "0.001,0.01", "--quiet"]
DEVICES = ["--set", 'run.devices=["cpu","cpu"]']


def _runs(out: Path) -> dict[str, dict]:
    """Each run directory under ``out``: its metrics rows without times and memory, and its ledger totals."""
    runs = {}
    for summary in sorted(out.rglob("summary.json")):
        rows = [json.loads(line) for line in (summary.parent / "metrics.jsonl").read_text().splitlines() if line]
        s = json.loads(summary.read_text())
        runs[str(summary.parent.relative_to(out))] = {
            "metrics": [{k: v for k, v in r.items() if k not in ("time", "peak_rss_mb")} for r in rows],
            "ledger": (s["bytes_up"], s["bytes_down"]), "final": s.get("accuracy")}
    return runs


def _results(out: Path, name: str) -> dict:
    """``name`` (results.json, tune.json) without what names the directory or the command's --set."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items()
                    if k not in ("run_dir", "in_force", "settings", "plots", "time", "command")}
        return [strip(v) for v in x] if isinstance(x, list) else x
    return strip(json.loads((out / name).read_text()))


def test_deal_is_round_robin_over_the_ranks_and_covers_every_run_once():
    shares = [deal(7, 3, r) for r in range(3)]
    assert shares == [[0, 3, 6], [1, 4], [2, 5]]
    assert deal(1, 2, 1) == []


def test_compare_on_run_devices_and_on_torchrun_ranks_equals_one_process_and_resumes(tmp_path, capsys):
    assert main([*COMPARE, "--out", str(tmp_path / "one")]) == 0
    reference = _runs(tmp_path / "one")
    assert len(reference) == 4
    assert main([*COMPARE, "--out", str(tmp_path / "devices"), *DEVICES]) == 0
    assert _runs(tmp_path / "devices") == reference
    assert _results(tmp_path / "devices", "results.json") == _results(tmp_path / "one", "results.json")

    codes = spawn(_rank_cli, ([*COMPARE, "--out", str(tmp_path / "ranks")],), ["cpu", "cpu"], grace_s=60)
    assert codes == [0, 0]
    assert _runs(tmp_path / "ranks") == reference
    assert _results(tmp_path / "ranks", "results.json") == _results(tmp_path / "one", "results.json")

    (tmp_path / "devices" / "florg-seed1" / "summary.json").unlink()  # an interrupted run: run again
    capsys.readouterr()
    assert main([*COMPARE, "--out", str(tmp_path / "devices"), "--resume", *DEVICES]) == 0
    assert _runs(tmp_path / "devices") == reference


def test_tune_on_run_devices_equals_one_process(tmp_path):
    assert main([*TUNE, "--out", str(tmp_path / "one")]) == 0
    assert main([*TUNE, "--out", str(tmp_path / "devices"), *DEVICES]) == 0
    assert _runs(tmp_path / "devices") == _runs(tmp_path / "one")
    assert _results(tmp_path / "devices", "tune.json") == _results(tmp_path / "one", "tune.json")


@pytest.mark.parametrize("command", [COMPARE, TUNE])
def test_jobs_with_run_devices_is_one_error_line(tmp_path, capsys, command):
    status = main([*command, "--out", str(tmp_path / "out"), "--jobs", "2", *DEVICES])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("error: --jobs 2 with run.devices")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.device_count() > 7, reason="this machine has a cuda:7")
def test_a_missing_device_on_compare_is_one_error_line(tmp_path, capsys):
    status = main([*COMPARE, "--out", str(tmp_path / "out"), "--set", 'run.devices=["cuda:7","cuda:7"]'])
    err = capsys.readouterr().err.strip().splitlines()
    assert status != 0 and len(err) == 1 and err[0].startswith("error: run.devices[0] = 'cuda:7'")
    assert not (tmp_path / "out").exists()


def test_rank_0_stopped_by_an_error_ends_the_other_rank_with_one_line(tmp_path, capfd):
    t0 = time.monotonic()
    status = main(["compare", "tiny", "--methods", "nosuch", "--out", str(tmp_path / "out"), "--quiet", *DEVICES,
                   "--set", "run.collective_timeout_s=30"])
    assert time.monotonic() - t0 < 30 + 30  # within the collective timeout, with the start of two processes
    err = capfd.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 2
    assert any(line.startswith("error: method.name: unknown method 'nosuch'") for line in err)
    assert any("rank 1 of 2: another rank of the sweep stopped" in line for line in err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("out, jobs", [(None, 1), (Path("out"), 2)])
def test_a_sweep_over_ranks_without_an_output_directory_or_with_jobs_is_refused(out, jobs):
    with pytest.raises(ConfigError, match="a sweep over ranks needs an output directory"):
        Sweep(out, jobs, ranks=True)


def test_sigterm_to_a_compare_on_run_devices_stops_its_ranks_with_one_line(tmp_path):
    """SIGTERM to the launcher of ``compare`` on 2 ranks: each rank's run saves its state and stops within seconds
    (not every remaining round), one line says how to continue (none from rank 1), exit 143."""
    import os
    import signal

    from helpers import ended, started

    out, err_file = tmp_path / "cmp", tmp_path / "stderr.txt"
    proc = started(["compare", "tiny", "--methods", "fedit,ffa-lora", "--seeds", "0", "--out", str(out), *DEVICES,
                    "--set", "run.rounds=2000"], err_file, lambda text: "round 3/2000" in text)
    os.kill(proc.pid, signal.SIGTERM)
    assert ended(proc, timeout=60) == 143, err_file.read_text()
    text = err_file.read_text()
    stops = [line for line in text.splitlines() if line.startswith("stopped by")]
    assert len(stops) == 1 and stops[0].startswith(f"stopped by SIGTERM; the runs are in {out}; continue with: "
                                                   "fedlowrank compare tiny") and stops[0].endswith("--resume"), text
    assert "Traceback" not in text and "error" not in text, text

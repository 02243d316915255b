"""benchmarks/protocols.py --records: a protocol's finished runs carried between machines."""

import pytest
from helpers import benchmark_module

from fedlowrank.experiments.compare import run_comparison
from fedlowrank.runtime.rundir import CLAIM


def test_sync_copies_the_finished_runs_to_the_records_and_from_them_into_a_fresh_out(tmp_path, capsys):
    protocols = benchmark_module("protocols")
    run_comparison("tiny", "fedit", "0", ["run.rounds=1"], tmp_path / "out" / "florg" / "compare", None)
    records = tmp_path / "records"
    assert protocols.main(["florg", "--records", str(records), "--out", str(tmp_path / "out"), "--sync"]) == 0
    kept = records / "florg" / "compare" / "fedit-seed0"
    assert sorted(p.name for p in kept.iterdir()) == sorted([CLAIM, "config.json", "metrics.jsonl", "summary.json"])
    assert not (records / "florg" / "compare" / "results.json").exists()  # runs only; a verdict is read from them
    assert protocols.main(["florg", "--records", str(records), "--out", str(tmp_path / "fresh"), "--sync"]) == 0
    copied = tmp_path / "fresh" / "florg" / "compare" / "fedit-seed0" / "summary.json"
    assert copied.read_bytes() == (kept / "summary.json").read_bytes()
    assert "1 finished run of florg copied" in capsys.readouterr().err


def test_sync_without_records_is_refused(capsys):
    with pytest.raises(SystemExit):
        benchmark_module("protocols").main(["florg", "--sync"])
    assert "--sync copies finished runs to and from --records DIR" in capsys.readouterr().err


def test_records_that_are_a_file_are_refused(tmp_path, capsys):
    (tmp_path / "records").write_text("runs\n")
    with pytest.raises(SystemExit):
        benchmark_module("protocols").main(["florg", "--records", str(tmp_path / "records"), "--sync"])
    assert "--records " + str(tmp_path / "records") + ": not a directory" in capsys.readouterr().err

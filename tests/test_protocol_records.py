"""benchmarks/protocols.py --records: a protocol's finished runs carried between machines, only while they are what
the runs wrote (sealed)."""

import json

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
    assert sorted(p.name for p in kept.iterdir()) == sorted([CLAIM, "config.json", "metrics.jsonl", "summary.json",
                                                             "seal.json"])
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


def _records(tmp_path):
    """A protocol's records folder holding one finished tiny run (``florg/compare/fedit-seed0``), as --sync makes it."""
    protocols = benchmark_module("protocols")
    run_comparison("tiny", "fedit", "0", ["run.rounds=1"], tmp_path / "out" / "florg" / "compare", None)
    records = tmp_path / "records"
    assert protocols.main(["florg", "--records", str(records), "--out", str(tmp_path / "out"), "--sync"]) == 0
    return protocols, records, records / "florg" / "compare" / "fedit-seed0"


def _forge_accuracy(run_dir, value):
    """The audit's forgery: the final accuracy edited in both summary.json and metrics.jsonl."""
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps({**summary, "accuracy": value}, indent=1))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows[-1]["accuracy"] = value
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("forgery", ["edited", "a linked file", "a linked folder", "unsealed"])
def test_a_forged_or_linked_record_is_not_carried_over(tmp_path, capsys, forgery):
    protocols, records, kept = _records(tmp_path)
    if forgery == "edited":
        _forge_accuracy(kept, 0.99)
    elif forgery == "a linked file":
        forged = tmp_path / "elsewhere.json"
        forged.write_text((kept / "summary.json").read_text().replace('"accuracy": ', '"accuracy": 0.99, "x": '))
        (kept / "summary.json").unlink()
        (kept / "summary.json").symlink_to(forged)
    elif forgery == "a linked folder":
        moved = tmp_path / "moved"
        kept.rename(moved)
        kept.symlink_to(moved, target_is_directory=True)
    else:
        (kept / "seal.json").unlink()
    capsys.readouterr()
    assert protocols.main(["florg", "--records", str(records), "--out", str(tmp_path / "fresh"), "--sync"]) == 0
    err = capsys.readouterr().err
    assert not (tmp_path / "fresh" / "florg" / "compare" / "fedit-seed0").exists()
    why = {"edited": "metrics.jsonl, summary.json in", "a linked file": "summary.json is a symbolic link",
           "a linked folder": "fedit-seed0 is a symbolic link", "unsealed": "seal.json is missing"}[forgery]
    assert "--records: not copied: " in err and why in err and "1 refused" in err, err


def test_a_forged_finished_run_is_refused_in_one_line_and_run_resumable_exits_2(tmp_path, capsys):
    """Reused from --out, an edited finished run is refused (not reported at 0.99); a benchmark script says so in one
    ``error:`` line with exit status 2, as it does for a data set that is not there."""
    pytest.importorskip("datasets")
    from fedlowrank.tasks.hub import hub_splits

    common = benchmark_module("common")
    out = tmp_path / "compare"
    run_comparison("tiny", "fedit", "0", ["run.rounds=1"], out, None)
    _forge_accuracy(out / "fedit-seed0", 0.99)

    def again():
        run_comparison("tiny", "fedit", "0", ["run.rounds=1"], out, None, resume=True)
        return 0

    assert common.run_resumable(again) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: --resume: the finished run in") and \
        "edited since it ended" in err, err

    def absent():  # a data set offline and in no cache
        hub_splits("fedlowrank-tests/no-such-set", "data.source = 'hf'")

    assert common.run_resumable(absent) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: data.source = 'hf': cannot load"), err
    with pytest.raises(ZeroDivisionError):  # a bug stays a traceback
        common.run_resumable(lambda: 1 / 0)

"""``fedlowrank evaluate``: a run's checkpoint scored after training reproduces the metrics the run recorded for
that round exactly (the global model; a personalised method's mean and each client's own model; an older round;
a resumed run), a file holding the test split reproduces them too, an export folder is scored as loaded back, the
run directory is never written, and every bad run directory, round, client or data file is one ``error:`` line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import tiny_config, tiny_task

from fedlowrank.cli import main
from fedlowrank.evaluate import evaluate_run
from fedlowrank.export import export_run
from fedlowrank.runtime.evaluation import scalar_metrics
from fedlowrank.runtime.simulator import Simulation

SETS = ("run.rounds=2", "run.clients_per_round=4", "run.checkpoint_every=1", "train.lr=0.02")


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def recorded(row: dict) -> dict:
    return {k: row[k] for k in ("accuracy", "loss")}


def listing(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes (to see that nothing was written)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Finished tiny runs with a checkpoint each round: a global method and a personalised one."""
    out = {}
    for method in ("fedit", "fedalt"):
        run_dir = tmp_path_factory.mktemp(method)
        Simulation(tiny_config(f"method.name={method}", *SETS), task=tiny_task(), run_dir=run_dir).run()
        out[method] = run_dir
    return out


def test_the_global_model_reproduces_the_last_row_exactly(runs):
    run_dir = runs["fedit"]
    before = listing(run_dir)
    report = evaluate_run(run_dir)
    last = rows(run_dir)[-1]
    assert report["round"] == 2 and report["model"] == "the global model" and report["data"] is None
    assert scalar_metrics(report["metrics"]) == recorded(last) == report["recorded"]
    assert report["metrics"]["predictions"] == last["predictions"]
    assert listing(run_dir) == before  # read-only


def test_an_older_round_reproduces_its_row(runs):
    report = evaluate_run(runs["fedit"], round=1)
    assert report["round"] == 1 and scalar_metrics(report["metrics"]) == recorded(rows(runs["fedit"])[0])


def test_a_personalised_method_reproduces_its_mean_and_each_clients_own_model(runs):
    run_dir = runs["fedalt"]
    last = rows(run_dir)[-1]
    report = evaluate_run(run_dir)
    assert scalar_metrics(report["metrics"]) == recorded(last) and "own models of clients 0, 1, 2, 3" in report["model"]
    tests = {e["client"]: scalar_metrics(e["test"]) for e in last["per_client"] if "test" in e}
    one = evaluate_run(run_dir, client=2)
    assert scalar_metrics(one["metrics"]) == tests[2] == one["recorded"] and one["model"] == "client 2's own model"
    every = evaluate_run(run_dir, client="all")
    assert {int(k): scalar_metrics(c["metrics"]) for k, c in every["clients"].items()} == tests
    assert {int(k): c["recorded"] for k, c in every["clients"].items()} == tests


def test_a_resumed_run_is_reproduced_too(tmp_path):
    run_dir = tmp_path / "run"
    cfg = tiny_config("method.name=fedit", "run.rounds=3", "run.checkpoint_every=1", "train.lr=0.02")
    Simulation(cfg, task=tiny_task(), run_dir=run_dir).run()
    Simulation.resume(run_dir, task=tiny_task(), round=2).run()  # round 3 again, from round 2's checkpoint
    last = rows(run_dir)[-1]
    assert last["round"] == 3
    assert scalar_metrics(evaluate_run(run_dir)["metrics"]) == recorded(last)


def test_a_file_holding_the_test_split_gives_the_test_metrics(runs, tmp_path):
    data = tiny_task().data
    path = tmp_path / "test.tsv"
    path.write_text("".join(f"{t}\t{data.label_names[y]}\n" for t, y in zip(data.test_texts, data.test_labels)))
    report = evaluate_run(runs["fedit"], data=path)
    assert report["data"] == str(path) and report["recorded"] is None
    last = rows(runs["fedit"])[-1]
    assert report["metrics"]["accuracy"] == last["accuracy"]
    assert report["metrics"]["loss"] == pytest.approx(last["loss"], rel=1e-12)
    one_class = tmp_path / "one-class.tsv"  # a file of one class is refused: it cannot be read as data.train
    one_class.write_text("".join(f"text {i}\tsports\n" for i in range(3)))
    with pytest.raises(ValueError, match="one-class.tsv"):
        evaluate_run(runs["fedit"], data=one_class)


def test_an_export_folder_is_scored_as_loaded_back(runs, tmp_path):
    report = export_run(runs["fedit"], tmp_path / "peft", "peft", task=tiny_task())
    scored = evaluate_run(tmp_path / "peft")
    assert scored["kind"] == "export" and scored["recorded"] == report["check"]["exported"]
    for key, value in recorded(rows(runs["fedit"])[-1]).items():
        assert scored["metrics"][key] == pytest.approx(value, abs=1e-5), key


def test_cli_prints_a_table_or_json_and_writes_only_into_its_own_out(runs, tmp_path, capsys):
    run_dir = runs["fedit"]
    before = listing(run_dir)
    assert main(["evaluate", str(run_dir)]) == 0
    table = capsys.readouterr().out
    assert "| accuracy |" in table and "round 2 of 2" in table
    assert main(["evaluate", str(run_dir), "--json", "--out", str(tmp_path / "ev")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["path"] == str(run_dir)
    assert json.loads((tmp_path / "ev" / "evaluation.json").read_text()) == printed
    assert (tmp_path / "ev" / "evaluation.md").read_text() == table
    claim = json.loads((tmp_path / "ev" / ".fedlowrank-run").read_text())
    assert claim["kind"] == "evaluate" and set(claim["own"]) == {"evaluation.json", "evaluation.md"}
    assert main(["evaluate", str(run_dir), "--out", str(tmp_path / "ev")]) == 2  # not empty
    assert "--overwrite" in capsys.readouterr().err
    assert main(["evaluate", str(run_dir), "--out", str(tmp_path / "ev"), "--overwrite"]) == 0
    assert listing(run_dir) == before


def one_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "internal" not in err[0], err
    for needle in needles:
        assert needle in err[0], (needle, err[0])
    return err[0]


def test_bad_run_dirs_rounds_clients_and_files_are_one_line_each(runs, tmp_path, capsys):
    fedit, fedalt = str(runs["fedit"]), str(runs["fedalt"])
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.tsv").write_text("a text\tsports\nanother text\tno such class\n")
    (tmp_path / "broken.tsv").write_text("a text\tsports\nanother\ttext\ttech\n")
    cases = [
        ([str(tmp_path / "nowhere")], ("nowhere", "no such directory")),
        ([str(tmp_path / "empty")], ("no checkpoint",)),
        ([fedit, "--round", "7"], ("round 7", "rounds with an intact checkpoint: 1, 2")),
        ([fedit, "--client", "0"], ("--client", "personalised")),
        ([fedalt, "--client", "9"], ("--client", "0..3")),
        ([fedalt, "--client", "x"], ("--client", "'x'")),
        ([fedit, "--data", str(tmp_path / "missing.tsv")], ("--data", "missing.tsv", "no such file")),
        ([fedit, "--data", str(tmp_path / "bad.tsv")], ("bad.tsv:2", "'no such class'")),
        ([fedit, "--data", str(tmp_path / "broken.tsv")], ("broken.tsv:2", "expected 2 fields")),
        ([fedit, "--out", str(Path(fedit) / "evaluation")], ("--out", "inside", "run")),
    ]
    for argv, needles in cases:
        assert main(["evaluate", *argv]) == 2, argv
        one_error(capsys, *needles)
    assert not (Path(fedit) / "evaluation").exists()

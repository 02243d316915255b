"""``fedlowrank tune``: the validation split is held out of training, the choice never looks at the test set,
and ``compare --tuned`` runs each method at its chosen learning rate."""

import json
import math

import numpy as np
import pytest
import torch

from fedlowrank.cli import main
from fedlowrank.config import ConfigError
from fedlowrank.tasks.partition import partition
from fedlowrank.tasks.matrix_regression import MatrixRegression
from fedlowrank.tasks.text import TextClassification
from fedlowrank.experiments.tune import parse_grid, run_tuning, split_validation

from helpers import tiny_config, tiny_task

GRID = "1e-4,3e-2"


def test_split_validation_holds_out_a_seeded_fraction_of_each_client():
    cfg = tiny_config()
    parts = partition(200, tiny_task().train_labels, cfg.partition, 0)
    train, held = split_validation(parts, 0.25, seed=0)
    for p, t in zip(parts, train):
        assert len(t) == len(p) - int(0.25 * len(p)) and np.isin(t, p).all()
    assert len(np.intersect1d(np.concatenate(train), held)) == 0
    assert np.array_equal(np.sort(np.concatenate([*train, held])), np.arange(200))
    again, held_again = split_validation(parts, 0.25, seed=0)
    assert np.array_equal(held, held_again) and not np.array_equal(held, split_validation(parts, 0.25, seed=1)[1])
    tiny = [np.array([3]), np.array([4, 5])]  # a client keeps at least one example to train on
    assert [len(t) for t in split_validation(tiny, 0.9, 0)[0]] == [1, 1]


def test_validation_view_evaluates_the_held_out_training_examples():
    task = tiny_task()
    model = task.build_model()
    idx = np.array([5, 17, 40, 41, 99])
    view = task.validation(idx)
    got = view.evaluate(model.net)
    with torch.no_grad():
        b = task.batch(idx)
        logits = model.net(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    assert got["accuracy"] == pytest.approx(float((logits.argmax(-1) == b["labels"]).float().mean()))
    assert got["loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, b["labels"])), rel=1e-5)
    assert view.num_train == task.num_train and view.describe()["num_validation"] == 5


def test_matrix_regression_validation_loss_at_zero_is_half_the_mean_label_energy():
    task = MatrixRegression(num_clients=2, dim=6, outputs=3, samples=5)
    rows = np.array([0, 3, 7])
    loss = task.validation(rows).evaluate(task.build_model().net)["loss"]
    assert loss == pytest.approx(0.5 * float((task.B[rows].double() ** 2).sum(1).mean()))


def test_tune_trains_only_on_the_clients_remaining_examples(monkeypatch):
    seen: list[int] = []
    batch = TextClassification.batch

    def recording_batch(self, indices):
        seen.extend(np.asarray(indices).tolist())
        return batch(self, indices)

    monkeypatch.setattr(TextClassification, "batch", recording_batch)
    res = run_tuning("tiny", "fedit", "1e-3", "0", ["run.rounds=1", "data.validation_fraction=0.3"])
    cfg = tiny_config("data.validation_fraction=0.3")
    _, held = split_validation(partition(200, tiny_task().train_labels, cfg.partition, 0), 0.3, 0)
    assert seen and not set(seen) & set(held.tolist())
    assert res["setup"]["num_validation"] == len(held) and res["setup"]["num_test"] is None


def test_the_choice_comes_from_the_validation_split_only(tmp_path, monkeypatch, capsys):
    """Another test set (a different subsample, and evaluating it would fail) gives the same choice and scores."""
    out = tmp_path / "tune"
    assert main(["tune", "tiny", "--methods", "fedit,ffa-lora", "--grid", GRID, "--seeds", "0", "--out", str(out),
                 "--quiet"]) == 0
    assert "| fedit | 0.0001 |" in capsys.readouterr().out
    first = json.loads((out / "tune.json").read_text())
    assert {(r["method"], r["lr"], r["seed"]) for r in first["runs"]} == {
        (m, lr, 0) for m in ("fedit", "ffa-lora") for lr in (1e-4, 3e-2)}
    assert all(r["metric"] == "accuracy" and 0 <= r["score"] <= 1 for r in first["runs"])

    def no_test_set(self, net):
        raise AssertionError("tuning evaluated the test set")

    monkeypatch.setattr(TextClassification, "evaluate", no_test_set)
    second = run_tuning("tiny", "fedit,ffa-lora", GRID, "0", ["data.max_test_examples=16"])
    assert second["chosen"] == first["chosen"]
    assert [r["score"] for r in second["runs"]] == [r["score"] for r in first["runs"]]


def test_compare_reuses_the_tuned_learning_rates(tmp_path):
    tuned = run_tuning("tiny", "fedit,ffa-lora", GRID, "0", ["run.rounds=1"], tmp_path / "tune")
    out = tmp_path / "cmp"
    assert main(["compare", "tiny", "--methods", "fedit,ffa-lora", "--seeds", "0", "--tuned",
                 str(tmp_path / "tune" / "tune.json"), "--out", str(out), "--quiet", "--set", "run.rounds=1"]) == 0
    res = json.loads((out / "results.json").read_text())
    for row in res["rows"]:
        assert row["lr"] == tuned["chosen"][row["method"]]["value"]
        assert f"train.lr={row['lr']!r}" in row["settings"]
        run_cfg = json.loads((out / f"{row['method']}-seed0" / "config.json").read_text())
        assert run_cfg["train"]["lr"] == row["lr"]
    assert str(tmp_path / "tune" / "tune.json") in (out / "results.md").read_text()
    with pytest.raises(ConfigError, match="chose no value for fedavg-full"):
        from fedlowrank.experiments.compare import run_comparison

        run_comparison("tiny", "fedit,fedavg-full", "0", [f"compare.tuned={tmp_path / 'tune' / 'tune.json'}"])


def test_bad_grids_are_refused():
    assert parse_grid("1e-3, 3e-3") == [1e-3, 3e-3] and parse_grid(None) is None
    for bad in ("", "1e-3,x", "0", "-1e-3", "1e-3,1e-3"):
        with pytest.raises(ConfigError, match="--grid"):
            parse_grid(bad)


def test_resume_reuses_finished_runs_and_combines_separate_processes(tmp_path, monkeypatch, capsys):
    """``--resume``: a finished run is read, not run again; an unfinished one runs again (or continues:
    tests/test_stopping.py); runs made by
    separate ``compare`` processes into one --out combine into the same results as one process."""
    from fedlowrank.runtime.simulator import Simulation

    sets = ["--set", "run.rounds=2", "--quiet"]
    whole = tmp_path / "whole"
    assert main(["compare", "tiny", "--methods", "fedit,ffa-lora", "--seeds", "0,1", "--out", str(whole), *sets]) == 0
    parts = tmp_path / "parts"
    for m in ("fedit", "ffa-lora"):
        for s in ("0", "1"):
            piece = tmp_path / f"piece-{m}-{s}"
            assert main(["compare", "tiny", "--methods", m, "--seeds", s, "--out", str(piece), *sets]) == 0
            parts.mkdir(exist_ok=True)
            (piece / f"{m}-seed{s}").rename(parts / f"{m}-seed{s}")
    (parts / "ffa-lora-seed1" / "summary.json").unlink()  # as if interrupted before its end
    ran: list[str] = []
    run = Simulation.run
    monkeypatch.setattr(Simulation, "run", lambda self: ran.append(self.method.name) or run(self))
    capsys.readouterr()
    assert main(["compare", "tiny", "--methods", "fedit,ffa-lora", "--seeds", "0,1", "--out", str(parts),
                 "--resume", "--set", "run.rounds=2"]) == 0
    assert ran == ["ffa-lora"] and capsys.readouterr().err.count("reusing the finished run") == 3
    a, b = (json.loads((d / "results.json").read_text()) for d in (whole, parts))
    def runs(res):
        return [[{k: v for k, v in x.items() if k not in ("time", "run_dir")} for x in r["runs"]] for r in res["rows"]]

    assert runs(a) == runs(b)
    assert a["paired"] == b["paired"]
    # another config in the same directory is refused, naming it
    with pytest.raises(ConfigError, match="holds a run of another config"):
        main(["compare", "tiny", "--methods", "fedit", "--seeds", "0", "--out", str(parts), "--resume",
              "--set", "run.rounds=2", "--set", "train.lr=0.1", "--debug"])
    # tune: the second call trains nothing and chooses the same
    tune = tmp_path / "tune"
    first = run_tuning("tiny", "fedit", GRID, "0", ["run.rounds=1"], tune)
    ran.clear()
    again = run_tuning("tiny", "fedit", GRID, "0", ["run.rounds=1"], tune, resume=True)
    assert ran == [] and again["chosen"] == first["chosen"]
    assert [r["score"] for r in again["runs"]] == [r["score"] for r in first["runs"]]


def test_resume_needs_an_out_directory_and_no_overwrite(tmp_path, capsys):
    for extra in ([], ["--out", str(tmp_path / "x"), "--overwrite"]):
        assert main(["tune", "tiny", "--resume", *extra]) == 2
        assert "--resume continues the runs in an --out directory" in capsys.readouterr().err


def test_jobs_run_in_worker_processes_with_the_same_results(tmp_path, capsys):
    """``--jobs 2``: the runs go to two spawned processes and are read back; same results as one process."""
    sets = ["--set", "run.rounds=2", "--set", "run.threads=1", "--quiet"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["compare", "tiny", "--methods", "fedit", "--seeds", "0,1", "--out", str(one), *sets]) == 0
    assert main(["compare", "tiny", "--methods", "fedit", "--seeds", "0,1", "--out", str(two), "--jobs", "2", *sets]) == 0
    a, b = (json.loads((d / "results.json").read_text()) for d in (one, two))
    strip = [[{k: v for k, v in x.items() if k not in ("time", "run_dir")} for x in r["runs"]] for r in a["rows"]]
    assert strip == [[{k: v for k, v in x.items() if k not in ("time", "run_dir")} for x in r["runs"]] for r in b["rows"]]
    t1 = run_tuning("tiny", "fedit", GRID, "0", ["run.rounds=1", "run.threads=1"], tmp_path / "t1")
    t2 = run_tuning("tiny", "fedit", GRID, "0", ["run.rounds=1", "run.threads=1"], tmp_path / "t2", jobs=2)
    assert t2["chosen"] == t1["chosen"] and [r["score"] for r in t2["runs"]] == [r["score"] for r in t1["runs"]]


def test_bad_jobs_are_refused(tmp_path, capsys):
    assert main(["compare", "tiny", "--jobs", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--jobs must be an integer >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--jobs > 1 needs an output directory"):
        run_tuning("tiny", "fedit", GRID, "0", ["run.rounds=1"], None, jobs=2)


def test_settings_for_the_compared_methods_only_are_accepted(tmp_path):
    """``--set`` values that suit only the compared methods (heterogeneous ranks, a method option) are checked
    against each of them, not against the config's own ``method.name``; a compared method they do not suit is
    named."""
    sets = ["run.rounds=1", "lora.ranks=[2,4]", "method.hetero_base=per_client"]
    res = run_tuning("tiny", "ilora", "1e-3", "0", sets)
    assert set(res["chosen"]) == {"ilora"}
    with pytest.raises(ConfigError, match="method 'fedit' does not support heterogeneous ranks"):
        from fedlowrank.experiments.compare import run_comparison

        run_comparison("tiny", "ilora,fedit", "0", ["run.rounds=1", "lora.ranks=[2,4]"])


def test_tuning_more_methods_into_one_directory_keeps_the_earlier_choices(tmp_path):
    """A second ``tune`` into the same --out (another method, or one method's grid extended) keeps what the first
    chose for the methods it does not re-tune; one of another config is refused before anything runs."""
    out = tmp_path / "tune"
    first = run_tuning("tiny", "fedit,ffa-lora", GRID, "0", ["run.rounds=1"], out)
    extended = run_tuning("tiny", "fedit", "1e-4,1e-3,3e-2", "0", ["run.rounds=1"], out, resume=True)
    saved = json.loads((out / "tune.json").read_text())
    assert saved["chosen"]["ffa-lora"] == first["chosen"]["ffa-lora"] == extended["chosen"]["ffa-lora"]
    assert saved["chosen"]["fedit"]["scores"].keys() == {"0.0001", "0.001", "0.03"}
    assert saved["grid"]["ffa-lora"] == [1e-4, 3e-2] and saved["settings"]["ffa-lora"] == first["settings"]["ffa-lora"]
    assert sorted((r["method"], r["lr"]) for r in saved["runs"]) == [
        ("fedit", 1e-4), ("fedit", 1e-3), ("fedit", 3e-2), ("ffa-lora", 1e-4), ("ffa-lora", 3e-2)]
    assert "| ffa-lora |" in (out / "tune.md").read_text()
    for sets, seeds in ((["run.rounds=2"], "0"), (["run.rounds=1"], "1")):
        with pytest.raises(ConfigError, match=r"tune.json holds the tuning of ffa-lora with another config, seeds or parameter"):
            run_tuning("tiny", "fedit", GRID, seeds, sets, out, resume=True)
    assert json.loads((out / "tune.json").read_text()) == saved
    (out / "tune.json").write_text("{}")
    with pytest.raises(ConfigError, match="is not a tune.json written by fedlowrank tune"):
        run_tuning("tiny", "fedit", GRID, "0", ["run.rounds=1"], out, resume=True)


def test_a_second_parameter_is_tuned_at_the_tuned_learning_rate(tmp_path):
    """``--param privacy.clip --tuned lr/tune.json``: every run at the method's tuned rate, the choice carries both
    values, and ``compare --tuned`` applies both."""
    lr = run_tuning("tiny", "fedit", GRID, "0", ["run.rounds=1"], tmp_path / "lr")
    sets = ["run.rounds=1", "privacy.mode=central", "privacy.noise_multiplier=0.5", "server.weighting=uniform"]
    assert main(["tune", "tiny", "--methods", "fedit", "--param", "privacy.clip", "--grid", "0.01,1",
                 "--tuned", str(tmp_path / "lr" / "tune.json"), "--out", str(tmp_path / "clip"), "--quiet",
                 *[x for s in sets for x in ("--set", s)]]) == 0
    clip = json.loads((tmp_path / "clip" / "tune.json").read_text())
    pick = clip["chosen"]["fedit"]
    assert pick["param"] == "privacy.clip" and pick["value"] in (0.01, 1.0)
    assert pick["sets"] == {"train.lr": lr["chosen"]["fedit"]["value"], "privacy.clip": pick["value"]}
    for value in ("0.01", "1"):
        run_cfg = json.loads((tmp_path / "clip" / f"fedit-privacy.clip{value}-seed0" / "config.json").read_text())
        assert run_cfg["train"]["lr"] == pick["sets"]["train.lr"] and run_cfg["privacy"]["clip"] == float(value)
    assert "| fedit | 0.01 |" in (tmp_path / "clip" / "tune.md").read_text()
    out = tmp_path / "cmp"
    assert main(["compare", "tiny", "--methods", "fedit", "--seeds", "0", "--tuned", str(tmp_path / "clip" / "tune.json"),
                 "--out", str(out), "--quiet", *[x for s in sets for x in ("--set", s)]]) == 0
    run_cfg = json.loads((out / "fedit-seed0" / "config.json").read_text())
    assert (run_cfg["train"]["lr"], run_cfg["privacy"]["clip"]) == (pick["sets"]["train.lr"], pick["value"])


def test_bad_tuning_parameters_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="--grid: give the values of privacy.clip"):
        run_tuning("tiny", "fedit", None, "0", ["run.rounds=1"], param="privacy.clip")
    with pytest.raises(ConfigError, match="--set privacy.clip=1 fixes privacy.clip, the parameter being tuned"):
        run_tuning("tiny", "fedit", "0.1,1", "0", ["privacy.clip=1"], param="privacy.clip")
    with pytest.raises(ConfigError, match="train.lrr is not a config key"):
        run_tuning("tiny", "fedit", "0.1,1", "0", [], param="train.lrr")
    with pytest.raises(ConfigError, match="--tuned: .* is not a tune.json"):
        run_tuning("tiny", "fedit", "0.1,1", "0", [], param="privacy.clip", tuned=tmp_path / "missing.json")
    lr = run_tuning("tiny", "fedit", GRID, "0", ["run.rounds=1"], tmp_path / "lr")
    with pytest.raises(ConfigError, match="--tuned: .* chose no value for ffa-lora"):
        run_tuning("tiny", "fedit,ffa-lora", "0.1,1", "0", [], param="privacy.clip", tuned=tmp_path / "lr" / "tune.json")
    assert lr["chosen"]["fedit"]["sets"] == {"train.lr": lr["chosen"]["fedit"]["value"]}


def test_tune_files_of_earlier_versions_are_read(tmp_path):
    from fedlowrank.experiments.compare import read_tuned

    old = tmp_path / "tune.json"
    old.write_text(json.dumps({"chosen": {"fedit": {"lr": 0.01, "score": 0.5, "scores": {"0.01": 0.5}}}}))
    assert read_tuned(old) == {"fedit": {"train.lr": 0.01}}


def test_extend_tries_values_beyond_an_edge_until_the_best_is_interior(monkeypatch):
    """``--extend``: validation accuracy peaks at lr = 10^-4.5; from {3e-4, 1e-3, 3e-3} the 1–3–10 ladder goes down
    to 1e-4, 3e-5 (the best) and 1e-5, where the best is interior and the extension stops."""
    from fedlowrank.runtime.simulator import Simulation
    from fedlowrank.experiments.tune import beyond_edge

    def fake_run(self):
        self.last_eval = {"accuracy": 1 - (math.log10(self.cfg.train.lr) + 4.5) ** 2}
        return {}

    monkeypatch.setattr(Simulation, "run", fake_run)
    res = run_tuning("tiny", "fedit", "3e-4,1e-3,3e-3", "0", ["run.rounds=1"], extend=5)
    assert res["grid"]["fedit"] == [3e-4, 1e-3, 3e-3, 1e-4, 3e-5, 1e-5]
    assert res["chosen"]["fedit"]["value"] == 3e-5
    short = run_tuning("tiny", "fedit", "3e-4,1e-3,3e-3", "0", ["run.rounds=1"], extend=1)
    assert short["grid"]["fedit"] == [3e-4, 1e-3, 3e-3, 1e-4] and short["chosen"]["fedit"]["value"] == 1e-4
    interior = run_tuning("tiny", "fedit", "1e-5,3e-5,1e-4", "0", ["run.rounds=1"], extend=5)
    assert interior["grid"]["fedit"] == [1e-5, 3e-5, 1e-4]
    assert beyond_edge([1e-4, 1e-3, 1e-2, 1e-1], True) == 1.0 and beyond_edge([1e-4, 1e-3, 1e-2], False) == 1e-5
    assert beyond_edge([0.1, 0.25, 0.5], True) == 1.0  # off the ladder: geometric
    with pytest.raises(ConfigError, match="--extend must be an integer >= 0"):
        run_tuning("tiny", "fedit", GRID, "0", [], extend=-1)

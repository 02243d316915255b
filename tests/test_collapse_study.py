"""benchmarks/collapse_study.py: the label mix a round's average saw (the evidence of docs/comparison.md, "When
federated models collapse"), from a run directory's partition, config and metrics, and the arms' settings."""

import json
from pathlib import Path

import pytest
from helpers import benchmark_module

from fedlowrank.config import load_config


@pytest.fixture(scope="module")
def study():
    return benchmark_module("collapse_study")


def write_run(folder: Path, method: str, weighting: str, pooled: list[int] | None = None) -> Path:
    """A run directory: clients 0 (90 A, 10 B), 1 (0 A, 10 B), 2 (5 A, 5 B); round 1 trains clients 0 and 1 and
    predicts B for 97 % of the test set."""
    folder.mkdir()
    (folder / "partition.json").write_text(json.dumps({"task": {"labels": ["A", "B"]},
                                                       "label_histograms": [[90, 10], [0, 10], [5, 5]]}))
    (folder / "config.json").write_text(json.dumps({"method": {"name": method}, "server": {"weighting": weighting}}))
    rows = [{"round": 0, "accuracy": 0.5, "predictions": {"top_class": 0, "top_label": "A", "top_share": 0.6}},
            {"round": 1, "clients": [0, 1], "accuracy": 0.52,
             "predictions": {"top_class": 1, "top_label": "B", "top_share": 0.97}}]
    if pooled is not None:
        rows[1].update({"clients": pooled[:1], "pooled": pooled})
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return folder


def test_mix_weighted_by_examples_and_uniformly(study, tmp_path):
    # by examples: B is 20 of 110 examples; uniformly: (0.1 + 1.0) / 2 = 55 %, the round's largest class
    assert study.rounds_of(write_run(tmp_path / "a", "fedit", "num_examples")) == ["r1 0.520 B 97 % (mix 18 %)"]
    assert study.rounds_of(write_run(tmp_path / "b", "fedit", "uniform")) == [
        "r1 0.520 B 97 % (mix 55 %, its largest class)"]


def test_a_pooled_reference_shows_the_mix_of_the_data_it_pooled(study, tmp_path):
    # clients 0 and 2 pooled: B is 15 of 110 examples, whatever server.weighting says (nothing is averaged)
    assert study.rounds_of(write_run(tmp_path / "c", "centralized", "uniform", pooled=[0, 2])) == [
        "r1 0.520 B 97 % (mix 14 %)"]
    # a record without the pooled clients: no mix
    assert study.rounds_of(write_run(tmp_path / "d", "centralized", "num_examples")) == ["r1 0.520 B 97 %"]


@pytest.mark.parametrize("arm", ["base", "uniform", "head-lr-1e-3", "lr-1e-3", "steps-2", "alpha-100"])
def test_each_arm_changes_one_setting_of_the_base(study, arm):
    methods, sets = study.ARMS[arm]
    base = load_config("agnews", study.BASE)
    cfg = load_config("agnews", study.BASE + sets)
    changed = {f"{s}.{k}" for s in ("train", "server", "partition", "run")
               for k, v in vars(getattr(cfg, s)).items() if v != vars(getattr(base, s))[k]}
    assert methods == ["fedit"] and len(changed) == (0 if arm == "base" else 1)


def changed_settings(base: list[str], other: list[str]) -> set[str]:
    """The config keys of train, server, partition, run and lora whose values differ between ``base`` and
    ``other``."""
    before, after = load_config("agnews", base), load_config("agnews", other)
    return {f"{s}.{k}" for s in ("train", "server", "partition", "run", "lora")
            for k, v in vars(getattr(after, s)).items() if v != vars(getattr(before, s))[k]}


@pytest.mark.parametrize("arm", ["check-florg-examples", "check-florg-no-procrustes", "check-florg-lr-1e-3", "check-florg-lr-1e-4",
                                 "check-florg-head-lr-1e-3", "check-fedit-uniform"])
def test_each_check_arm_changes_one_factor_of_florg_as_the_held_out_check_ran_it(study, arm):
    reference = study.base_arm(arm)
    assert reference == "check-florg" and study.base_arm("uniform") == "base"
    base = study.BASE + study.arm_settings(reference)
    changed = changed_settings(base, study.BASE + study.arm_settings(arm))
    method_changed = study.ARMS[arm][0] != study.ARMS[reference][0]
    assert len(changed) + method_changed == 1
    # the held-out check's setting: every client every round, 6 rounds, rank 4, main's rate
    cfg = load_config("agnews", base)
    assert (cfg.run.clients_per_round, cfg.partition.num_clients, cfg.run.rounds, cfg.lora.rank, cfg.train.lr) == \
        (10, 10, 6, 4, 5e-3)


def test_check_fedit_differs_from_check_florg_as_the_held_out_check_did(study):
    # the method and its weighting (FLoRG ran with its preset's uniform weights, FedIT by examples)
    base = study.BASE + study.arm_settings("check-florg")
    assert changed_settings(base, study.BASE + study.arm_settings("check-fedit")) == {"server.weighting"}
    assert study.ARMS["check-fedit"][0] == ["fedit"] and study.ARMS["check-florg"][0] == ["florg"]


def test_your_own_files_are_a_data_set_of_the_study_named_by_their_folder(study, tmp_path):
    folder = tmp_path / "reviews"
    folder.mkdir()
    (folder / "train.tsv").write_text("great film\tpos\nawful plot\tneg\n")
    args = study_args(study, ["run", "--train", str(folder / "train.tsv"), "--out", str(tmp_path / "out")])
    name, sets = study.data_settings(args)
    assert name == "reviews" and sets == ["data.source=files", f"data.train={folder / 'train.tsv'}",
                                          "data.max_train_examples=0"]
    cfg = load_config("agnews", study.BASE + sets)
    assert (cfg.data.source, cfg.data.train, cfg.data.test) == ("files", str(folder / "train.tsv"), "")
    with_test = study_args(study, ["run", "--train", str(folder / "train.tsv"), "--test", str(folder / "t.tsv")])
    assert study.data_settings(with_test)[1][-1] == f"data.test={folder / 't.tsv'}"
    assert study.data_settings(study_args(study, ["run", "--data", "bbc"])) == ("bbc", ["data.source=bbc-news"])


def study_args(study, argv: list[str]):
    """The parsed arguments of ``collapse_study.py argv`` (what :func:`main` runs with), without running it."""
    captured = {}
    original = study.run
    study.run = lambda args: captured.setdefault("args", args)
    try:
        study.main(argv)
    finally:
        study.run = original
    return captured["args"]


def test_test_without_train_is_refused(study, capsys):
    with pytest.raises(SystemExit):
        study.main(["run", "--test", "t.tsv"])
    assert "--test needs --train" in capsys.readouterr().err


def test_records_are_read_before_the_arms_run_and_written_back_after_even_when_stopped(study, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(study, "keep_records", lambda records, out, homes, into_out: calls.append((homes, into_out)))

    def stopped(*args, **kwargs):
        calls.append("arm")
        raise KeyboardInterrupt

    monkeypatch.setattr(study, "run_comparison", stopped)
    args = study_args(study, ["run", "--data", "bbc", "--arms", "base", "--records", str(tmp_path / "rec")])
    with pytest.raises(KeyboardInterrupt):
        study.run(args)
    assert calls == [(["bbc"], True), "arm", (["bbc"], False)]

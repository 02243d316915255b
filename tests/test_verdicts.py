"""Verdicts that read right: collapse detection, the reference rows (centralized, local-only), and the settings a
comparison applies."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fedlowrank.config import from_dict
from fedlowrank.message import Message, State
from fedlowrank.runtime.evaluation import COLLAPSE_SHARE, collapse_of, run_collapse
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.tasks.base import prediction_counts, prediction_summary
from helpers import run_tiny, tiny_config, tiny_simulation, tiny_task
from test_image import image_config, image_task


# -- collapse --------------------------------------------------------------------------------------------------
def test_prediction_summary_matches_a_count_by_hand():
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 2])
    predicted = torch.tensor([0, 1, 0, 1, 1, 1, 1, 2, 1, 1])
    counts = prediction_counts(predicted, labels, 4)
    dense = np.zeros((4, 4), dtype=int)  # the confusion matrix: rows true class, columns predicted
    for t, p in zip(labels.tolist(), predicted.tolist()):
        dense[t, p] += 1
    assert np.array_equal(counts.numpy(), [dense.sum(1), dense.sum(0), np.diag(dense)])
    s = prediction_summary(counts, ["a", "b", "c", "d"])
    assert (s["top_class"], s["top_label"], s["top_share"]) == (1, "b", 0.7)
    assert s["recall"] == [2 / 3, 1.0, 0.2, None]  # class d has no test example
    assert s["majority_share"] == 0.5


def test_collapse_needs_the_threshold_share_and_records_first_and_last_rounds():
    def row(rnd, share):
        return {"round": rnd, "accuracy": 0.3, "predictions": {"top_class": 2, "top_label": "c", "top_share": share,
                                                               "recall": [0, 0, 1], "majority_share": 0.4}}
    assert collapse_of(row(1, COLLAPSE_SHARE - 1e-9)) is None
    assert collapse_of(row(1, COLLAPSE_SHARE))["top_label"] == "c"
    history = [row(1, 0.5), {"round": 2, "train_loss": 1.0}, row(3, 0.97), row(4, 0.6)]
    got = run_collapse(history)
    assert (got["round"], got["rounds"], got["at_end"]) == (3, [3], False)
    assert run_collapse(history[:2]) is None


def image_run(lines: list[str], rounds: int = 2, forced: int | None = None, **run) -> Simulation:
    """FedIT on the synthetic bands (learnable in two rounds at this rate); ``forced``: the global head's bias made
    to favour that class by 100, so that every model predicts it."""
    d = image_config("fedit", rounds=rounds).to_dict()
    d["train"].update(lr=1e-2, local_steps=5)
    d["run"].update(run)
    sim = Simulation(from_dict(d), task=image_task(), log=lines.append)
    if forced is not None:
        sim.server["head/classifier.bias"][forced] += 100.0
    sim.run()
    return sim


def test_a_run_forced_to_predict_one_class_says_so_in_one_line():
    lines: list[str] = []
    sim = image_run(lines, forced=2)
    said = [line for line in lines if "collapse:" in line]
    assert len(said) == 1 and "round 1:" in said[0] and "'band2'" in said[0] and "100.0 %" in said[0]
    assert ("try task.options.logit_adjustment = 1, or without privacy settings task.options.ccvr_samples = 100, or "
            "task.options.calibration = 10") in said[0]  # the remedies to try
    assert "remedies" not in sim.summary()
    assert sim.summary()["collapse"]["top_class"] == 2 and sim.summary()["collapse"]["at_end"]
    assert sim.history[0]["predictions"]["recall"] == [0.0, 0.0, 1.0]


def test_the_collapse_line_names_the_remedies_in_use():
    from fedlowrank.tasks.base import ClassificationOptions

    lines: list[str] = []
    task = image_task()
    task.remedies = ClassificationOptions(calibration=0.5, restricted_softmax=0.25)
    try:
        summary = image_run(lines, rounds=1, forced=2).summary()
    finally:
        task.remedies = ClassificationOptions()
    said = [line for line in lines if "collapse:" in line]
    assert said[0].endswith("; remedies in use: task.options.calibration = 0.5, task.options.restricted_softmax = 0.25")
    assert summary["remedies"] == {"calibration": 0.5, "restricted_softmax": 0.25} and summary["collapse"]


def test_a_healthy_run_says_nothing_of_a_collapse():
    lines: list[str] = []
    sim = image_run(lines, eval_every=2)
    assert sim.history[-1]["accuracy"] > 0.9
    assert not [line for line in lines if "collapse" in line] and "collapse" not in sim.summary()


# -- reference rows ---------------------------------------------------------------------------------------------
def assert_same_state(a, b) -> None:
    assert sorted(a.tensors()) == sorted(b.tensors())
    for key, t in a.tensors().items():
        torch.testing.assert_close(t, b[key], rtol=1e-5, atol=1e-6, msg=key)


def test_centralized_with_one_client_is_plain_training_of_that_client():
    """One client holding all the data: the pooled round is that client's round with the same steps, so the
    centralised reference is FedIT's run (β = 1, one reply: the global model is what the client trained)."""
    one = ("partition.kind=iid", "partition.num_clients=1", "run.clients_per_round=1")
    central, fedit = run_tiny("centralized", *one, rounds=2), run_tiny("fedit", *one, rounds=2)
    assert_same_state(central.server, fedit.server)
    assert [r["accuracy"] for r in central.history] == pytest.approx([r["accuracy"] for r in fedit.history])
    assert central.ledger.total_up == central.ledger.total_down == 0


def test_centralized_trains_on_the_pooled_data_of_the_round_for_the_clients_total_steps():
    """A round of four clients with 3 local steps each is one fit of 12 steps on their pooled examples, with the
    first client's data-order stream, from the initial model; the global model is its result."""
    from fedlowrank.methods import get_method
    from fedlowrank.runtime.engine import sample_clients
    from fedlowrank.training.local import LocalTrainer

    sets = ("run.clients_per_round=4", "train.local_steps=3")
    sim = tiny_simulation("centralized", *sets, rounds=1)
    clients = sample_clients(sim.cfg.run.seed, 1, 4, 4)
    pooled = np.concatenate([sim.parts[k] for k in clients])
    fedit = get_method("fedit")
    fedit.info = sim.info
    start = Message(sim.server)
    sim.run()
    trainer = LocalTrainer(tiny_task(), pooled, dataclasses.replace(sim.cfg.train, local_steps=12), clients[0], 1,
                           sim.cfg.run.rounds, sim.cfg.run.seed)
    reply, _ = fedit.train(sim.model, start, State(), trainer)
    assert trainer.num_examples == sum(len(sim.parts[k]) for k in clients)
    for key in sim.server.tensors():
        torch.testing.assert_close(sim.server[key], reply[key], rtol=1e-5, atol=1e-6, msg=key)
    assert sim.history[0]["replied"] == [clients[0]] and sim.history[0]["bytes_up"] == 0
    assert sim.history[0]["pooled"] == sorted(clients)  # the row names every client whose data was pooled


def test_local_only_never_communicates_and_each_client_keeps_its_own_model():
    sim = run_tiny("local-only", rounds=3)
    assert sim.ledger.rows and all(r["up"] == r["down"] == 0 for r in sim.ledger.rows)
    assert all(r["bytes_up"] == r["bytes_down"] == r["cum_bytes_up"] == 0 for r in sim.history)
    summary = sim.summary()
    assert summary["bytes_up"] == summary["bytes_down"] == 0
    initial = tiny_simulation("local-only").server
    assert_same_state(sim.server, initial)  # nothing is ever averaged
    trained = sorted(sim.store)
    assert len(trained) >= 2
    a, b = (sim.store[k] for k in trained[:2])
    assert any(not torch.equal(a[k], b[k]) for k in a.tensors())  # each its own model
    tests = [c for c in sim.history[-1]["per_client"] if "test" in c]
    assert sorted(c["client"] for c in tests) == trained
    assert sim.history[-1]["accuracy"] == pytest.approx(np.mean([c["test"]["accuracy"] for c in tests]))


@pytest.mark.parametrize("name", ["centralized", "local-only"])
def test_references_declare_what_they_are_and_refuse_privacy_and_corrections(name):
    from fedlowrank.config import ConfigError
    from fedlowrank.methods import method_class

    cls = method_class(name)
    assert cls.reference and not cls.communicates and cls.pooled == (name == "centralized")
    assert cls.personalized == (name == "local-only")
    with pytest.raises(ConfigError, match="method.correction"):
        tiny_config(f"method.name={name}", "method.correction=fedprox")
    with pytest.raises(ConfigError, match="privacy"):
        tiny_config(f"method.name={name}", 'privacy.mode="central"', "privacy.noise_multiplier=1.0")


# -- what compare applies, and what its tables say ---------------------------------------------------------------
def config_value(config: dict, key: str):
    section, _, name = key.partition(".")
    return config[section][name]


def test_settings_cell_and_config_preview_agree_with_the_resolved_config(tmp_path, capsys):
    import json
    import tomllib

    from fedlowrank.cli import main
    from fedlowrank.experiments.compare import run_comparison

    sets = ["run.rounds=1", 'compare.overrides.ffa-lora=["train.lr=0.2", "train.lr=0.05"]', "train.batch_size=4"]
    res = run_comparison("tiny", "ffa-lora,centralized,local-only", "0", sets, tmp_path / "c")
    md = (tmp_path / "c" / "results.md").read_text()
    row = next(r for r in res["rows"] if r["method"] == "ffa-lora")
    config = json.loads((tmp_path / "c" / "ffa-lora-seed0" / "config.json").read_text())
    keys = [s["key"] for s in row["in_force"]]
    assert len(keys) == len(set(keys)) and "train.lr" in keys and "train.optimizer" in keys
    for s in row["in_force"]:
        assert tomllib.loads(f"v = {s['value']}")["v"] == config_value(config, s["key"]), s
        assert f"`{s['key']}={s['value']}` ({s['source']})" in md
    assert "`train.lr=0.2`" not in md and "`train.lr=0.05` (compare.overrides)" in md  # only the value in force
    assert "(preset)" in md
    assert main(["config", "tiny", "--set", "method.name=ffa-lora", *(x for s in sets for x in ("--set", s))]) == 0
    shown = {}
    for line in capsys.readouterr().out.splitlines():
        if " = " in line and not line.startswith((" ", "#")):
            key, _, value = line.partition(" = ")
            shown[key] = value
    for s in row["in_force"]:
        value, _, mark = shown[s["key"]].partition("  [")
        assert json.loads(value) == config_value(config, s["key"]), s
        assert (mark == "preset of ffa-lora]") == (s["source"] == "preset"), (s, mark)
    assert "| centralized (reference) |" in md and "| local-only (reference) |" in md
    assert "Reference rows, not federated methods: centralized: " in md
    # the tiny random model predicts one class from the start: said once per method that is not personalised
    assert "- collapse: ffa-lora predicted one class for ≥ 95 % of the test set in 1 of 1 seeds (seed 0: round 1" in md
    assert "collapse: local-only" not in md


def test_differences_are_signed_in_every_column():
    from fedlowrank.experiments.stats import Interval

    assert Interval(0.0125, 0.031, 4, 0.02).format(signed=True) == "+0.0125 ± 0.0310"
    assert Interval(-0.0125, None, 1, None).format(signed=True) == "-0.0125 (n = 1, no interval)"
    assert Interval(0.0125, 0.031, 4, 0.02).format() == "0.0125 ± 0.0310"


# -- plots -------------------------------------------------------------------------------------------------------
def rows_of(values: dict[int, float], rounds: int = 6, chance: float = 0.4) -> list[dict]:
    rows = []
    for t in range(1, rounds + 1):
        row = {"round": t, "train_loss": 1.0, "cum_bytes_up": 100 * t, "cum_bytes_down": 100 * t}
        if t in values:
            row.update(accuracy=values[t], loss=1.0, predictions={"top_class": 0, "top_label": "a", "top_share": 0.5,
                                                                  "recall": [1.0, 0.0], "majority_share": chance})
        rows.append(row)
    return rows


def test_comparison_plot_marks_references_and_chance_clips_intervals_and_ends_at_the_last_round():
    from fedlowrank.experiments.plots import comparison_figure

    histories = {"fedit": [rows_of({2: 0.95, 4: 0.99, 6: 0.98}), rows_of({2: 0.55, 4: 0.8, 6: 0.99})],
                 "centralized": [rows_of({2: 0.9, 4: 0.9, 6: 0.9}), rows_of({2: 0.92, 4: 0.93, 6: 0.94})]}
    ax = comparison_figure(histories, "accuracy", "round", "t", {"centralized"}).axes[0]
    labels = {line.get_label(): line for line in ax.lines}
    assert labels["centralized (reference)"].get_linestyle() == "--" and labels["fedit"].get_linestyle() == "-"
    chance = next(line for name, line in labels.items() if name.startswith("chance level"))
    assert list(chance.get_ydata()) == [0.4, 0.4]
    for bars in ax.collections:  # every interval within [0, 1]
        for segment in bars.get_segments():
            assert 0.0 <= segment[:, 1].min() and segment[:, 1].max() <= 1.0 + 1e-12
    low, high = ax.get_xlim()
    assert 6.0 <= high <= 6.0 + 0.5 and ax.get_ylim()[1] <= 1.0


def test_run_plot_shows_the_chance_level_and_ends_at_the_last_round():
    from fedlowrank.reporting.plots import run_figure

    fig = run_figure(rows_of({2: 0.5, 4: 0.6, 5: 0.7}, rounds=5, chance=0.3), "accuracy")
    ax = fig.axes[0]
    assert any(line.get_label().startswith("chance level (0.300)") for line in ax.lines)
    assert ax.get_xlim()[1] == 5 and fig.axes[1].get_xlim()[1] == 5


def test_titles_name_the_data_set_not_the_file(tmp_path):
    from fedlowrank.experiments.compare import data_name

    for train, name in (("reviews.tsv", "reviews"), ("sst2/train.tsv", "sst2"), ("imdb/data.jsonl", "imdb")):
        cfg = tiny_config("data.source=files", f"data.train={tmp_path / train}", "data.test_fraction=0.2")
        assert data_name(cfg) == name


def test_round_zero_is_the_model_before_training_and_is_drawn_on_the_round_axis_only():
    from fedlowrank.experiments.plots import comparison_curves
    from fedlowrank.reporting.plots import with_round_zero

    sim = run_tiny("fedit", rounds=1)
    before = tiny_simulation("fedit", rounds=1).evaluate()
    initial = sim.summary()["initial"]
    assert initial["loss"] == pytest.approx(before["loss"]) and initial["accuracy"] == before["accuracy"]
    assert initial["loss"] != sim.history[-1]["loss"]  # training moved the model
    history = with_round_zero(sim.history, initial)
    assert history[0]["round"] == 0 and history[0]["cum_bytes_up"] == 0 and history[1:] == sim.history
    assert comparison_curves({"fedit": [history]}, "accuracy", "round")["fedit"].x.tolist() == [0.0, 1.0]
    assert comparison_curves({"fedit": [history]}, "accuracy", "bytes")["fedit"].x.tolist() == [
        sim.history[0]["cum_bytes_up"] + sim.history[0]["cum_bytes_down"]]
    assert with_round_zero(sim.history, None) == sim.history


def test_a_table_interval_beyond_the_metric_range_is_given_clipped():
    from fedlowrank.experiments.compare import interval_cell
    from fedlowrank.experiments.stats import Interval

    assert interval_cell(Interval(0.1953, 0.2978, 2, 0.03), "accuracy") == "0.1953 ± 0.2978 (in [0, 0.4931])"
    assert interval_cell(Interval(0.95, 0.08, 2, 0.01), "accuracy") == "0.9500 ± 0.0800 (in [0.87, 1])"
    assert interval_cell(Interval(0.5, 0.1, 2, 0.01), "accuracy") == "0.5000 ± 0.1000"
    assert interval_cell(Interval(0.5, 0.9, 2, 0.01), "loss") == "0.5000 ± 0.9000 (in [0, 1.4])"
    assert interval_cell(Interval(0.5, None, 1, None), "accuracy") == "0.5000 (n = 1, no interval)"

"""The first run the README gives a newcomer, ``fedlowrank run quick``, learns visibly in seconds: MiniLM on BBC News
from about a third of the test set before training to most of it after five rounds, without collapsing; the
``tiny`` smoke config says in its own description (``fedlowrank run --help``) that it learns nothing."""

from fedlowrank.configs import summary
from fedlowrank.config import load_config
from fedlowrank.runtime.simulator import Simulation


def test_the_quick_config_learns_from_near_chance_to_most_of_the_test_set():
    sim = Simulation(load_config("quick"))
    summary_ = sim.run()
    chance = summary_["predictions"]["majority_share"]
    assert summary_["initial"]["accuracy"] < chance + 0.1
    assert summary_["accuracy"] > 0.75 and summary_["accuracy"] > summary_["initial"]["accuracy"] + 0.4
    assert "collapse" not in summary_ and summary_["time"]["total"] < 120


def test_the_tiny_smoke_config_says_it_learns_nothing():
    assert "learns nothing" in summary("tiny") and "fedlowrank run quick" in summary("tiny")


def test_run_json_names_the_run_directory(tmp_path, capsys):
    import json

    from fedlowrank.cli import main

    assert main(["run", "tiny", "--set", "run.rounds=1", "--json", "--quiet", "--out", str(tmp_path / "run")]) == 0
    assert json.loads(capsys.readouterr().out)["run_dir"] == str(tmp_path / "run")

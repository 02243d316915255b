"""Outputs of a run: progress lines (and bars), per-client rows in metrics.jsonl, a run's own plots, tracking."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedlowrank.cli import main
from fedlowrank.config import ConfigError, load_config
from fedlowrank.reporting.progress import Progress, StderrLog, format_eta, round_line
from fedlowrank.runtime.engine import sample_clients
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.reporting.tracking import require_package, row_scalars

from helpers import tiny_config, tiny_task


def _run(tmp_path: Path, *sets: str, rounds: int = 2, log=None) -> Simulation:
    sim = Simulation(tiny_config(f"run.rounds={rounds}", *sets), task=tiny_task(), run_dir=tmp_path / "run", log=log)
    sim.run()
    return sim


def _rows(sim: Simulation) -> list[dict]:
    return [json.loads(line) for line in (sim.run_dir / "metrics.jsonl").read_text().splitlines()]


# -- progress ----------------------------------------------------------------------------------------------
def test_plain_lines_name_train_and_test_loss_and_eta(tmp_path):
    lines: list[str] = []
    sim = _run(tmp_path, "run.eval_every=2", rounds=3, log=lines.append)
    rounds = [line for line in lines if "] round " in line]
    assert len(rounds) == 3
    assert all("train loss" in line and "ETA" in line for line in rounds)
    # evaluated rounds (2 and the last) carry the test loss, round 1 does not
    assert ["test loss" in line for line in rounds] == [False, True, True]
    assert f"test loss {sim.history[-1]['loss']:.4f}" in rounds[-1]
    assert "ETA 0:00:00" in rounds[-1]  # nothing left after the last round


def test_eta_is_mean_round_time_times_rounds_left():
    p = Progress(None, "m", rounds=10)
    p.round_seconds = [2.0, 4.0]
    assert p.eta(2) == pytest.approx(24.0)
    assert format_eta(3725) == "1:02:05"
    assert format_eta(float("nan")) == "?"
    row = {"round": 2, "clients": [0, 1], "replied": [1], "train_loss": 0.5, "bytes_up": 1500, "bytes_down": 2_500_000,
           "time": {"total": 1.0}}
    line = round_line("m", row, {"accuracy": 0.75, "loss": 0.25}, 10, 24.0)
    assert line == ("[m] round 2/10 | train loss 0.5000 | test loss 0.2500, accuracy 0.75 | replied 1/2 | "
                    "up 1.5 KB, down 2.50 MB | 1.0 s, ETA 0:00:24")


def test_stderr_log_is_plain_off_a_terminal(capsys):
    log = StderrLog()
    assert not log.bars  # pytest's captured stderr is not a terminal
    log("hello")
    assert capsys.readouterr().err == "hello\n"


class _BarLog(list):
    """A log that asks for bars (as :class:`StderrLog` does on a terminal)."""

    bars = True

    def __call__(self, line):
        self.append(line)


class _FakeBar:
    """Records what the progress layer does with a tqdm bar."""

    made: list["_FakeBar"] = []

    def __init__(self, total, initial, desc, **kwargs):
        self.total, self.n, self.desc, self.closed, self.postfix = total, initial, desc, False, {}
        _FakeBar.made.append(self)

    def update(self, n=1):
        self.n += n

    def set_postfix(self, post, refresh=True):
        self.postfix = post

    def close(self):
        self.closed = True

    @staticmethod
    def write(line, file=None):
        raise AssertionError("the simulator writes through its log")


def test_bars_count_rounds_clients_steps_and_evaluation(tmp_path, monkeypatch):
    import fedlowrank.reporting.progress as progress

    monkeypatch.setattr(progress, "_tqdm", lambda: _FakeBar)
    _FakeBar.made = []
    log = _BarLog()
    _run(tmp_path, "train.local_steps=3", rounds=2, log=log)
    bars = {}
    for bar in _FakeBar.made:
        bars.setdefault(bar.desc.split(" ")[-1] if "client " in bar.desc else bar.desc, []).append(bar)
    assert [(b.total, b.n) for b in bars["[fedit] rounds"]] == [(2, 2)]
    assert bars["[fedit] rounds"][0].postfix.keys() == {"train loss", "test loss"}
    assert [(b.desc, b.total, b.n) for b in bars["round 1 clients"] + bars["round 2 clients"]] == [
        ("round 1 clients", 2, 2), ("round 2 clients", 2, 2)]
    assert [(b.total, b.n) for b in bars["steps"]] == [(3, 3)] * 4  # 2 clients × 2 rounds
    # forward passes: 64 examples, 1 batch; before training (round 0) and after each round
    assert [(b.total, b.n) for b in bars["evaluate"]] == [(None, 1)] * 3
    assert all(b.closed for b in _FakeBar.made)
    assert sum("] round " in line for line in log) == 2


def test_real_tqdm_bars_leave_the_rounds_bar(tmp_path, capsys):
    pytest.importorskip("tqdm")
    _run(tmp_path, rounds=2, log=_BarLog())
    assert "[fedit] rounds: 100%" in capsys.readouterr().err


def test_quiet_cli_prints_no_round_lines(tmp_path, capsys):
    assert main(["run", "tiny", "--quiet", "--set", "run.rounds=1", "--out", str(tmp_path / "q")]) == 0
    err = capsys.readouterr().err
    assert "] round " not in err and "train loss" not in err and "plot:" not in err and "%|" not in err


# -- per-client rows ---------------------------------------------------------------------------------------
def test_per_client_rows_match_the_round(tmp_path):
    gone = sample_clients(0, 2, 4, 3)[0]  # a client sampled in round 2 (seed 0, 3 of the tiny config's 4)
    sim = _run(tmp_path, f"run.dropout_schedule=[[2, {gone}]]", "run.clients_per_round=3", rounds=2)
    rows = _rows(sim)
    assert len(rows) == 2
    for row in rows:
        entries = row["per_client"]
        assert [e["client"] for e in entries] == row["clients"]
        assert sum(e["bytes_up"] for e in entries) == row["bytes_up"]
        assert sum(e["bytes_down"] for e in entries) == row["bytes_down"]
        used = [e for e in entries if e["train_loss"] is not None]
        assert [e["client"] for e in used] == row["replied"]
        assert np.mean([e["train_loss"] for e in used]) == pytest.approx(row["train_loss"])
        assert all(e["num_examples"] == len(sim.parts[e["client"]]) for e in used)
        assert all("test" not in e for e in entries)  # fedit is not personalised
    assert rows[1]["dropped"] == [gone]
    dropped = next(e for e in rows[1]["per_client"] if e["client"] == gone)
    assert dropped["train_loss"] is None and dropped["num_examples"] is None
    assert dropped["bytes_up"] == 0 and dropped["bytes_down"] > 0
    # the checkpointed history (resume) holds the same rows
    assert sim.history == rows


def test_personalised_method_reports_each_clients_test_metrics(tmp_path):
    sim = _run(tmp_path, "method.name=fedsa-lora", rounds=2)
    last = _rows(sim)[-1]
    tested = {e["client"]: e["test"] for e in last["per_client"] if "test" in e}
    assert sorted(tested) == sorted(sim.store)  # every client with a personal model, sampled this round or not
    assert np.mean([t["accuracy"] for t in tested.values()]) == pytest.approx(last["accuracy"])
    assert np.mean([t["loss"] for t in tested.values()]) == pytest.approx(last["loss"])
    for e in last["per_client"]:
        if e["client"] not in last["clients"]:
            assert e["bytes_up"] == e["bytes_down"] == 0 and e["train_loss"] is None


def test_personal_eval_clients_evaluates_a_fixed_subset_and_changes_nothing_else(tmp_path):
    full = _run(tmp_path / "all", "method.name=fedsa-lora", "run.clients_per_round=3", rounds=2)
    some = _run(tmp_path / "some", "method.name=fedsa-lora", "run.clients_per_round=3", "run.personal_eval_clients=2",
                rounds=2)
    assert len(full.store) > 2
    chosen = some.personal_eval_clients()
    assert len(chosen) == 2 and set(chosen) <= set(some.store)
    every, last = _rows(full)[-1], _rows(some)[-1]
    tested = {e["client"]: e["test"] for e in last["per_client"] if "test" in e}
    assert sorted(tested) == chosen
    # each chosen client's own model scores what it scores when every client is evaluated
    assert tested == {e["client"]: e["test"] for e in every["per_client"] if e["client"] in chosen}
    assert np.mean([t["accuracy"] for t in tested.values()]) == pytest.approx(last["accuracy"])
    # training is untouched: same losses and bytes every round
    for a, b in zip(_rows(full), _rows(some)):
        assert (a["train_loss"], a["bytes_up"], a["bytes_down"]) == (b["train_loss"], b["bytes_up"], b["bytes_down"])


@pytest.mark.parametrize("value", ["-1", "5"])
def test_bad_personal_eval_clients_names_the_range(value):
    with pytest.raises(ConfigError, match=rf"run\.personal_eval_clients must be in \[0, partition\.num_clients = 4\] "
                                          rf"\(0 = every client\), got {value}"):
        tiny_config(f"run.personal_eval_clients={value}")


# -- a run's own plots -------------------------------------------------------------------------------------
def test_cli_run_plots_its_curves(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["run", "tiny", "--set", "run.rounds=2", "--out", str(out)]) == 0
    png = out / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {png}" in capsys.readouterr().err


# -- tracking ----------------------------------------------------------------------------------------------
def test_bad_tracking_value_names_the_allowed_values():
    with pytest.raises(ConfigError, match=r"run\.tracking must be one of .*tensorboard, wandb, mlflow; got 'neptune'"):
        load_config("tiny", ["run.tracking=neptune"])
    assert load_config("tiny", ["run.tracking=tensorboard"]).run.tracking == "tensorboard"


def test_missing_tracking_package_is_one_line_naming_the_pip_command(monkeypatch, tmp_path, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"run\.tracking = 'wandb' needs the wandb package.*pip install wandb=="):
        require_package("wandb")
    assert main(["run", "tiny", "--set", "run.tracking=wandb", "--out", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: run.tracking = 'wandb'")
    assert not (tmp_path / "w").exists()  # refused before any work


def test_row_scalars_flatten_numbers_only():
    row = {"round": 3, "clients": [0, 1], "train_loss": 0.5, "accuracy": 0.25, "bytes_up": 10, "skipped": True,
           "time": {"total": 1.5, "evaluation": 0.5}, "per_client": [{"client": 0}], "diagnostics": {"gap": 2}}
    assert row_scalars(row) == {"train_loss": 0.5, "accuracy": 0.25, "bytes_up": 10.0, "time/total": 1.5,
                                "time/evaluation": 0.5, "diagnostics/gap": 2.0}


def test_tensorboard_event_file_round_trip(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sim = _run(tmp_path, "run.tracking=tensorboard", rounds=2)
    acc = EventAccumulator(str(sim.run_dir / "tensorboard"))
    acc.Reload()
    rows = _rows(sim)
    for key in ("accuracy", "loss", "train_loss", "bytes_up", "time/total"):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [1, 2]
        want = [r[key.split("/")[0]][key.split("/")[1]] if "/" in key else r[key] for r in rows]
        assert [e.value for e in events] == pytest.approx(want, rel=1e-6)


# wandb and mlflow are not in the pinned environment (the `wandb` and `mlflow` extras); these two run where they are
# installed.
def test_mlflow_store_round_trip(tmp_path):
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow.tracking import MlflowClient

    sim = _run(tmp_path, "run.tracking=mlflow", rounds=2)
    client = MlflowClient(tracking_uri=f"sqlite:///{(sim.run_dir / 'mlflow.db').resolve()}")
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    history = client.get_metric_history(run.info.run_id, "accuracy")
    assert [(m.step, m.value) for m in history] == [(r["round"], pytest.approx(r["accuracy"])) for r in _rows(sim)]
    assert run.data.params["lora.rank"] == "2" and run.info.status == "FINISHED"


def test_wandb_offline_run_holds_the_rows(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    sim = _run(tmp_path, "run.tracking=wandb", rounds=2)
    (record,) = (sim.run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data = record.read_bytes()
    assert all(key.encode() in data for key in ("accuracy", "train_loss", "time/total", "cum_bytes_up"))

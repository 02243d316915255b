"""The sweep shared by ``compare`` and ``tune``: progress lines with an ETA, tuning on several seeds (spread and
collapsed runs shown, ties named), and ``--extend`` running every method's next value in one sweep."""

import json
import math
import re

import pytest

from fedlowrank.experiments import sweep as sweep_module
from fedlowrank.experiments.compare import run_comparison
from fedlowrank.experiments.tune import choose, run_tuning, tune_markdown
from fedlowrank.runtime.simulator import DivergenceError, Simulation


def test_compare_says_run_k_of_n_with_an_eta(tmp_path):
    lines: list[str] = []
    run_comparison("tiny", "fedit,ffa-lora", "0,1", ["run.rounds=1"], tmp_path / "c", lines.append)
    starts = [line for line in lines if re.match(r"run \d of 4: ", line)]
    assert [s.split(" (")[0] for s in starts] == ["run 1 of 4: [fedit] seed 0", "run 2 of 4: [fedit] seed 1",
                                                  "run 3 of 4: [ffa-lora] seed 0", "run 4 of 4: [ffa-lora] seed 1"]
    assert "ETA" not in starts[0]  # no run has ended yet
    assert re.search(r"\(ETA \d+:\d\d:\d\d for 3 runs\)$", starts[1]) and starts[3].endswith("for 1 run)")
    done = [line for line in lines if " done: " in line]
    assert len(done) == 4 and re.fullmatch(r"run 4 of 4 done: \[ffa-lora\] seed 1: accuracy \d\.\d{4}", done[-1])
    again: list[str] = []
    run_comparison("tiny", "fedit,ffa-lora", "0,1", ["run.rounds=1"], tmp_path / "c", again.append, resume=True)
    assert again[0] == f"run 1 of 4: [fedit] seed 0: reusing the finished run in {tmp_path / 'c' / 'fedit-seed0'}"
    assert not any(" done: " in line for line in again)


def _fake_runs(monkeypatch, accuracy):
    """Simulation.run replaced by ``accuracy(lr, seed, method)`` (a number, or an exception to raise)."""
    def fake_run(self):
        value = accuracy(self.cfg.train.lr, self.cfg.run.seed, self.cfg.method_name)
        if isinstance(value, Exception):
            raise value
        self.last_eval = {"accuracy": value}
        return {}

    monkeypatch.setattr(Simulation, "run", fake_run)


def test_tuning_on_several_seeds_shows_spread_and_collapsed_runs(monkeypatch, tmp_path):
    """Three seeds: 1e-3 is best on average; 1e-2 collapses to chance on seed 1, 1e-1 diverges on seed 2 and so has
    no mean. tune.md shows each seed's score, the collapses and the spread."""
    table = {1e-3: [0.80, 0.70, 0.75], 1e-2: [0.85, 0.0, 0.80], 1e-1: [0.9, 0.9, DivergenceError("loss is nan")]}
    _fake_runs(monkeypatch, lambda lr, seed, _: table[lr][seed])
    res = run_tuning("tiny", "fedit", "1e-3,1e-2,1e-1", "0,1,2", ["run.rounds=1"], tmp_path / "t")
    pick = res["chosen"]["fedit"]
    assert pick["value"] == 1e-3 and pick["score"] == pytest.approx(0.75)
    assert math.isnan(pick["scores"]["0.1"]) and pick["scores"]["0.01"] == pytest.approx(0.55)
    assert pick["spread"]["0.001"] == pytest.approx({"min": 0.70, "max": 0.80, "sd": 0.05})
    marks = {(r["value"], r["seed"]): r["collapsed"] for r in res["runs"]}
    assert marks[1e-2, 1] == "at chance" and marks[1e-1, 2] == "diverged"
    assert sum(m is not None for m in marks.values()) == 2
    chance = [r["chance"] for r in res["runs"] if r["seed"] == 1][0]
    assert 0.25 <= chance < 0.85  # the most frequent class's share of the validation examples
    md = (tmp_path / "t" / "tune.md").read_text()
    assert "| fedit | 0.01 | 0.5500 | 0.8500, 0.0000 (at chance), 0.8000 |" in md
    assert "| fedit | 0.1 | nan | 0.9000, 0.9000, diverged |" in md
    assert "| fedit | 0.001 | 0.7500 | 0.8000, 0.7000, 0.7500 | 0.0500 | ✓ |" in md
    assert "mean over the 3 seeds" in md and "never chosen" in md


def test_ties_are_said(monkeypatch, capsys):
    _fake_runs(monkeypatch, lambda lr, seed, _: 0.25 if lr < 0.05 else 0.1)
    lines: list[str] = []
    res = run_tuning("tiny", "fedit", "1e-3,1e-2,1e-1", "0", ["run.rounds=1"], log=lines.append)
    assert res["chosen"]["fedit"]["value"] == 1e-3 and res["chosen"]["fedit"]["tied"] == [1e-3, 1e-2]
    assert any("2 values tie at the best validation accuracy 0.2500 (0.001, 0.01); chose 0.001" in line
               for line in lines)
    assert "- fedit: 0.001, 0.01 tie at the best mean score 0.2500" in tune_markdown(res)
    assert choose({1.0: 0.5, 2.0: 0.7}, True) == (2.0, [2.0]) and choose({1.0: math.nan}, True) == (None, [])


def test_extend_runs_every_methods_next_value_in_one_sweep(monkeypatch):
    """Both methods' best sits at the lower edge: each extension step runs both methods' next values together,
    and each method gets the values a method-by-method extension would give."""
    peaks = {"fedit": -4.5, "ffa-lora": -3.7}
    _fake_runs(monkeypatch, lambda lr, seed, method: 1 - (math.log10(lr) - peaks[method]) ** 2)
    batches: list[list[str]] = []
    run = sweep_module.Sweep.run

    def recording(self, runs, stop_on_divergence=False):
        batches.append([r.label for r in runs])
        return run(self, runs, stop_on_divergence)

    monkeypatch.setattr(sweep_module.Sweep, "run", recording)
    res = run_tuning("tiny", "fedit,ffa-lora", "3e-4,1e-3,3e-3", "0", ["run.rounds=1"], extend=5)
    assert res["grid"] == {"fedit": [3e-4, 1e-3, 3e-3, 1e-4, 3e-5, 1e-5], "ffa-lora": [3e-4, 1e-3, 3e-3, 1e-4]}
    assert batches[1] == ["tune [fedit] lr=0.0001 seed=0", "tune [ffa-lora] lr=0.0001 seed=0"]
    assert batches[2:] == [["tune [fedit] lr=3e-05 seed=0"], ["tune [fedit] lr=1e-05 seed=0"]]
    assert [(r["method"], r["value"]) for r in res["runs"]] == [
        ("fedit", v) for v in res["grid"]["fedit"]] + [("ffa-lora", v) for v in res["grid"]["ffa-lora"]]
    assert res["chosen"]["fedit"]["value"] == 3e-5 and res["chosen"]["ffa-lora"]["value"] == 3e-4


def test_tune_json_records_collapse_for_every_run(monkeypatch, tmp_path):
    _fake_runs(monkeypatch, lambda lr, seed, _: 0.9)
    run_tuning("tiny", "fedit", "1e-3", "0,1", ["run.rounds=1"], tmp_path / "t")
    saved = json.loads((tmp_path / "t" / "tune.json").read_text())
    assert [(r["seed"], r["collapsed"]) for r in saved["runs"]] == [(0, None), (1, None)]
    assert all(0 < r["chance"] < 0.9 for r in saved["runs"])


# -- worker processes: lines as they come, done lines in order, an ETA from measured run times -----------------------
def test_worker_progress_lines_are_shown_and_done_lines_come_in_the_order_of_the_runs(monkeypatch, tmp_path):
    """Run 2 ends before run 1: its done line waits for run 1's; each run's own lines are prefixed with its label."""
    from helpers import tiny_config

    from fedlowrank.experiments.sweep import Outcome, Run, Sweep

    runs = [Run("fedit", f"[fedit] seed {s}", tiny_config(), tmp_path / str(s), "accuracy") for s in range(3)]
    monkeypatch.setattr(Sweep, "data_of", lambda self, run: (None, [], None))
    monkeypatch.setattr(Sweep, "_read", staticmethod(lambda run: Outcome(metrics={"accuracy": 0.5})))

    def workers(work, jobs, overwrite, report, lines=False):
        assert lines and [w[0] for w in work] == [r.label for r in runs]
        for event in [("start", 0, 11), ("start", 1, 12), ("line", 1, "[fedit] round 1/2"), ("done", 1, None),
                      ("start", 2, 12), ("done", 2, None), ("line", 0, "[fedit] round 2/2"), ("done", 0, None)]:
            report(*event)
        return {}

    monkeypatch.setattr(sweep_module, "run_in_processes", workers)
    lines: list[str] = []
    Sweep(tmp_path, jobs=2, log=lines.append).run(runs)
    assert lines[1:5] == ["run 1 of 3: [fedit] seed 0 (worker process 11)",
                          "run 2 of 3: [fedit] seed 1 (worker process 12)", "[fedit] seed 1: [fedit] round 1/2",
                          "run 3 of 3: [fedit] seed 2 (worker process 12)"]
    assert lines[5] == "[fedit] seed 0: [fedit] round 2/2"
    assert [line.split(":")[0] for line in lines[6:]] == ["run 1 of 3 done", "run 2 of 3 done", "run 3 of 3 done"]


def test_the_eta_counts_the_runs_going_at_once_and_what_they_have_done():
    """5 runs of 10 s on 2 workers: when the first ends (runs 2 and 3 going, run 2 for 10 s) 15 s are left by the
    measure (20 s in truth); the wall time per run × the runs left said 40 s."""
    now = [0.0]
    clock = sweep_module._Clock(5, jobs=2, clock=lambda: now[0])
    clock.start(0)
    clock.start(1)
    assert clock.suffix() == ""
    now[0] = 10.0
    clock.end(0)
    clock.start(2)
    assert clock.eta() == 15.0 and clock.suffix() == " (ETA 0:00:15 for 4 runs)"
    one = sweep_module._Clock(3)  # in this process: the mean run time × the runs left
    one.start(0)
    one.end(0)
    assert one.eta() == 2 * one.durations[0]


# -- what benchmarks need of a sweep: each run's outcome as it ends, vectorised runs ----------------------------------
def _vectorized_config(method: str, seed: int = 3, **run):
    from fedlowrank.config import from_dict

    return from_dict({
        "run": {"rounds": 3, "clients_per_round": 2, "eval_every": 1, "seed": seed, "vectorized": True, **run},
        "task": {"kind": "matrix-regression", "options": {"num_clients": 4, "dim": 8, "outputs": 3, "samples": 6}},
        "partition": {"kind": "natural", "num_clients": 4},
        "train": {"optimizer": "sgd", "lr": 0.02, "local_steps": 3, "batch_size": 4},
        "lora": {"rank": 2, "alpha": 2.0}, "method": {"name": method}})


def test_on_done_hears_every_run_in_order_reused_ones_included(tmp_path):
    from helpers import tiny_config

    from fedlowrank.experiments.sweep import Run, Sweep

    def runs():
        return [Run("fedit", f"seed {s}", tiny_config(f"run.seed={s}", "run.rounds=1"), tmp_path / str(s),
                    "accuracy") for s in range(3)]

    Sweep(tmp_path).run(runs()[1:2])  # run 2 has ended before the sweep below starts
    heard: list[tuple[int, bool]] = []
    outcomes = Sweep(tmp_path, resume=True).run(runs(), on_done=lambda i, o: heard.append((i, o.reused)))
    assert heard == [(0, False), (1, True), (2, False)]
    assert [o.summary["rounds"] for o in outcomes] == [1, 1, 1]
    assert outcomes[1].seconds is None and outcomes[0].seconds > outcomes[0].summary["time"]["total"] > 0


def test_a_vectorized_run_goes_to_the_vectorised_runner_and_equals_it(tmp_path):
    from fedlowrank.experiments.sweep import Run, Sweep
    from fedlowrank.runtime.vectorized import run_vectorized

    cfg = _vectorized_config("ssf")
    alone = run_vectorized(_vectorized_config("ssf"))
    outcome, = Sweep(None).run([Run("ssf", "ssf", cfg, None, "rel_error")])
    assert [r["rel_error"] for r in outcome.history] == [r["rel_error"] for r in alone.history]
    assert outcome.metrics["rel_error"] == alone.final["rel_error"] and "diverged_at" not in outcome.summary
    cfg = _vectorized_config("ssf", rounds=40, stop_metric="rel_error", stop_above=1e6)
    cfg.train.lr = 5.0
    diverged, = Sweep(tmp_path).run([Run("ssf", "ssf", cfg, tmp_path / "ssf", "rel_error")])
    assert diverged.summary["diverged_at"] == run_vectorized(cfg).diverged_at < 40


def test_a_vectorized_run_with_a_validation_split_is_refused():
    from fedlowrank.config import ConfigError
    from fedlowrank.experiments.sweep import Run, Sweep

    run = Run("ssf", "[ssf] lr 0.02", _vectorized_config("ssf"), None, "rel_error", validation=True)
    with pytest.raises(ConfigError, match=r"\[ssf\] lr 0.02: run.vectorized = true cannot hold out a validation"):
        Sweep(None).run([run])


def test_finished_runs_copied_to_another_folder_are_reused_there(tmp_path):
    from fedlowrank.experiments.sweep import RECORD_FILES, copy_finished_runs
    from fedlowrank.runtime.rundir import CLAIM, new_claim, write_claim

    first = run_comparison("tiny", "fedit", "0,1", ["run.rounds=1"], tmp_path / "a", None)
    cut = tmp_path / "a" / "cut"  # a run whose metrics stop before the round its summary ends at
    cut.mkdir()
    write_claim(cut, new_claim("run", list(RECORD_FILES)))
    for name in RECORD_FILES:
        (cut / name).write_bytes((tmp_path / "a" / "fedit-seed0" / name).read_bytes())
    (cut / "summary.json").write_text(json.dumps({**json.loads((cut / "summary.json").read_text()), "rounds": 2}))
    loose = tmp_path / "a" / "loose"  # the files without a run's claim
    loose.mkdir()
    for name in RECORD_FILES:
        (loose / name).write_bytes((tmp_path / "a" / "fedit-seed0" / name).read_bytes())

    written, skipped, refused = copy_finished_runs(tmp_path / "a", tmp_path / "b")
    assert written == [tmp_path / "b" / "fedit-seed0", tmp_path / "b" / "fedit-seed1"] and skipped == []
    assert refused == [f"summary.json in {cut} differ from what the run wrote (seal.json): edited since it ended"]
    assert sorted(p.name for p in written[0].iterdir()) == sorted([CLAIM, *RECORD_FILES])
    lines: list[str] = []
    again = run_comparison("tiny", "fedit", "0,1", ["run.rounds=1"], tmp_path / "b", lines.append, resume=True)
    assert sum("reusing the finished run" in line for line in lines) == 2 and not any(" done: " in x for x in lines)
    finals = [[(r["seed"], r["final"], r["bytes_up"]) for r in row["runs"]] for row in first["rows"]]
    assert [[(r["seed"], r["final"], r["bytes_up"]) for r in row["runs"]] for row in again["rows"]] == finals
    before = {p: p.read_bytes() for p in (tmp_path / "b").rglob("*") if p.is_file()}
    assert copy_finished_runs(tmp_path / "a", tmp_path / "b")[:2] == ([], written)  # what is there stays as it is
    assert {p: p.read_bytes() for p in (tmp_path / "b").rglob("*") if p.is_file()} == before

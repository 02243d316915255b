"""``compare`` statistics: the t quantile and intervals against hand computations, the paired differences and
verdicts, the pairing of runs by seed, and the setup block of results.md."""

import json
import math

import numpy as np
import pytest

from fedlowrank.cli import main
from fedlowrank.experiments.compare import method_settings, run_comparison
from fedlowrank.config import ConfigError, load_config
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.experiments.stats import mean_interval, paired_interval, t_cdf, t_quantile, verdict

from helpers import tiny_config, tiny_task

# t_{0.975, df}: closed forms for df = 1 (Cauchy: tan(0.475π)) and df = 2 (0.95·√(2 / (1 − 0.95²))),
# tabled values (scipy.stats.t.ppf) for the others.
T_975 = {1: math.tan(0.475 * math.pi), 2: 0.95 * math.sqrt(2 / (1 - 0.95 ** 2)), 3: 3.182446305284263,
         4: 2.7764451051977987, 10: 2.2281388519649385, 30: 2.0422724563012373}


@pytest.mark.parametrize("df", sorted(T_975))
def test_t_quantile_matches_the_tables(df):
    assert t_quantile(0.975, df) == pytest.approx(T_975[df], rel=1e-10)
    assert t_quantile(0.025, df) == pytest.approx(-T_975[df], rel=1e-10)
    assert t_cdf(T_975[df], df) == pytest.approx(0.975, abs=1e-11)


def test_t_quantile_tends_to_the_normal_one_and_cdf_is_symmetric():
    assert t_quantile(0.975, 1e7) == pytest.approx(1.959963984540054, rel=1e-6)
    assert t_quantile(0.5, 5) == pytest.approx(0.0, abs=1e-12)
    for t in (0.3, 1.7, 6.0):
        assert t_cdf(t, 4) + t_cdf(-t, 4) == pytest.approx(1.0, abs=1e-14)


def test_mean_interval_by_hand():
    iv = mean_interval([1.0, 2.0, 3.0, 4.0])
    sd = math.sqrt(((1.5 ** 2) * 2 + (0.5 ** 2) * 2) / 3)  # ddof = 1: sqrt(5/3)
    assert iv.mean == 2.5 and iv.n == 4 and iv.sd == pytest.approx(sd, rel=1e-15)
    assert iv.half_width == pytest.approx(3.182446305284263 * sd / 2.0, rel=1e-10)  # = 2.05426...
    assert iv.half_width == pytest.approx(2.0542602567, abs=1e-9)
    assert (iv.low, iv.high) == (iv.mean - iv.half_width, iv.mean + iv.half_width)
    assert iv.format(2) == "2.50 ± 2.05"


def test_one_value_has_no_interval():
    iv = mean_interval([0.7])
    assert iv.half_width is None and iv.low is None and not iv.excludes_zero()
    assert iv.format() == "0.7000 (n = 1, no interval)"
    assert verdict(iv, True) == "undecided"


def test_paired_differences_and_verdicts():
    diffs, iv = paired_interval([0.8, 0.9, 0.85], [0.7, 0.7, 0.7])
    assert diffs == pytest.approx([0.1, 0.2, 0.15])
    assert iv.mean == pytest.approx(0.15) and iv.half_width == pytest.approx(T_975[2] * 0.05 / math.sqrt(3))
    assert verdict(iv, higher_is_better=True) == "better" and verdict(iv, higher_is_better=False) == "worse"
    _, straddles = paired_interval([0.8, 0.6, 0.75], [0.7, 0.7, 0.7])
    assert straddles.low < 0 < straddles.high and verdict(straddles, True) == "undecided"
    with pytest.raises(ValueError, match="reference"):
        paired_interval([1.0, 2.0], [1.0])


def test_the_same_seed_gives_every_method_the_same_partition_and_client_sampling():
    """Partition and client sampling derive from run.seed only: two methods on one seed see identical data."""
    runs = {m: Simulation(tiny_config(f"method.name={m}", "run.rounds=2"), task=tiny_task()) for m in ("fedit", "ffa-lora")}
    a, b = runs["fedit"], runs["ffa-lora"]
    assert len(a.parts) == len(b.parts) and all(np.array_equal(p, q) for p, q in zip(a.parts, b.parts))
    a.run(), b.run()
    assert [r["clients"] for r in a.history] == [r["clients"] for r in b.history]
    other = Simulation(tiny_config("run.seed=1"), task=tiny_task())
    assert not all(np.array_equal(p, q) for p, q in zip(a.parts, other.parts))


def test_compare_results_hold_per_seed_values_intervals_and_paired_differences(tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", "tiny", "--methods", "fedit,fedavg-full", "--seeds", "0,1,2", "--reference",
                 "fedavg-full", "--out", str(out), "--quiet", "--set", "run.rounds=1"]) == 0
    printed = capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())
    assert res["reference"] == "fedavg-full" and res["seeds"] == [0, 1, 2] and res["metric"] == "accuracy"
    rows = {r["method"]: r for r in res["rows"]}
    for row in rows.values():
        finals = [r["final"] for r in row["runs"]]
        assert [r["seed"] for r in row["runs"]] == [0, 1, 2]
        iv = mean_interval(finals)
        assert row["final"]["mean"] == pytest.approx(iv.mean) and row["final"]["half_width"] == pytest.approx(iv.half_width)
    # paired by seed: the same partition and client sampling per seed, different ones across seeds
    for a, b in zip(rows["fedit"]["runs"], rows["fedavg-full"]["runs"]):
        assert a["partition"] == b["partition"] and a["sampling"] == b["sampling"]
    assert len({r["partition"] for r in rows["fedit"]["runs"]}) == 3
    (pair,) = res["paired"]
    assert pair["method"] == "fedit" and pair["reference"] == "fedavg-full"
    expected = [a["final"] - b["final"] for a, b in zip(rows["fedit"]["runs"], rows["fedavg-full"]["runs"])]
    assert pair["final"]["differences"] == pytest.approx(expected)
    assert pair["final"]["verdict"] == verdict(paired_interval(expected, [0.0] * 3)[1], True)
    md = (out / "results.md").read_text()
    lines = md.splitlines()
    assert lines[0].startswith("# Comparison") and lines[2] == "## Setup (as run)"
    setup = md[: md.index("## Results")]
    for needle in ("task: text-classification, model tiny-bert", "200 training examples, 64 test examples",
                   "dirichlet (alpha = 0.5, min_partition_size = 5), 4 clients; 2 clients per round",
                   "rounds: 1", "2 local steps of batch 8", "seeds: 0, 1, 2", "| fedit | 0.001 |"):
        assert needle in setup
    assert "95% Student-t confidence interval" in md and "ddof = 1" in md and "## Paired differences against fedavg-full" in md
    assert printed.strip() == md.strip()


def test_one_seed_says_no_interval(tmp_path):
    res = run_comparison("tiny", "fedit,ffa-lora", "0", ["run.rounds=1"], tmp_path / "c")
    assert res["rows"][0]["final"]["half_width"] is None and res["paired"][0]["final"]["verdict"] == "undecided"
    assert "n = 1, no interval" in (tmp_path / "c" / "results.md").read_text()


def test_a_per_method_partition_change_is_refused_before_any_run(tmp_path):
    with pytest.raises(ConfigError, match="another partition"):
        run_comparison("tiny", "fedit,ffa-lora", "0", ['compare.overrides.ffa-lora=["partition.alpha=5.0"]'],
                       tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_bad_methods_seeds_and_reference_are_one_line_errors(capsys, tmp_path):
    for argv, field in ((["--seeds", "0,x"], "--seeds"), (["--methods", ""], "--methods"),
                        (["--methods", "fedit,fedit"], "--methods"), (["--reference", "florg"], "--reference")):
        assert main(["compare", "tiny", "--quiet", "--out", str(tmp_path / "c"), *argv]) == 2
        assert field in capsys.readouterr().err


def test_presets_come_first_and_the_user_wins():
    cfg = load_config("tiny", ['compare.overrides.ffa-lora=["train.lr=0.2"]'])
    assert load_config("tiny", method_settings(cfg, "ffa-lora")).train.optimizer == "sgd"  # the paper's preset
    assert load_config("tiny", method_settings(cfg, "ffa-lora")).train.lr == 0.2  # compare.overrides
    assert load_config("tiny", method_settings(cfg, "ffa-lora", tuned={"train.lr": 0.03})).train.lr == 0.03  # tuned
    user = load_config("tiny", method_settings(cfg, "ffa-lora", ["train.lr=0.5", "train.optimizer=adamw"], {"train.lr": 0.03}))
    assert user.train.lr == 0.5 and user.train.optimizer == "adamw"  # --set


def test_a_private_comparison_reports_epsilon(tmp_path):
    res = run_comparison("tiny", "fedit,ffa-lora", "0", ["run.rounds=1", "server.weighting=uniform", "privacy.mode=local",
                                                          "privacy.clip=1.0", "privacy.noise_multiplier=1.0"],
                         tmp_path / "c")
    eps = [r["epsilon"] for r in res["rows"]]
    assert all(e is not None and e > 0 for e in eps)
    md = (tmp_path / "c" / "results.md").read_text()
    assert "ε (client-level DP)" in md and f"{eps[0]:.3g}" in md
    plain = run_comparison("tiny", "fedit", "0", ["run.rounds=1"], tmp_path / "d")
    assert plain["rows"][0]["epsilon"] is None and "ε" not in (tmp_path / "d" / "results.md").read_text()


def test_a_dpsgd_comparison_reports_the_record_level_epsilon(tmp_path):
    """DP-SGD's ε reaches each run's summary and compare's table, in a column of its own."""
    res = run_comparison("tiny", "fedsvd,ffa-lora", "0", ["run.rounds=1", "privacy.dpsgd=true",
                                                           "privacy.dpsgd_noise=0.7"], tmp_path / "c")
    eps = [r["dpsgd_epsilon"] for r in res["rows"]]
    assert all(e is not None and e > 0 for e in eps) and all(r["epsilon"] is None for r in res["rows"])
    summary = json.loads((tmp_path / "c" / "fedsvd-seed0" / "summary.json").read_text())
    assert summary["dpsgd_epsilon"] == pytest.approx(res["rows"][0]["runs"][0]["dpsgd_epsilon"])
    md = (tmp_path / "c" / "results.md").read_text()
    assert "ε (record-level DP-SGD)" in md and "client-level" not in md and f"{eps[0]:.3g}" in md

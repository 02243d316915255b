"""Paired statistics that survive heavy tails: the median, wins and losses, the Wilcoxon signed-rank test (exact
null distribution, ties and zeros) and the paired bootstrap, against hand computations, a published table and
reference values of scipy 1.17.1 (not a dependency: computed once in a separate environment, hard-coded here)."""

import math

import pytest

from fedlowrank.config import ConfigError
from fedlowrank.experiments.compare import against_reference, paired_against, paired_statistics
from fedlowrank.experiments.stats import (bootstrap_interval, median, midranks, rank_verdict, signed_rank_null,
                                          wilcoxon_signed_rank, wins_losses)

# Critical values T of the two-sided signed-rank test (reject when min(W⁺, W⁻) <= T), n = 6..30, from Wilcoxon,
# Katti & Wilcox, "Critical values and probability levels for the Wilcoxon rank sum test and the Wilcoxon signed
# rank test", Selected Tables in Mathematical Statistics, vol. 1 (1970), as reprinted in textbooks' tables.
CRITICAL_05 = {6: 0, 7: 2, 8: 3, 9: 5, 10: 8, 11: 10, 12: 13, 13: 17, 14: 21, 15: 25, 16: 29, 17: 34, 18: 40,
               19: 46, 20: 52, 21: 58, 22: 65, 23: 73, 24: 81, 25: 89, 26: 98, 27: 107, 28: 116, 29: 126, 30: 137}
CRITICAL_01 = {8: 0, 9: 1, 10: 3, 11: 5, 12: 7, 13: 9, 14: 12, 15: 15, 16: 19, 17: 23, 18: 27, 19: 32, 20: 37,
               21: 42, 22: 48, 23: 54, 24: 61, 25: 68, 26: 75, 27: 83, 28: 91, 29: 100, 30: 109}

# scipy.stats.wilcoxon(d, method="exact").pvalue (no ties), scipy 1.17.1
SCIPY_EXACT = [
    ([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], 0.0, 0.03125),
    ([0.031, -0.012, 0.054, 0.007, -0.020, 0.043, 0.066, 0.015], 6.0, 0.109375),
    ([1.83, 0.50, 1.62, 2.48, 1.68, 1.88, 1.55, 3.06, 1.30, -0.2], 1.0, 0.00390625),
    ([-0.05, 0.11, 0.02, 0.09, 0.14, 0.07, 0.16], 2.0, 0.046875),
    ([0.31, 0.05, -0.04, 0.12, 0.40, -0.01, 0.02, 0.08, -0.06, 0.30, 0.03, 0.09], 11.0, 0.02685546875),
]
# with tied magnitudes and a zero: scipy.stats.wilcoxon(d, method=PermutationMethod(n_resamples=inf)), the exact
# permutation distribution given the ties (scipy's method="exact" ignores ties: 0.0425 for the first)
SCIPY_PERMUTATION = [
    ([0.21, 0.05, -0.03, 0.12, 0.40, -0.02, 0.01, 0.08, -0.06, 0.30, 0.02, 0.09], 12.5, 0.0361328125),
    ([0.1, -0.1, 0.2, 0.2, 0.0, 0.3, -0.05, 0.3, 0.1, 0.4], 4.0, 0.03125),
]


def test_median_midranks_and_the_null_distribution_by_hand():
    assert median([3.0, -1.0, 2.0]) == 2.0 and median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert midranks([0.5, 2.0, 2.0, 1.0, 2.0]) == [1.0, 4.0, 4.0, 2.0, 4.0]
    # ranks 1, 2, 3: W⁺ ∈ {0, 1, 2, 3, 3, 4, 5, 6} over the 8 sign patterns (doubled: 0, 2, ..., 12)
    dist = signed_rank_null([1, 2, 3])
    assert dist.tolist() == [1 / 8 if k in (0, 2, 4, 8, 10, 12) else 2 / 8 if k == 6 else 0.0 for k in range(13)]
    # ties: ranks 1.5, 1.5 → W⁺ ∈ {0, 1.5, 1.5, 3}
    assert signed_rank_null([1.5, 1.5]).tolist() == [0.25, 0, 0, 0.5, 0, 0, 0.25]


@pytest.mark.parametrize("table, alpha", [(CRITICAL_05, 0.05), (CRITICAL_01, 0.01)])
def test_exact_distribution_gives_the_published_critical_values(table, alpha):
    for n, critical in table.items():
        w = signed_rank_null(range(1, n + 1))[::2]  # P(W⁺ = k), k = 0 .. n(n+1)/2
        assert w[:critical + 1].sum() <= alpha / 2 < w[:critical + 2].sum(), n


@pytest.mark.parametrize("d, statistic, p", SCIPY_EXACT + SCIPY_PERMUTATION)
def test_signed_rank_p_values_match_scipy(d, statistic, p):
    test = wilcoxon_signed_rank(d)
    assert test.exact and min(test.w_plus, test.w_minus) == statistic
    assert test.p == pytest.approx(p, rel=1e-12)
    assert test.w_plus + test.w_minus == test.n * (test.n + 1) / 2


def test_large_samples_use_the_tie_corrected_normal_approximation():
    d = [round(math.sin(i) * 0.3 + 0.05, 3) for i in range(1, 151)]  # 150 differences, tied magnitudes
    test = wilcoxon_signed_rank(d)
    # scipy.stats.wilcoxon(d, method="approx", correction=True): statistic 4068.0, p 0.0027829675497725477
    assert not test.exact and test.w_minus == 4068.0 and test.p == pytest.approx(0.0027829675497725477, rel=1e-9)
    exact = wilcoxon_signed_rank(d, exact_max_n=200)  # the exact count is close to the approximation
    assert exact.exact and exact.p == pytest.approx(test.p, rel=0.1)


def test_zeros_are_dropped_signs_are_symmetric_and_six_seeds_are_needed():
    test = wilcoxon_signed_rank([0.0, 0.0, 0.1, 0.2])
    assert (test.n, test.zeros, test.w_plus, test.p) == (2, 2, 3.0, 0.5)
    assert wilcoxon_signed_rank([0.0, 0.0]).p == 1.0 and wilcoxon_signed_rank([]).p == 1.0
    five, six = wilcoxon_signed_rank([0.1, 0.2, 0.3, 0.4, 0.5]), wilcoxon_signed_rank([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    assert five.p == 2 / 2 ** 5 and six.p == 2 / 2 ** 6  # every seed on one side: the smallest p there is
    assert rank_verdict(five, True) == "undecided" and rank_verdict(six, True) == "better"
    assert rank_verdict(six, higher_is_better=False) == "worse"
    flipped = wilcoxon_signed_rank([-0.1, -0.2, -0.3, -0.4, -0.5, -0.6])
    assert (flipped.w_plus, flipped.w_minus, flipped.p) == (six.w_minus, six.w_plus, six.p)
    assert rank_verdict(flipped, True) == "worse"
    # differences equal but for floating-point noise share a rank
    assert wilcoxon_signed_rank([0.3 - 0.1, 0.2, 0.5]).w_plus == 6.0
    assert midranks([float(f"{abs(x):.12g}") for x in (0.3 - 0.1, 0.2)]) == [1.5, 1.5]


def test_one_collapse_cannot_win_the_rank_test():
    """Five small losses and one huge win: the mean is positive and its t-interval may exclude 0, the signed-rank
    test does not call it "better"."""
    d = [-0.01, -0.02, -0.01, -0.03, -0.02, 0.9]
    test = wilcoxon_signed_rank(d)
    assert sum(d) > 0 and test.w_plus == 6.0 and rank_verdict(test, True) == "undecided"
    assert wins_losses(d, True) == {"wins": 1, "losses": 5, "ties": 0}
    assert wins_losses(d + [0.0], False) == {"wins": 5, "losses": 1, "ties": 1}


def test_bootstrap_interval_is_reproducible_by_seed():
    d = [0.05, -0.02, 0.11, 0.03, 0.07, -0.04, 0.09, 0.01]
    a, b, c = bootstrap_interval(d, seed=0), bootstrap_interval(d, seed=0), bootstrap_interval(d, seed=1)
    assert a == b and a != c
    assert min(d) < a[0] < sum(d) / len(d) < a[1] < max(d)
    assert abs(a[0] - c[0]) < 0.01 and abs(a[1] - c[1]) < 0.01  # 10,000 resamples: seeds agree closely
    assert bootstrap_interval([0.2, 0.2, 0.2]) == (pytest.approx(0.2), pytest.approx(0.2))
    assert bootstrap_interval([0.3]) is None
    # two seeds, 0 and 1: resampled means 0, ½, 1 with probabilities ¼, ½, ¼, so the 95% interval is [0, 1]
    assert bootstrap_interval([0.0, 1.0]) == (0.0, 1.0)


def test_paired_statistics_hold_every_summary():
    stats = paired_statistics([0.8, 0.7, 0.9, 0.6, 0.85, 0.75], [0.7, 0.72, 0.8, 0.5, 0.8, 0.7], True)
    assert stats["differences"] == pytest.approx([0.1, -0.02, 0.1, 0.1, 0.05, 0.05])
    assert (stats["wins"], stats["losses"], stats["ties"]) == (5, 1, 0)
    assert stats["median"] == pytest.approx(0.075)
    assert stats["signed_rank"]["n"] == 6 and stats["signed_rank"]["w_minus"] == 1.0
    assert stats["signed_rank"]["p"] == pytest.approx(4 / 64)  # W⁻ ≤ 1: 2 of the 64 sign patterns, two-sided
    assert stats["verdict"] == "undecided" and stats["t_verdict"] == "better"
    assert stats["bootstrap"]["seed"] == 0 and stats["bootstrap"]["low"] < stats["mean"] < stats["bootstrap"]["high"]


def test_the_same_runs_read_against_another_reference():
    """``against_reference`` recomputes only the paired differences; back to the first reference it is the identity."""
    values = {"a": [0.80, 0.70, 0.90, 0.60], "b": [0.70, 0.72, 0.80, 0.50], "c": [0.75, 0.71, 0.85, 0.55]}
    rows = [{"method": m, "runs": [{"seed": s, "final": v, "best": v + 0.01} for s, v in enumerate(vs)]}
            for m, vs in values.items()]
    results = {"higher_is_better": True, "reference": "a", "rows": rows,
               "paired": paired_against(rows, "a", True), "seeds": [0, 1, 2, 3]}
    against_b = against_reference(results, "b")
    assert against_b["reference"] == "b" and against_b["rows"] is rows and results["reference"] == "a"
    assert [p["method"] for p in against_b["paired"]] == ["a", "c"]
    assert against_b["paired"][0]["final"] == paired_statistics(values["a"], values["b"], True)
    assert against_reference(against_b, "a")["paired"] == results["paired"]
    with pytest.raises(ConfigError, match="--reference: 'd' is not one of the compared methods \\(a, b, c\\)"):
        against_reference(results, "d")

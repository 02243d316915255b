"""benchmarks/repro_ssf.py --decide: a method against itself gives zero differences on every seed, no verdict, and
equivalence at any margin; a method against a worse one is worse on every seed (docs/methods/ssf.md, "FedSub vs SSF
decided")."""

import argparse
import sys

import pytest
from helpers import benchmark_module


@pytest.fixture(scope="module")
def repro():
    return benchmark_module("repro_ssf")


def decide(repro, methods, capsys) -> tuple[list[dict], str]:
    rows: list[dict] = []
    args = argparse.Namespace(decide=methods, het=[0.5], ranks=[5], rounds=30, decide_grid=[1e-2],
                              tune_seeds=[100], seeds=[0, 1, 2, 3, 4, 5], data_seed=0, margin=0.05,
                              jobs=1, runs_dir=None, resume=False)
    repro.decide(args, rows.append)
    return rows, capsys.readouterr().out


def test_a_method_against_itself_is_equivalent(repro, capsys):
    rows, out = decide(repro, ["ssf", "ssf"], capsys)
    assert len([r for r in rows if r["kind"] == "decide"]) == 12
    assert "mean +0.0000 ± 0.0000" in out and "tied 6" in out and "signed-rank p = 1" in out
    assert "undecided" in out and "equivalence at that margin shown" in out


def test_a_worse_method_is_worse_on_every_seed(repro, capsys):
    # 30 rounds from x0 = 0: r = 5 of 100 directions a round (FedSub, SSF) lags the full model (Full-FedAvg)
    _, out = decide(repro, ["fedavg", "fedsub"], capsys)
    assert "fedsub better on 0, worse on 6" in out and "verdict for fedsub against fedavg: worse" in out

"""Outputs people read: the plots draw only measured points, keep legends off the data and name the data set;
round lines write shares of examples as counts; the evaluation bar moves during a long evaluation."""

import numpy as np
import pytest
import torch
from matplotlib.collections import PolyCollection

from fedlowrank.experiments.compare import data_name, default_metric, plot_title
from fedlowrank.experiments.plots import DODGE, comparison_curves, comparison_figure
from fedlowrank.reporting import plots as report_plots
from fedlowrank.reporting.progress import Progress, format_metric, round_line

from helpers import tiny_config

pytest.importorskip("matplotlib")


def _history(values: dict[int, float], rounds: int = 6, metric: str | None = "accuracy", per_round: int = 1000):
    """metrics.jsonl rows for ``rounds`` rounds; ``metric`` (if any) and the test loss only at the rounds in
    ``values``."""
    rows = []
    for t in range(1, rounds + 1):
        row = {"round": t, "train_loss": 1.0 / t, "cum_bytes_up": per_round * t, "cum_bytes_down": per_round * t}
        if t in values:
            row.update({metric: values[t]} if metric else {})
            row["loss"] = 1.0 - values[t]
        rows.append(row)
    return rows


HISTORIES = {"a": [_history({2: 0.5, 4: 0.6, 6: 0.7}), _history({2: 0.3, 4: 0.4, 6: 0.5})],
             "b": [_history({2: 0.4, 4: 0.45, 6: 0.5}, per_round=500),
                   _history({2: 0.2, 4: 0.5, 6: 0.6}, per_round=500)]}


def test_curves_hold_only_the_rounds_every_seed_evaluated():
    ragged = {"a": [_history({2: 0.5, 4: 0.6, 6: 0.7}), _history({2: 0.3, 6: 0.5})]}  # seed 1 lacks round 4
    c = comparison_curves(ragged, "accuracy", "round")["a"]
    assert c.x.tolist() == [2.0, 6.0] and c.mean.tolist() == pytest.approx([0.4, 0.6])
    assert c.half.tolist() == pytest.approx([12.706204736 * 0.1] * 2)  # t_{.975, 1} · sd / √2, sd = 0.1·√2
    b = comparison_curves(HISTORIES, "accuracy", "bytes")["b"]
    assert b.x.tolist() == [2000.0, 4000.0, 6000.0]
    one = comparison_curves({"a": HISTORIES["a"][:1]}, "accuracy", "round")["a"]
    assert one.half is None and comparison_curves({"a": [_history({})]}, "accuracy", "round") == {}


def test_comparison_plot_draws_markers_at_evaluated_rounds_and_no_blended_bands():
    fig = comparison_figure(HISTORIES, "accuracy", "round", "AG News (tiny-bert), 2 seeds")
    ax = fig.axes[0]
    lines = [line for line in ax.lines if line.get_label() in ("a", "b")]
    assert [line.get_label() for line in lines] == ["a", "b"]
    for line in lines:
        x = np.asarray(line.get_xdata(), dtype=float)
        assert line.get_marker() == "o" and len(x) == 3  # a marker per evaluated round, none between
        assert np.allclose(x, [2, 4, 6], atol=DODGE * 2) and not np.allclose(x, [2, 4, 6])  # shifted apart
    assert not any(isinstance(c, PolyCollection) for c in ax.collections)  # error bars, no shaded bands
    assert "mean over 2 seeds" in ax.get_title() and "AG News" in ax.get_title()
    fig.canvas.draw()
    legend, frame = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert legend.x0 >= frame.x1  # the legend sits beside the axes, never on a curve


def test_one_seed_plot_says_so_and_draws_at_the_measured_rounds():
    for xkey in ("round", "bytes"):
        fig = comparison_figure({"a": HISTORIES["a"][:1]}, "accuracy", xkey)
        ax = fig.axes[0]
        assert "mean over" not in ax.get_title() + ax.get_xlabel() and "one seed" in ax.get_title()
        assert not ax.collections  # no interval with one seed
    x = comparison_figure({"a": HISTORIES["a"][:1]}, "accuracy", "round").axes[0].lines[0].get_xdata()
    assert list(x) == [2.0, 4.0, 6.0]


def test_run_plot_of_a_causal_lm_has_data_in_every_panel():
    cfg = tiny_config("task.kind=causal-lm", "task.model=tiny-llama", "data.source=gsm8k")
    metric = default_metric(cfg)
    history = [{**row, "perplexity": 250.0, "exact_match": 0.0} if "loss" in row else row
               for row in _history({2: 0.1, 4: 0.2}, rounds=4, metric=None)]
    fig = report_plots.run_figure(history, metric)
    for ax in fig.axes:
        assert any(len(line.get_xdata()) > 0 for line in ax.lines), ax.get_title()
        assert not ax.texts
    assert [line.get_xdata().tolist() for line in fig.axes[0].lines] == [[2, 4]]  # test values where measured
    assert fig.axes[1].lines[0].get_xdata().tolist() == [1, 2, 3, 4]  # train loss every round
    empty = report_plots.run_figure(history, "rel_error")
    assert "no test rel_error" in empty.axes[0].texts[0].get_text()
    assert data_name(cfg) == "GSM8K" and plot_title({"data_name": "GSM8K", "task": "causal-lm", "model": None,
                                                      "partition": {"kind": "iid", "num_clients": 4},
                                                      "seeds": [0]}).startswith("GSM8K, iid, 4 clients, 1 seed")


def test_partition_legend_sits_beside_the_bars(tmp_path, monkeypatch):
    plt = report_plots.pyplot()
    kept = []
    monkeypatch.setattr(plt, "close", kept.append)
    hist = np.array([[5, 0, 3, 9], [1, 7, 7, 2], [0, 0, 12, 4]])
    assert report_plots.plot_label_histograms(hist, tmp_path / "p.png", ["World", "Sports", "Business", "Sci/Tech"])
    fig = kept[0]
    fig.canvas.draw()
    ax = fig.axes[0]
    assert ax.get_legend().get_window_extent().x0 >= ax.get_window_extent().x1


def test_shares_of_examples_are_written_as_counts():
    assert format_metric("exact_match", 0.0, {"exact_match": 16}) == "exact match 0/16 (0.0 %)"
    assert format_metric("exact_match", 3 / 16, {"exact_match": 16}) == "exact match 3/16 (18.8 %)"
    assert format_metric("accuracy", 0.75, {"exact_match": 16}) == "accuracy 0.75"
    row = {"round": 2, "clients": [0], "replied": [0], "train_loss": 0.5, "bytes_up": 10, "bytes_down": 10,
           "time": {"total": 1.0}}
    line = round_line("m", row, {"loss": 2.0, "perplexity": 7.39, "exact_match": 0.25}, 4, 2.0, {"exact_match": 8})
    assert "test loss 2.0000, perplexity 7.39, exact match 2/8 (25.0 %)" in line


class _Bar:
    made: list["_Bar"] = []

    def __init__(self, total, initial, desc, **kwargs):
        self.total, self.n, self.desc, self.closed, self.unit = total, initial, desc, False, kwargs.get("unit")
        _Bar.made.append(self)

    def update(self, n=1):
        self.n += n

    def close(self):
        self.closed = True


class _BarLog(list):
    bars = True


def test_evaluation_bar_counts_forward_passes(monkeypatch):
    import fedlowrank.reporting.progress as progress

    monkeypatch.setattr(progress, "_tqdm", lambda: _Bar)
    _Bar.made = []
    net = torch.nn.Linear(3, 2)
    p = Progress(_BarLog(), "m", rounds=2)
    with p.evaluating(net):
        for _ in range(5):  # five batches (or generated tokens)
            net(torch.zeros(1, 3))
    (bar,) = _Bar.made
    assert (bar.desc, bar.total, bar.n, bar.unit, bar.closed) == ("evaluate", None, 5, "forward", True)
    net(torch.zeros(1, 3))
    assert bar.n == 5 and not net._forward_hooks  # the hook is gone after the block
    quiet = Progress(None, "m", rounds=2)
    with quiet.evaluating(net):
        net(torch.zeros(1, 3))
    assert not net._forward_hooks and len(_Bar.made) == 1

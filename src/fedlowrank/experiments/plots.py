"""Plots of a comparison: each method's metric vs round and vs bytes, the mean over seeds with its interval.

Only measured points are drawn: a marker at each round evaluated in every seed (``run.eval_every``; rounds in
between have no value), joined by a thin line. With two or more seeds each marker carries an error bar, the 95%
t-interval of the mean over seeds, in the method's colour; the methods' bars are shifted apart a little along the
round axis so that they never hide one another (no shaded bands, whose overlaps make colours no legend names), and
clipped to the values the metric can take (:func:`fedlowrank.tasks.metric_range`). Reference rows (``centralized``,
``local-only``) are drawn dashed and named as references; for a classification task a dotted line marks the chance
level, the share of the test set in its most frequent class. The round axis ends at the last round.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..reporting.plots import bytes_axis, chance_level, pyplot
from ..tasks import metric_range
from .stats import mean_interval

DODGE = 0.12  # with error bars: shift between neighbouring methods on the round axis, in evaluation intervals


@dataclass
class Curve:
    """One method's curve: ``x [points]`` (evaluated rounds, or mean cumulative bytes sent), ``mean [points]``
    over seeds and ``half [points]`` (half-width of the 95% t-interval; ``None`` with one seed)."""

    x: np.ndarray
    mean: np.ndarray
    half: np.ndarray | None


def comparison_curves(histories: dict[str, list[list[dict[str, Any]]]], metric: str,
                      xkey: str) -> dict[str, Curve]:
    """Per method, its curve against ``xkey`` (``"round"`` or ``"bytes"``: cumulative bytes up + down, mean over
    seeds; on that log axis, only the rounds after some were sent) at the rounds where every seed reported
    ``metric`` (round 0, before training, where every seed has it: :func:`~fedlowrank.reporting.plots.with_round_zero`).
    ``histories[method]``: one list of ``metrics.jsonl`` rows per seed. Methods with no such round are left out."""
    curves = {}
    for method, runs in histories.items():
        rows = [{r["round"]: r for r in run if metric in r
                 and (xkey == "round" or r["cum_bytes_up"] + r["cum_bytes_down"] > 0)} for run in runs]
        rounds = sorted(set.intersection(*(set(r) for r in rows))) if rows else []
        if not rounds:
            continue
        y = np.array([[r[t][metric] for t in rounds] for r in rows], dtype=float)
        intervals = [mean_interval(col.tolist()) for col in y.T]
        if xkey == "round":
            x = np.array(rounds, dtype=float)
        else:
            x = np.array([[r[t]["cum_bytes_up"] + r[t]["cum_bytes_down"] for t in rounds] for r in rows]).mean(0)
        curves[method] = Curve(x, np.array([iv.mean for iv in intervals]),
                               None if len(rows) < 2 else np.array([iv.half_width for iv in intervals]))
    return curves


def error_bars(c: Curve, metric: str) -> np.ndarray:
    """``[2, points]`` lower and upper bar lengths of ``c``'s intervals, clipped to the range of ``metric``."""
    low, high = metric_range(metric)
    return np.stack([c.mean - np.maximum(c.mean - c.half, low), np.minimum(c.mean + c.half, high) - c.mean])


def comparison_figure(histories: dict[str, list[list[dict[str, Any]]]], metric: str, xkey: str, title: str = "",
                      references: set[str] | frozenset[str] = frozenset()):
    """The figure of ``metric`` vs ``xkey`` (see :func:`comparison_curves`); ``references``: the methods that are
    reference rows; ``None`` without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    from matplotlib.ticker import MaxNLocator

    curves = comparison_curves(histories, metric, xkey)
    seeds = max((len(runs) for runs in histories.values()), default=0)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    step = min((float(np.diff(c.x).min()) for c in curves.values() if len(c.x) > 1), default=1.0)
    for i, (method, c) in enumerate(curves.items()):
        shift = (i - (len(curves) - 1) / 2) * DODGE * step if xkey == "round" and c.half is not None else 0.0
        x = c.x + shift
        line, = ax.plot(x, c.mean, marker="o", markersize=4, linewidth=1.0,
                        linestyle="--" if method in references else "-",
                        label=f"{method} (reference)" if method in references else method)
        if c.half is not None:
            ax.errorbar(x, c.mean, yerr=error_bars(c, metric), fmt="none", ecolor=line.get_color(), elinewidth=1.0,
                        capsize=3)
    chance = (chance_level([row for runs in histories.values() for run in runs for row in run])
              if metric == "accuracy" else None)
    if chance is not None:
        ax.axhline(chance, color="0.4", linestyle=":", linewidth=1.0,
                   label=f"chance level ({chance:.3f}: the majority class)")
    ax.margins(y=0.08)
    low, high = ax.get_ylim()  # a wide interval (few seeds) must not stretch the axis beyond the metric's range
    bounds = metric_range(metric)
    ax.set_ylim(max(low, bounds[0]), min(high, bounds[1]))
    if xkey == "bytes":
        xs = np.concatenate([c.x for c in curves.values()]) if curves else np.array([1.0])
        bytes_axis(ax, float(xs.max()), float(xs.min()))
        ax.set_xlabel("bytes sent, up + down" + (f" (mean over {seeds} seeds)" if seeds > 1 else ""))
    else:
        last = max((float(c.x.max()) for c in curves.values()), default=1.0)
        dodged = DODGE * step * (len(curves) - 1) / 2 if seeds > 1 else 0.0
        ax.set_xlim(-dodged, last + dodged)  # ends at the last round (and the bars shifted beside it)
        for artist in ax.lines + ax.collections:
            artist.set_clip_on(False)  # the markers on the last round drawn whole
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("round (markers: evaluated rounds)")
    ax.set_ylabel(metric)
    what = (f"mean over {seeds} seeds; bars: 95% t-interval of the mean" if seeds > 1 else "one seed")
    ax.set_title((title + "\n" if title else "") + f"{metric} vs {xkey}: {what}", fontsize=9)
    ax.grid(alpha=0.3, which="both" if xkey == "bytes" else "major")
    if curves or chance is not None:  # outside the axes: it never covers a curve
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    return fig


def plot_comparison(histories: dict[str, list[list[dict[str, Any]]]], out_dir: Path, metric: str = "accuracy",
                    title: str = "", references: set[str] | frozenset[str] = frozenset()) -> list[Path]:
    """``<metric>_vs_round.png`` and ``<metric>_vs_bytes.png`` in ``out_dir`` (:func:`comparison_figure`), with
    ``title`` on both; ``references``: the methods that are reference rows. Returns the written files (none when
    matplotlib is missing)."""
    plt = pyplot()
    if plt is None:
        return []
    written = []
    for xkey in ("round", "bytes"):
        fig = comparison_figure(histories, metric, xkey, title, references)
        path = out_dir / f"{metric}_vs_{xkey}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written

"""Plots of a comparison: each method's metric vs round and vs bytes, mean over seeds with its interval."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..reporting.plots import bytes_axis, pyplot
from .stats import mean_interval


def _band(y: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Mean over seeds (rows of ``y [seeds, points]``) and the half-width of its 95% t-interval per point."""
    intervals = [mean_interval(col.tolist()) for col in y.T]
    mean = np.array([iv.mean for iv in intervals])
    return mean, (None if y.shape[0] < 2 else np.array([iv.half_width for iv in intervals]))


def plot_comparison(histories: dict[str, list[list[dict[str, Any]]]], out_dir: Path, metric: str = "accuracy",
                    title: str = "") -> list[Path]:
    """``<metric>`` vs round and vs cumulative bytes (up + down): per method the mean over seeds and, with two or
    more seeds, a band of the 95% t-interval of that mean.

    ``histories[method]`` is a list (one per seed) of per-round rows from ``metrics.jsonl``; ``title`` goes on
    both plots. Returns the written files (none when matplotlib is missing).
    """
    plt = pyplot()
    if plt is None:
        return []
    from matplotlib.ticker import MaxNLocator

    written = []
    for xkey, xlabel, fname in (("round", "round", f"{metric}_vs_round.png"),
                                ("bytes", "bytes sent, up + down (mean over seeds)", f"{metric}_vs_bytes.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        x_lo, x_hi = np.inf, 0.0
        for method, runs in histories.items():
            rows = [[r for r in run if metric in r] for run in runs]
            if not rows or not rows[0]:
                continue
            n = min(len(r) for r in rows)
            y = np.array([[r[i][metric] for i in range(n)] for r in rows])
            if xkey == "round":
                x = np.array([rows[0][i]["round"] for i in range(n)], dtype=float)
            else:
                x = np.array([[r[i]["cum_bytes_up"] + r[i]["cum_bytes_down"] for i in range(n)] for r in rows]).mean(0)
            x_lo, x_hi = min(x_lo, float(x.min())), max(x_hi, float(x.max()))
            mean, half = _band(y)
            line, = ax.plot(x, mean, marker="o", markersize=3, label=method)
            if half is not None and len(x) > 1:
                ax.fill_between(x, mean - half, mean + half, alpha=0.2, color=line.get_color(), linewidth=0)
            elif half is not None:  # one evaluated round: the interval as an error bar
                ax.errorbar(x, mean, yerr=half, color=line.get_color(), capsize=3)
        if xkey == "bytes":
            bytes_axis(ax, x_hi, x_lo)
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if metric == "accuracy":  # a wide interval (few seeds) must not stretch the axis beyond [0, 1]
            low, high = ax.get_ylim()
            ax.set_ylim(max(low, 0.0), min(high, 1.0))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(metric)
        seeds = len(next(iter(histories.values()), []))
        band = "; shaded: 95% t-interval of the mean over seeds" if seeds > 1 else ""
        ax.set_title((title + "\n" if title else "") + f"{metric} vs {xkey}{band}", fontsize=9)
        ax.grid(alpha=0.3, which="both" if xkey == "bytes" else "major")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written

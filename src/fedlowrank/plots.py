"""Plots of a comparison and of a partition (matplotlib, an optional dependency)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_comparison(histories: dict[str, list[list[dict[str, Any]]]], out_dir: Path, metric: str = "accuracy") -> list[Path]:
    """``<metric>`` vs round and vs cumulative bytes (up + down), mean over seeds, one line per method.

    ``histories[method]`` is a list (one per seed) of per-round rows from ``metrics.jsonl``.
    Returns the written files (none when matplotlib is missing).
    """
    plt = _pyplot()
    if plt is None:
        return []
    written = []
    for xkey, xlabel, fname in (("round", "round", f"{metric}_vs_round.png"),
                                ("bytes", "bytes sent, up + down (MB)", f"{metric}_vs_bytes.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for method, runs in histories.items():
            rows = [[r for r in run if metric in r] for run in runs]
            if not rows or not rows[0]:
                continue
            n = min(len(r) for r in rows)
            y = np.array([[r[i][metric] for i in range(n)] for r in rows])
            if xkey == "round":
                x = np.array([rows[0][i]["round"] for i in range(n)])
            else:
                x = np.array([(rows[0][i]["cum_bytes_up"] + rows[0][i]["cum_bytes_down"]) / 1e6 for i in range(n)])
            ax.plot(x, y.mean(0), marker="o", markersize=3, label=method)
            if len(rows) > 1:
                ax.fill_between(x, y.mean(0) - y.std(0), y.mean(0) + y.std(0), alpha=0.2)
        if xkey == "bytes":
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def plot_label_histograms(hist: np.ndarray, path: Path, label_names: list[str] | None = None,
                          what: str = "label") -> Path | None:
    """Stacked bars of each client's counts of each value split on (``what``: label, a column, clusters)."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(max(4, 0.35 * hist.shape[0] + 2), 3.5))
    names = label_names or [str(c) for c in range(hist.shape[1])]
    bottom = np.zeros(hist.shape[0])
    for c in range(hist.shape[1]):
        ax.bar(np.arange(hist.shape[0]), hist[:, c], bottom=bottom, label=names[c])
        bottom += hist[:, c]
    ax.set_xlabel("client")
    ax.set_ylabel("examples")
    ax.set_title(f"split on: {what}", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

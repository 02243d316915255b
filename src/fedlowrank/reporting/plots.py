"""Plots of a single run and of a partition (matplotlib, an optional dependency); a comparison's plots are
:mod:`fedlowrank.experiments.plots`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def bytes_axis(ax, x_max: float, x_min: float) -> None:
    """Log-scaled bytes axis labelled ``10 kB``, ``1 MB``...; within one decade also ``20 kB``, ``30 kB``,
    ``50 kB`` (labels that do not run into each other)."""
    from matplotlib.ticker import EngFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(EngFormatter(unit="B"))
    narrow = x_min > 0 and x_max / x_min < 10
    if narrow:
        ax.xaxis.set_minor_locator(LogLocator(base=10, subs=(2.0, 3.0, 5.0)))
    ax.xaxis.set_minor_formatter(EngFormatter(unit="B") if narrow else NullFormatter())
    ax.tick_params(axis="x", which="both", labelsize=8)


def chance_level(rows: list[dict[str, Any]]) -> float | None:
    """The share of the test set in its most frequent class (the accuracy of always predicting it), from the
    ``predictions`` of evaluated metrics rows; ``None`` when no row has them (not a classification task)."""
    return next((r["predictions"]["majority_share"] for r in rows if r.get("predictions")), None)


def with_round_zero(history: list[dict[str, Any]], initial: dict[str, Any] | None) -> list[dict[str, Any]]:
    """``history`` (metrics rows) led by a round-0 row of the model before training, ``initial`` (a run summary's
    ``initial``): no train loss, no bytes sent yet. Unchanged without ``initial``."""
    if not initial:
        return list(history)
    return [{"round": 0, "train_loss": float("nan"), "cum_bytes_up": 0, "cum_bytes_down": 0, **initial}, *history]


def plot_label_histograms(hist: np.ndarray, path: Path, label_names: list[str] | None = None,
                          client_names: list[str] | None = None, what: str = "label") -> Path | None:
    """Stacked bars of each client's counts of each value split on (``what``: label, a column, clusters;
    ``client_names``, e.g. each client's image domain, label the bars under their numbers); the legend sits
    right of the bars, never on them."""
    plt = pyplot()
    if plt is None:
        return None
    if hist.shape[1] > BARS_UP_TO:
        return _plot_histogram_map(plt, hist, path, client_names, what)
    fig, ax = plt.subplots(figsize=(max(4, 0.35 * hist.shape[0] + 2) + 1.5, 3.5))
    names = label_names or [str(c) for c in range(hist.shape[1])]
    bottom = np.zeros(hist.shape[0])
    for c in range(hist.shape[1]):
        ax.bar(np.arange(hist.shape[0]), hist[:, c], bottom=bottom, label=names[c])
        bottom += hist[:, c]
    ax.set_xlabel("client")
    ax.set_xticks(np.arange(hist.shape[0]), [f"{k}\n{n}" for k, n in enumerate(client_names)] if client_names
                  else [str(k) for k in range(hist.shape[0])], fontsize=7 if client_names else None)
    ax.set_ylabel("examples")
    ax.set_title(f"split on: {what}", fontsize=9)
    ax.legend(fontsize=7, ncol=1 if hist.shape[1] <= 12 else 2, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              borderaxespad=0.0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


BARS_UP_TO = 20  # the most values drawn as stacked bars with a legend; beyond, a map of the counts


def _plot_histogram_map(plt, hist: np.ndarray, path: Path, client_names: list[str] | None, what: str) -> Path:
    """Each client's counts of each of many values as one image (clients × values, values by total count, colour
    on a log scale): a fixed number of artists, whatever the number of values."""
    from matplotlib.colors import LogNorm

    order = np.argsort(-hist.sum(axis=0), kind="stable")
    counts = hist[:, order].astype(float)
    fig, ax = plt.subplots(figsize=(8, max(2.5, 0.25 * hist.shape[0] + 1.5)))
    shown = np.ma.masked_equal(counts, 0)
    image = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap="viridis",
                      norm=LogNorm(vmin=1, vmax=max(1.0, counts.max())))
    fig.colorbar(image, ax=ax, label="examples")
    ax.set_xlabel(f"{what} ({hist.shape[1]:,} values, most frequent first)")
    ax.set_yticks(np.arange(hist.shape[0]), [f"{k} {n}" for k, n in enumerate(client_names)] if client_names
                  else [str(k) for k in range(hist.shape[0])], fontsize=7)
    ax.set_ylabel("client")
    ax.set_title(f"split on: {what}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _readable_log_ticks(axis) -> None:
    """Log-scale ticks at 1, 2 and 5 × 10^k, labelled as plain numbers (0.05, 0.1, 0.2), not 10^-1."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def run_figure(history: list[dict[str, Any]], metric: str, title: str = ""):
    """One run's curves: its test ``metric`` vs round, train and test loss vs round, and the test metric vs
    cumulative bytes sent (up + down); ``None`` without matplotlib.

    ``history`` is the run's per-round rows (``metrics.jsonl``). Test values are drawn only at the rounds that
    were evaluated (a marker each, joined by a line); train loss at every round. ``metric`` (the task's metric,
    chosen by the caller) is drawn on a log scale when it is not ``accuracy`` and spans a factor of 10 or more
    (e.g. ``rel_error``); for accuracy a dotted line marks the chance level (:func:`chance_level`). The round axes
    end at the last round. A panel with nothing to draw says so instead of staying blank."""
    plt = pyplot()
    if plt is None:
        return None
    from matplotlib.ticker import MaxNLocator

    evaluated = [r for r in history if metric in r]
    rounds = [r["round"] for r in history]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = ((axes[0], "round", "round"), (axes[2], "bytes sent, up + down", "bytes sent"))
    if evaluated:
        x = [r["round"] for r in evaluated]
        y = np.array([r[metric] for r in evaluated], dtype=float)
        sent = [r["cum_bytes_up"] + r["cum_bytes_down"] for r in evaluated]
        on_log = max(sent) > 0  # bytes on a log axis, without round 0's none (the vectorised runner sends none)
        log_y = metric != "accuracy" and bool(np.all(y > 0)) and y.max() >= 10 * y.min()
        chance = chance_level(history) if metric == "accuracy" else None
        for (ax, xlabel, name), xs in zip(panels, (x, sent)):
            shown = [i for i, v in enumerate(xs) if ax is axes[0] or not on_log or v > 0]
            ax.plot([xs[i] for i in shown], y[shown], marker="o", markersize=3, label=f"test {metric}")
            if chance is not None:
                ax.axhline(chance, color="0.4", linestyle=":", linewidth=1.0, label=f"chance level ({chance:.3f})")
                ax.legend(fontsize=8)
            if log_y:
                ax.set_yscale("log")
                _readable_log_ticks(ax.yaxis)
        if on_log:
            bytes_axis(axes[2], max(sent), min(v for v in sent if v > 0))
    else:
        for ax, _, _ in panels:
            ax.text(0.5, 0.5, f"no test {metric} in this run", ha="center", va="center", transform=ax.transAxes)
    for ax, xlabel, name in panels:
        ax.set_title(f"test {metric} vs {name}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(metric)
    axes[1].plot(rounds, [r["train_loss"] for r in history], marker="o", markersize=3, label="train loss")
    tested = [r for r in history if "loss" in r]
    if tested:
        axes[1].plot([r["round"] for r in tested], [r["loss"] for r in tested], marker="s", markersize=3,
                     label="test loss")
    axes[1].set_title("train and test loss vs round")
    axes[1].set_xlabel("round")
    axes[1].set_ylabel("loss")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    for ax in axes[:2]:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if rounds:
            ax.set_xlim(min(0, rounds[0]), rounds[-1])  # ends at the last round
        for artist in ax.lines:
            artist.set_clip_on(False)  # the markers on the last round drawn whole
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_run(history: list[dict[str, Any]], out_dir: Path, metric: str, title: str = "") -> list[Path]:
    """One run's curves (:func:`run_figure`) in ``out_dir/curves.png``; ``metric``: the task's test metric (the
    caller's, e.g. :func:`fedlowrank.tasks.headline_metric`). Returns the written files (none when
    matplotlib is missing)."""
    plt = pyplot()
    if plt is None:
        return []
    fig = run_figure(history, metric, title)
    path = out_dir / "curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]

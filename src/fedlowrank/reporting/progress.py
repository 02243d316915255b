"""Progress of a run: one line per round everywhere, tqdm bars as well when stderr is a terminal.

Each round's line names the train loss (mean over the round's usable replies), the test metrics when the
round was evaluated, the bytes sent, the round's time and an ETA (mean round time so far × rounds left)::

    [fedit] round 3/10 | train loss 0.6931 | test loss 0.6812, accuracy 0.5312 | up 7.4 KB, down 7.2 KB | 1.2 s, ETA 0:00:08

A metric that is a share of a known number of examples (``counts``, e.g. a causal LM's ``exact_match`` over its
generated answers) is written as a count: ``exact match 3/16 (18.8 %)``.

On a terminal (and with tqdm installed, the ``progress`` extra) bars show the rounds, the clients of the
round, the current client's local steps and the evaluation (the forward passes of the evaluated model, or the
clients' models of a personalised method); log lines are written above them.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator


def _tqdm():
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


class StderrLog:
    """A log sink for the command line: lines on stderr; :attr:`bars` when stderr is a terminal and tqdm is
    installed (then lines go through ``tqdm.write`` so that they do not break the bars)."""

    @property
    def bars(self) -> bool:
        return sys.stderr.isatty() and _tqdm() is not None

    def __call__(self, line: str) -> None:
        tqdm = _tqdm() if self.bars else None
        if tqdm is not None:
            tqdm.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)


def format_eta(seconds: float) -> str:
    """``H:MM:SS`` (``?`` before the first round has a time)."""
    if seconds != seconds:
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def format_bytes(n: float) -> str:
    """``812 B``, ``7.4 KB``, ``1.25 MB``, ``3.10 GB`` (powers of 1000)."""
    if n < 1e3:
        return f"{int(n)} B"
    if n < 1e6:
        return f"{n / 1e3:.1f} KB"
    return f"{n / 1e6:.2f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def format_metric(name: str, value: float, counts: dict[str, int] | None = None) -> str:
    """``accuracy 0.8125``; a metric that is a share of ``counts[name]`` examples as ``exact match 3/16
    (18.8 %)``."""
    total = (counts or {}).get(name)
    if total:
        return f"{name.replace('_', ' ')} {round(value * total)}/{total} ({100 * value:.1f} %)"
    return f"{name} {value:.4g}"


def round_line(method: str, row: dict[str, Any], metrics: dict[str, float], rounds: int, eta: float,
               counts: dict[str, int] | None = None) -> str:
    """The one-line summary of a finished round: its metrics row (see :mod:`fedlowrank.runtime.simulator`),
    the test ``metrics`` of the round (empty when it was not evaluated), the ETA in seconds and ``counts``: the
    number of examples behind each metric that is a share of them (:func:`format_metric`)."""
    parts = [f"[{method}] round {row['round']}/{rounds}"]
    if row["train_loss"] == row["train_loss"]:  # no train loss (nan) when no reply was used, or none exists
        parts.append(f"train loss {row['train_loss']:.4f}")
    tests = []
    own = "by_task" in metrics  # an own-task evaluation: means over clients, not shares of the counts
    if "loss" in metrics:
        tests.append(f"test loss {metrics['loss']:.4f}")
    tests += [format_metric(k, v, None if own else counts) for k, v in metrics.items()
              if k != "loss" and isinstance(v, (int, float))]  # not the predictions' summary
    if tests:
        parts.append(("own-task mean over clients: " if own else "") + ", ".join(tests))
    if len(row["replied"]) < len(row["clients"]):
        parts.append(f"replied {len(row['replied'])}/{len(row['clients'])}")
    parts.append(f"up {format_bytes(row['bytes_up'])}, down {format_bytes(row['bytes_down'])}")
    parts.append(f"{row['time']['total']:.1f} s, ETA {format_eta(eta)}")
    return " | ".join(parts)


class Progress:
    """Progress of one run (used by the simulator and the Flower server).

    Args:
        log: where lines go (``None`` = silent: no lines, no bars).
        method: the method's name (prefix of every line).
        rounds: the run's total number of rounds.
        bars: draw tqdm bars on stderr (ignored when tqdm is missing or ``log`` is ``None``); default: the
            ``bars`` attribute of ``log`` (see :class:`StderrLog`), else no bars.
        counts: for each test metric that is a share of a number of examples, that number (round lines write
            it as a count, :func:`format_metric`).
    """

    def __init__(self, log: Callable[[str], None] | None, method: str, rounds: int, bars: bool | None = None,
                 counts: dict[str, int] | None = None):
        self.log = log
        self.method, self.rounds = method, rounds
        self.counts = dict(counts or {})
        wanted = getattr(log, "bars", False) if bars is None else bars
        self._tqdm = _tqdm() if (log is not None and wanted) else None
        self.round_seconds: list[float] = []
        self._bars: dict[str, Any] = {}

    @property
    def bars(self) -> bool:
        return self._tqdm is not None

    def write(self, line: str) -> None:
        if self.log is not None:
            self.log(line)

    def eta(self, rounds_done: int) -> float:
        """Seconds left: mean round time so far × rounds left."""
        if not self.round_seconds:
            return float("nan")
        return sum(self.round_seconds) / len(self.round_seconds) * max(self.rounds - rounds_done, 0)

    # -- bars ----------------------------------------------------------------------------------------
    def _open(self, name: str, total: int | None, position: int, desc: str, initial: int = 0,
              unit: str = "it") -> None:
        if self._tqdm is None:
            return
        self._close(name)
        self._bars[name] = self._tqdm(total=total, initial=initial, position=position, desc=desc, file=sys.stderr,
                                      leave=name == "rounds", dynamic_ncols=True, unit=unit)

    def _close(self, name: str) -> None:
        bar = self._bars.pop(name, None)
        if bar is not None:
            bar.close()

    def _advance(self, name: str, n: int = 1) -> None:
        bar = self._bars.get(name)
        if bar is not None:
            bar.update(n)

    def round_start(self, rnd: int, num_clients: int) -> None:
        if "rounds" not in self._bars:
            self._open("rounds", self.rounds, 0, f"[{self.method}] rounds", initial=rnd - 1)
        self._open("clients", num_clients, 1, f"round {rnd} clients")

    def client_start(self, client: int | list[int]) -> Callable[[int, int], None] | None:
        """A per-step hook for the local training of a client, or of a cohort of them (``None`` without bars):
        ``hook(step, total)``."""
        if self._tqdm is None:
            return None
        who = f"client {client}" if isinstance(client, int) else f"clients {', '.join(map(str, client))}"

        def on_step(step: int, total: int) -> None:
            if step == 1:
                self._open("steps", total, 2, f"{who} steps")
            self._advance("steps")

        return on_step

    def client_done(self) -> None:
        self._close("steps")
        self._advance("clients")

    def eval_start(self, num_models: int) -> None:
        """The evaluation bar over ``num_models`` models (a personalised method's clients)."""
        self._close("clients")
        self._open("eval", num_models, 1, "evaluate", unit="model")

    def eval_step(self) -> None:
        self._advance("eval")

    @contextmanager
    def evaluating(self, net) -> Iterator[None]:
        """Within the block, an evaluation bar counts the forward passes of ``net`` (a ``torch.nn.Module``: one
        per batch scored, one per generated token): it moves during a long evaluation whatever the task does.
        Without bars, nothing is hooked."""
        if self._tqdm is None:
            yield
            return
        self._close("clients")
        self._open("eval", None, 1, "evaluate", unit="forward")
        handle = net.register_forward_hook(lambda *_: self._advance("eval"))
        try:
            yield
        finally:
            handle.remove()
            self._close("eval")

    def round_end(self, row: dict[str, Any], metrics: dict[str, float], rounds: int = 1) -> None:
        """Write the round's line (with its ETA) and move the rounds bar; ``metrics``: the round's test
        metrics (empty when it was not evaluated); ``rounds``: how many rounds the row covers (the vectorised
        runner writes one row per evaluation)."""
        self._close("clients")
        self._close("eval")
        self.round_seconds += [row["time"]["total"] / rounds] * rounds
        line = round_line(self.method, row, metrics, self.rounds, self.eta(row["round"]), self.counts)
        self.write(line)
        bar = self._bars.get("rounds")
        if bar is not None:
            post = {"train loss": f"{row['train_loss']:.4f}"}
            if "loss" in metrics:
                post["test loss"] = f"{metrics['loss']:.4f}"
            bar.set_postfix(post, refresh=False)
            bar.update(rounds)

    def close(self) -> None:
        for name in ("steps", "eval", "clients", "rounds"):
            self._close(name)

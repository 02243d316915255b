"""How a run stops when people stop it: Ctrl-C (SIGINT), or SIGTERM (a cluster pre-empting the job, ``kill``).

While a run's rounds go (:func:`stop_signals`, in the main thread), both signals are caught. A run stops at once
while it only computes (local training, evaluation: code inside :func:`interruptible`), and otherwise as soon as it
has finished changing its state (broadcasts, aggregation, committing a round, writing files, checkpointing: a signal
that arrives there is held until the next :func:`interruptible` or :func:`check_stop`). So it always stops in a
consistent state, the one after its last finished round: the loop saves that state as a checkpoint and raises
:class:`StopRequested`, which the command line turns into one line saying how to resume, and the exit status
128 + the signal's number (130 for SIGINT, 143 for SIGTERM). A signal held through the last round's checkpoint
stops the run there too, before its summary: the caller (``compare``, ``tune``) must not go on to its next run.

The ranks of a distributed job stop together instead (``stop_signals(hold=True)``): a signal is only noted, and
:func:`pending_stop` tells the runner, which agrees on it with the other ranks at the end of the round and raises
:class:`StopRequested` on every rank at once (:mod:`.distributed`); a rank that stopped alone would leave the others
waiting in a collective.

Outside :func:`stop_signals` (or in another thread) nothing changes: SIGINT raises ``KeyboardInterrupt`` as usual.
A signal ignored when the run starts stays ignored (a job that a script starts with ``&`` ignores SIGINT, for one):
that is how its starter asked the process not to be stopped by it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequested(KeyboardInterrupt):
    """A run was asked to stop by signal ``signum``."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        super().__init__(f"stopped by {self.name}")

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        """What a shell reports for a process ended by the signal: 128 + its number."""
        return 128 + self.signum


class _Signals:
    """The stop signals caught while a run goes: the first one received, how deep in :func:`interruptible`, and
    whether stops are only noted (``hold``)."""

    def __init__(self, hold: bool = False) -> None:
        self.received: int | None = None
        self.depth = 0
        self.hold = hold

    def handle(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signum
        if self.depth and not self.hold and not in_finalizer(frame):
            raise StopRequested(signum)


_FINALIZER_FILES = ("weakref.py", "_weakrefset.py")


def in_finalizer(frame) -> bool:
    """Whether ``frame`` (where a signal arrived) runs inside a finalizer (a ``__del__`` or a weakref callback), where
    Python prints an exception and drops it: the stop is then only noted, and :func:`check_stop` raises it before
    the next round."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or code.co_filename.endswith(_FINALIZER_FILES):
            return True
        frame = frame.f_back
    return False


_caught: _Signals | None = None


@contextmanager
def stop_signals(hold: bool = False) -> Iterator[None]:
    """Catch SIGINT and SIGTERM while the block runs (see the module docstring), unless ignored; the handlers that
    were there before are put back afterwards. ``hold``: only note them (:func:`pending_stop`; a rank of a
    distributed job). Nested uses, and uses outside the main thread, change nothing."""
    global _caught
    if _caught is not None or threading.current_thread() is not threading.main_thread():
        yield
        return
    _caught = caught = _Signals(hold)
    before = {s: signal.signal(s, caught.handle) for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        _caught = None


def check_stop() -> None:
    """Raise :class:`StopRequested` if a stop signal has arrived (inside :func:`stop_signals`, unless it holds
    them)."""
    if _caught is not None and _caught.received is not None and not _caught.hold:
        raise StopRequested(_caught.received)


def pending_stop() -> int:
    """The stop signal received so far inside :func:`stop_signals` (0: none)."""
    return _caught.received or 0 if _caught is not None else 0


@contextmanager
def interruptible() -> Iterator[None]:
    """A block that only computes: a stop signal (one already received, or one arriving during it) raises
    :class:`StopRequested` at once."""
    caught = _caught
    if caught is None:
        yield
        return
    check_stop()
    caught.depth += 1
    try:
        yield
    finally:
        caught.depth -= 1


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """While the block runs, SIGTERM (``kill``, a cluster pre-empting the job) raises :class:`StopRequested` as
    Ctrl-C raises ``KeyboardInterrupt``: a command stops as on Ctrl-C, a run in progress saving its state first
    (:func:`stop_signals`) and a sweep's worker processes stopped and waited for. Only in the main thread, and not
    when SIGTERM is ignored."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        yield
        return

    def terminate(signum: int, frame) -> None:
        raise StopRequested(signum)

    before = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)

"""Run directories: one run per directory, never two at once, never mixed with an older run.

* :func:`new_run_dir` creates a fresh directory ``<parent>/<stem>`` (``<stem>-2``, ``-3``, ... when taken; the
  ``mkdir`` itself decides, so two runs started in the same second get different directories);
* :func:`check_run_dir` refuses what :func:`claim_run_dir` would, without changing anything;
* :func:`claim_run_dir` locks a directory for a new run and refuses it when it already holds files, unless
  ``overwrite`` is set: then the old run's files are deleted first (only in a directory fedlowrank wrote);
* :func:`lock_run_dir` locks a directory for a run that continues it (resume).

The lock is ``fcntl.flock`` on ``<dir>/.lock``, which records the holder's PID. The kernel drops it when the
holder closes it or its process ends (even by ``kill -9``), so a crashed run never leaves a stale lock; the
``.lock`` file itself stays and marks the directory as fedlowrank's.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

LOCK_FILE = ".lock"
RUN_MARKERS = (LOCK_FILE, "config.json", "results.json")  # a directory holding one of these is a run's


class RunDirError(ValueError):
    """A run directory cannot be used: it holds another run, or another process is writing it."""


class RunDirLock:
    """An exclusive ``flock`` on ``<path>/.lock``, held until :meth:`release` (or the process ends)."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __del__(self) -> None:
        self.release()


def _holder(lock_file: Path) -> str:
    try:
        pid = lock_file.read_text().strip()
    except OSError:
        pid = ""
    return f" (pid {pid})" if pid else ""


def lock_run_dir(path: str | Path) -> RunDirLock:
    """Create ``path`` if needed and lock it; :class:`RunDirError` when another run holds the lock."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise RunDirError(f"run directory {path}: cannot create it or its lock file ({exc.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirError(f"run directory {path} is in use by another run{_holder(path / LOCK_FILE)}; "
                          f"wait for it to end or choose another directory") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return RunDirLock(path, fd)


def _check_not_in_use(path: Path) -> None:
    """Refuse when a run holds the lock of a sub-directory of ``path`` (e.g. one method of a comparison)."""
    for lock_file in path.glob(f"*/{LOCK_FILE}"):
        lock_run_dir(lock_file.parent).release()


def _old_run(path: Path, overwrite: bool, is_run: bool, flag: str = "--overwrite") -> list[str]:
    """The names in ``path`` (locked by the caller) that an ``overwrite`` would delete; refusals as in
    :func:`claim_run_dir`, naming ``flag`` as the way to overwrite."""
    old = sorted(p.name for p in path.iterdir() if p.name != LOCK_FILE)
    if old and not overwrite:
        shown = ", ".join(old[:4]) + (", ..." if len(old) > 4 else "")
        raise RunDirError(f"run directory {path} is not empty (holds {shown}); pass {flag} to replace "
                          f"its run, or choose another directory")
    if old and not is_run:
        raise RunDirError(f"run directory {path} is not empty and holds no fedlowrank run (no "
                          f"{', '.join(RUN_MARKERS)}): not deleting it with {flag}; choose another directory")
    for lock_file in path.glob(f"*/{LOCK_FILE}"):  # e.g. one method of a comparison, being run right now
        lock_run_dir(lock_file.parent).release()
    return old


def check_run_dir(path: str | Path, overwrite: bool = False, flag: str = "--overwrite") -> None:
    """Raise the :class:`RunDirError` that :func:`claim_run_dir` would, changing nothing but creating ``path``
    (to refuse a run before it builds anything); ``flag`` is how the user asks to overwrite."""
    path = Path(path)
    is_run = any((path / name).exists() for name in RUN_MARKERS)
    lock = lock_run_dir(path)
    try:
        _old_run(path, overwrite, is_run, flag)
    finally:
        lock.release()


def claim_run_dir(path: str | Path, overwrite: bool = False) -> RunDirLock:
    """Lock ``path`` for a new run. A directory holding files is refused unless ``overwrite``; with it, the
    old run's files are deleted (refused if the directory holds no fedlowrank run, or a run is writing in it).
    Returns the lock; the caller releases it when the run ends."""
    path = Path(path)
    is_run = any((path / name).exists() for name in RUN_MARKERS)
    lock = lock_run_dir(path)
    try:
        for name in _old_run(path, overwrite, is_run):
            target = path / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            else:
                target.unlink()
    except BaseException:
        lock.release()
        raise
    return lock


def new_run_dir(parent: str | Path, stem: str) -> Path:
    """A directory ``parent/stem`` that did not exist before this call (``stem-2``, ``stem-3``, ... when taken)."""
    parent = Path(parent)
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunDirError(f"run.out_dir {parent}: cannot create it ({exc.strerror})") from None
    for i in range(1, 10_000):
        path = parent / (stem if i == 1 else f"{stem}-{i}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
        except OSError as exc:
            raise RunDirError(f"run.out_dir {parent}: cannot create {path.name} in it ({exc.strerror})") from None
    raise RunDirError(f"run.out_dir {parent}: every name {stem}-N is taken")

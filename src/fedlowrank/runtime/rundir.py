"""Run directories: one run per directory, never two at once, never mixed with an older run, and nothing of a
refused command left behind.

* :func:`new_run_dir` creates a fresh directory ``<parent>/<stem>`` (``<stem>-2``, ``-3``, ... when taken; the
  ``mkdir`` itself decides, so two runs started in the same second get different directories);
* :func:`check_run_dir` refuses what :func:`claim_run_dir` would, without changing anything;
* :func:`claim_run_dir` locks a directory for a new run and refuses it when it already holds files, unless
  ``overwrite`` is set: then the old run's files are deleted first (only in a run directory, below);
* :func:`lock_run_dir` locks a directory for a run that continues it (resume); :func:`continue_run_dir` does so for
  ``compare``/``tune --resume``, claiming the directory when it is new.

**What is a run directory.** One that holds :data:`RUN_MARKER`, written by :func:`claim_run_dir` once it has
claimed the directory (it was empty, or a run directory already), or ``ledger.jsonl`` (a run written before the
marker existed). ``--overwrite`` deletes the contents of such a directory only; any other non-empty directory is
refused, and nothing is written into it. Neither a lock file nor a common name such as ``config.json`` (every
Hugging Face model folder has one) is evidence.

**The lock** is ``fcntl.flock`` on ``<dir>/.lock``, which records the holder's PID. The holder deletes the file
when it releases the lock; the kernel drops the lock itself when the holder's process ends (even by ``kill -9``),
so a crashed run never leaves a stale lock (a ``.lock`` file left by one is ignored and replaced). Releasing also
undoes what a holder made but never used: the marker when it is all the directory holds, and the directory (with
the parents it made) when the lock created it and it is empty.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

LOCK_FILE = ".lock"
RUN_MARKER = ".fedlowrank-run"
RUN_FILES = (RUN_MARKER, "ledger.jsonl")  # a directory holding one of these is a run's
_OWN_FILES = (LOCK_FILE, RUN_MARKER)  # bookkeeping, not contents of the run
_MARKER_TEXT = ("This directory holds a fedlowrank run (or comparison, or tuning). `fedlowrank run|compare|tune "
                "--overwrite --out DIR` replaces everything in it.\n")


class RunDirError(ValueError):
    """A run directory cannot be used: it holds another run or other files, or another process is writing it."""


class RunDirLock:
    """An exclusive ``flock`` on ``<path>/.lock``, held until :meth:`release` (or the process ends).

    ``created`` is the topmost directory that taking the lock created (``path`` or one of its parents), or ``None``.
    """

    def __init__(self, path: Path, fd: int, created: Path | None = None):
        self.path, self._fd, self.created = path, fd, created

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock and delete the lock file; then remove the marker when it is all the directory holds, and
        the directories the lock created when they are empty (what a refused or failed command made)."""
        if self._fd is None:
            return
        try:
            (self.path / LOCK_FILE).unlink()  # still ours: nobody else can lock it while we hold it
        except FileNotFoundError:
            pass
        os.close(self._fd)  # closing the descriptor drops the flock
        self._fd = None
        _tidy(self.path, self.created)

    def __del__(self) -> None:
        self.release()


def _tidy(path: Path, created: Path | None) -> None:
    """Remove the marker when it is all ``path`` holds, then the empty directories that made ``path`` exist."""
    try:
        if [p.name for p in path.iterdir()] == [RUN_MARKER]:
            (path / RUN_MARKER).unlink()
    except OSError:
        pass
    remove_created_dirs(path, created)


def make_dirs(path: Path) -> Path | None:
    """``mkdir -p path``; returns the topmost directory this call created, or ``None``."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    return missing[-1] if missing else None


def remove_created_dirs(path: Path, created: Path | None) -> None:
    """Remove ``path`` and its parents up to ``created`` (what :func:`make_dirs` returned) while they are empty."""
    if created is None:
        return
    for folder in (path, *path.parents):
        try:
            folder.rmdir()  # only ever removes an empty directory
        except OSError:
            return
        if folder == created:
            return


def _holder(lock_file: Path) -> str:
    try:
        pid = lock_file.read_text().strip()
    except OSError:
        pid = ""
    return f" (pid {pid})" if pid else ""


def lock_run_dir(path: str | Path) -> RunDirLock:
    """Create ``path`` if needed and lock it; :class:`RunDirError` when another run holds the lock."""
    path = Path(path)
    created = None
    try:
        created = make_dirs(path)
        while True:
            fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunDirError(f"run directory {path} is in use by another run{_holder(path / LOCK_FILE)}; "
                                  f"wait for it to end or choose another directory") from None
            try:  # the file we locked may have been deleted by its previous holder meanwhile: lock the new one
                if os.stat(path / LOCK_FILE).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
    except OSError as exc:
        _tidy(path, created)
        raise RunDirError(f"run directory {path}: cannot create it or its lock file ({exc.strerror})") from None
    except BaseException:
        _tidy(path, created)
        raise
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return RunDirLock(path, fd, created)


def is_run_dir(path: str | Path) -> bool:
    """Whether ``path`` holds a fedlowrank run, comparison or tuning (one of :data:`RUN_FILES`)."""
    return any((Path(path) / name).exists() for name in RUN_FILES)


def _old_run(path: Path, overwrite: bool, flag: str) -> list[str]:
    """The names in ``path`` that an ``overwrite`` would delete; :class:`RunDirError` when ``path`` holds files and
    ``overwrite`` is not set, or holds files but no run (``flag`` is how the user asks to overwrite)."""
    if path.exists() and not path.is_dir():
        raise RunDirError(f"run directory {path} is a file; choose a directory")
    if not path.exists():
        return []
    old = sorted(p.name for p in path.iterdir() if p.name not in _OWN_FILES)
    if old and not overwrite:
        shown = ", ".join(old[:4]) + (", ..." if len(old) > 4 else "")
        raise RunDirError(f"run directory {path} is not empty (holds {shown}); pass {flag} to replace "
                          f"its run, or choose another directory")
    if old and not is_run_dir(path):
        raise RunDirError(f"run directory {path} is not empty and holds no fedlowrank run (none of "
                          f"{', '.join(RUN_FILES)}): not deleting it with {flag}; choose another directory")
    return old


def _check_runs_inside(path: Path) -> None:
    """Refuse when a run holds the lock of a sub-directory of ``path`` (e.g. one method of a comparison)."""
    for lock_file in path.glob(f"*/{LOCK_FILE}"):
        lock_run_dir(lock_file.parent).release()


def check_run_dir(path: str | Path, overwrite: bool = False, flag: str = "--overwrite") -> None:
    """Raise the :class:`RunDirError` that :func:`claim_run_dir` would, changing nothing (to refuse a run before
    it builds anything); ``flag`` is how the user asks to overwrite."""
    path = Path(path)
    _old_run(path, overwrite, flag)
    if path.is_dir():  # is a run writing it, or one inside it?
        lock_run_dir(path).release()
        _check_runs_inside(path)


def claim_run_dir(path: str | Path, overwrite: bool = False, flag: str = "--overwrite") -> RunDirLock:
    """Lock ``path`` for a new run and mark it as a run directory. A directory holding files is refused unless
    ``overwrite``; with it, the old run's files are deleted (refused if the directory holds no fedlowrank run, or
    a run is writing in it). Returns the lock; the caller releases it when the run ends."""
    path = Path(path)
    _old_run(path, overwrite, flag)  # refuse before writing anything into the directory
    lock = lock_run_dir(path)
    try:
        old = _old_run(path, overwrite, flag)  # again under the lock: another claim may have come first
        _check_runs_inside(path)
        for name in old:
            target = path / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            else:
                target.unlink()
        (path / RUN_MARKER).write_text(_MARKER_TEXT)
    except BaseException:
        lock.release()
        raise
    return lock


def continue_run_dir(path: str | Path, flag: str = "--resume") -> RunDirLock:
    """Lock ``path`` to continue the runs in it (``compare``/``tune --resume``): claimed when it is absent or
    empty; refused when it holds other files than a run or run directories (e.g. runs of separate processes moved
    into it: the directory is then marked as a run directory), or another process writes it."""
    path = Path(path)
    entries = [p for p in path.iterdir() if p.name not in _OWN_FILES] if path.is_dir() else []
    if not entries:
        return claim_run_dir(path)
    if not (is_run_dir(path) or all(is_run_dir(p) for p in entries)):
        raise RunDirError(f"run directory {path} holds neither a fedlowrank run (none of {', '.join(RUN_FILES)}) "
                          f"nor only run directories: nothing to continue with {flag}; choose another directory")
    lock = lock_run_dir(path)
    if not (path / RUN_MARKER).exists():
        (path / RUN_MARKER).write_text(_MARKER_TEXT)
    return lock


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. another user's process
        return True
    return True


def remove_dead_temporaries(folder: Path, stem: str = "") -> list[str]:
    """Delete the temporaries ``folder/.<stem>*.tmp-<PID>`` (files or folders written, then renamed into place) whose
    writer process is no longer alive, e.g. killed while writing; returns their names."""
    removed = []
    for path in Path(folder).glob(f".{stem}*.tmp-*"):
        pid = path.name.rsplit(".tmp-", 1)[1]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path.name)
    return sorted(removed)


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

"""Run directories: one run per directory, never two at once, never mixed with an older run, nothing of a refused
command left behind, and nothing deleted that a fedlowrank command did not make.

* :func:`new_run_dir` creates a fresh directory ``<parent>/<stem>`` (``<stem>-2``, ``-3``, ... when taken; the
  ``mkdir`` itself decides, so two runs started in the same second get different directories);
* :func:`check_run_dir` refuses what :func:`claim_run_dir` would, without changing anything;
* :func:`claim_run_dir` locks a directory for a new run (comparison, tuning) and refuses it when it already holds
  files, unless ``overwrite`` is set: then the old run's own files are removed first (below);
* :func:`lock_run_dir` locks a directory for a run that continues it (resume); :func:`continue_run_dir` does so for
  ``compare``/``tune --resume``, claiming the directory when it is new;
* :func:`own` records a name that a command writes in the directory it claimed.

**Ownership.** A command that makes a directory its own writes the claim file :data:`CLAIM` into it: JSON holding
the kind of output (``run``, ``compare``, ``tune``, ``export``, ``evaluate``), a random id, and ``own``, the names
directly in the directory that the command wrote (recorded before each is written). No file name alone is
evidence: a folder holding ``ledger.jsonl``, ``export.json`` or ``config.json`` but no valid claim is nobody's, and
is never written into or deleted from. ``--overwrite`` removes the entries listed in ``own`` (an own directory, e.g.
``checkpoints``, as a whole, symbolic links as links, never what they point to) and the sub-directories that hold a
claim of their own whose entries are all theirs (a comparison's runs, an export inside a run); a directory holding
any other entry, or a claim of another kind, is refused with the entry named and nothing changed. Before removing
anything it checks that it can remove all of it: every own entry is first renamed into a temporary folder in the
directory (undone when one rename fails), then that folder is deleted.

**The lock** is ``fcntl.flock`` on ``<dir>/.lock``, which records the holder's PID. The holder deletes the file
when it releases the lock; the kernel drops the lock itself when the holder's process ends (even by ``kill -9``),
so a crashed run never leaves a stale lock (a ``.lock`` file left by one is ignored and replaced). Releasing also
undoes what a holder made but never used: the claim when it is all the directory holds, and the directory (with
the parents it made) when the lock created it and it is empty.

**The files of a run** (:class:`RunFiles`, ``docs/runs.md``), for every runtime:

* at the start (:meth:`RunFiles.start`): ``config.json`` (the resolved config), ``partition.json`` (task, client
  sizes, per-client counts of what the partition split on), ``partition.png``, and empty ``metrics.jsonl`` and
  ``ledger.jsonl``;
* after each round (:meth:`RunFiles.append_round`): its metrics row to ``metrics.jsonl``, its ledger rows to
  ``ledger.jsonl``, and the task's sample generations (a causal LM's answers) to ``generations-roundN.jsonl``;
* on resume (:meth:`RunFiles.rewrite`): both ``.jsonl`` files cut back to the checkpoint's rows;
* at the end (:meth:`RunFiles.write_summary`): ``summary.json``.

Checkpoints are :mod:`.checkpoint`'s. A run without a directory (``path`` ``None``) writes nothing.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

LOCK_FILE = ".lock"
CLAIM = ".fedlowrank-run"
RUN_KINDS = ("run", "compare", "tune")  # what `run`, `compare` and `tune` claim; `export` and `evaluate` their own
KINDS = (*RUN_KINDS, "export", "evaluate")
_BOOKKEEPING = (LOCK_FILE, CLAIM)  # not contents of the run
_NOTE = ("This directory is the output of a fedlowrank command. `--overwrite` removes only the entries listed in "
         "`own` (and sub-directories holding a claim of their own); it refuses a directory holding anything else.")


class RunDirError(ValueError):
    """A run directory cannot be used: it holds another run or other files, or another process is writing it."""


DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO)


@contextlib.contextmanager
def writing(path: str | Path, what: str):
    """Turn a disk's error while the block writes into ``path`` (full, over quota, read-only, failing: an
    ``OSError``, or a library's error quoting ``os error N``) into one :class:`RunDirError` naming ``path``
    (``what`` says what it is, e.g. ``--out``)."""
    try:
        yield
    except Exception as exc:
        code = exc.errno if isinstance(exc, OSError) else None
        if code is None:
            found = re.search(r"\(os error (\d+)\)", str(exc))
            code = int(found.group(1)) if found else None
        if code not in DISK_ERRORS:
            raise
        where = f" ({exc.filename})" if isinstance(exc, OSError) and exc.filename else ""
        raise RunDirError(f"{what} {path}: {os.strerror(code)} while writing it{where}; free space on that disk "
                          f"or choose another directory") from None


@dataclass
class Claim:
    """A parsed, valid claim file: ``kind`` (one of :data:`KINDS`), ``id`` (32 hex digits), ``own`` (names)."""

    kind: str
    id: str
    own: list[str]


def _plain(name) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..", *_BOOKKEEPING) and "/" not in name and "\0" not in name


def read_claim(folder: str | Path) -> Claim | None:
    """The valid claim of ``folder`` (a regular file, not a link), or ``None`` when it has none or a malformed one."""
    path = Path(folder) / CLAIM
    try:
        if path.is_symlink() or not path.is_file():
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not (isinstance(data, dict) and set(data) == {"fedlowrank", "kind", "id", "own"} and data["kind"] in KINDS
            and isinstance(data["id"], str) and re.fullmatch(r"[0-9a-f]{32}", data["id"])
            and isinstance(data["own"], list) and all(_plain(n) for n in data["own"])):
        return None
    return Claim(data["kind"], data["id"], list(data["own"]))


def write_claim(folder: str | Path, claim: Claim) -> None:
    """Write ``claim`` into ``folder`` atomically (a temporary file renamed over it)."""
    folder = Path(folder)
    tmp = folder / f".claim.tmp-{os.getpid()}"
    tmp.write_text(json.dumps({"fedlowrank": _NOTE, "kind": claim.kind, "id": claim.id, "own": claim.own}, indent=1)
                   + "\n", encoding="utf-8")
    os.replace(tmp, folder / CLAIM)


def new_claim(kind: str, own: list[str] | None = None) -> Claim:
    return Claim(kind, secrets.token_hex(16), list(own or []))


def own(folder: str | Path | None, *names: str) -> Path | None:
    """Record ``names`` (entries directly in ``folder``) as written by the command that claimed ``folder``, before
    it writes them; returns ``folder / names[0]``. A folder without a claim (no run directory) records nothing."""
    if folder is None:
        return None
    folder = Path(folder)
    claim = read_claim(folder)
    if claim is not None:
        new = [n for n in names if n not in claim.own]
        if new:
            claim.own.extend(new)
            write_claim(folder, claim)
    return folder / names[0] if names else folder


def foreign_entries(folder: str | Path, kinds: tuple[str, ...] = KINDS) -> list[str]:
    """The entries of ``folder`` that no fedlowrank command of ``kinds`` recorded as its own (everything, when it
    holds no valid claim of those kinds); sub-directories holding a claim of their own are checked inside."""
    folder = Path(folder)
    claim = read_claim(folder)
    if claim is None or claim.kind not in kinds:
        return sorted(p.name for p in folder.iterdir())
    names = sorted(p.name for p in folder.iterdir() if p.name not in _BOOKKEEPING)
    out = []
    for name in names:
        entry = folder / name
        nested = entry.is_dir() and not entry.is_symlink() and read_claim(entry) is not None
        if nested:
            out += [f"{name}/{n}" for n in foreign_entries(entry)]
        elif name not in claim.own and not _dead_temporary(name):
            out.append(name)
    return out


def _dead_temporary(name: str) -> bool:
    """Whether ``name`` is a claim or overwrite temporary of this module whose writer is no longer alive."""
    found = re.fullmatch(r"\.(?:claim|overwrite)\.tmp-(\d+)", name)
    return found is not None and not _alive(int(found.group(1)))


class RunDirLock:
    """An exclusive ``flock`` on ``<path>/.lock``, held until :meth:`release` (or the process ends: a finaliser that
    runs at exit, before the interpreter tears its modules down, releases a lock still held).

    ``created`` is the topmost directory that taking the lock created (``path`` or one of its parents), or ``None``.
    """

    def __init__(self, path: Path, fd: int, created: Path | None = None):
        self.path, self.created = path, created
        self._release = weakref.finalize(self, _drop_lock, path, fd, created)

    @property
    def held(self) -> bool:
        return self._release.alive

    def release(self) -> None:
        """Drop the lock and delete the lock file; then remove the claim when it is all the directory holds, and
        the directories the lock created when they are empty (what a refused or failed command made). Once."""
        self._release()


def _drop_lock(path: Path, fd: int, created: Path | None) -> None:
    """:meth:`RunDirLock.release`: the lock file deleted (still ours: nobody else can lock it while we hold it), the
    descriptor closed (which drops the ``flock``), then :func:`_tidy`."""
    try:
        (path / LOCK_FILE).unlink()
    except FileNotFoundError:
        pass
    os.close(fd)
    _tidy(path, created)


def _tidy(path: Path, created: Path | None) -> None:
    """Remove the claim when it is all ``path`` holds, then the empty directories that made ``path`` exist."""
    try:
        if [p.name for p in path.iterdir()] == [CLAIM] and read_claim(path) is not None:
            (path / CLAIM).unlink()
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
            fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
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
    """Whether ``path`` holds a valid claim of a fedlowrank run, comparison or tuning."""
    claim = read_claim(path)
    return claim is not None and claim.kind in RUN_KINDS


def _old_run(path: Path, overwrite: bool, flag: str, kind: str, locked: bool = False) -> list[str]:
    """The own entries of ``path`` that an ``overwrite`` would remove; :class:`RunDirError` when ``path`` holds
    files and ``overwrite`` is not set, or holds files that no ``kind`` command recorded as its own (``flag`` is
    how the user asks to overwrite)."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise RunDirError(f"run directory {path} is a file or a symbolic link; choose a directory")
    if not path.exists():
        return []
    old = _entries(path, locked)
    if old and not overwrite:
        shown = ", ".join(old[:4]) + (", ..." if len(old) > 4 else "")
        raise RunDirError(f"run directory {path} is not empty (holds {shown}); pass {flag} to replace "
                          f"its run, or choose another directory")
    claim = read_claim(path)
    if old and (claim is None or claim.kind != kind):
        what = "no fedlowrank claim" if claim is None else f"the output of `fedlowrank {claim.kind}`"
        raise RunDirError(f"run directory {path} is not empty and holds no fedlowrank {kind} ({what} in {CLAIM}): "
                          f"not deleting anything with {flag}; choose another directory")
    foreign = foreign_entries(path, (kind,)) if old else []
    if foreign:
        shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
        raise RunDirError(f"run directory {path} holds {shown}, which no fedlowrank command wrote: not deleting "
                          f"anything with {flag}; move {'it' if len(foreign) == 1 else 'them'} away or choose "
                          f"another directory")
    return old


def _entries(path: Path, locked: bool = False) -> list[str]:
    """The names in the directory ``path``, without the lock and claim files when it holds a valid claim (without
    the lock file when this process holds it: ``locked``)."""
    names = sorted(p.name for p in path.iterdir() if not (locked and p.name == LOCK_FILE))
    return [n for n in names if n not in _BOOKKEEPING] if read_claim(path) is not None else names


def _check_runs_inside(path: Path) -> None:
    """Refuse when a run holds the lock of a sub-directory of ``path`` (e.g. one method of a comparison)."""
    for lock_file in path.glob(f"*/{LOCK_FILE}"):
        if not lock_file.parent.is_symlink():
            lock_run_dir(lock_file.parent).release()


FS_IOC_GETFLAGS, FS_IMMUTABLE_FL, FS_APPEND_FL = 0x80086601, 0x10, 0x20  # Linux's chattr flags (linux/fs.h)


def file_flags(path: Path) -> int:
    """Linux's inode flags of ``path`` (``chattr``/``lsattr``: immutable, append-only, ...); 0 where the system or
    its file system has none (another OS, a file system without them) or ``path`` is a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return 0
    try:
        flags = array.array("i", [0])
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags, True)
        return flags[0]
    except OSError:
        return 0
    finally:
        os.close(fd)


def _check_removable(path: Path, names: list[str]) -> None:
    """:class:`RunDirError` naming the first folder under ``path/names`` whose entries this process may not remove,
    or the first entry there marked immutable or append-only (which no permission lets anyone delete)."""
    folders = [path] + [path / n for n in names if (path / n).is_dir() and not (path / n).is_symlink()]
    entries = [path / n for n in names]
    for top in folders[1:]:
        for d, dirs, files in os.walk(top):
            folders += [Path(d)] if Path(d) != top else []
            entries += [Path(d) / n for n in dirs + files]
    for folder in folders:
        if not os.access(folder, os.W_OK | os.X_OK):
            raise RunDirError(f"cannot remove the entries of {folder} (not writable); nothing was removed")
    for entry in entries:
        if file_flags(entry) & (FS_IMMUTABLE_FL | FS_APPEND_FL):
            raise RunDirError(f"cannot remove {entry} (marked immutable or append-only: lsattr shows it, chattr -i "
                              "or -a clears it); nothing was removed")


def remove_own(path: Path, names: list[str]) -> None:
    """Remove the entries ``names`` of ``path`` all or none: each is renamed into a temporary folder (renames are
    undone when one fails), then that folder is deleted; links are removed, never followed. :class:`RunDirError`
    (saying what cannot be removed) when one cannot be."""
    if not names:
        return
    _check_removable(path, names)
    trash = path / f".overwrite.tmp-{os.getpid()}"
    trash.mkdir()
    moved: list[str] = []
    try:
        for name in names:
            os.rename(path / name, trash / name)
            moved.append(name)
    except OSError as exc:
        for back in reversed(moved):
            os.rename(trash / back, path / back)
        trash.rmdir()
        raise RunDirError(f"cannot remove {path / name} ({exc.strerror}); nothing was removed") from None
    left: list[str] = []
    shutil.rmtree(trash, onerror=lambda fn, where, exc: left.append(f"{where} ({exc[1].strerror or exc[1]})"))
    if left:
        raise RunDirError(f"removed the old output's entries but cannot delete {left[0]}"
                          f"{f' and {len(left) - 1} more' if len(left) > 1 else ''}: they are in {trash}, which the "
                          "next claim of the directory deletes once they are deletable")


def check_run_dir(path: str | Path, overwrite: bool = False, flag: str = "--overwrite", kind: str = "run") -> None:
    """Raise the :class:`RunDirError` that :func:`claim_run_dir` would, changing nothing (to refuse a run before
    it builds anything); ``flag`` is how the user asks to overwrite."""
    path = Path(path)
    old = _old_run(path, overwrite, flag, kind)
    if path.is_dir():  # is a run writing it, or one inside it?
        lock_run_dir(path).release()
        _check_runs_inside(path)
        if old:
            try:
                _check_removable(path, old)
            except RunDirError as exc:
                raise RunDirError(f"run directory {path}: {exc}; make it writable or choose another directory") \
                    from None


def claim_run_dir(path: str | Path, overwrite: bool = False, flag: str = "--overwrite",
                  kind: str = "run") -> RunDirLock:
    """Lock ``path`` for a new output of ``kind`` (one of :data:`RUN_KINDS`) and claim it. A directory holding
    files is refused unless ``overwrite``; with it, the old output's own entries are removed (refused when it holds
    anything else, or a run is writing in it). Returns the lock; the caller releases it when the run ends."""
    path = Path(path)
    _old_run(path, overwrite, flag, kind)  # refuse before writing anything into the directory
    lock = lock_run_dir(path)
    try:
        remove_dead_temporaries(path, "overwrite")
        old = _old_run(path, overwrite, flag, kind, locked=True)  # again under the lock: another claim may have come first
        _check_runs_inside(path)
        try:
            remove_own(path, old)
        except RunDirError as exc:
            raise RunDirError(f"run directory {path}: {exc}; make it removable or choose another directory") \
                from None
        write_claim(path, new_claim(kind))
    except BaseException:
        lock.release()
        raise
    return lock


def continue_run_dir(path: str | Path, flag: str = "--resume", kind: str = "compare") -> RunDirLock:
    """Lock ``path`` to continue the runs in it (``compare``/``tune --resume``): claimed when it is absent or
    empty; refused when it holds anything no fedlowrank ``kind`` command wrote, unless it holds only run
    directories (runs of separate processes moved into it: the directory is then claimed with them as its own), or
    when another process writes it."""
    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise RunDirError(f"run directory {path} is a file or a symbolic link; choose a directory")
    entries = [path / n for n in _entries(path)] if path.is_dir() else []
    if not entries:
        return claim_run_dir(path, kind=kind)
    claim = read_claim(path)
    runs_only = claim is None and all(p.is_dir() and not p.is_symlink() and is_run_dir(p) for p in entries)
    if not runs_only and (claim is None or claim.kind != kind or foreign_entries(path, (kind,))):
        raise RunDirError(f"run directory {path} holds neither a fedlowrank {kind} nor only run directories "
                          f"(no valid {CLAIM} listing what it holds): nothing to continue with {flag}; choose "
                          f"another directory")
    lock = lock_run_dir(path)
    if runs_only:
        write_claim(path, new_claim(kind, sorted(p.name for p in entries)))
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


class RunFiles:
    """The files of the run directory ``path`` (``None``: no directory, nothing is written)."""

    def __init__(self, path: Path | None):
        self.path = path

    def start(self, run, log: Callable[[str], None] | None = None) -> None:
        """Write the start files of ``run`` (a :class:`~.run.Run`); ``log`` gets the per-client counts."""
        from ..reporting.plots import plot_label_histograms
        from ..tasks.partition import format_histograms, label_histograms

        if self.path is None:
            return
        own(self.path, "config.json", "partition.json", "metrics.jsonl", "ledger.jsonl")
        (self.path / "config.json").write_text(run.cfg.to_json())
        report: dict[str, Any] = {"task": run.task.describe(), "client_sizes": [len(p) for p in run.parts]}
        report.update(run.task.describe_partition(run.parts))
        if run.split is not None:  # per-client counts of what the partition split on (labels, column, clusters)
            hist = label_histograms(run.split.values, run.parts, len(run.split.names))
            report.update(split_on=run.split.what, split_names=run.split.names, label_histograms=hist.tolist())
            domains = report.get("client_domains")
            plot_label_histograms(hist, own(self.path, "partition.png"), run.split.names, domains, run.split.what)
            if log is not None:
                log(f"per-client counts of each {run.split.what}:\n"
                    + format_histograms(hist, run.split.names, domains))
        (self.path / "partition.json").write_text(json.dumps(report, indent=1))
        for name in ("metrics.jsonl", "ledger.jsonl"):
            (self.path / name).write_text("")

    def _append(self, name: str, rows: list[dict[str, Any]]) -> None:
        with (self.path / name).open("a") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")

    def append_round(self, row: dict[str, Any], ledger: list[dict[str, int]],
                     generations: list[dict[str, Any]] | None = None) -> None:
        if self.path is None:
            return
        self._append("metrics.jsonl", [row])
        self._append("ledger.jsonl", ledger)
        if generations:
            own(self.path, f"generations-round{row['round']}.jsonl").write_text(
                "".join(json.dumps(g) + "\n" for g in generations))

    def rewrite(self, history: list[dict[str, Any]], ledger: list[dict[str, int]]) -> None:
        """``metrics.jsonl`` and ``ledger.jsonl`` holding exactly ``history`` and ``ledger`` (a resumed run's)."""
        if self.path is None:
            return
        for name, rows in (("metrics.jsonl", history), ("ledger.jsonl", ledger)):
            (self.path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    def write_summary(self, summary: dict[str, Any]) -> None:
        """``summary.json``, then the run's :data:`SEAL` over it and the other files it reads back."""
        if self.path is not None:
            own(self.path, "summary.json").write_text(json.dumps(summary, indent=1))
            seal_run(self.path)


SEAL = "seal.json"
SEALED = ("config.json", "metrics.jsonl", "summary.json")  # what a finished run is read back from (its record)


def _sealed_hashes(path: Path) -> dict[str, str]:
    return {name: hashlib.sha256((path / name).read_bytes()).hexdigest() for name in SEALED}


def seal_run(path: Path) -> None:
    """Write ``path/seal.json``: the sha256 of each of :data:`SEALED` as the run ended. A finished run is reused or
    carried to another machine only while its files match it (:func:`seal_problem`)."""
    own(path, SEAL).write_text(json.dumps({"format": 1, "sha256": _sealed_hashes(path)}, indent=1))


def seal_problem(path: Path) -> str | None:
    """Why the finished run in ``path`` cannot be trusted as it is (one line), or ``None``: the folder or one of its
    :data:`SEALED` files or seal is a symbolic link or missing, the seal unreadable, or a file differs from what the
    seal says it was when the run ended (it was edited since). A seal proves the files are those the run wrote, not
    who wrote them: whoever can rewrite them can rewrite the seal."""
    if path.is_symlink():
        return f"{path} is a symbolic link"
    for name in (*SEALED, SEAL):
        if (path / name).is_symlink():
            return f"{path / name} is a symbolic link"
        if not (path / name).is_file():
            return f"{path / name} is missing" + (" (a run that ended before runs were sealed)" if name == SEAL else "")
    try:
        seal = json.loads((path / SEAL).read_text())
        recorded = seal["sha256"]
        ok = seal.get("format") == 1 and isinstance(recorded, dict) and set(recorded) == set(SEALED)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        return f"{path / SEAL} is unreadable"
    edited = [name for name, digest in _sealed_hashes(path).items() if recorded[name] != digest]
    if edited:
        return f"{', '.join(edited)} in {path} differ from what the run wrote ({SEAL}): edited since it ended"
    return None

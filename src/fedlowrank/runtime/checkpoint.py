"""Checkpoints: their format (atomic, verified: round counter, server state, every client's state, metrics history
and ledger), when a run saves one, and how a run and a checkpoint map to each other.

Layout under ``<run_dir>/checkpoints/``::

    round-00003/server.safetensors    server State (tensors; scalars in the metadata)
    round-00003/clients.safetensors   every client's State in memory, keys "<client>/<key>"
    round-00003/clients/<file>        a copy of each state the client store had spilled to disk (see .store)
    round-00003/run.json              round, method, config fingerprint, whether the client states are in it,
                                      the spilled files by client, metrics history, ledger rows
    round-00003/meta.json             the integrity record: format, and bytes + sha256 of every file above
    latest                            the name of the newest complete checkpoint

Everything a checkpoint restores from is a file that ``meta.json`` hashes; ``meta.json`` holds nothing else, so an
edit anywhere (a forged metric, a shortened history, a dropped or added entry) either breaks a hash or a field
check, and the checkpoint counts as damaged. A checkpoint is written to a temporary folder, flushed to disk, then
renamed, and ``latest`` is replaced atomically after it: a crash while writing leaves the previous checkpoint in
force (and a temporary ``.round-*.tmp-PID`` folder that :func:`restart_from` removes). Reading verifies sizes,
hashes and every field, and parses tensors without unpickling anything. RNG streams are pure functions of
``(seed, stream, round, client)`` (see :mod:`fedlowrank.seeding`), so the round counter restores them all.

:func:`find_checkpoint` picks the checkpoint to continue from: the one ``latest`` names, or, when it is
damaged or ``latest`` is missing, the newest intact older one (saying so); or a given round.

A run saves a checkpoint (:class:`Checkpointer`) after a round when ``run.checkpoint_seconds`` have passed since its
last one (but never sooner than 50 times what the last one took, so that checkpoints cost at most 2 % of the run),
every ``run.checkpoint_every`` rounds, at its last round (every finished run can be exported), and when it is
stopped (:mod:`.stopping`: the state after its last finished round). Its client states are those the run holds
(none on the Flower server: they stay on the nodes; the checkpoint says so).

:func:`read_run_checkpoint` reads the checkpoint a run continues from and checks that it belongs to the run
directory's ``config.json`` (method, config fingerprint, rounds); :func:`restore` puts it into a run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..message import State
from ..serialization import FormatError

FORMAT_VERSION = 2  # 1: run metadata in meta.json, unverified (refused)
RECORD = "run.json"
TENSOR_FILES = ("server.safetensors", "clients.safetensors")
ROW_TIMES = ("client_compute", "aggregation", "evaluation", "other", "total")  # seconds in every history row


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated or corrupted."""


@dataclass
class Checkpoint:
    round: int
    method: str
    server: State
    clients: dict[int, State]
    history: list[dict[str, Any]]
    ledger: list[dict[str, int]]
    config_fingerprint: str = ""  # see config_fingerprint(); "" in checkpoints written before it existed
    client_states: bool = True  # False when the clients kept their states (Flower: on the SuperNodes)
    spilled: dict[int, Path] = field(default_factory=dict)   # client -> file of a spilled state (see .store)


# run settings that do not change what a run computes: a checkpoint stays valid when they change
# run.cohort: how many clients share a forward pass, which changes results only by float rounding (and, with
# dropout, which stream draws the masks); its automatic value follows the device, which a resume may change.
# run.compile, task.length_buckets (padding), train.gradient_checkpointing: the same maths, compiled, padded
# further or recomputed (float rounding at most); run.gpu_memory_fraction: how large an automatic cohort is.
NON_MATHS_KEYS = {"run": ("name", "out_dir", "threads", "checkpoint_every", "checkpoint_seconds", "state_memory_mb",
                          "cohort", "compile", "gpu_memory_fraction", "devices", "collective_timeout_s"),
                  "task": ("length_buckets",), "train": ("gradient_checkpointing",), "compare": None}


def config_fingerprint(cfg) -> str:
    """sha256 of the resolved config (``cfg.to_dict()``) without :data:`NON_MATHS_KEYS` (where it is written, with
    how many threads, how often it checkpoints, the other methods of a comparison)."""
    return dict_fingerprint(cfg.to_dict())


def dict_fingerprint(config: dict[str, Any]) -> str:
    """:func:`config_fingerprint` of a config as a dict (``config.json`` as written)."""
    d = json.loads(json.dumps(config))
    for section, keys in NON_MATHS_KEYS.items():
        if keys is None:
            d.pop(section, None)
        else:
            for key in keys:
                d.get(section, {}).pop(key, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def _fsync_write(path: Path, data: bytes) -> None:
    with path.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _flatten_clients(clients: dict[int, State]) -> State:
    flat = State()
    for k, state in clients.items():
        for key, value in state.items():
            flat[f"{k}/{key}"] = value
    return flat


def _unflatten_clients(flat: State) -> dict[int, State]:
    """``{client: State}`` of the keys ``"<client>/<key>"``; :class:`ValueError` naming a key of another form."""
    out: dict[int, State] = {}
    for key, value in flat.items():
        client, _, name = key.partition("/")
        if not (client.isdigit() and name):
            raise ValueError(f"key {key!r} is not <client>/<name>")
        out.setdefault(int(client), State())[name] = value
    return out


def save_checkpoint(run_dir: Path, ck: Checkpoint, keep: int = 2) -> Path:
    """Write ``ck`` atomically; keep the newest ``keep`` checkpoints. Returns its folder."""
    from .rundir import own

    root = own(Path(run_dir), "checkpoints")
    root.mkdir(parents=True, exist_ok=True)
    name = f"round-{ck.round:05d}"
    tmp = root / f".{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    # a client store that spills (``.store.ClientStore``) gives its in-memory states and its files separately
    resident = ck.clients.resident() if hasattr(ck.clients, "resident") else ck.clients
    spilled = {**ck.spilled, **(ck.clients.spilled_files() if hasattr(ck.clients, "spilled_files") else {})}
    listed = {}

    def write(fname: str, data: bytes) -> None:
        _fsync_write(tmp / fname, data)
        listed[fname] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    write("server.safetensors", ck.server.to_bytes())
    write("clients.safetensors", _flatten_clients(resident).to_bytes())
    if spilled:
        (tmp / "clients").mkdir()
    for path in spilled.values():   # one file at a time: memory stays bounded
        write(f"clients/{path.name}", path.read_bytes())
    record = {"round": ck.round, "method": ck.method, "config_fingerprint": ck.config_fingerprint,
              "client_states": ck.client_states,
              "spilled": {str(int(client)): f"clients/{path.name}" for client, path in spilled.items()},
              "history": ck.history, "ledger": ck.ledger}
    write(RECORD, json.dumps(record).encode())
    _fsync_write(tmp / "meta.json", json.dumps({"format": FORMAT_VERSION, "files": listed}).encode())
    final = root / name
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = root / f".latest.tmp-{os.getpid()}"
    _fsync_write(pointer, name.encode())
    os.replace(pointer, root / "latest")
    done = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("round-"))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoint_folders(run_dir: Path) -> dict[int, Path]:
    """The complete checkpoint folders of ``run_dir`` by round (not verified)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return {}
    return {int(p.name[6:]): p for p in root.iterdir()
            if p.is_dir() and not p.is_symlink() and p.name.startswith("round-") and p.name[6:].isdigit()}


def latest_checkpoint(run_dir: Path) -> Path:
    """The folder ``checkpoints/latest`` names (not verified)."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / "latest"
    if not pointer.is_file():
        raise CheckpointError(f"no checkpoint in {run_dir} (no checkpoints/latest)")
    path = root / pointer.read_text().strip()
    if not path.is_dir():
        raise CheckpointError(f"checkpoints/latest names {path.name}, which does not exist")
    return path


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _number(v: Any) -> bool:
    return type(v) in (int, float)


def _counts(v: Any) -> bool:
    return isinstance(v, list) and all(_is_count(x) for x in v)


# the fields of a metrics row that the run reads back (resume, export, the summary, compare), with their types;
# a row may hold others (diagnostics, privacy, ...), which are only written out again
ROW_FIELDS: dict[str, Callable[[Any], bool]] = {
    "clients": _counts, "replied": _counts, "dropped": _counts, "train_loss": _number, "update_norm": _number,
    "bytes_up": _is_count, "bytes_down": _is_count, "cum_bytes_up": _is_count, "cum_bytes_down": _is_count,
    "skipped": lambda v: type(v) is bool, "peak_rss_mb": _number,
    "rejected": lambda v: isinstance(v, list) and all(isinstance(r, dict) and _is_count(r.get("client"))
                                                      and isinstance(r.get("reason"), str) for r in v),
    "per_client": lambda v: isinstance(v, list) and all(isinstance(r, dict) and _is_count(r.get("client")) for r in v),
    "predictions": lambda v: isinstance(v, dict), "by_task": lambda v: isinstance(v, dict),
    "diagnostics": lambda v: isinstance(v, dict),
}


def check_history(path: Path, ck: Checkpoint, rounds: list[int], metrics: tuple[str, ...] = ()) -> None:
    """:class:`CheckpointError` unless the history of the checkpoint ``path`` has a row for exactly ``rounds``
    (those the run records up to the checkpoint's round), each of its :data:`ROW_FIELDS` and its task's
    ``metrics`` (numbers, or ``null``) of its type, and its ledger the bytes its rows count: per round, the ledger's
    bytes up and down sum to the row's ``bytes_up`` and ``bytes_down``, and to its ``cum_`` totals since round 1."""
    got = [r["round"] for r in ck.history]
    if got != rounds:
        def show(xs: list[int]) -> str:
            return str(xs) if len(xs) <= 4 else f"[{xs[0]}, {xs[1]}, ..., {xs[-1]}] ({len(xs)} rows)"

        raise CheckpointError(f"checkpoint {path}: {RECORD}: the history holds rounds {show(got)}, the run records "
                              f"{show(rounds)} up to round {ck.round}")
    fields = {**ROW_FIELDS, **{m: lambda v: v is None or _number(v) for m in metrics}}
    for row in ck.history:
        for key, ok in fields.items():
            if key in row and not ok(row[key]):
                raise CheckpointError(f"checkpoint {path}: {RECORD}: round {row['round']}'s {key} is "
                                      f"{json.dumps(row[key])[:60]}, not a value of its type")
    ledger: dict[int, list[int]] = {}
    for r in ck.ledger:
        ledger.setdefault(r["round"], [0, 0])
        ledger[r["round"]][0] += r["up"]
        ledger[r["round"]][1] += r["down"]
    cum = [0, 0]
    for row in ck.history:
        if "bytes_up" not in row:
            continue
        up, down = ledger.pop(row["round"], [0, 0])
        cum = [cum[0] + up, cum[1] + down]
        if [row["bytes_up"], row["bytes_down"]] != [up, down] or [row.get("cum_bytes_up", cum[0]),
                                                                   row.get("cum_bytes_down", cum[1])] != cum:
            raise CheckpointError(f"checkpoint {path}: {RECORD}: the ledger of round {row['round']} counts {up} bytes "
                                  f"up and {down} down, its metrics row {row['bytes_up']} and {row['bytes_down']} (or "
                                  "its totals differ)")
    if ledger:
        raise CheckpointError(f"checkpoint {path}: {RECORD}: the ledger holds round {min(ledger)}, which has no "
                              "metrics row")


@dataclass
class StateSchema:
    """What a state may hold: every entry of ``initial`` as the same kind of value (a tensor of the same dtype and
    number of dimensions, and of the same shape when ``same_shapes``; or a scalar), any other entry only as one of
    the method's ``templates`` says (:meth:`fedlowrank.methods.base.Method.state_entries`), and every floating
    tensor finite. A template's ``{key}`` is an entry of ``keys`` (the initial server state: the entry has its
    dtype), ``{module}`` one of ``modules`` (the target modules), ``{head}`` one of ``heads`` (the head's parameter
    names), ``{client}`` a client below ``num_clients``, ``{n}`` a count."""

    initial: State
    templates: tuple[str, ...]
    keys: State
    modules: list[str]
    heads: list[str]
    num_clients: int
    same_shapes: bool = False

    def __post_init__(self) -> None:
        def one_of(names) -> str:
            return "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True)) or "(?!)"

        fill = {"{key}": f"(?P<key>{one_of(self.keys.tensors())})", "{module}": f"(?:{one_of(self.modules)})",
                "{head}": f"(?:{one_of(self.heads)})", "{client}": "(?P<client>0|[1-9][0-9]*)", "{n}": "(?:0|[1-9][0-9]*)"}
        self._patterns = [re.compile("".join(fill.get(part, re.escape(part))
                                             for part in re.split(r"(\{key\}|\{module\}|\{head\}|\{client\}|\{n\})", t)))
                          for t in self.templates]

    def _declared(self, key: str, value: Any) -> bool:
        for pattern in self._patterns:
            m = pattern.fullmatch(key)
            if m is None:
                continue
            named = m.groupdict()
            if named.get("client") is not None and int(named["client"]) >= self.num_clients:
                continue
            if named.get("key") is not None and not (isinstance(value, torch.Tensor)
                                                     and value.dtype == self.keys[named["key"]].dtype):
                continue
            return True
        return False

    def problem(self, state: State) -> str | None:
        """What is wrong with ``state`` (one line naming the entry), or ``None``."""
        for key, value in self.initial.items():
            got = state.get(key)
            if key not in state:
                return f"entry {key!r} is missing"
            if isinstance(value, torch.Tensor):
                if not isinstance(got, torch.Tensor) or got.dtype != value.dtype or got.dim() != value.dim():
                    return f"entry {key!r} is not a {value.dtype} tensor of {value.dim()} dimensions"
                if self.same_shapes and got.shape != value.shape:
                    return f"entry {key!r} is of shape {tuple(got.shape)}, not {tuple(value.shape)}"
            elif isinstance(got, torch.Tensor):
                return f"entry {key!r} is a tensor, not a scalar"
        for key, value in state.items():
            if key not in self.initial and not self._declared(key, value):
                return f"entry {key!r} is not one the method keeps"
            if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
                return f"entry {key!r} holds non-finite values"
        return None


def check_state(path: Path, state: State, schema: StateSchema, fname: str = "server.safetensors") -> None:
    """:class:`CheckpointError` naming the checkpoint ``path``, its file ``fname`` and the defect, unless ``state``
    holds what ``schema`` allows."""
    problem = schema.problem(state)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path}: {fname}: {problem}")


def _load(path: Path, check: Callable[[Path, Checkpoint], None] | None) -> Checkpoint:
    ck = load_checkpoint(path)
    if check is not None:
        check(path, ck)
    return ck


def _intact_rounds(folders: dict[int, Path], check=None) -> list[int]:
    intact = []
    for rnd in sorted(folders):
        try:
            _load(folders[rnd], check)
        except CheckpointError:
            continue
        intact.append(rnd)
    return intact


def find_checkpoint(run_dir: str | Path, round: int | None = None, warn: Callable[[str], None] | None = None,
                    check: Callable[[Path, Checkpoint], None] | None = None) -> tuple[Path, Checkpoint]:
    """The checkpoint to continue ``run_dir`` from, verified (and passed by ``check``, which raises
    :class:`CheckpointError` for a checkpoint that does not fit the run): ``(folder, checkpoint)``.

    With ``round``: that round's checkpoint; :class:`CheckpointError` listing the intact rounds when it is
    missing or damaged. Without: the one ``checkpoints/latest`` names; when that is damaged, or ``latest`` is
    missing or names nothing, the newest intact checkpoint not newer than it, and ``warn`` gets one line
    saying which was skipped and why and which is used.
    """
    run_dir = Path(run_dir)
    folders = checkpoint_folders(run_dir)
    if round is not None:
        if round in folders:
            try:
                return folders[round], _load(folders[round], check)
            except CheckpointError as exc:
                problem = str(exc)
        else:
            problem = f"{run_dir} has no checkpoint of round {round}"
        intact = _intact_rounds(folders, check)
        raise CheckpointError(f"{problem}; rounds with an intact checkpoint: "
                              f"{', '.join(map(str, intact)) if intact else 'none'}")
    if not folders:
        raise CheckpointError(f"no checkpoint in {run_dir} (no checkpoints/round-* folder; a run writes one every "
                              f"run.checkpoint_every rounds and at its last round)")
    pointer = run_dir / "checkpoints" / "latest"
    named = pointer.read_text().strip() if pointer.is_file() else None
    newest = next((rnd for rnd, folder in folders.items() if folder.name == named), None)
    skipped = [] if newest is not None else [
        "checkpoints/latest is missing" if named is None else f"checkpoints/latest names {named!r}, which does not exist"]
    if newest is None:
        newest = max(folders)
    for rnd in sorted((r for r in folders if r <= newest), reverse=True):
        try:
            ck = _load(folders[rnd], check)
        except CheckpointError as exc:
            skipped.append(str(exc))
            continue
        if skipped and warn is not None:
            warn(f"warning: {'; '.join(skipped)}; using {folders[rnd].name}, the newest intact checkpoint")
        return folders[rnd], ck
    raise CheckpointError(f"no intact checkpoint in {run_dir}: {'; '.join(skipped)}")


def _read_integrity(path: Path) -> dict[str, dict[str, Any]]:
    """``meta.json``'s ``files``, checked: only the checkpoint's own names, each with a byte count and a sha256."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path}: meta.json unreadable ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"checkpoint {path}: format {found!r}, expected {FORMAT_VERSION}"
                              + (" (written by an older fedlowrank, whose metadata cannot be verified)"
                                 if found == 1 else ""))
    if set(meta) != {"format", "files"}:
        raise CheckpointError(f"checkpoint {path}: meta.json holds other keys than format and files "
                              f"({', '.join(sorted(set(meta) - {'format', 'files'}))})")
    files = meta.get("files")
    if not isinstance(files, dict) or not set(TENSOR_FILES + (RECORD,)) <= set(files):
        raise CheckpointError(f"checkpoint {path}: meta.json does not list {', '.join(TENSOR_FILES + (RECORD,))}")
    for fname, spec in files.items():
        own = fname in TENSOR_FILES + (RECORD,) or (
            fname.startswith("clients/") and fname.count("/") == 1 and fname[8:] not in ("", ".", ".."))
        if not (own and isinstance(spec, dict) and set(spec) == {"bytes", "sha256"} and _is_count(spec["bytes"])
                and isinstance(spec["sha256"], str) and len(spec["sha256"]) == 64):
            raise CheckpointError(f"checkpoint {path}: meta.json: malformed entry {fname!r}")
    return files


def _check_record(path: Path, record: Any, files: dict[str, Any]) -> None:
    """The fields of ``run.json``: types, and a history and ledger within the checkpoint's round."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise CheckpointError(f"checkpoint {path}: {RECORD}: {what}")

    need(isinstance(record, dict) and {"round", "method", "config_fingerprint", "client_states", "spilled",
                                        "history", "ledger"} <= set(record), "missing fields")
    rnd = record["round"]
    need(_is_count(rnd), f"round {rnd!r} is not an integer >= 0")  # 0: a run stopped before its first round
    named = path.name[6:] if path.name.startswith("round-") else ""
    need(not named.isdigit() or int(named) == rnd, f"round {rnd} in the folder of round {named}")
    need(isinstance(record["method"], str) and isinstance(record["config_fingerprint"], str)
         and isinstance(record["client_states"], bool), "method, config_fingerprint or client_states malformed")
    spilled = record["spilled"]
    need(isinstance(spilled, dict) and all(k.isdigit() and v in files and v.startswith("clients/")
                                           for k, v in spilled.items()), "spilled files malformed")
    history, ledger = record["history"], record["ledger"]
    need(isinstance(history, list) and all(isinstance(r, dict) and _is_count(r.get("round")) for r in history),
         "history malformed")
    need(all(isinstance(r.get("time"), dict) and all(type(r["time"].get(k)) in (int, float) for k in ROW_TIMES)
             for r in history), f"a history row lacks its times ({', '.join(ROW_TIMES)})")
    rounds = [r["round"] for r in history]
    # one row per round, or per evaluated round (the vectorised runner): increasing, none beyond the checkpoint's
    # (which rounds exactly, the runner says: checkpointing.read_run_checkpoint)
    need(rounds == sorted(set(rounds)) and all(r <= rnd for r in rounds),
         f"history rounds {rounds[:3]}... are not increasing up to {rnd}")
    need(isinstance(ledger, list) and all(
        isinstance(r, dict) and all(_is_count(r.get(k)) for k in ("round", "client", "down", "up"))
        and 1 <= r["round"] <= rnd for r in ledger), "ledger malformed")


def load_checkpoint(path: Path) -> Checkpoint:
    """Read and verify a checkpoint folder; :class:`CheckpointError` names what is wrong."""
    path = Path(path)
    files = _read_integrity(path)
    blobs: dict[str, bytes] = {}
    for fname, spec in files.items():
        try:
            data = (path / fname).read_bytes()
        except OSError as exc:
            raise CheckpointError(f"checkpoint {path}: {fname} missing ({exc})") from exc
        if len(data) != spec["bytes"]:
            raise CheckpointError(f"checkpoint {path}: {fname} is truncated ({len(data)} of {spec['bytes']} bytes)")
        if hashlib.sha256(data).hexdigest() != spec["sha256"]:
            raise CheckpointError(f"checkpoint {path}: {fname} is corrupted (sha256 mismatch)")
        if not fname.startswith("clients/"):  # a spilled state: verified here, read by the client store when needed
            blobs[fname] = data
    try:
        record = json.loads(blobs[RECORD])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path}: {RECORD} unreadable ({exc})") from exc
    _check_record(path, record, files)
    try:
        server = State.from_bytes(blobs["server.safetensors"])
        clients = _unflatten_clients(State.from_bytes(blobs["clients.safetensors"]))
    except (FormatError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: {exc}") from exc
    spilled = {int(k): path / v for k, v in record["spilled"].items()}
    return Checkpoint(record["round"], record["method"], server, clients, record["history"], record["ledger"],
                      record["config_fingerprint"], record["client_states"], spilled)


def _rounds_in(path: Path) -> int:
    """The highest round of the JSON lines in ``path`` (0 when none can be read)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    rounds = []
    for line in lines:
        try:
            rounds.append(int(json.loads(line)["round"]))
        except (ValueError, TypeError, KeyError):
            continue
    return max(rounds, default=0)


def restart_from(run_dir: Path, round: int, history: list[dict[str, Any]], ledger: list[dict[str, int]],
                 warn: Callable[[str], None] | None = None) -> None:
    """Make ``run_dir`` continue from its checkpoint of ``round``: delete later checkpoints and the temporaries of
    writers that were killed, point ``latest`` at it, and rewrite ``metrics.jsonl`` and ``ledger.jsonl`` from the
    checkpoint's ``history`` and ``ledger``; when that drops rounds they held, ``warn`` gets one line saying so."""
    from .rundir import RunDirError, remove_dead_temporaries, remove_own

    run_dir = Path(run_dir)
    root = run_dir / "checkpoints"
    links = sorted(p.name for p in root.glob("round-*") if p.is_symlink())
    if links:
        raise CheckpointError(f"{root / links[0]} is a symbolic link, not a checkpoint this run wrote; move it out "
                              f"of {root} to resume")
    later = sorted(folder.name for rnd, folder in checkpoint_folders(run_dir).items() if rnd > round)
    try:
        remove_own(root, later)  # all or none
    except RunDirError as exc:
        raise CheckpointError(f"resuming after round {round} deletes the later checkpoints, but {exc}; make them "
                              f"removable or move them out of {root}") from None
    remove_dead_temporaries(root)
    pointer = root / f".latest.tmp-{os.getpid()}"
    _fsync_write(pointer, f"round-{round:05d}".encode())
    os.replace(pointer, root / "latest")
    held = max(_rounds_in(run_dir / name) for name in ("metrics.jsonl", "ledger.jsonl"))
    if held > round and warn is not None:
        warn(f"note: metrics.jsonl and ledger.jsonl held rounds up to round {held}; cut back to round {round}, "
             f"the checkpoint's (the later rounds run again)")
    for name, rows in (("metrics.jsonl", history), ("ledger.jsonl", ledger)):
        (run_dir / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


MAX_COST = 0.02  # the share of a run's time that checkpoints saved for run.checkpoint_seconds may take


class Checkpointer:
    """Saves the checkpoints of the run in ``run_dir`` (``None``: never) configured by ``cfg``.

    Attributes:
        saved_round: the round of the last checkpoint it saved (``None``: none yet).
        seconds: the time its saves took, in all.
    """

    def __init__(self, cfg, run_dir: Path | None, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.run_dir, self.clock = cfg, run_dir, clock
        self.saved_round: int | None = None
        self.seconds = 0.0
        self._last_save, self._last_cost = clock(), 0.0

    def due(self, rnd: int) -> bool:
        """Whether the state after round ``rnd`` is saved (see the module docstring)."""
        r = self.cfg.run
        if self.run_dir is None:
            return False
        if rnd == r.rounds or (r.checkpoint_every and rnd % r.checkpoint_every == 0):
            return True
        wait = max(r.checkpoint_seconds, self._last_cost / MAX_COST)
        return r.checkpoint_seconds > 0 and self.clock() - self._last_save >= wait

    def save(self, run) -> Path:
        """Save ``run`` (a :class:`~.server_run.ServerRun`) as it is now."""
        assert self.run_dir is not None
        t0 = self.clock()
        ck = Checkpoint(run.round, run.method.name, run.server, run.store, run.history, run.ledger.rows,
                        config_fingerprint(run.cfg), run.client_states)
        path = save_checkpoint(self.run_dir, ck)
        self._last_save = self.clock()
        self._last_cost = self._last_save - t0
        self.seconds += self._last_cost
        self.saved_round = run.round
        return path


def read_run_checkpoint(run_dir: str | Path, round: int | None = None, warn: Callable[[str], None] | None = None,
                        fits: Callable[[Any], Callable[[Path, Checkpoint], None]] | None = None
                        ) -> tuple[Any, Checkpoint]:
    """``(config, checkpoint)`` of the run in ``run_dir``: its ``config.json`` and its newest intact checkpoint (or
    that of ``round``; ``warn`` gets a line when a damaged one is skipped), after checking that the checkpoint is
    of that config. ``fits(config)``: a check ``(folder, checkpoint)`` raising :class:`CheckpointError` when the
    checkpoint does not fit the run (its history, its server state); such a checkpoint counts as damaged. Reads
    only."""
    from ..config import ConfigError, from_dict

    run_dir = Path(run_dir)
    if not checkpoint_folders(run_dir):
        find_checkpoint(run_dir, round, warn)  # says that there is none
    try:
        written = json.loads((run_dir / "config.json").read_text())
        cfg = from_dict(written)
    except (OSError, ValueError, ConfigError) as exc:
        raise CheckpointError(f"{run_dir}: config.json unreadable ({exc})") from exc
    path, ck = find_checkpoint(run_dir, round, warn, None if fits is None else fits(cfg))
    if ck.method != cfg.method_name:
        raise CheckpointError(f"checkpoint {path} is of method {ck.method!r}, {run_dir / 'config.json'} says "
                              f"{cfg.method_name!r}: they are not of the same run")
    # config.json as written also fingerprints a checkpoint of a fedlowrank whose configs had fewer keys: the keys
    # added since are at their defaults in `cfg`, so the run computes what it computed then
    if ck.config_fingerprint and ck.config_fingerprint not in (config_fingerprint(cfg), dict_fingerprint(written)):
        raise CheckpointError(f"checkpoint {path} was written with another config (fingerprint "
                              f"{ck.config_fingerprint[:12]}) than {run_dir / 'config.json'} (fingerprint "
                              f"{config_fingerprint(cfg)[:12]}): they are not of the same run")
    if ck.round > cfg.run.rounds:
        raise CheckpointError(f"checkpoint {path} is of round {ck.round}, beyond run.rounds = {cfg.run.rounds} "
                              f"in {run_dir / 'config.json'}: they are not of the same run")
    return cfg, ck


def restore(run, ck: Checkpoint) -> None:
    """Put checkpoint ``ck`` into ``run`` (a :class:`~.server_run.ServerRun` of the checkpoint's config)."""
    run.server, run.round, run.client_states = ck.server, ck.round, ck.client_states
    run.store.restore(ck.clients, ck.spilled)
    run.history, run.ledger.rows = ck.history, ck.ledger
    metrics = run.task.metrics
    evals = [r for r in ck.history if any(k in r for k in metrics)]
    run.last_eval = ({k: v for k, v in evals[-1].items() if k in metrics or k in ("predictions", "by_task")}
                     if evals else {})

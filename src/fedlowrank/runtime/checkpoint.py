"""Atomic checkpoints: round counter, server state, every client's state, metrics history and ledger.

Layout under ``<run_dir>/checkpoints/``::

    round-00003/server.safetensors    server State (tensors; scalars in the metadata)
    round-00003/clients.safetensors   every client's State in memory, keys "<client>/<key>"
    round-00003/clients/<file>        a copy of each state the client store had spilled to disk (see .store)
    round-00003/meta.json             round, method, config fingerprint, history, ledger rows, whether the
                                      client states are in it, sha256 + size of every file
    latest                            the name of the newest complete checkpoint

A checkpoint is written to a temporary folder, flushed to disk, then renamed, and ``latest`` is replaced
atomically after it: a crash while writing leaves the previous checkpoint in force. Reading verifies sizes
and hashes and parses tensors without unpickling anything. RNG streams are pure functions of
``(seed, stream, round, client)`` (see :mod:`fedlowrank.seeding`), so the round counter restores them all.

:func:`find_checkpoint` picks the checkpoint to continue from: the one ``latest`` names, or, when it is
corrupted or ``latest`` is missing, the newest intact older one (saying so); or a given round.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..message import State
from ..serialization import FormatError

FORMAT_VERSION = 1


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
NON_MATHS_KEYS = {"run": ("name", "out_dir", "threads", "checkpoint_every", "state_memory_mb", "cohort", "compile",
                          "gpu_memory_fraction"),
                  "task": ("length_buckets",), "train": ("gradient_checkpointing",), "compare": None}


def config_fingerprint(cfg) -> str:
    """sha256 of the resolved config (``cfg.to_dict()``) without :data:`NON_MATHS_KEYS` (where it is written, with
    how many threads, how often it checkpoints, the other methods of a comparison)."""
    d = cfg.to_dict()
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
    out: dict[int, State] = {}
    for key, value in flat.items():
        client, name = key.split("/", 1)
        out.setdefault(int(client), State())[name] = value
    return out


def save_checkpoint(run_dir: Path, ck: Checkpoint, keep: int = 2) -> Path:
    """Write ``ck`` atomically; keep the newest ``keep`` checkpoints. Returns its folder."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"round-{ck.round:05d}"
    tmp = root / f".{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    # a client store that spills (``.store.ClientStore``) gives its in-memory states and its files separately
    resident = ck.clients.resident() if hasattr(ck.clients, "resident") else ck.clients
    spilled = {**ck.spilled, **(ck.clients.spilled_files() if hasattr(ck.clients, "spilled_files") else {})}
    files = {"server.safetensors": ck.server.to_bytes(), "clients.safetensors": _flatten_clients(resident).to_bytes()}
    listed = {}
    for fname, data in files.items():
        _fsync_write(tmp / fname, data)
        listed[fname] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if spilled:
        (tmp / "clients").mkdir()
    for client, path in spilled.items():   # one file at a time: memory stays bounded
        fname = f"clients/{path.name}"
        data = path.read_bytes()
        _fsync_write(tmp / fname, data)
        listed[fname] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "client": int(client)}
    meta = {"format": FORMAT_VERSION, "round": ck.round, "method": ck.method,
            "config_fingerprint": ck.config_fingerprint, "client_states": ck.client_states,
            "history": ck.history, "ledger": ck.ledger, "files": listed}
    _fsync_write(tmp / "meta.json", json.dumps(meta).encode())
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
            if p.is_dir() and p.name.startswith("round-") and p.name[6:].isdigit()}


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


def _intact_rounds(folders: dict[int, Path]) -> list[int]:
    intact = []
    for rnd in sorted(folders):
        try:
            load_checkpoint(folders[rnd])
        except CheckpointError:
            continue
        intact.append(rnd)
    return intact


def find_checkpoint(run_dir: str | Path, round: int | None = None,
                    warn: Callable[[str], None] | None = None) -> tuple[Path, Checkpoint]:
    """The checkpoint to continue ``run_dir`` from, verified: ``(folder, checkpoint)``.

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
                return folders[round], load_checkpoint(folders[round])
            except CheckpointError as exc:
                problem = str(exc)
        else:
            problem = f"{run_dir} has no checkpoint of round {round}"
        intact = _intact_rounds(folders)
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
            ck = load_checkpoint(folders[rnd])
        except CheckpointError as exc:
            skipped.append(str(exc))
            continue
        if skipped and warn is not None:
            warn(f"warning: {'; '.join(skipped)}; using {folders[rnd].name}, the newest intact checkpoint")
        return folders[rnd], ck
    raise CheckpointError(f"no intact checkpoint in {run_dir}: {'; '.join(skipped)}")


def load_checkpoint(path: Path) -> Checkpoint:
    """Read and verify a checkpoint folder; :class:`CheckpointError` names what is wrong."""
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path}: meta.json unreadable ({exc})") from exc
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path}: format {meta.get('format')!r}, expected {FORMAT_VERSION}")
    blobs: dict[str, bytes] = {}
    spilled: dict[int, Path] = {}
    for fname, spec in meta["files"].items():
        try:
            data = (path / fname).read_bytes()
        except OSError as exc:
            raise CheckpointError(f"checkpoint {path}: {fname} missing ({exc})") from exc
        if len(data) != spec["bytes"]:
            raise CheckpointError(f"checkpoint {path}: {fname} is truncated ({len(data)} of {spec['bytes']} bytes)")
        if hashlib.sha256(data).hexdigest() != spec["sha256"]:
            raise CheckpointError(f"checkpoint {path}: {fname} is corrupted (sha256 mismatch)")
        if "client" in spec:   # a spilled state: verified here, read by the client store when needed
            spilled[int(spec["client"])] = path / fname
        else:
            blobs[fname] = data
    try:
        server = State.from_bytes(blobs["server.safetensors"])
        clients = _unflatten_clients(State.from_bytes(blobs["clients.safetensors"]))
    except FormatError as exc:
        raise CheckpointError(f"checkpoint {path}: {exc}") from exc
    return Checkpoint(meta["round"], meta["method"], server, clients, meta["history"], meta["ledger"],
                      meta.get("config_fingerprint", ""), meta.get("client_states", True), spilled)


def drop_checkpoints_after(run_dir: Path, round: int) -> None:
    """Make the checkpoint of ``round`` the newest: delete later ones and point ``latest`` at it (resume from
    an older round must not leave the abandoned rounds in force)."""
    root = Path(run_dir) / "checkpoints"
    for rnd, folder in checkpoint_folders(run_dir).items():
        if rnd > round:
            shutil.rmtree(folder)
    pointer = root / f".latest.tmp-{os.getpid()}"
    _fsync_write(pointer, f"round-{round:05d}".encode())
    os.replace(pointer, root / "latest")

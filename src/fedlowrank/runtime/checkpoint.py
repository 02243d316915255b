"""Atomic checkpoints: round counter, server state, every client's state, metrics history and ledger.

Layout under ``<run_dir>/checkpoints/``::

    round-00003/server.safetensors    server State (tensors; scalars in the metadata)
    round-00003/clients.safetensors   every client's State, keys "<client>/<key>"
    round-00003/meta.json             round, method, history, ledger rows, sha256 + size of both files
    latest                            the name of the newest complete checkpoint

A checkpoint is written to a temporary folder, flushed to disk, then renamed, and ``latest`` is replaced
atomically after it: a crash while writing leaves the previous checkpoint in force. Reading verifies sizes
and hashes and parses tensors without unpickling anything. RNG streams are pure functions of
``(seed, stream, round, client)`` (see :mod:`fedlowrank.seeding`), so the round counter restores them all.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    files = {"server.safetensors": ck.server.to_bytes(), "clients.safetensors": _flatten_clients(ck.clients).to_bytes()}
    for fname, data in files.items():
        _fsync_write(tmp / fname, data)
    meta = {"format": FORMAT_VERSION, "round": ck.round, "method": ck.method, "history": ck.history,
            "ledger": ck.ledger,
            "files": {f: {"bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()} for f, d in files.items()}}
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


def latest_checkpoint(run_dir: Path) -> Path:
    root = Path(run_dir) / "checkpoints"
    pointer = root / "latest"
    if not pointer.is_file():
        raise CheckpointError(f"no checkpoint in {run_dir} (no checkpoints/latest); was run.checkpoint_every > 0?")
    path = root / pointer.read_text().strip()
    if not path.is_dir():
        raise CheckpointError(f"checkpoints/latest names {path.name}, which does not exist")
    return path


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
    for fname, spec in meta["files"].items():
        try:
            data = (path / fname).read_bytes()
        except OSError as exc:
            raise CheckpointError(f"checkpoint {path}: {fname} missing ({exc})") from exc
        if len(data) != spec["bytes"]:
            raise CheckpointError(f"checkpoint {path}: {fname} is truncated ({len(data)} of {spec['bytes']} bytes)")
        if hashlib.sha256(data).hexdigest() != spec["sha256"]:
            raise CheckpointError(f"checkpoint {path}: {fname} is corrupted (sha256 mismatch)")
        blobs[fname] = data
    try:
        server = State.from_bytes(blobs["server.safetensors"])
        clients = _unflatten_clients(State.from_bytes(blobs["clients.safetensors"]))
    except FormatError as exc:
        raise CheckpointError(f"checkpoint {path}: {exc}") from exc
    return Checkpoint(meta["round"], meta["method"], server, clients, meta["history"], meta["ledger"])

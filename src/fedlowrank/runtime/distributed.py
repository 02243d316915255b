"""The distributed runner: a round's clients spread over the ranks of a ``torch.distributed`` job.

Launched by ``torchrun`` (its environment: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``; multi-node through its rendezvous), or on one machine by :func:`spawn` for ``run.devices`` (one
process per listed device, a free local port). Each rank builds the same run (:func:`~.run.build_run`) and keeps its
model across rounds; gloo on CPUs, NCCL on CUDA; every collective waits at most ``run.collective_timeout_s``.

A round (:meth:`Distributed.run_round`), on every rank:

1. the round's clients are sampled as in the simulator and assigned to ranks by :func:`assign` (deterministic,
   balanced by estimated cost: examples trained × sequence length); the client states whose owner is not the
   client's new rank move there (:meth:`Distributed.move_states`, one all-gather of their bytes), so a client's
   state lives with the rank that trains it;
2. each rank trains its clients (as cohorts where ``run.cohort`` says so, :meth:`~.simulator.Simulation.train_clients`)
   from the broadcast of the same global state; the replies, coded (:mod:`fedlowrank.codecs`) and serialised, are
   gathered to rank 0 as one byte tensor per rank (:func:`gather_bytes`; the per-client metadata rides in the same safetensors container);
3. rank 0 checks every reply in client order and runs the server's step once (:meth:`~.server_run.ServerRun.close_round`);
   the new global state and the clients whose replies were used are broadcast (:func:`broadcast_bytes`); each rank
   commits the new states of its used clients;
4. when rank 0 needs every client state (a checkpoint is due, or a personalised method is evaluated) the other ranks
   send theirs to it for that round only: one consistent checkpoint per round, written by rank 0.

Results do not depend on the number of ranks: a client's reply depends only on its message, state, data and
streams, and the server aggregates the replies sorted by client. The ledger counts the federated messages'
bytes as the simulator does, never the collectives'; each round's row adds ``time.collective`` (rank 0's seconds
in collectives, waiting for the slowest rank included). A collective that fails or times out (a rank died) stops
the rank with one :class:`RankFailure` line naming the rank that stopped and the ``fedlowrank resume`` command.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import json
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist

from ..message import Message, State
from ..tasks import Task
from ..training.local import steps_per_round
from .engine import pool, sample_clients, send_down
from .rounds import RoundReplies
from .simulator import Simulation
from .stopping import StopRequested, pending_stop

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


class RankFailure(RuntimeError):
    """A collective failed or timed out: another rank of the job stopped."""


def under_torchrun() -> bool:
    """Whether this process is a rank of a ``torch.distributed`` job (``torchrun``'s or :func:`spawn`'s
    environment)."""
    return all(k in os.environ for k in ENV)


def assign(costs: dict[int, float], world: int) -> dict[int, int]:
    """Client -> rank: the costliest client first (ties: the lower id) to the least loaded rank (ties: the lower
    rank), the longest-processing-time rule. With at least ``world`` clients of positive cost every rank gets one."""
    loads, out = [0.0] * world, {}
    for k in sorted(costs, key=lambda k: (-costs[k], k)):
        r = min(range(world), key=lambda r: (loads[r], r))
        out[k] = r
        loads[r] += costs[k]
    return out


def rank_device(cfg, rank: int, local_rank: int, world: int) -> str:
    """The device of rank ``rank``: the one :func:`spawn` gave it (``FEDLOWRANK_DEVICE``), else
    ``run.devices[rank]`` when the job has one rank per listed device, else ``cuda:LOCAL_RANK`` when ``run.device``
    is ``auto``/``cuda`` and CUDA is there, else ``run.device``."""
    if os.environ.get("FEDLOWRANK_DEVICE"):
        return os.environ["FEDLOWRANK_DEVICE"]
    if len(cfg.run.devices) == world:
        return cfg.run.devices[rank]
    if cfg.run.device in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{local_rank}"
    return "cpu" if cfg.run.device == "auto" else cfg.run.device


def _tensor(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else torch.zeros(0, dtype=torch.uint8, device=device)


def _bytes(t: torch.Tensor) -> bytes:
    return t.cpu().numpy().tobytes()


class Collectives:
    """The byte collectives of one process group on ``device`` (the CPU for gloo, the rank's GPU for NCCL); the
    seconds spent in them add up in :attr:`seconds`. A failure raises :class:`RankFailure` with ``failed(what)``'s
    line."""

    def __init__(self, device: torch.device, failed: Callable[[str, BaseException], str]):
        self.device, self.failed = device, failed
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.seconds = 0.0

    def _call(self, what: str, fn, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except RuntimeError as exc:  # gloo/NCCL: a peer closed its connection, or the timeout passed
            raise RankFailure(self.failed(what, exc)) from None
        finally:
            self.seconds += time.perf_counter() - t0

    def _sizes(self, what: str, n: int) -> list[int]:
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world)]
        self._call(what, dist.all_gather, sizes, torch.tensor([n], dtype=torch.int64, device=self.device))
        return [int(s.item()) for s in sizes]

    def all_gather_bytes(self, what: str, data: bytes) -> list[bytes]:
        """Every rank's ``data``, by rank (one int64 all-gather of the sizes, one uint8 all-gather padded to the
        largest)."""
        sizes = self._sizes(what, len(data))
        width = max(sizes)
        mine = torch.zeros(width, dtype=torch.uint8, device=self.device)
        mine[:len(data)] = _tensor(data, self.device)
        out = [torch.empty(width, dtype=torch.uint8, device=self.device) for _ in range(self.world)]
        self._call(what, dist.all_gather, out, mine)
        return [_bytes(t[:n]) for t, n in zip(out, sizes)]

    def gather_bytes(self, what: str, data: bytes) -> list[bytes] | None:
        """Every rank's ``data`` on rank 0, by rank (``None`` on the others)."""
        sizes = self._sizes(what, len(data))
        width = max(sizes)
        mine = torch.zeros(width, dtype=torch.uint8, device=self.device)
        mine[:len(data)] = _tensor(data, self.device)
        out = [torch.empty(width, dtype=torch.uint8, device=self.device) for _ in range(self.world)] \
            if self.rank == 0 else None
        self._call(what, dist.gather, mine, out, dst=0)
        return None if out is None else [_bytes(t[:n]) for t, n in zip(out, sizes)]

    def broadcast_bytes(self, what: str, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank."""
        n = torch.tensor([len(data) if self.rank == 0 else 0], dtype=torch.int64, device=self.device)
        self._call(what, dist.broadcast, n, src=0)
        buf = _tensor(data, self.device) if self.rank == 0 else torch.empty(int(n.item()), dtype=torch.uint8,
                                                                             device=self.device)
        self._call(what, dist.broadcast, buf, src=0)
        return _bytes(buf)


def _pack(entries: dict[str, Any]) -> bytes:
    """``entries`` (name -> bytes, or a JSON scalar) as one safetensors container: bytes as uint8 tensors."""
    return State({k: _tensor(v, torch.device("cpu")) if isinstance(v, bytes) else v
                  for k, v in entries.items()}).to_bytes()


def _unpack(blobs: Iterable[bytes]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for blob in blobs:
        for k, v in State.from_bytes(blob).items():
            out[k] = _bytes(v) if isinstance(v, torch.Tensor) else v
    return out


def init_process_group(cfg, backend: str | None = None) -> torch.device:
    """Join the job of this process's environment (when not yet joined) with ``backend`` (default: the one of this
    rank's device, NCCL on CUDA, gloo otherwise) and ``run.collective_timeout_s``; returns the rank's device."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    spec = rank_device(cfg, rank, int(os.environ["LOCAL_RANK"]), world)
    from ..device import resolve_device

    device = resolve_device(spec, f"run.devices[{rank}]" if cfg.run.devices else "run.device")
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend or ("nccl" if device.type == "cuda" else "gloo"), rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=cfg.run.collective_timeout_s))
    return device


class Distributed(Simulation):
    """The run of ``cfg`` over the ranks of the job this process belongs to (see the module docstring); the same
    arguments as :class:`~.simulator.Simulation`. Rank 0 holds the run directory and the log; the other ranks
    write nothing."""

    def __init__(self, cfg, task: Task | None = None, run_dir: str | Path | None = None,
                 log: Callable[[str], None] | None = None, parts: list[np.ndarray] | None = None,
                 overwrite: bool = False, log_partition: bool = True):
        device = init_process_group(cfg)
        rank = dist.get_rank()
        if cfg.run.clients_per_round < dist.get_world_size():
            raise ValueError(f"run.clients_per_round = {cfg.run.clients_per_round} is fewer than the job's "
                             f"{dist.get_world_size()} ranks: every rank trains at least one client a round")
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, device=str(device)))
        if rank != 0:
            run_dir, log = None, None
        self.comm = Collectives(device if device.type == "cuda" else torch.device("cpu"), self._failure_line)
        self.rank, self.world = self.comm.rank, self.comm.world
        self._resume_dir = str(run_dir) if run_dir is not None else "RUN_DIR"
        self._round_now = 0
        super().__init__(cfg, task, run_dir, log, None, parts, overwrite, log_partition)
        self._resume_dir = self.comm.broadcast_bytes("the run directory", self._resume_dir.encode()).decode()
        self.owner: dict[int, int] = {}  # client -> the rank holding its state
        self.moves = 0  # client states moved between ranks so far
        self._gather_due = False  # rank 0 holds every client state this round
        self._checkpoint_now = False  # and writes a checkpoint of it
        self._stop = 0  # the stop signal the ranks agreed on at the end of this round (0: none)

    stops_together = True  # a stop signal is noted, and every rank stops at the end of the round it came in

    def _failure_line(self, what: str, exc: BaseException) -> str:
        other = f"rank {1 - self.rank}" if self.world == 2 else "another rank"
        return (f"round {self._round_now}: {what} failed on rank {self.rank} of {self.world}: {other} stopped or did "
                f"not answer within run.collective_timeout_s = {self.cfg.run.collective_timeout_s:g} s "
                f"({str(exc).splitlines()[0][:160]}); continue with: fedlowrank resume {self._resume_dir}")

    # -- placement ---------------------------------------------------------------------------------------
    def costs(self, data: dict[int, np.ndarray], cfg) -> dict[int, float]:
        """Each client's estimated cost this round: examples trained (local steps × batch size) × sequence
        length."""
        seq = getattr(self.task, "max_length", None) or cfg.task.max_length
        return {k: float(max(1, steps_per_round(cfg.train, len(ix)) * cfg.train.batch_size * seq))
                for k, ix in data.items()}

    def move_states(self, owners: dict[int, int]) -> None:
        """Move the states of the round's clients to the rank that trains them (``owners``: client -> rank)."""
        moving = [k for k in sorted(owners) if k in self.owner and self.owner[k] != owners[k]]
        if not moving:
            return
        out = {f"{k}": self.store.pop(k).to_bytes() for k in moving if self.owner[k] == self.rank}
        got = _unpack(self.comm.all_gather_bytes("moving client states", _pack(out)))
        for k in moving:
            if owners[k] == self.rank:
                self.store[k] = State.from_bytes(got[f"{k}"])
            self.owner[k] = owners[k]
        self.moves += len(moving)

    def gather_states(self) -> list[int]:
        """Every client state on rank 0 (copies; their owners keep them); returns the clients copied to rank 0."""
        mine = {f"{k}": self.store[k].to_bytes() for k in list(self.store)} if self.rank else {}
        blobs = self.comm.gather_bytes("gathering client states", _pack(mine))
        if blobs is None:
            return []
        got = _unpack(blobs[1:])
        for k, data in got.items():
            self.store[int(k)] = State.from_bytes(data)
        return sorted(int(k) for k in got)

    # -- a round -----------------------------------------------------------------------------------------
    def run_round(self) -> dict[str, Any] | None:
        """Run the next round on every rank; returns its metrics row on rank 0 (``None`` on the others)."""
        cfg, rnd = self.cfg, self.round + 1
        self._round_now = rnd
        started, comm0 = time.perf_counter(), self.comm.seconds
        clients = sample_clients(cfg.run.seed, rnd, cfg.partition.num_clients, cfg.run.clients_per_round)
        data = {k: self.parts[k] for k in clients}
        if self.method.pooled:
            first, data, cfg = pool(cfg, data)
            clients = [first]
        dropped = self.dropped_clients(rnd, clients)
        owners = assign(self.costs(data, cfg), self.world)
        self.move_states(owners)
        mine = [k for k in clients if owners[k] == self.rank]
        if self.rank == 0:
            self.progress.round_start(rnd, len(clients))
        entries: dict[str, Any] = {}
        downs: dict[int, Message] = {}
        pending: dict[int, State] = {}
        for k, down_bytes, down, reply, new_state, trainer in self.trained_clients(rnd, mine, data, cfg):
            entries[f"compute/{k}"] = float(trainer.compute_seconds)
            entries[f"down/{k}"] = down_bytes
            downs[k] = down
            if k not in dropped:
                entries[f"reply/{k}"] = reply.to_bytes()
                pending[k] = new_state
        entries[f"stop/{self.rank}"] = pending_stop()  # a stop signal this rank got: the ranks stop together
        blobs = self.comm.gather_bytes("gathering replies", _pack(entries))
        outcome = None
        if self.rank == 0:
            blob_entries = _unpack(blobs)
            stop = next((int(blob_entries[f"stop/{r}"]) for r in range(self.world) if blob_entries[f"stop/{r}"]), 0)
            outcome = self.close_gathered(rnd, clients, data, dropped, downs, blob_entries, started)
            used = sorted(r.client for r in outcome.replies) if not outcome.skipped else []
            self._checkpoint_now = self.checkpoints.due(rnd) or bool(stop and self.run_dir is not None)
            self._gather_due = self._checkpoint_now or (self.method.personalized and self.evaluator.due(rnd))
            control = _pack({"server": b"" if outcome.skipped else outcome.server.to_bytes(), "used": used,
                             "gather": self._gather_due, "stop": stop})
        else:
            control = None
        control = _unpack([self.comm.broadcast_bytes("broadcasting the global state", control)])
        self._stop = int(control["stop"])
        used = set(control["used"])
        new_states = {k: s for k, s in pending.items() if k in used}
        for k in used:
            self.owner[k] = owners[k]
        if self.rank != 0:
            if control["server"]:
                self.server = State.from_bytes(control["server"])
                self.store.update(new_states)
            if control["gather"]:
                self.gather_states()
            self.round = rnd
            self._stop_if_agreed()
            return None
        copied = [k for k in self.gather_states() if k not in new_states] if control["gather"] else []
        t = outcome.row["time"]
        per_rank = [sum(float(blob_entries[f"compute/{k}"]) for k in clients if owners[k] == r)
                    for r in range(self.world)]
        t.update({"client_compute": max(per_rank), "client_compute_total": t["client_compute"],
                  "collective": self.comm.seconds - comm0})
        metrics, evaluation = self.evaluate_round(outcome, new_states)
        try:
            row = self.commit_round(outcome, metrics, evaluation, new_states)
        finally:
            for k in copied:  # their owners keep them
                del self.store[k]
            self._gather_due = self._checkpoint_now = False
        self._stop_if_agreed()
        return row

    def _stop_if_agreed(self) -> None:
        """Every rank raises :class:`~.stopping.StopRequested` after a round in which one of them got a stop signal
        (its checkpoint written by rank 0, the clients' states gathered for it)."""
        if self._stop:
            raise StopRequested(self._stop)

    def close_gathered(self, rnd: int, clients: list[int], data: dict[int, np.ndarray], dropped: dict[int, str],
                       downs: dict[int, Message], got_entries: dict[str, Any], started: float):
        """Rank 0: every gathered reply received in client order (checked as in the simulator; the broadcast of
        a client trained elsewhere is made again here), then the server's step."""
        got = RoundReplies(rnd, clients, uplink=self.state.uplink, downlink=self.state.downlink)
        for k in clients:
            got.compute += got_entries[f"compute/{k}"]
            self.progress.client_done()
            if k in dropped:
                got.drop(k, dropped[k], got_entries[f"down/{k}"])
                continue
            down = downs.get(k) or send_down(self.state.downlink, self.method.broadcast(self.server, k, rnd), k, rnd)[1]
            reply = Message.from_bytes(got_entries[f"reply/{k}"])
            got.receive(self.method, k, down, reply, len(data[k]), reply.nbytes(), down_bytes=got_entries[f"down/{k}"])
        return self.close_round(got, started)

    def checkpoint_due(self, rnd: int) -> bool:
        """A checkpoint is written only in a round whose client states were gathered to rank 0 for it."""
        return self._checkpoint_now and self._gather_due

    def save_checkpoint(self):
        """Save only while rank 0 holds every client state (a stop between rounds keeps the last checkpoint)."""
        if self._gather_due:
            return super().save_checkpoint()
        return None

    def evaluate_initial(self) -> None:
        if self.rank == 0:
            super().evaluate_initial()

    def evaluate_round(self, outcome, new_states=None):
        return super().evaluate_round(outcome, new_states) if self.rank == 0 else ({}, 0.0)

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out["time"]["collective"] = sum(r["time"].get("collective", 0.0) for r in self.history)
        out["ranks"] = self.world
        if self.run_dir is not None:
            self.files.write_summary(out)
        return out

    @classmethod
    def resume(cls, run_dir, task=None, log=None, round=None, warn=None):
        """As :meth:`~.server_run.ServerRun.resume` on every rank: rank 0 restores the checkpoint (holding every
        client state), the other ranks build the run and receive the round and global state from it."""
        if int(os.environ["RANK"]) == 0:
            run = super().resume(run_dir, task, log, round, warn)
            run.owner = {k: 0 for k in run.store}
            start = _pack({"round": run.round, "server": run.server.to_bytes(), "owned": list(run.owner)})
            run.comm.broadcast_bytes("starting the resumed run", start)
            return run
        from ..config import from_dict

        run = cls(from_dict(json.loads((Path(run_dir) / "config.json").read_text())), task=task)
        run._resume_dir = str(run_dir)
        start = _unpack([run.comm.broadcast_bytes("starting the resumed run", None)])
        run.round, run.server = start["round"], State.from_bytes(start["server"])
        run.owner = {int(k): 0 for k in start["owned"]}
        return run


# -- launching ranks on this machine -----------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_when_orphaned(parent: int) -> None:
    """A spawned rank's watch: once the launcher has ended without stopping it (``kill -9``), stop as on its
    SIGTERM (with the other ranks, at the end of the round) rather than train on with nobody waiting for it."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


def _rank_main(rank: int, devices: list[str], port: int, target: Callable[..., Any], args: tuple) -> None:
    world = len(devices)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "FEDLOWRANK_DEVICE": devices[rank]})
    threading.Thread(target=_stop_when_orphaned, args=(os.getppid(),), daemon=True).start()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: a rank that seems stuck shows where
    try:
        status = target(*args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # its files written and closed, the rank ends without the interpreter's teardown, which takes seconds with torch
    # loaded on a busy machine while the launcher (and a user who stopped it) waits
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status if isinstance(status, int) else 0)


def spawn(target: Callable[..., Any], args: tuple, devices: list[str], grace_s: float) -> list[int]:
    """Run ``target(*args)`` in one new process per entry of ``devices``, as the ranks of one job on this machine
    (``torchrun``'s environment, a free port; rank r computes on ``devices[r]``); ``target`` is a module-level
    function (it is pickled by name). Waits for them all; once one has failed, the others get ``grace_s`` seconds to
    end by themselves (their collectives fail or time out), then are killed (SIGKILL: a rank holds SIGTERM until its
    round's end, which a rank stuck in a round never reaches). Stopped itself (Ctrl-C, SIGTERM:
    ``KeyboardInterrupt``), it forwards SIGTERM to every rank, which stop together at the end of the round (rank 0
    saving it and saying so) and waits for them; a second stop kills them. Each rank also stops when this process
    ends without stopping it (:func:`_stop_when_orphaned`). Returns the exit codes by rank."""
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, list(devices), port, target, args))
             for r in range(len(devices))]
    for p in procs:
        p.start()
    deadline, stops = None, 0
    while any(p.is_alive() for p in procs):
        try:
            for p in procs:
                p.join(0.2)
        except KeyboardInterrupt:
            stops += 1
            for p in procs:
                if p.is_alive() and stops == 1:
                    os.kill(p.pid, signal.SIGTERM)
                elif p.is_alive():
                    p.kill()
            continue
        if deadline is None and any(p.exitcode not in (None, 0) for p in procs):
            deadline = time.monotonic() + grace_s
        if deadline is not None and time.monotonic() > deadline:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join()
    return [p.exitcode for p in procs]

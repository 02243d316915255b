"""The simulator's per-client states, with a memory budget: what does not fit is spilled to disk.

:class:`ClientStore` is a mapping ``client id -> State`` (the interface of the dict it replaces). With a budget
(``run.state_memory_mb`` > 0) it keeps the most recently used states in memory while their tensors total at most
the budget, and writes the others, one safetensors file per client (:meth:`State.to_bytes`: tensors exact, scalars
in the metadata), to its folder; a spilled state is read back when it is asked for, and its file removed (each
state lives in exactly one place). Without a budget it is a plain in-memory mapping.

The folder is ``<run_dir>/client_states`` (emptied at the first spill) or, without a run directory, a temporary folder
removed when the store is garbage-collected or the process exits. Checkpoints take the in-memory states and
copies of the spilled files (:mod:`.checkpoint`), so a resumed run continues from the same states bit for bit.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections import OrderedDict
from collections.abc import Iterator, MutableMapping
from pathlib import Path

from ..message import State
from .rundir import own


def state_bytes(state: State) -> int:
    """Bytes held by a state's tensors (scalars are not counted)."""
    return sum(t.numel() * t.element_size() for t in state.tensors().values())


class ClientStore(MutableMapping):
    """``client -> State`` with at most ``memory_mb`` MiB of tensors in memory (0 = no limit, nothing spilled).

    Args:
        memory_mb: the budget of the in-memory states; the least recently used are spilled beyond it.
        folder: where spilled states go (emptied at the first spill); ``None`` = a temporary folder of its own.
    """

    def __init__(self, memory_mb: float = 0.0, folder: str | Path | None = None):
        if memory_mb < 0:
            raise ValueError(f"run.state_memory_mb must be >= 0 (0 = keep every state in memory), got {memory_mb}")
        self.limit = int(memory_mb * 2**20)
        self._memory: OrderedDict[int, State] = OrderedDict()   # least recently used first
        self._sizes: dict[int, int] = {}
        self._spilled: set[int] = set()
        self._folder = None if folder is None else Path(folder)
        self._ready = False
        self._cleanup = None

    # -- where spilled states live ----------------------------------------------------------------------
    @property
    def folder(self) -> Path:
        """The spill folder, made (and emptied of an earlier run's files) at the first spill."""
        if not self._ready:
            if self._folder is None:
                self._folder = Path(tempfile.mkdtemp(prefix="fedlowrank-states-"))
                self._cleanup = weakref.finalize(self, shutil.rmtree, self._folder, True)
            else:
                own(self._folder.parent, self._folder.name)
                if self._folder.exists():
                    shutil.rmtree(self._folder)
            self._folder.mkdir(parents=True, exist_ok=True)
            self._ready = True
        return self._folder

    def path(self, client: int) -> Path:
        return self.folder / f"client-{client:07d}.safetensors"

    @property
    def memory_bytes(self) -> int:
        """Bytes of the tensors of the states now in memory."""
        return sum(self._sizes.values())

    def resident(self) -> dict[int, State]:
        """The states now in memory (not copied)."""
        return dict(self._memory)

    def spilled_files(self) -> dict[int, Path]:
        """The spilled states' files, by client."""
        return {k: self.path(k) for k in sorted(self._spilled)}

    # -- mapping -----------------------------------------------------------------------------------------
    def __getitem__(self, client: int) -> State:
        client = int(client)
        if client in self._memory:
            self._memory.move_to_end(client)
            return self._memory[client]
        if client not in self._spilled:
            raise KeyError(client)
        path = self.path(client)
        state = State.from_bytes(path.read_bytes())
        self._spilled.discard(client)
        path.unlink()
        self._keep(client, state)
        return state

    def __setitem__(self, client: int, state: State) -> None:
        client = int(client)
        if client in self._spilled:
            self._spilled.discard(client)
            self.path(client).unlink()
        self._memory.pop(client, None)
        self._keep(client, state)

    def __delitem__(self, client: int) -> None:
        if client in self._memory:
            del self._memory[client]
            del self._sizes[client]
        elif client in self._spilled:
            self._spilled.discard(client)
            self.path(client).unlink()
        else:
            raise KeyError(client)

    def __contains__(self, client: object) -> bool:
        return client in self._memory or client in self._spilled

    def __iter__(self) -> Iterator[int]:
        return iter(sorted([*self._memory, *self._spilled]))

    def __len__(self) -> int:
        return len(self._memory) + len(self._spilled)

    def restore(self, resident: dict[int, State], spilled: dict[int, Path]) -> None:
        """Replace the contents by ``resident`` states and the spilled state files ``spilled`` (copied)."""
        for k in list(self):
            del self[k]
        for k, path in spilled.items():
            shutil.copyfile(path, self.path(k))
            self._spilled.add(int(k))
        for k, state in resident.items():
            self[k] = state

    # -- the budget --------------------------------------------------------------------------------------
    def _keep(self, client: int, state: State) -> None:
        self._memory[client] = state
        self._sizes[client] = state_bytes(state)
        if not self.limit:
            return
        total = self.memory_bytes
        while total > self.limit and self._memory:
            old, victim = self._memory.popitem(last=False)
            self.path(old).write_bytes(victim.to_bytes())
            self._spilled.add(old)
            total -= self._sizes.pop(old)

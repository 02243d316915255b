"""Building blocks shared by every runtime (the in-process simulator and Flower).

Both runtimes do the same things in the same order, through these functions only, so that a Flower run and
a simulated run with the same seeds produce the same global model:

* :func:`setup_info` — the :class:`SetupInfo` a method is set up with (same on server and clients);
* :func:`sample_clients` — uniform sampling of K of M clients without replacement, from the round's stream;
* :func:`wire` — what crosses the network: a message serialised and parsed back;
* :func:`client_update` — one client's round: fresh base deltas, ``method.train``, the reply.
"""

from __future__ import annotations

import numpy as np

from ..adapters.model import AdaptedModel
from ..message import Message, State
from ..methods.base import Method, SetupInfo
from ..seeding import numpy_rng
from ..training.local import LocalTrainer


def setup_info(cfg, client_sizes: list[int]) -> SetupInfo:
    """The method's view of the run, from a :class:`~fedlowrank.config.RunConfig`."""
    ranks = cfg.client_ranks()
    return SetupInfo(
        num_clients=cfg.partition.num_clients, client_sizes=list(client_sizes), client_ranks=ranks,
        rank=max(ranks) if cfg.lora.ranks else cfg.lora.rank, alpha=cfg.lora.alpha, scaling=cfg.lora.scaling,
        dropout=cfg.lora.dropout, weighting=cfg.server.weighting, server_lr=cfg.server.lr, seed=cfg.run.seed,
        rounds=cfg.run.rounds)


def sample_clients(seed: int, rnd: int, num_clients: int, per_round: int) -> list[int]:
    """K distinct clients for round ``rnd`` (sorted), uniformly without replacement, from the round's stream."""
    rng = numpy_rng(seed, "client-sampling", rnd)
    return sorted(int(k) for k in rng.choice(num_clients, size=per_round, replace=False))


def wire(msg: Message) -> Message:
    """The message as the receiver gets it: serialised and parsed (no shared tensors, exact bytes)."""
    return Message.from_bytes(msg.to_bytes())


def client_update(method: Method, model: AdaptedModel, msg: Message, state: State, task, indices: np.ndarray,
                  cfg, client: int, rnd: int) -> tuple[Message, State, LocalTrainer]:
    """Run one client's round on ``model`` and return (reply, new client state, the trainer used).

    Every adapter's base delta is cleared first: whatever the client needs must come in ``msg``.
    """
    for mod in model.adapters().values():
        mod.set_base_delta(None)
    trainer = LocalTrainer(task, indices, cfg.train, client, rnd, cfg.run.rounds, cfg.run.seed)
    reply, new_state = method.train(model, msg, state, trainer)
    return reply, new_state, trainer

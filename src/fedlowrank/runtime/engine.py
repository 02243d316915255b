"""Building blocks shared by every runtime (the in-process simulator and Flower).

Both runtimes do the same things in the same order, through these functions (and the same set-up,
:func:`~.run.build_run`, and server step, :func:`~.rounds.close_round`), so that a Flower run and a simulated run
with the same seeds produce the same global model:

* :func:`setup_info` — the :class:`SetupInfo` a method is set up with (same on server and clients);
* :func:`sample_clients` — uniform sampling of K of M clients without replacement, from the round's stream;
* :func:`wire` — what crosses the network: a message serialised and parsed back;
* :func:`send_down` — a broadcast through the downlink's codec and the wire: what travels, and what the client
  decodes (the server keeps the same, what updates are measured from); a reply's codec is the uplink's
  :meth:`~fedlowrank.codecs.Link.encode_reply` on the client and :meth:`.rounds.RoundReplies.receive` on the server;
* :func:`client_update` — one client's round: fresh base deltas, ``method.train``, the reply (the simulator's
  cohorts run the same parts, :func:`client_trainer` and :func:`client_reply`, around a joint fit, :mod:`.cohort`);
* :func:`check_reply` — whether the server may use a reply (shapes, dtypes, finiteness, size, keys);
* :func:`pool` — the round of a method that trains on pooled data (``method.pooled``, a centralised reference).
"""

from __future__ import annotations

import dataclasses
import math
import numpy as np
import torch

from ..adapters.model import AdaptedModel
from ..codecs import Link
from ..device import to_host
from ..execution.measure import phase, phased
from ..linalg.reductions import all_finite
from ..message import Message, State
from ..methods.base import Method, SetupInfo
from ..privacy.dpsgd import DPSGD
from ..privacy.runtime import local_reply
from ..seeding import numpy_rng, torch_generator
from ..training.local import LocalTrainer, steps_per_round
from .plan import Plan


def setup_info(cfg, client_sizes: list[int]) -> SetupInfo:
    """The method's view of the run, from a :class:`~fedlowrank.config.RunConfig`."""
    ranks = cfg.client_ranks()
    return SetupInfo(
        num_clients=cfg.partition.num_clients, client_sizes=list(client_sizes), client_ranks=ranks,
        rank=cfg.lora.server_rank or (max(ranks) if cfg.lora.ranks else cfg.lora.rank), alpha=cfg.lora.alpha, scaling=cfg.lora.scaling,
        dropout=cfg.lora.dropout, weighting=cfg.server.weighting, server_lr=cfg.server.lr, seed=cfg.run.seed,
        rounds=cfg.run.rounds, clients_per_round=cfg.run.clients_per_round)


def sample_clients(seed: int, rnd: int, num_clients: int, per_round: int) -> list[int]:
    """K distinct clients for round ``rnd`` (sorted), uniformly without replacement, from the round's stream."""
    rng = numpy_rng(seed, "client-sampling", rnd)
    return np.sort(rng.choice(num_clients, size=per_round, replace=False)).tolist()


def pool(cfg, data: dict[int, np.ndarray]):
    """A pooled method's round (``method.pooled``): the round's clients' ``data`` (client -> example indices) as
    one client, the first of them (whose streams it uses), holding all of it in client order, and the run config
    whose local training takes the sum of their local steps (``train.local_steps``; ``train.local_epochs`` 0), so
    that the pool trains on as many examples with as many steps as the clients would together.
    Returns ``(client, {client: indices}, cfg)``."""
    first = min(data)
    steps = sum(steps_per_round(cfg.train, len(ix)) for ix in data.values())
    train = dataclasses.replace(cfg.train, local_steps=steps, local_epochs=0.0)
    return first, {first: np.concatenate([data[k] for k in sorted(data)])}, dataclasses.replace(cfg, train=train)


@phased("wire")
def wire(msg: Message) -> Message:
    """The message as the receiver gets it: serialised and parsed (no shared tensors, exact bytes)."""
    return Message.from_bytes(msg.to_bytes())


def send_down(link: Link, msg: Message, client: int, rnd: int) -> tuple[Message, Message]:
    """``(coded, received)``: the broadcast ``msg`` to ``client`` in round ``rnd`` as the downlink ``link`` codes it
    (what travels; the ledger counts its bytes) and as the client decodes it after the wire (deterministic: the server
    decodes the same and measures the client's update from it). Without a codec, ``msg`` and ``wire(msg)``."""
    coded, _ = link.encode(msg, None, client, rnd)
    return coded, link.decode(wire(coded), None)


def client_trainer(model: AdaptedModel, task, indices: np.ndarray, cfg, client: int, rnd: int,
                   on_step=None) -> LocalTrainer:
    """Before client ``client`` trains on ``model``: every adapter's base delta cleared (whatever the client needs
    must come in its message) and its trainer (``on_step(step, total)``: its progress hook; with ``privacy.dpsgd``
    its DP-SGD)."""
    for mod in model.adapters().values():
        mod.set_base_delta(None)
    dp = cfg.privacy
    dpsgd = DPSGD(dp.dpsgd_clip, dp.dpsgd_noise, torch_generator(cfg.run.seed, "dpsgd", client, rnd)) if dp.dpsgd else None
    return LocalTrainer(task, indices, cfg.train, client, rnd, cfg.run.rounds, cfg.run.seed, on_step=on_step,
                        dpsgd=dpsgd)


def client_reply(cfg, reply: Message, new_state: State, msg: Message, client: int, rnd: int) -> tuple[Message, State]:
    """After client ``client`` trained: its reply and new state on the CPU, whatever device the model is on; with
    ``privacy.mode = "local"`` the reply clipped and noised before it leaves the client
    (:func:`fedlowrank.privacy.runtime.local_reply`)."""
    with phase("reply_to_host"):
        return local_reply(cfg, to_host(reply), msg, client, rnd), to_host(new_state)


@phased("client_update")
def client_update(method: Method, model: AdaptedModel, msg: Message, state: State, task, indices: np.ndarray,
                  cfg, client: int, rnd: int, plan: Plan, on_step=None) -> tuple[Message, State, LocalTrainer]:
    """Run one client's round on ``model`` and return (reply, new client state, the trainer used): the run's
    ``plan`` applied to the model (:meth:`~.plan.Plan.prepare`), :func:`client_trainer`, ``method.train``,
    :func:`client_reply`. The simulator's cohorts run the same parts around a joint fit (:mod:`.cohort`)."""
    plan.prepare(model, task)  # once: the backbone in the compute dtype, checkpointing, compiling
    trainer = client_trainer(model, task, indices, cfg, client, rnd, on_step)
    reply, new_state = method.train(model, msg, state, trainer)
    return (*client_reply(cfg, reply, new_state, msg, client, rnd), trainer)


def check_reply(method: Method, down: Message, reply: Message, rnd: int, client_size: int | None = None) -> str | None:
    """Why ``reply`` must be rejected, or ``None`` if it is acceptable.

    Checks: ``num_examples`` an int in ``[1, client_size]``; ``train_loss`` a finite number; the serialised size
    within ``method.max_reply_bytes(down)``; the tensors exactly those the method declares for ``down``
    (:meth:`~fedlowrank.methods.base.Method.upload_spec`, :meth:`~fedlowrank.methods.base.Method.chosen_upload_spec`):
    none missing, none extra, each of its declared shape and dtype, and finite.
    """
    n = reply.get("num_examples")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or (client_size is not None and n > client_size):
        return f"num_examples must be an integer in [1, {client_size or 'inf'}], got {n!r}"
    loss = reply.get("train_loss")
    if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss):
        return f"train_loss must be a finite number, got {loss!r}"
    size, limit = reply.nbytes(), method.max_reply_bytes(down)
    if size > limit:
        return f"reply of {size} bytes exceeds the method's bound of {limit} bytes"
    try:
        expected = {**method.upload_spec(down, rnd), **method.chosen_upload_spec(down, reply)}
    except ValueError as exc:
        return str(exc)
    tensors = reply.tensors()
    for what, keys in (("missing", sorted(expected.keys() - tensors.keys())),
                       ("unexpected", sorted(tensors.keys() - expected.keys()))):
        if keys:
            return f"{what} tensors: {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
    finite = all_finite(list(tensors.values()))  # one read for the reply; the first bad tensor found below
    for key, t in sorted(tensors.items()):
        spec = expected[key]
        if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
            return f"tensor {key!r} is {t.dtype} {tuple(t.shape)}, expected {spec.dtype} {spec.shape}"
        if not finite and not bool(torch.isfinite(t).all()):
            return f"tensor {key!r} has non-finite values"
    return None

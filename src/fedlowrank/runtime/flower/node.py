"""A Flower node's side of a run: what a SuperNode builds for its client, and its client round.

A node builds only what a client needs (:func:`build_node_run`): the run's task, its partition, the method and the
model (:func:`~fedlowrank.runtime.run.build_run`, the same set-up as the server's), and nothing of the server's
(no run directory, no evaluation, no ledger). :func:`client_round` runs the simulator's client step
(:func:`~fedlowrank.runtime.engine.client_update`) on the node's partition with its client state from
``context.state``, and keeps the new state *pending* until the server says it aggregated the reply
(:func:`committed_state`).

The ClientApp (:mod:`.client_app`) and the client side of SecAgg+ (:mod:`.secagg`) both call :func:`client_round`.
"""

from __future__ import annotations

import dataclasses

from flwr.app import ConfigRecord, Context, RecordDict

ROUTE = "fedlowrank"  # ConfigRecord naming the client and round of a train message (and a query's answer)
STATE = "fedlowrank.state."  # prefix of the client state's records in context.state
PENDING = "fedlowrank.pending."  # prefix of the state made by the last reply, not yet known to be aggregated
PENDING_ROUND = "fedlowrank.pending-round"  # ConfigRecord {"round": r}: the round that made the pending state
DATA_TRAIN = "data-train"  # node-config key: this node's own training file (absent: partition k of the run's data)


def node_partition(context: Context) -> tuple[int, int]:
    """``(partition-id, num-partitions)`` of this SuperNode's node config."""
    try:
        return int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    except KeyError:
        raise ValueError("this SuperNode has no partition: start it with "
                         "--node-config \"partition-id=<k> num-partitions=<partition.num_clients>\"") from None


def build_node_run(cfg, own: str | None, client: int):
    """The :class:`~fedlowrank.runtime.run.Run` a node serving ``client`` trains with: the run of ``cfg``, or, for a
    node that brings its own training file ``own``, one where ``client`` trains on all of that file. The other
    clients' data are not on such a node (their sizes are 0 in the method's view); the configured partition is the
    server's business, so the node's run splits nothing (``partition.kind = iid``)."""
    import numpy as np

    from ...tasks.text import build_node_task
    from ..run import build_run

    if own is None:
        return build_run(cfg)
    m = cfg.partition.num_clients
    if not 0 <= client < m:
        raise ValueError(f"node config partition-id = {client} is out of range: the run has partition.num_clients = {m}")
    task = build_node_task(cfg, own, DATA_TRAIN)
    parts = [np.arange(task.num_train) if j == client else np.zeros(0, dtype=np.int64) for j in range(m)]
    node_cfg = dataclasses.replace(cfg, partition=dataclasses.replace(cfg.partition, kind="iid", partition_by=""))
    return build_run(node_cfg, task, parts)


def committed_state(records: RecordDict, accepted: int):
    """The client's state in ``records`` (its ``context.state``) once the server has said that ``accepted`` is the
    last round whose reply it aggregated: the pending state is committed if it was made in that round and
    dropped otherwise. Returns the committed :class:`~fedlowrank.message.State` (``None`` if there is none yet)."""
    from ...message import State
    from .records import from_records, put_records

    if PENDING_ROUND in records:
        pending = from_records(records, State, PENDING)
        if int(records[PENDING_ROUND]["round"]) == accepted and pending is not None:
            put_records(records, pending, STATE)
        for name in [n for n in records if n.startswith(PENDING) or n == PENDING_ROUND]:
            del records[name]
    return from_records(records, State, STATE)


def client_round(run, context: Context, route, down):
    """This node's client round of ``run`` (its :func:`build_node_run`) on ``down`` (the broadcast, decoded) for
    ``route`` (client, round, accepted): the new state (with the uplink's error feedback residuals) is kept pending in
    ``context.state``. Returns (reply, the reply coded by the uplink's codec, trainer)."""
    from ...codecs import split_state
    from ..engine import client_update
    from .records import put_records

    k, _ = node_partition(context)
    if int(route["client"]) != k:
        raise ValueError(f"message for client {route['client']} reached the SuperNode of partition {k}")
    rnd = int(route["round"])
    state = committed_state(context.state, int(route["accepted"]))
    if state is None:
        state = run.method.init_client(k)
    state, residual = split_state(state) if run.uplink.error_feedback else (state, {})
    reply, new_state, trainer = client_update(run.method, run.model, down, state, run.task, run.parts[k], run.cfg,
                                              k, rnd, run.training_plan(one_at_a_time=True))
    coded, new_state = run.uplink.encode_reply(reply, down, new_state, residual, k, rnd)
    put_records(context.state, new_state, PENDING)
    context.state[PENDING_ROUND] = ConfigRecord({"round": rnd})
    return reply, coded, trainer

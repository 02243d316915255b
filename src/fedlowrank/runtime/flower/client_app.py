"""The Flower ``ClientApp``: a SuperNode with ``partition-id = k`` is client ``k`` of the run.

* ``query``: answers the server's question "which client are you?" (``partition-id``, ``num-partitions``);
* ``train``: rebuilds the run from the run config (cached per process), then runs
  :func:`~fedlowrank.runtime.engine.client_update` — the simulator's client step — on partition ``k`` with
  the client's state from ``context.state`` (``method.init_client(k)`` the first time) and stores the new
  state back, so that stateful methods (control variates, private factors, optimiser moments) carry over
  rounds. Start each SuperNode with ``--node-config "partition-id=<k> num-partitions=<M>"``.

A node may bring its own training file instead: ``--node-config "partition-id=<k> num-partitions=<M>
data-train=/path/own.tsv"``. It then builds its task from that file alone (read like ``data.train``, with the
run config's ``data.*`` columns and header; label ids from the run config's ``data.labels``) and trains on all
of it: its partition is its file. Nothing else changes; the server evaluates on its own test data.

The new state is kept *pending* (records ``fedlowrank.pending.*`` and the round it was made in) until the
server has aggregated the reply it came with: every train message names the last round whose reply of this
client the server aggregated (``accepted``), and the node commits its pending state if it is that round's and
drops it otherwise (a reply rejected, lost or timed out, a skipped round). So a client's state only ever
advances with replies the global state took in, as in the simulator, which commits a round's client states
only when it aggregates the round.

With ``flower.secagg = true`` the train messages of a round come through Flower's ``secaggplus_mod`` (the app's
mod, applied only to SecAgg+ messages) and are answered by :func:`~.secagg.secagg_reply`.
"""

from __future__ import annotations

import json
from typing import Any

from flwr.app import ConfigRecord, Context, MetricRecord, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.clientapp import ClientApp

# Flower starts a fresh process for every message: torch and the run are imported in `train` only, so that
# the partition query answers without loading them.

ROUTE = "fedlowrank"  # ConfigRecord naming the client and round of a train message (and a query's answer)
STATE = "fedlowrank.state."  # prefix of the client state's records in context.state
PENDING = "fedlowrank.pending."  # prefix of the state made by the last reply, not yet known to be aggregated
PENDING_ROUND = "fedlowrank.pending-round"  # ConfigRecord {"round": r}: the round that made the pending state
DATA_TRAIN = "data-train"  # node-config key: this node's own training file (absent: partition k of the run's data)


def _secagg_when_asked(msg: FlowerMessage, context: Context, call_next) -> FlowerMessage:
    """Flower's ``secaggplus_mod`` for the messages of a SecAgg+ round (``flower.secagg``); others pass through."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    if RECORD_KEY_CONFIGS in msg.content.config_records:
        from flwr.client.mod import secaggplus_mod

        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


app = ClientApp(mods=[_secagg_when_asked])
_runs: dict[str, Any] = {}  # run config (JSON) -> the Simulation this process built from it


def _run(context: Context):
    from ..simulator import Simulation
    from .settings import load_run_config

    own = context.node_config.get(DATA_TRAIN)
    key = json.dumps([dict(context.run_config), own], sort_keys=True)
    if key not in _runs:
        _runs.clear()
        cfg, _ = load_run_config(context.run_config)
        _runs[key] = Simulation(cfg) if own is None else _own_data_run(cfg, str(own), _partition(context)[0])
    return _runs[key]


def _own_data_run(cfg, path: str, k: int):
    """The run of a node that brings its own training file ``path``: client ``k`` trains on all of it. The
    other clients' data are not here (their sizes are 0 in the method's view); the configured partition is
    the server's business, so the node's run splits nothing (``partition.kind = iid``)."""
    import dataclasses

    import numpy as np

    from ...tasks import build_node_task
    from ..simulator import Simulation

    m = cfg.partition.num_clients
    if not 0 <= k < m:
        raise ValueError(f"node config partition-id = {k} is out of range: the run has partition.num_clients = {m}")
    task = build_node_task(cfg, path, DATA_TRAIN)
    parts = [np.arange(task.num_train) if j == k else np.zeros(0, dtype=np.int64) for j in range(m)]
    node_cfg = dataclasses.replace(cfg, partition=dataclasses.replace(cfg.partition, kind="iid", partition_by=""))
    return Simulation(node_cfg, task=task, parts=parts)


def _partition(context: Context) -> tuple[int, int]:
    try:
        return int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    except KeyError:
        raise ValueError("this SuperNode has no partition: start it with "
                         "--node-config \"partition-id=<k> num-partitions=<partition.num_clients>\"") from None


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


@app.query()
def query(msg: FlowerMessage, context: Context) -> FlowerMessage:
    k, m = _partition(context)
    answer = {"partition-id": k, "num-partitions": m}
    own = context.node_config.get(DATA_TRAIN)
    if own is not None:  # the server learns the node's size: it bounds the reply's num_examples
        from ...tasks import node_data
        from .settings import load_run_config

        answer["num-examples"] = len(node_data(load_run_config(context.run_config)[0], str(own), DATA_TRAIN).train_texts)
    return FlowerMessage(RecordDict({ROUTE: ConfigRecord(answer)}), reply_to=msg)


def client_round(context: Context, route, down):
    """This node's client round on ``down`` (the broadcast) for ``route`` (client, round, accepted): the new state
    is kept pending in ``context.state``. Returns (reply, trainer)."""
    from ..engine import client_update
    from .records import put_records

    sim = _run(context)
    k, _ = _partition(context)
    if int(route["client"]) != k:
        raise ValueError(f"message for client {route['client']} reached the SuperNode of partition {k}")
    rnd = int(route["round"])
    state = committed_state(context.state, int(route["accepted"]))
    if state is None:
        state = sim.method.init_client(k)
    reply, new_state, trainer = client_update(sim.method, sim.model, down, state, sim.task, sim.parts[k], sim.cfg,
                                              k, rnd)
    put_records(context.state, new_state, PENDING)
    context.state[PENDING_ROUND] = ConfigRecord({"round": rnd})
    return reply, trainer


@app.train()
def train(msg: FlowerMessage, context: Context) -> FlowerMessage:
    from ...message import Message
    from .records import from_records, to_records
    from .secagg import SECAGG_ROUND, secagg_reply

    if SECAGG_ROUND in msg.content:
        return secagg_reply(msg, context)
    reply, trainer = client_round(context, msg.content[ROUTE], from_records(msg.content, Message))
    metrics = MetricRecord({"num-examples": int(reply["num_examples"]),
                            "train-loss": float(reply.get("train_loss", float("nan"))),
                            "compute-seconds": float(trainer.compute_seconds)})
    return FlowerMessage(RecordDict({**to_records(reply), "metrics": metrics}), reply_to=msg)

"""The Flower ``ClientApp``: a SuperNode with ``partition-id = k`` is client ``k`` of the run.

* ``query``: answers the server's question "which client are you?" (``partition-id``, ``num-partitions``);
* ``train``: builds what the client needs from the run config (:func:`~.node.build_node_run`, cached per
  process), then runs :func:`~fedlowrank.runtime.engine.client_update` — the simulator's client step — on
  partition ``k`` with the client's state from ``context.state`` (``method.init_client(k)`` the first time) and
  stores the new state back, so that stateful methods (control variates, private factors, optimiser moments) carry
  over rounds (:func:`~.node.client_round`). Start each SuperNode with
  ``--node-config "partition-id=<k> num-partitions=<M>"``.

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

from .node import DATA_TRAIN, PENDING, PENDING_ROUND, ROUTE, STATE, committed_state, node_partition

# Flower starts a fresh process for every message: torch and the run are imported in `train` only, so that
# the partition query answers without loading them.

__all__ = ["DATA_TRAIN", "PENDING", "PENDING_ROUND", "ROUTE", "STATE", "app", "committed_state", "query", "train"]


def _secagg_when_asked(msg: FlowerMessage, context: Context, call_next) -> FlowerMessage:
    """Flower's ``secaggplus_mod`` for the messages of a SecAgg+ round (``flower.secagg``); others pass through."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    if RECORD_KEY_CONFIGS in msg.content.config_records:
        from flwr.client.mod import secaggplus_mod

        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


app = ClientApp(mods=[_secagg_when_asked])
_runs: dict[str, Any] = {}  # run config and own data file (JSON) -> the node's run this process built from them


def _node_run(context: Context):
    from .settings import load_run_config

    own = context.node_config.get(DATA_TRAIN)
    key = json.dumps([dict(context.run_config), own], sort_keys=True)
    if key not in _runs:
        from .node import build_node_run

        _runs.clear()
        cfg, _ = load_run_config(context.run_config)
        _runs[key] = build_node_run(cfg, None if own is None else str(own), node_partition(context)[0])
    return _runs[key]


@app.query()
def query(msg: FlowerMessage, context: Context) -> FlowerMessage:
    k, m = node_partition(context)
    answer = {"partition-id": k, "num-partitions": m}
    own = context.node_config.get(DATA_TRAIN)
    if own is not None:  # the server learns the node's size: it bounds the reply's num_examples
        from ...tasks.text import node_data
        from .settings import load_run_config

        answer["num-examples"] = len(node_data(load_run_config(context.run_config)[0], str(own), DATA_TRAIN).train_texts)
    return FlowerMessage(RecordDict({ROUTE: ConfigRecord(answer)}), reply_to=msg)


@app.train()
def train(msg: FlowerMessage, context: Context) -> FlowerMessage:
    from ...message import Message
    from .node import client_round
    from .records import from_records, to_records
    from .secagg import SECAGG_ROUND, secagg_reply

    if SECAGG_ROUND in msg.content:
        return secagg_reply(msg, context, _node_run(context))
    run = _node_run(context)
    down = run.downlink.decode(from_records(msg.content, Message), None)
    reply, coded, trainer = client_round(run, context, msg.content[ROUTE], down)
    metrics = MetricRecord({"num-examples": int(reply["num_examples"]),
                            "train-loss": float(reply.get("train_loss", float("nan"))),
                            "compute-seconds": float(trainer.compute_seconds)})
    return FlowerMessage(RecordDict({**to_records(coded), "metrics": metrics}), reply_to=msg)

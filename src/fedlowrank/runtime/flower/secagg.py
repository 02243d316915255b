"""Secure aggregation on Flower: Flower's own SecAgg+ (``SecAggPlusWorkflow`` on the server, ``secaggplus_mod``
on the clients) carrying fedlowrank rounds (run config ``flower.secagg = true``; ``docs/privacy.md``).

Flower 1.41 ships SecAgg+ for its legacy ``FitIns``/``FitRes`` records only, driven by a legacy ``Strategy`` in a
``LegacyContext``. :class:`SecAggRounds` is that legacy strategy, a thin adapter over :class:`MethodStrategy`:

* ``configure_fit``: the round's sampled clients and broadcasts (:meth:`MethodStrategy.start_round`); each
  broadcast travels in ``FitIns.config`` as fedlowrank's byte format (plaintext, as in a plain round, coded by the
  downlink's codec when there is one; the uplink's codecs are refused, :func:`~.settings.check_secagg`);
* client (:func:`secagg_reply`): the client round of a plain run (local DP included), then the *update* of each
  floating-point reply tensor (:mod:`fedlowrank.privacy.mechanisms`: ``reply − broadcast``, or the tensor itself)
  goes into ``FitRes.parameters`` with ``num_examples = 1``, which ``secaggplus_mod`` quantises, masks and sends;
  the reply's scalars and tensor names go in ``FitRes.metrics`` (plaintext);
* ``aggregate_fit``: the workflow has unmasked only the *mean* update Δ̄ over the clients that finished; client k's
  reply is rebuilt as ``broadcast_k + Δ̄`` (per tensor), so that the method's uniform average equals the average of
  the true replies up to SecAgg+'s quantisation; then :meth:`MethodStrategy.close_round` as in a plain round.

The round's ``flower_bytes_up`` / ``flower_bytes_down`` count every message of the protocol that round (setup, key
shares, masked vectors, unmasking; :class:`CountingGrid`), what SecAgg+ costs beside the plaintext ledger.

Only methods whose server step is a uniform sum of the replies (``"central"`` among their
``supported_privacy_modes()``) can run this way, with ``server.weighting = "uniform"``.
"""

from __future__ import annotations

import json
import time
from logging import INFO

import numpy as np
from flwr.app import ConfigRecord, Context
from flwr.app import Message as FlowerMessage
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common import log
from flwr.compat.common import recorddict_compat as compat
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.server_config import ServerConfig
from flwr.server.strategy import Strategy as LegacyStrategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.serverapp import Grid

SECAGG_ROUND = "fitins.config"  # the record a SecAgg+ round's train message carries our broadcast in


class CountingGrid:
    """``grid`` with the payload bytes (:func:`~.records.records_nbytes`) of every message it sends (``down``) and
    receives (``up``) through ``send_and_receive`` counted; the rest is ``grid``'s own."""

    def __init__(self, grid: Grid):
        self.grid, self.down, self.up = grid, 0, 0

    def __getattr__(self, name: str):
        return getattr(self.grid, name)

    def send_and_receive(self, messages, *args, **kwargs):
        from .records import records_nbytes

        messages = list(messages)
        self.down += sum(records_nbytes(m.content) for m in messages)
        replies = list(self.grid.send_and_receive(messages, *args, **kwargs))
        self.up += sum(records_nbytes(m.content) for m in replies if m.has_content())
        return replies


def secagg_reply(msg: FlowerMessage, context: Context, run) -> FlowerMessage:
    """Client side of a SecAgg+ round of ``run`` (the node's run, :func:`~.node.build_node_run`): train as in a
    plain round (:func:`~.node.client_round`), answer with the update as ``FitRes``."""
    from ...message import Message
    from ...privacy.mechanisms import update_keys, update_tensor
    from .node import client_round

    config = msg.content[SECAGG_ROUND]
    down = run.downlink.decode(Message.from_bytes(bytes(config["fedlowrank.message"])), None)
    route = json.loads(str(config["fedlowrank.route"]))
    reply, _, trainer = client_round(run, context, route, down)
    keys = update_keys(reply)
    updates = [update_tensor(reply, down, key).to("cpu").numpy() for key in keys]
    names = [[key, str(reply[key].dtype).removeprefix("torch.")] for key in keys]
    metrics = {"fedlowrank.client": int(route["client"]), "fedlowrank.keys": json.dumps(names),
               "fedlowrank.scalars": json.dumps(reply.scalars()), "compute-seconds": float(trainer.compute_seconds)}
    fitres = FitRes(status=Status(code=Code.OK, message=""), parameters=ndarrays_to_parameters(updates),
                    num_examples=1, metrics=metrics)
    return FlowerMessage(compat.fitres_to_recorddict(fitres, keep_input=False), reply_to=msg)


class SecAggRounds(LegacyStrategy):
    """The legacy strategy ``SecAggPlusWorkflow`` drives, one round at a time, over a :class:`MethodStrategy`."""

    def __init__(self, strategy, grid: CountingGrid, run_id: int):
        self.strategy = strategy
        self.grid = grid
        self.run_id = run_id
        self.downs: dict[int, object] = {}  # client -> what it decodes from its broadcast
        self.down_bytes: dict[int, int] = {}  # client -> its coded broadcast's bytes

    def configure_fit(self, server_round, parameters, client_manager):
        s = self.strategy
        self.downs, self.down_bytes, out = {}, {}, []
        self.grid.up = self.grid.down = 0  # the round's protocol traffic starts here (SecAgg+'s setup stage)
        for k, coded, down, route in s.start_round(server_round, self.grid):
            self.downs[k], self.down_bytes[k] = down, coded.nbytes()
            config = {"fedlowrank.message": coded.to_bytes(), "fedlowrank.route": json.dumps(dict(route))}
            out.append((GridClientProxy(s.nodes[k], self.grid, self.run_id), FitIns(Parameters([], ""), config)))
        return out

    def aggregate_fit(self, server_round, results, failures):
        from .strategy import reported_seconds

        s = self.strategy
        got = s.round
        for proxy, fitres in results:
            k = next((c for c, node in s.nodes.items() if node == proxy.node_id), None)
            if k not in self.downs:
                continue  # not a client of this round
            down, down_bytes = self.downs.pop(k), self.down_bytes[k]
            try:
                reply = self.rebuild(fitres, down)
                usable = got.receive(s.run.method, k, down, reply, s.size_bound(k), down_bytes=down_bytes)
            except Exception as exc:  # noqa: BLE001 - whatever a node sent, the run goes on without it
                got.reject(k, f"malformed reply ({type(exc).__name__}: {exc})", down_bytes, 0)
                continue
            if usable:
                got.compute += reported_seconds(fitres.metrics.get("compute-seconds"))
        for k in self.downs:
            got.drop(k, "no masked update (SecAgg+ dropped it)", self.down_bytes[k])
        got.extra = {"flower_bytes_up": int(self.grid.up), "flower_bytes_down": int(self.grid.down)}
        s.close_round()
        self.downs = {}
        return None, {}

    @staticmethod
    def rebuild(fitres, down):
        """Client k's reply as the method sees it: its plaintext scalars, and ``down + Δ̄`` for each of its update
        tensors (Δ̄: the unmasked mean update in ``fitres.parameters``)."""
        import torch

        from ...message import Message
        from ...privacy.mechanisms import reference

        mean = parameters_to_ndarrays(fitres.parameters)
        reply = Message(json.loads(str(fitres.metrics["fedlowrank.scalars"])))
        for (key, dtype), delta in zip(json.loads(str(fitres.metrics["fedlowrank.keys"])), mean, strict=True):
            t = torch.from_numpy(np.asarray(delta, dtype=np.float64))
            ref = reference(down, key, t.shape, getattr(torch, dtype))
            reply[key] = (t if ref is None else ref.to(torch.float64) + t).to(getattr(torch, dtype))
        return reply

    def initialize_parameters(self, client_manager):
        return None

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return None


def run_secagg(strategy, grid: Grid, context: Context, clipping_range: float, timeout: float) -> None:
    """Run every round of ``strategy``'s run with SecAgg+; a round the protocol halts (too few clients) is
    recorded as skipped."""
    from ..rounds import RoundReplies

    rounds = strategy.run.cfg.run.rounds
    grid = CountingGrid(grid)
    legacy_strategy = SecAggRounds(strategy, grid, context.run_id)
    legacy = LegacyContext(context, config=ServerConfig(num_rounds=rounds, round_timeout=timeout),
                           strategy=legacy_strategy)
    workflow = SecAggPlusWorkflow(num_shares=1.0, reconstruction_threshold=0.67, max_weight=1.0,
                                  clipping_range=clipping_range, timeout=timeout)
    for rnd in range(strategy.run.round + 1, rounds + 1):
        legacy.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: rnd})
        legacy.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(Parameters([], ""), True)
        strategy.round = strategy.outcome = None
        workflow(grid, legacy)
        if strategy.outcome is None:  # the protocol halted before aggregation
            log(INFO, "fedlowrank: round %d: SecAgg+ halted; round skipped, global state unchanged", rnd)
            if strategy.round is None:
                strategy.round, strategy.started = RoundReplies(rnd, []), time.perf_counter()
            for k in legacy_strategy.downs:
                strategy.round.drop(k, "SecAgg+ halted")
            strategy.round.extra = {"flower_bytes_up": int(grid.up), "flower_bytes_down": int(grid.down)}
            strategy.close_round()
            legacy_strategy.downs = {}
        strategy.evaluate(rnd, None)

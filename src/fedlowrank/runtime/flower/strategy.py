"""A Flower ``Strategy`` that drives any fedlowrank :class:`~fedlowrank.methods.base.Method`.

It is the Flower-side twin of :meth:`Simulation.run_round <fedlowrank.runtime.simulator.Simulation.run_round>`
and shares its building blocks (:mod:`fedlowrank.runtime.engine`) and its :class:`Simulation` object (task,
partition, method, server state, ledger, history, run directory), so that a Flower run and a simulated run
with the same config produce the same global model:

* sampling: :func:`~fedlowrank.runtime.engine.sample_clients` (the run's seeded stream, never Python's
  global ``random``); client ``k`` is the SuperNode whose ``partition-id`` is ``k``, learnt by a ``query``
  message to each node;
* broadcast: ``method.broadcast(server, k, rnd)`` for each sampled client, one ``Message`` per node, its
  records built by :func:`~fedlowrank.runtime.flower.records.to_records` (any keys, shapes and scalars);
* aggregate: the replies, sorted by client as in the simulator, go to ``method.aggregate``; a reply that
  fails :func:`~fedlowrank.runtime.engine.check_reply` is rejected, and a client whose node answers with an
  error or does not answer within ``flower.round-timeout`` is dropped, each logged with its reason and
  listed in the round's row (``rejected``, ``dropped``); the round aggregates when at least
  ``run.min_replies`` replies remain, else it is skipped, the global state kept, and the run says so;
* client state: each train message names the last round whose reply of that client was aggregated
  (``accepted``), so that its node commits the state it made then and drops one whose reply was not taken;
* evaluation: on the server, on the task's global test set (``evaluate``, passed as ``evaluate_fn``);
* ledger: ``Message.nbytes()`` of every broadcast and reply (the simulator's count), plus the bytes of the
  Flower records themselves (``flower_bytes_up``/``flower_bytes_down`` in the round's row).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.app import MessageType
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from ...message import Message, Reply, State
from ...privacy.runtime import central_replies
from ..engine import check_reply, sample_clients
from ..simulator import Simulation, peak_rss_mb
from .records import from_records, records_nbytes, to_array, to_records
from .client_app import ROUTE
from .settings import FlowerSettings


def state_arrays(state: State) -> ArrayRecord:
    """The tensors of a server state as an ``ArrayRecord`` (what ``Strategy.start`` threads through rounds)."""
    return ArrayRecord({k: to_array(t) for k, t in state.tensors().items()})


class MethodStrategy(Strategy):
    """Run the method of ``sim`` (a :class:`Simulation` built from the run's config) on Flower's grid.

    Use :meth:`connect` once, then ``start(grid, state_arrays(sim.server), num_rounds=cfg.run.rounds,
    timeout=settings.round_timeout, evaluate_fn=strategy.evaluate)``.
    """

    def __init__(self, sim: Simulation, settings: FlowerSettings):
        self.sim = sim
        sim.client_states = False  # they live on the SuperNodes; the run's checkpoints say so
        self.settings = settings
        self.nodes: dict[int, int] = {}  # client id (SuperNode partition-id) -> node id
        self._ignored: set[int] = set()  # node ids whose answer to the query was unusable
        self.node_sizes: dict[int, int] = {}  # client id -> its training examples, for nodes with their own data
        self._sent: list[tuple[FlowerMessage, int, Message, int]] = []  # (sent, client, its Message, flower bytes)
        self._row: dict[str, Any] = {}
        self.accepted: dict[int, int] = {}  # client -> last round whose reply of it was aggregated (0: none)

    @property
    def num_clients(self) -> int:
        return self.sim.cfg.partition.num_clients

    # -- nodes ---------------------------------------------------------------------------------------
    def connect(self, grid: Grid) -> None:
        """Wait up to ``flower.node-timeout`` s for a node per client and learn each node's partition."""
        deadline = time.monotonic() + self.settings.node_timeout
        self.refresh_nodes(grid)
        while len(self.nodes) < self.num_clients and time.monotonic() < deadline:
            time.sleep(1.0)
            self.refresh_nodes(grid)
        missing = sorted(set(range(self.num_clients)) - set(self.nodes))
        log(INFO if not missing else WARNING, "fedlowrank: %d of %d clients have a SuperNode%s", len(self.nodes),
            self.num_clients, f"; none for clients {missing} (they will count as dropped)" if missing else "")

    def refresh_nodes(self, grid: Grid) -> None:
        """Forget nodes that left; ask new nodes for their ``partition-id`` (a ``query`` message)."""
        ids = set(grid.get_node_ids())
        self.nodes = {k: n for k, n in self.nodes.items() if n in ids}
        new = sorted(ids - set(self.nodes.values()) - self._ignored)
        if not new:
            return
        queries = [FlowerMessage(RecordDict({ROUTE: ConfigRecord({"query": "partition-id"})}), dst_node_id=n,
                                 message_type=MessageType.QUERY) for n in new]
        replies = list(grid.send_and_receive(queries, timeout=self.settings.round_timeout))
        asked = {q.metadata.message_id: q.metadata.dst_node_id for q in queries}  # ids set by the grid
        for reply in replies:
            node = asked.get(reply.metadata.reply_to_message_id)
            if node is None:
                continue
            if reply.has_error():
                log(WARNING, "fedlowrank: node %d did not answer the partition query: %s", node, reply.error.reason)
                continue
            answer = reply.content[ROUTE]
            k, m = int(answer["partition-id"]), int(answer["num-partitions"])
            if m != self.num_clients or not 0 <= k < m or k in self.nodes:
                log(WARNING, "fedlowrank: ignoring node %d: partition-id=%d num-partitions=%d (run has %d clients%s)",
                    node, k, m, self.num_clients, ", partition taken" if k in self.nodes else "")
                self._ignored.add(node)
                continue
            self.nodes[k] = node
            if "num-examples" in answer:  # the node brings its own data (node config data-train)
                self.node_sizes[k] = int(answer["num-examples"])

    # -- training ------------------------------------------------------------------------------------
    def start_round(self, rnd: int, grid: Grid) -> list[tuple[int, Message, ConfigRecord]]:
        """Sample round ``rnd``'s clients and open its row; (client, broadcast, route) for each client with a node."""
        sim = self.sim
        self.refresh_nodes(grid)
        clients = sample_clients(sim.cfg.run.seed, rnd, self.num_clients, sim.cfg.run.clients_per_round)
        self._row = {"round": rnd, "clients": clients, "t_start": time.perf_counter()}
        out = []
        for k in clients:
            if k not in self.nodes:
                log(WARNING, "fedlowrank: round %d: client %d has no SuperNode; counted as dropped", rnd, k)
                continue
            route = ConfigRecord({"client": k, "round": rnd, "accepted": self.accepted.get(k, 0)})
            out.append((k, sim.method.broadcast(sim.server, k, rnd), route))
        return out

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[FlowerMessage]:
        rnd = server_round
        self._sent = []
        for k, msg, route in self.start_round(rnd, grid):
            content = RecordDict({**to_records(msg), ROUTE: route})
            sent = FlowerMessage(content, dst_node_id=self.nodes[k], message_type=MessageType.TRAIN)
            self._sent.append((sent, k, msg, records_nbytes(content)))
        log(INFO, "fedlowrank: round %d: sampled clients %s, sent to %d nodes", rnd, self._row["clients"],
            len(self._sent))
        return [sent for sent, *_ in self._sent]

    def aggregate_train(self, server_round: int,
                        replies: Iterable[FlowerMessage]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        sim, rnd = self.sim, server_round
        usable: list[Reply] = []
        ledger: list[dict[str, int]] = []
        dropped: dict[int, str] = {}
        rejected: list[dict[str, Any]] = []
        downs: dict[int, Message] = {}
        compute = flower_up = flower_down = 0.0
        # the grid gave each sent message its id; replies (and the SuperLink's error replies) name it
        pending = {sent.metadata.message_id: (sent.metadata.dst_node_id, k, down, fdown)
                   for sent, k, down, fdown in self._sent}
        for reply in replies:
            if reply.metadata.reply_to_message_id not in pending:
                log(WARNING, "fedlowrank: round %d: ignoring a reply to an unknown message", rnd)
                continue
            node, k, down, fdown = pending.pop(reply.metadata.reply_to_message_id)
            downs[k] = down
            flower_down += fdown
            if reply.has_error():
                dropped[k] = f"node {node} answered with an error: {reply.error.reason}"
                ledger.append({"round": rnd, "client": k, "down": down.nbytes(), "up": 0})
                continue
            msg = from_records(reply.content, Message)
            flower_up += records_nbytes(reply.content)
            if msg is None:
                msg = Message()
            ledger.append({"round": rnd, "client": k, "down": down.nbytes(), "up": msg.nbytes()})
            reason = check_reply(sim.method, down, msg, rnd, self.node_sizes.get(k, len(sim.parts[k])))
            if reason is not None:
                rejected.append({"client": k, "reason": reason})
                log(WARNING, "fedlowrank: round %d: rejected the reply of client %d: %s", rnd, k, reason)
                continue
            usable.append(Reply(k, int(msg["num_examples"]), msg))
            if "metrics" in reply.content:
                compute += float(reply.content["metrics"].get("compute-seconds", 0.0))
        for node, k, down, fdown in pending.values():
            dropped[k] = f"no reply from node {node} within flower.round-timeout = {self.settings.round_timeout:g} s"
            ledger.append({"round": rnd, "client": k, "down": down.nbytes(), "up": 0})
            flower_down += fdown
        self._sent = []
        return self.aggregate_replies(rnd, usable, downs, ledger, dropped, rejected, compute, flower_up, flower_down)

    def aggregate_replies(self, rnd: int, usable: list[Reply], downs: dict[int, Message], ledger: list[dict[str, int]],
                          dropped: dict[int, str], rejected: list[dict[str, Any]], compute: float, flower_up: float,
                          flower_down: float) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The server step of a round whose replies are in: ledger, central DP, ``method.aggregate`` (or a skipped
        round), the round's row (closed by :meth:`evaluate`). Shared by plain rounds and SecAgg+ rounds."""
        sim, cfg = self.sim, self.sim.cfg
        for k in set(self._row["clients"]) - set(dropped) - {r["client"] for r in ledger}:
            dropped[k] = "no SuperNode for this client"
        for k in sorted(dropped):
            log(WARNING, "fedlowrank: round %d: client %d dropped (%s)", rnd, k, dropped[k])
        ledger.sort(key=lambda r: r["client"])
        for row in ledger:
            sim.ledger.add(row["round"], row["client"], row["down"], row["up"])
        usable.sort(key=lambda r: r.client)  # the simulator's order: aggregation sums in this order
        sampled, aggregation = len(self._row["clients"]), 0.0
        skipped = len(usable) < cfg.run.min_replies
        if skipped:
            log(WARNING, "fedlowrank: round %d: %d usable replies of %d sampled clients, fewer than "
                "run.min_replies = %d: round skipped, global state unchanged", rnd, len(usable), sampled,
                cfg.run.min_replies)
        else:
            t_agg = time.perf_counter()
            usable, privacy = central_replies(cfg, usable, downs, rnd, sim.history)
            if privacy:
                self._row["privacy"] = privacy
            sim.server = sim.method.aggregate(sim.server, usable, rnd)
            aggregation = time.perf_counter() - t_agg
            self.accepted.update({r.client: rnd for r in usable})  # their nodes commit this round's state
            if len(usable) < sampled:
                log(WARNING, "fedlowrank: round %d: %d usable replies of %d sampled clients; run.min_replies = %d "
                    "is met, aggregated them", rnd, len(usable), sampled, cfg.run.min_replies)
        diagnostics = sim.method.pop_metrics()
        losses = [float(r.message["train_loss"]) for r in usable]
        self._row.update({
            "replied": [r.client for r in usable], "train_loss": float(np.mean(losses)) if losses else float("nan"),
            "bytes_up": sum(r["up"] for r in ledger), "bytes_down": sum(r["down"] for r in ledger),
            "cum_bytes_up": sim.ledger.total_up, "cum_bytes_down": sim.ledger.total_down,
            "flower_bytes_up": int(flower_up), "flower_bytes_down": int(flower_down),
            "time": {"client_compute": compute, "aggregation": aggregation}, "ledger": ledger, "replies": usable,
        })
        if dropped:
            self._row["dropped"] = sorted(dropped)
        if rejected:
            self._row["rejected"] = rejected
        if skipped:
            self._row["skipped"] = True
        if diagnostics:
            self._row["diagnostics"] = diagnostics
        metrics = MetricRecord({"replied": len(usable), "dropped": len(dropped), "rejected": len(rejected)})
        if losses:
            metrics["train-loss"] = self._row["train_loss"]
        return (None if skipped else state_arrays(sim.server)), metrics

    # -- evaluation ----------------------------------------------------------------------------------
    def evaluate(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """``evaluate_fn`` of ``Strategy.start``: closes the round's row (global test set every
        ``run.eval_every`` rounds and at the last), writes it to the run directory."""
        sim, rnd = self.sim, server_round
        if rnd == 0:
            return None
        metrics: dict[str, float] = {}
        evaluation = 0.0
        if rnd % sim.cfg.run.eval_every == 0 or rnd == sim.cfg.run.rounds:
            t_eval = time.perf_counter()
            metrics = sim.evaluate()
            sim.last_eval = metrics
            evaluation = time.perf_counter() - t_eval
        row = self._row
        ledger, usable = row.pop("ledger"), row.pop("replies")
        total = time.perf_counter() - row.pop("t_start")
        t = row["time"]
        row.update(metrics)
        t.update({"evaluation": evaluation, "other": total - t["client_compute"] - t["aggregation"] - evaluation,
                  "total": total})
        row["peak_rss_mb"] = peak_rss_mb()
        sim.record_round(row, ledger, usable)
        sim.progress.round_end(row, metrics)
        return MetricRecord(metrics) if metrics else None

    # -- no client-side evaluation: the global test set is evaluated on the server ----------------------
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[FlowerMessage]:
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[FlowerMessage]) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        cfg = self.sim.cfg
        log(INFO, "\t├── fedlowrank method: %s %s", cfg.method_name, cfg.method_options or "")
        log(INFO, "\t├── clients: %d, %d per round (run.seed = %d), run.min_replies = %d", cfg.partition.num_clients,
            cfg.run.clients_per_round, cfg.run.seed, cfg.run.min_replies)
        log(INFO, "\t└── round timeout: %g s", self.settings.round_timeout)

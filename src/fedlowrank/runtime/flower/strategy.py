"""A Flower ``Strategy`` that drives any fedlowrank :class:`~fedlowrank.methods.base.Method`.

It is the Flower-side twin of :meth:`Simulation.run_round <fedlowrank.runtime.simulator.Simulation.run_round>`:
it drives a :class:`~fedlowrank.runtime.server_run.ServerRun` (task, partition, method, server state, ledger,
history, run directory, evaluation, checkpoints), shares the client-side building blocks
(:mod:`fedlowrank.runtime.engine`) and closes each round with the simulator's own server step
(:func:`fedlowrank.runtime.rounds.close_round`), so that a Flower run and a simulated run with the same config
produce the same global model:

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

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.app import MessageType
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from ...message import Message, State
from ..engine import sample_clients
from ..rounds import RoundOutcome, RoundReplies
from ..server_run import ServerRun
from .node import ROUTE
from .records import from_records, records_nbytes, to_array, to_records
from .settings import FlowerSettings


def state_arrays(state: State) -> ArrayRecord:
    """The tensors of a server state as an ``ArrayRecord`` (what ``Strategy.start`` threads through rounds)."""
    return ArrayRecord({k: to_array(t) for k, t in state.tensors().items()})


def warn(line: str) -> None:
    """A warning of the run in the ServerApp's log (Flower's logger)."""
    log(WARNING, "fedlowrank: %s", line)


class MethodStrategy(Strategy):
    """Run the method of ``run`` (a :class:`ServerRun` of the run's config, e.g. built by the ServerApp) on
    Flower's grid.

    Use :meth:`connect` once, then ``start(grid, state_arrays(run.server), num_rounds=cfg.run.rounds,
    timeout=settings.round_timeout, evaluate_fn=strategy.evaluate)``.
    """

    def __init__(self, run: ServerRun, settings: FlowerSettings):
        self.run = run
        run.client_states = False  # they live on the SuperNodes; the run's checkpoints say so
        self.settings = settings
        self.nodes: dict[int, int] = {}  # client id (SuperNode partition-id) -> node id
        self._ignored: set[int] = set()  # node ids whose answer to the query was unusable
        self.node_sizes: dict[int, int] = {}  # client id -> its training examples, for nodes with their own data
        self._sent: list[tuple[FlowerMessage, int, Message, int]] = []  # (sent, client, its Message, flower bytes)
        self.round: RoundReplies | None = None  # the round in progress
        self.started = 0.0  # when it started (time.perf_counter)
        self.outcome: RoundOutcome | None = None  # the round closed, waiting for its evaluation
        self.accepted: dict[int, int] = {}  # client -> last round whose reply of it was aggregated (0: none)

    @property
    def num_clients(self) -> int:
        return self.run.cfg.partition.num_clients

    def size_bound(self, client: int) -> int:
        """The most examples ``client``'s reply may claim: its node's own data, or its partition."""
        return self.node_sizes.get(client, len(self.run.parts[client]))

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
        """Sample round ``rnd``'s clients and open it; (client, broadcast, route) for each client with a node."""
        run = self.run
        self.refresh_nodes(grid)
        clients = sample_clients(run.cfg.run.seed, rnd, self.num_clients, run.cfg.run.clients_per_round)
        self.round, self.started, self.outcome = RoundReplies(rnd, clients), time.perf_counter(), None
        out = []
        for k in clients:
            if k not in self.nodes:
                self.round.drop(k, "no SuperNode for this client")
                continue
            route = ConfigRecord({"client": k, "round": rnd, "accepted": self.accepted.get(k, 0)})
            out.append((k, run.method.broadcast(run.server, k, rnd), route))
        return out

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[FlowerMessage]:
        rnd = server_round
        self._sent = []
        for k, msg, route in self.start_round(rnd, grid):
            content = RecordDict({**to_records(msg), ROUTE: route})
            sent = FlowerMessage(content, dst_node_id=self.nodes[k], message_type=MessageType.TRAIN)
            self._sent.append((sent, k, msg, records_nbytes(content)))
        log(INFO, "fedlowrank: round %d: sampled clients %s, sent to %d nodes", rnd, self.round.clients,
            len(self._sent))
        return [sent for sent, *_ in self._sent]

    def aggregate_train(self, server_round: int,
                        replies: Iterable[FlowerMessage]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        got, rnd = self.round, server_round
        flower_up = flower_down = 0
        # the grid gave each sent message its id; replies (and the SuperLink's error replies) name it
        pending = {sent.metadata.message_id: (sent.metadata.dst_node_id, k, down, fdown)
                   for sent, k, down, fdown in self._sent}
        for reply in replies:
            if reply.metadata.reply_to_message_id not in pending:
                log(WARNING, "fedlowrank: round %d: ignoring a reply to an unknown message", rnd)
                continue
            node, k, down, fdown = pending.pop(reply.metadata.reply_to_message_id)
            flower_down += fdown
            if reply.has_error():
                got.drop(k, f"node {node} answered with an error: {reply.error.reason}", down.nbytes())
                continue
            msg = from_records(reply.content, Message)
            flower_up += records_nbytes(reply.content)
            if msg is None:
                msg = Message()
            if got.receive(self.run.method, k, down, msg, self.size_bound(k)) and "metrics" in reply.content:
                got.compute += float(reply.content["metrics"].get("compute-seconds", 0.0))
        for node, k, down, fdown in pending.values():
            got.drop(k, f"no reply from node {node} within flower.round-timeout = {self.settings.round_timeout:g} s",
                     down.nbytes())
            flower_down += fdown
        self._sent = []
        got.extra = {"flower_bytes_up": int(flower_up), "flower_bytes_down": int(flower_down)}
        return self.close_round()

    def close_round(self) -> tuple[ArrayRecord | None, MetricRecord]:
        """The server step of the round whose replies are in (:meth:`ServerRun.close_round`), for plain and SecAgg+
        rounds; :meth:`evaluate` commits it."""
        got = self.round
        self.outcome = outcome = self.run.close_round(got, self.started, warn)
        metrics = MetricRecord({"replied": len(outcome.replies), "dropped": len(got.dropped),
                                "rejected": len(got.rejected)})
        if outcome.replies:
            metrics["train-loss"] = outcome.row["train_loss"]
        return (None if outcome.skipped else state_arrays(outcome.server)), metrics

    # -- evaluation ----------------------------------------------------------------------------------
    def evaluate(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """``evaluate_fn`` of ``Strategy.start``: evaluates the closed round (global test set every
        ``run.eval_every`` rounds and at the last) and commits it to the run (history, run directory)."""
        if server_round == 0 or self.outcome is None:
            return None
        outcome, self.outcome = self.outcome, None
        metrics, evaluation = self.run.evaluate_round(outcome)
        self.run.commit_round(outcome, metrics, evaluation)
        self.accepted.update({r.client: outcome.row["round"] for r in outcome.replies})  # their nodes commit
        return MetricRecord(metrics) if metrics else None

    # -- no client-side evaluation: the global test set is evaluated on the server ----------------------
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[FlowerMessage]:
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[FlowerMessage]) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        cfg = self.run.cfg
        log(INFO, "\t├── fedlowrank method: %s %s", cfg.method_name, cfg.method_options or "")
        log(INFO, "\t├── clients: %d, %d per round (run.seed = %d), run.min_replies = %d", cfg.partition.num_clients,
            cfg.run.clients_per_round, cfg.run.seed, cfg.run.min_replies)
        log(INFO, "\t└── round timeout: %g s", self.settings.round_timeout)

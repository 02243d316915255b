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
* broadcast: ``method.broadcast(server, k, rnd)`` for each sampled client, coded by the run's downlink
  (:func:`~fedlowrank.runtime.engine.send_down`), one ``Message`` per node, its records built by
  :func:`~fedlowrank.runtime.flower.records.to_records` (any keys, shapes and scalars); a reply is decoded by the
  uplink's codec in :meth:`~fedlowrank.runtime.rounds.RoundReplies.receive`, before any check;
* aggregate: the replies, sorted by client as in the simulator, go to ``method.aggregate``; a reply that
  fails :func:`~fedlowrank.runtime.engine.check_reply`, is larger than the method can send
  (``method.max_reply_bytes``, checked before anything is decoded) or cannot be decoded at all is rejected, and a
  client whose node answers with an error or does not answer within ``flower.round-timeout`` is dropped, each
  logged with its reason, listed in the round's row (``rejected``, ``dropped``) and counted in the round's
  ``MetricRecord``; the round aggregates when at least ``run.min_replies`` replies remain, else it is skipped,
  the global state kept, and the run says so. Nothing a node sends can end the run;
* weights: a reply's ``num_examples`` is bounded by what the server can check, the client's partition of the
  run's data; a node with its own data declares its size in its answer to the query, which bounds its replies,
  and weighs at most ``server.max_examples_per_node`` examples (``server.weighting = "uniform"`` ignores sizes);
* client state: each train message names the last round whose reply of that client was aggregated
  (``accepted``), so that its node commits the state it made then and drops one whose reply was not taken;
* evaluation: on the server, on the task's global test set (``evaluate``, passed as ``evaluate_fn``);
* ledger: ``Message.nbytes()`` of every coded broadcast and reply (the simulator's count), plus the bytes of the
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
from ..engine import sample_clients, send_down
from ..evaluation import scalar_metrics
from ..rounds import RoundOutcome, RoundReplies
from ..server_run import ServerRun
from .node import ROUTE
from .records import from_records, records_nbytes, to_array, to_records
from .settings import FlowerSettings


class MalformedReply(ValueError):
    """A node's reply that cannot be taken in (too large, undecodable); the message is the reason."""


def decode_reply(content: RecordDict, size: int, limit: int) -> Message:
    """The fedlowrank message in a reply's ``content`` of ``size`` payload bytes (:func:`~.records.records_nbytes`),
    which may be at most ``limit``: checked before anything is decoded. Raises :class:`MalformedReply` with the
    reason for anything else: too large, records or bytes that do not decode (whatever Flower's record layer or our
    decoder raises). A reply without a message decodes to an empty one (which :func:`~..engine.check_reply`
    rejects)."""
    if size > limit:
        raise MalformedReply(f"reply of {size} bytes exceeds the method's bound of {limit} bytes (not decoded)")
    try:
        msg = from_records(content, Message)
    except Exception as exc:  # noqa: BLE001 - e.g. invalid JSON, a bf16 array of the wrong size, garbage .npy bytes
        raise MalformedReply(f"undecodable reply ({type(exc).__name__}: {exc})") from None
    return Message() if msg is None else msg


def _count(value) -> int | None:
    """``value`` if it is an integer (not a bool), else ``None``."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def reported_seconds(value) -> float:
    """A duration a node reports: ``value`` if it is a finite number >= 0, else 0."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf")
    return float(value) if ok else 0.0


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
        if run.method.pooled:
            raise ValueError(f"method.name = {run.method.name!r} trains on the pooled data of each round's clients "
                             f"(a centralised reference); on Flower each client's data stays on its node: run it "
                             f"with `fedlowrank run` or `fedlowrank compare`")
        if run.calibration is not None:
            raise ValueError("task.options.ccvr_samples: CCVR's class statistics are computed where the clients' data "
                             "are, and Flower's nodes do not send them; set it to 0, or run it with `fedlowrank run` "
                             "(run.devices for several processes)")
        self.run = run
        run.client_states = False  # they live on the SuperNodes; the run's checkpoints say so
        self.settings = settings
        self.nodes: dict[int, int] = {}  # client id (SuperNode partition-id) -> node id
        self._ignored: set[int] = set()  # node ids whose answer to the query was unusable
        self.node_sizes: dict[int, int] = {}  # client id -> its declared training examples (nodes with own data)
        # (sent, client, the Message it decodes, its coded bytes, flower bytes)
        self._sent: list[tuple[FlowerMessage, int, Message, int, int]] = []
        self.round: RoundReplies | None = None  # the round in progress
        self.started = 0.0  # when it started (time.perf_counter)
        self.outcome: RoundOutcome | None = None  # the round closed, waiting for its evaluation
        self.accepted: dict[int, int] = {}  # client -> last round whose reply of it was aggregated (0: none)

    @property
    def num_clients(self) -> int:
        return self.run.cfg.partition.num_clients

    def size_bound(self, client: int) -> int:
        """The most examples ``client``'s reply may claim: what its node declared (own data), or its partition."""
        return self.node_sizes.get(client, len(self.run.parts[client]))

    def weight_cap(self, client: int) -> int | None:
        """The most examples ``client``'s reply may weigh: for a node with its own data (which the server cannot
        check) ``server.max_examples_per_node`` (0: the largest client of the run's partition); ``None`` for a
        partition of the run's data (its size is the server's)."""
        if client not in self.node_sizes:
            return None
        return self.run.cfg.server.max_examples_per_node or max(len(p) for p in self.run.parts)

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
            try:
                k, size = self.read_answer(reply.content)
            except MalformedReply as exc:
                log(WARNING, "fedlowrank: ignoring node %d: %s", node, exc)
                self._ignored.add(node)
                continue
            self.nodes[k] = node
            if size is not None:  # the node brings its own data (node config data-train)
                self.node_sizes[k] = size
                cap = self.weight_cap(k)
                if size > cap:
                    log(WARNING, "fedlowrank: node %d (client %d) declares %d examples of its own; its replies weigh at "
                        "most %d (server.max_examples_per_node)", node, k, size, cap)

    def read_answer(self, content: RecordDict) -> tuple[int, int | None]:
        """``(client, declared size or None)`` of a node's answer to the partition query; :class:`MalformedReply`
        saying why it is unusable (not an answer, a partition-id or num-partitions that is missing, not an integer,
        of another run or taken, a num-examples that is not a positive integer)."""
        try:
            answer = dict(content[ROUTE])
        except Exception:  # noqa: BLE001 - whatever a node sent instead of an answer
            raise MalformedReply(f"its answer to the partition query has no {ROUTE!r} config record") from None
        k, m = _count(answer.get("partition-id")), _count(answer.get("num-partitions"))
        if k is None or m is None:
            raise MalformedReply(f"partition-id and num-partitions must be integers, got partition-id = "
                                 f"{answer.get('partition-id')!r}, num-partitions = {answer.get('num-partitions')!r}")
        if m != self.num_clients or not 0 <= k < m or k in self.nodes:
            raise MalformedReply(f"partition-id={k} num-partitions={m} (run has {self.num_clients} clients"
                                 f"{', partition taken' if k in self.nodes else ''})")
        if "num-examples" not in answer:
            return k, None
        size = _count(answer["num-examples"])
        if size is None or size < 1:
            raise MalformedReply(f"num-examples must be a positive integer, got {answer['num-examples']!r}")
        return k, size

    # -- training ------------------------------------------------------------------------------------
    def start_round(self, rnd: int, grid: Grid) -> list[tuple[int, Message, Message, ConfigRecord]]:
        """Sample round ``rnd``'s clients and open it; (client, coded broadcast, what the client decodes from it,
        route) for each client with a node (:func:`~fedlowrank.runtime.engine.send_down`)."""
        run = self.run
        self.refresh_nodes(grid)
        clients = sample_clients(run.cfg.run.seed, rnd, self.num_clients, run.cfg.run.clients_per_round)
        self.round = RoundReplies(rnd, clients, uplink=run.state.uplink, downlink=run.state.downlink)
        self.started, self.outcome = time.perf_counter(), None
        out = []
        for k in clients:
            if k not in self.nodes:
                self.round.drop(k, "no SuperNode for this client")
                continue
            route = ConfigRecord({"client": k, "round": rnd, "accepted": self.accepted.get(k, 0)})
            coded, down = send_down(run.state.downlink, run.method.broadcast(run.server, k, rnd), k, rnd)
            out.append((k, coded, down, route))
        return out

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[FlowerMessage]:
        rnd = server_round
        self._sent = []
        for k, coded, down, route in self.start_round(rnd, grid):
            content = RecordDict({**to_records(coded), ROUTE: route})
            sent = FlowerMessage(content, dst_node_id=self.nodes[k], message_type=MessageType.TRAIN)
            self._sent.append((sent, k, down, coded.nbytes(), records_nbytes(content)))
        log(INFO, "fedlowrank: round %d: sampled clients %s, sent to %d nodes", rnd, self.round.clients,
            len(self._sent))
        return [sent for sent, *_ in self._sent]

    def aggregate_train(self, server_round: int,
                        replies: Iterable[FlowerMessage]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        got, rnd = self.round, server_round
        flower_up = flower_down = 0
        # the grid gave each sent message its id; replies (and the SuperLink's error replies) name it
        pending = {sent.metadata.message_id: (sent.metadata.dst_node_id, k, down, down_bytes, fdown)
                   for sent, k, down, down_bytes, fdown in self._sent}
        for reply in replies:
            if reply.metadata.reply_to_message_id not in pending:
                log(WARNING, "fedlowrank: round %d: ignoring a reply to an unknown message", rnd)
                continue
            node, k, down, down_bytes, fdown = pending.pop(reply.metadata.reply_to_message_id)
            flower_down += fdown
            if reply.has_error():
                got.drop(k, f"node {node} answered with an error: {reply.error.reason}", down_bytes)
                continue
            flower_up += self.take_reply(got, k, down, reply.content, down_bytes)
        for node, k, down, down_bytes, fdown in pending.values():
            got.drop(k, f"no reply from node {node} within flower.round-timeout = {self.settings.round_timeout:g} s",
                     down_bytes)
            flower_down += fdown
        self._sent = []
        got.extra = {"flower_bytes_up": int(flower_up), "flower_bytes_down": int(flower_down)}
        return self.close_round()

    def take_reply(self, got: RoundReplies, client: int, down: Message, content: RecordDict,
                   down_bytes: int | None = None) -> int:
        """Decode ``client``'s reply ``content`` to ``down`` (sent in ``down_bytes``, default ``down.nbytes()``) into
        ``got``: usable, or rejected with the reason (:func:`decode_reply`, :meth:`RoundReplies.receive`); never
        raises. Returns its payload bytes."""
        down_bytes = down.nbytes() if down_bytes is None else down_bytes
        try:
            size = records_nbytes(content)
        except Exception as exc:  # noqa: BLE001 - any malformed record is the node's fault, never the server's
            got.reject(client, f"unreadable records ({type(exc).__name__}: {exc})", down_bytes, 0)
            return 0
        try:
            msg = decode_reply(content, size, self.run.method.max_reply_bytes(down))
            usable = got.receive(self.run.method, client, down, msg, self.size_bound(client), cap=self.weight_cap(client),
                                 down_bytes=down_bytes)
        except Exception as exc:  # noqa: BLE001 - whatever a node sent, the run goes on without it
            reason = str(exc) if isinstance(exc, MalformedReply) else f"malformed reply ({type(exc).__name__}: {exc})"
            got.reject(client, reason, down_bytes, size)
            return size
        if usable:
            got.compute += reported_seconds(content.get("metrics", MetricRecord()).get("compute-seconds"))
        return size

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
        if server_round == 0 and self.run.round == 0 and not self.run.initial_eval:
            self.run.evaluate_initial()  # the model before training: the summary's ``initial``
        if server_round == 0 or self.outcome is None:
            return None
        outcome, self.outcome = self.outcome, None
        metrics, evaluation = self.run.evaluate_round(outcome)
        self.run.commit_round(outcome, metrics, evaluation)
        self.accepted.update({r.client: outcome.row["round"] for r in outcome.replies})  # their nodes commit
        return MetricRecord(scalar_metrics(metrics)) if metrics else None

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

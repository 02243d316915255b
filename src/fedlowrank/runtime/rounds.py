"""The server's half of a round, the same for every runtime.

A runtime (the simulator, or the Flower strategy) sends the round's broadcasts and collects what comes back into
a :class:`RoundReplies`: for each sampled client, the bytes it was sent and sent back (the ledger: the coded
messages' bytes, :mod:`fedlowrank.codecs`), and whether its reply is usable (:meth:`RoundReplies.receive` decodes it
with the uplink's codec and runs :func:`~.engine.check_reply` on what it decodes to), rejected (with the reason) or
missing (dropped, with the reason). :func:`close_round` then does the rest, identically for both:

1. rejects the replies whose update is an outlier (:func:`.robust.outlying_replies`, ``server.outlier_ratio``:
   measured against the round's other replies, or for a lone reply against the earlier rounds' or what it was
   sent) and, with a robust aggregate or central DP, those whose tensors differ in shape from the
   round's others (:func:`.robust.matching_replies`); logs each dropped client and each rejected reply with its reason;
2. skips the round when fewer than ``run.min_replies`` replies are usable (the global state is not touched);
3. otherwise transforms the replies on the server (:func:`.robust.server_replies`: ``server.update_clip``,
   ``server.aggregate``, central DP) and runs ``method.aggregate`` on them, sorted by client (sums in the same
   order everywhere);
4. opens the round's metrics row (see :mod:`.simulator` for its keys; with a codec, ``codec``: each direction's, and
   ``time.codec``: the seconds spent coding and decoding in this process, a part of ``time.other``); the ledger rows of a method that declares that it does
   not communicate (``method.communicates``, a reference) count zero bytes; the first time a codec leaves tensors
   exact because the method declares them so, one line says which.

It changes nothing of the run: the :class:`RoundOutcome` (new server state, row, ledger rows, aggregated replies)
is committed by :meth:`~.server_run.ServerRun.commit_round` once the round is evaluated.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..codecs import CodecError, Link
from ..execution.measure import phased
from ..message import Message, Reply, State
from .engine import check_reply, sample_clients
from .robust import (earlier_update_norm, matching_replies, needs_matching, outlier_ratio, outlying_replies,
                     server_replies)
from .run import Run

Warn = Callable[[str], None]


@dataclass
class RoundReplies:
    """What came back in round ``round`` from its sampled ``clients``.

    Attributes:
        usable: the replies that passed :func:`~.engine.check_reply`.
        downs: what each client that replied was sent (central DP measures updates from it).
        ledger: one row per client that was sent its broadcast: ``{"round", "client", "down", "up"}`` bytes.
        dropped: client -> why it did not reply; rejected: ``{"client", "reason"}`` of each rejected reply.
        compute: seconds of local training reported for the usable replies.
        extra: runtime-specific entries of the round's row (Flower's ``flower_bytes_up``/``_down``).
        uplink, downlink: the run's codecs (``None``: none); replies are decoded with ``uplink``, and a method's own
            protocol messages counted at their coded sizes.
    """

    round: int
    clients: list[int]
    usable: list[Reply] = field(default_factory=list)
    downs: dict[int, Message] = field(default_factory=dict)
    ledger: list[dict[str, int]] = field(default_factory=list)
    dropped: dict[int, str] = field(default_factory=dict)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    compute: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    uplink: Link | None = None
    downlink: Link | None = None

    def __post_init__(self) -> None:
        self.codec_seconds = self.coding_seconds()  # what the links had spent before the round

    def coding_seconds(self) -> float:
        """Seconds the run's codecs have spent coding and decoding in this process so far."""
        return sum(link.seconds for link in (self.uplink, self.downlink) if link is not None)

    def drop(self, client: int, reason: str, down_bytes: int | None = None) -> None:
        """``client`` sent nothing back; ``down_bytes``: what it was sent (``None``: nothing was sent)."""
        self.dropped[client] = reason
        if down_bytes is not None:
            self.ledger.append({"round": self.round, "client": client, "down": down_bytes, "up": 0})

    def reject(self, client: int, reason: str, down_bytes: int, up_bytes: int) -> None:
        """``client``'s reply of ``up_bytes`` bytes is unusable, for ``reason``."""
        self.ledger.append({"round": self.round, "client": client, "down": down_bytes, "up": up_bytes})
        self.rejected.append({"client": client, "reason": reason})

    @phased("receive")
    def receive(self, method, client: int, down: Message, reply: Message, bound: int | None,
                up_bytes: int | None = None, cap: int | None = None, down_bytes: int | None = None) -> bool:
        """Take ``client``'s ``reply`` (as received, coded by :attr:`uplink`) to ``down`` (what the client decoded
        from its broadcast): usable if it decodes and :func:`~.engine.check_reply` finds nothing wrong with what it
        decodes to (``bound``: the most examples it may claim), else rejected. ``up_bytes``: what the ledger counts
        (default ``reply.nbytes()``), ``down_bytes``: the broadcast's (default ``down.nbytes()``); ``cap``: the most
        examples it weighs in aggregation (``None``: its ``num_examples``). A usable reply's ledger row counts the
        method's own protocol when it declares one (:meth:`~fedlowrank.methods.base.Method.protocol_messages`), at
        the lossy stages' coded sizes. Returns whether it is usable."""
        up = reply.nbytes() if up_bytes is None else up_bytes
        down_bytes = down.nbytes() if down_bytes is None else down_bytes
        if self.uplink is not None:
            try:
                reply = self.uplink.decode(reply, down, method.max_reply_bytes(down))
            except CodecError as exc:
                self.reject(client, f"the coded reply does not decode: {exc}", down_bytes, up)
                return False
        reason = check_reply(method, down, reply, self.round, bound)
        if reason is not None:
            self.reject(client, reason, down_bytes, up)
            return False
        protocol = method.protocol_messages(down, reply)
        if protocol is not None:
            sizes = [(self.downlink, None), (self.uplink, down)]
            down_bytes, up = (sum(m.nbytes() if link is None else link.coded_size(m, ref) for m in messages)
                              for messages, (link, ref) in zip(protocol, sizes))
        self.ledger.append({"round": self.round, "client": client, "down": down_bytes, "up": up})
        self.downs[client] = down
        n = int(reply["num_examples"])
        self.usable.append(Reply(client, n if cap is None else min(n, cap), reply))
        return True


@dataclass
class RoundOutcome:
    """A closed round, not yet committed: ``server`` the new server state (``None``: the round was skipped),
    ``row`` its metrics row (without evaluation and total time), ``ledger`` its ledger rows (by client),
    ``replies`` the aggregated replies (by client), ``started`` when the round began (``time.perf_counter``)."""

    server: State | None
    row: dict[str, Any]
    ledger: list[dict[str, int]]
    replies: list[Reply]
    started: float

    @property
    def skipped(self) -> bool:
        return self.server is None


@phased("close_round")
def close_round(run: Run, got: RoundReplies, started: float, warn: Warn | None = None) -> RoundOutcome:
    """Close round ``got.round`` of ``run`` on the server (see the module docstring); ``warn`` gets a line per
    dropped client, rejected reply and short round. ``run`` itself is not changed."""
    cfg, rnd = run.cfg, got.round
    say = warn or (lambda line: None)
    replies = sorted(got.usable, key=lambda r: r.client)
    rejected = list(got.rejected)
    ratio = outlier_ratio(cfg)
    kept_norm = None
    if math.isfinite(ratio):
        replies, outliers, kept_norm = outlying_replies(replies, got.downs, ratio, cfg.train,
                                                        earlier_update_norm(run.history), run.method.init_client)
        rejected += outliers
    if needs_matching(cfg):
        replies, mismatched = matching_replies(replies)
        rejected += mismatched
    rejected.sort(key=lambda r: r["client"])
    for k in sorted(got.dropped):
        say(f"round {rnd}: client {k} dropped ({got.dropped[k]})")
    for r in rejected:
        say(f"round {rnd}: rejected the reply of client {r['client']}: {r['reason']}")
    ledger = sorted(got.ledger, key=lambda r: r["client"])
    if not run.method.communicates:  # a reference that trains where the data is: nothing crosses a network
        ledger = [{**r, "down": 0, "up": 0} for r in ledger]
    sampled, server, aggregation = len(got.clients), None, 0.0
    notes: dict[str, Any] = {}
    if len(replies) < cfg.run.min_replies:
        say(f"round {rnd}: {len(replies)} usable replies of {sampled} sampled clients, fewer than run.min_replies = "
            f"{cfg.run.min_replies}: round skipped, global state unchanged")
    else:
        t_agg = time.perf_counter()
        replies, notes = server_replies(cfg, replies, got.downs, rnd, run.history)
        server = run.method.aggregate(run.server, replies, rnd)
        aggregation = time.perf_counter() - t_agg
        if len(replies) < sampled:
            say(f"round {rnd}: {len(replies)} usable replies of {sampled} sampled clients; run.min_replies = "
                f"{cfg.run.min_replies} is met, aggregated them")
    diagnostics = run.method.pop_metrics()
    losses = [float(r.message["train_loss"]) for r in replies]
    up, down = sum(r["up"] for r in ledger), sum(r["down"] for r in ledger)
    row: dict[str, Any] = {
        "round": rnd, "clients": list(got.clients), "replied": [r.client for r in replies],
        "train_loss": float(np.mean(losses)) if losses else float("nan"), "bytes_up": up, "bytes_down": down,
        "cum_bytes_up": run.ledger.total_up + up, "cum_bytes_down": run.ledger.total_down + down, **got.extra,
        "time": {"client_compute": got.compute, "aggregation": aggregation},
    }
    if run.method.pooled:  # the one pooled client held the data of the round's sampled clients (engine.pool)
        row["pooled"] = sorted(sample_clients(cfg.run.seed, rnd, cfg.partition.num_clients, cfg.run.clients_per_round))
    if got.dropped:
        row["dropped"] = sorted(got.dropped)
    if rejected:
        row["rejected"] = rejected
    if server is None:
        row["skipped"] = True
    elif kept_norm is not None:  # what a later round's lone reply is measured against
        row["update_norm"] = kept_norm
    if diagnostics:
        row["diagnostics"] = diagnostics
    row.update(notes)
    links = [link for link in (got.uplink, got.downlink) if link is not None]
    if any(link.active for link in links):
        row["codec"] = {link.direction: link.describe() for link in links}
        row["time"]["codec"] = got.coding_seconds() - got.codec_seconds
    for link in links:
        line = link.exact_line()
        if line:
            say(f"round {rnd}: {line}")
    return RoundOutcome(server, row, ledger, replies, started)


def client_rows(ledger: list[dict[str, int]], replies: list[Reply],
                tests: dict[int, dict[str, float]]) -> list[dict[str, Any]]:
    """The round's ``per_client`` entries, sorted by client: one per ledger row of its training exchange (train loss
    and examples of its used reply, ``None`` when it was dropped or rejected; bytes up and down), with ``"test"``
    metrics for the clients in ``tests`` (a personalised method's own models; an evaluated client that was not
    sampled gets an entry with zero bytes)."""
    used = {r.client: r for r in replies}
    rows: dict[int, dict[str, Any]] = {}
    for lr in (r for r in ledger if "phase" not in r):  # the round's training exchange only
        reply = used.get(lr["client"])
        rows[lr["client"]] = {
            "client": lr["client"], "train_loss": float(reply.message["train_loss"]) if reply else None,
            "num_examples": reply.num_examples if reply else None, "bytes_up": lr["up"], "bytes_down": lr["down"]}
    for k, test in tests.items():
        rows.setdefault(k, {"client": k, "train_loss": None, "num_examples": None, "bytes_up": 0,
                            "bytes_down": 0})["test"] = test
    return [rows[k] for k in sorted(rows)]

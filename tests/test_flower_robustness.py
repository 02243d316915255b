"""Nothing a Flower node sends can crash the server run or capture the global model.

Malformed replies (invalid JSON scalars, bf16 arrays of the wrong size, garbage array bytes, oversized replies) and
malformed answers to the partition query are rejected or ignored with a reason while the run goes on; a node's
declared data size weighs at most ``server.max_examples_per_node``; ``server.update_clip`` and ``server.aggregate``
bound what one bad update does, identically in the simulator and on Flower. The strategy is driven in process with
``test_flower``'s loop-back grid; a hypothesis fuzz checks reply decoding and query answers.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("flwr")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from flwr.app import Array, ConfigRecord, MetricRecord, RecordDict  # noqa: E402
from helpers import tiny_config, tiny_task  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_flower import (TINY_LABELS, LoopGrid, assert_same_state, flower_process, node_files,  # noqa: E402,F401
                         run_flower)  # flower_process: this process plays SuperLink and SuperNodes (autouse)

from fedlowrank.config import ConfigError, load_config  # noqa: E402
from fedlowrank.message import Message  # noqa: E402
from fedlowrank.runtime.engine import client_update, sample_clients, wire  # noqa: E402
from fedlowrank.runtime.flower.node import ROUTE  # noqa: E402
from fedlowrank.runtime.flower.records import to_records  # noqa: E402
from fedlowrank.runtime.flower.settings import load_run_config  # noqa: E402
from fedlowrank.runtime.flower.strategy import MalformedReply, MethodStrategy, state_arrays  # noqa: E402
from fedlowrank.runtime.robust import coordinate_aggregate  # noqa: E402
from fedlowrank.runtime.rounds import RoundReplies  # noqa: E402
from fedlowrank.runtime.run import build_run  # noqa: E402
from fedlowrank.runtime.server_run import ServerRun  # noqa: E402
from fedlowrank.runtime.simulator import Simulation  # noqa: E402


def victim(*sets: str, rnd: int = 1, index: int = 0) -> int:
    cfg = tiny_config(*sets)
    return sample_clients(cfg.run.seed, rnd, cfg.partition.num_clients, cfg.run.clients_per_round)[index]


def lora_b(content: RecordDict) -> str:
    return next(k for k in content["arrays"] if k.endswith("lora_B"))


# -- malformed replies: rejected with a reason, the run goes on ----------------------------------------
def _bad_json(content):
    content["scalars.json"] = ConfigRecord({"note": "{not json"})


def _bf16_wrong_size(content):
    content["arrays"][lora_b(content)] = Array(dtype="bfloat16", shape=(4, 2), stype="torch.bfloat16", data=b"\x00" * 7)


def _garbage_bytes(content):
    key = lora_b(content)
    old = content["arrays"][key]
    content["arrays"][key] = Array(dtype=old.dtype, shape=old.shape, stype=old.stype, data=b"\x93NUMPY garbage" * 3)


def _oversized(content):
    content["arrays"]["padding"] = Array(dtype="float32", shape=(1 << 20,), stype="numpy.ndarray", data=b"\x00" * (4 << 20))


def _metrics_garbage(content):  # honest tensors, a lying duration: the reply is used, the duration ignored
    content["metrics"] = MetricRecord({"compute-seconds": -1e300})


@pytest.mark.parametrize("tamper, reason", [
    (_bad_json, "undecodable reply (JSONDecodeError"),
    (_bf16_wrong_size, "undecodable reply (ValueError"),
    (_garbage_bytes, "undecodable reply"),
    (_oversized, "bytes (not decoded)"),
])
def test_a_malformed_reply_is_rejected_and_the_run_goes_on(tamper, reason, caplog):
    bad = victim()

    def attack(client, reply):
        if client == bad:
            tamper(reply.content)

    with caplog.at_level("WARNING"):
        sim, *_ = run_flower("run.rounds=2", tamper=attack)
    assert [r["round"] for r in sim.history] == [1, 2]  # the run finished
    for row in sim.history:
        if bad in row["clients"]:
            assert [r["client"] for r in row["rejected"]] == [bad] and reason in row["rejected"][0]["reason"]
            assert row["replied"] == [c for c in row["clients"] if c != bad]
            assert next(e for e in row["per_client"] if e["client"] == bad)["bytes_up"] > 0
    assert f"rejected the reply of client {bad}: " in caplog.text
    assert all(torch.isfinite(t).all() for t in sim.server.tensors().values())


def test_a_lying_duration_is_ignored_and_the_reply_used():
    bad = victim()
    sim, *_ = run_flower("run.rounds=1", tamper=lambda k, reply: _metrics_garbage(reply.content) if k == bad else None)
    row = sim.history[0]
    assert bad in row["replied"] and "rejected" not in row and row["time"]["client_compute"] >= 0


def test_rejections_are_counted_in_the_rounds_metric_record():
    bad = victim()
    counted = []

    class Counting(MethodStrategy):
        def close_round(self):
            arrays, metrics = super().close_round()
            counted.append(dict(metrics))
            return arrays, metrics

    run_config = {"config": "tiny", "set": "run.rounds=1", "flower.node-timeout": 0.0}
    cfg, settings = load_run_config(run_config)
    strategy = Counting(ServerRun(build_run(cfg, tiny_task())), settings)
    grid = LoopGrid(run_config, cfg.partition.num_clients,
                    tamper=lambda k, reply: _garbage_bytes(reply.content) if k == bad else None)
    strategy.connect(grid)
    strategy.start(grid, state_arrays(strategy.run.server), num_rounds=1, timeout=1.0, evaluate_fn=strategy.evaluate)
    assert counted == [{"replied": 1, "dropped": 0, "rejected": 1, "train-loss": counted[0]["train-loss"]}]


# -- malformed answers to the partition query: that node is ignored, the run goes on ----------------------
class QueryTamperingGrid(LoopGrid):
    """A loop-back grid whose node ``node`` answers the partition query with ``answer(content)`` instead."""

    def __init__(self, *args, node: int, answer, **kwargs):
        super().__init__(*args, **kwargs)
        self.bad_node, self.answer = 1000 + node, answer

    def send_and_receive(self, messages, *, timeout=None):
        replies = super().send_and_receive(messages, timeout=timeout)
        for msg, reply in zip(messages, replies):
            if msg.metadata.message_type == "query" and msg.metadata.dst_node_id == self.bad_node:
                self.answer(reply.content)
        return replies


def _no_partition_id(content):
    del content[ROUTE]["partition-id"]


def _text_partition_id(content):
    content[ROUTE]["partition-id"] = "zero"


def _float_partition_id(content):
    content[ROUTE]["partition-id"] = 1.5


def _no_answer(content):
    del content[ROUTE]


@pytest.mark.parametrize("answer, reason", [
    (_no_partition_id, "partition-id and num-partitions must be integers, got partition-id = None"),
    (_text_partition_id, "partition-id = 'zero'"),
    (_float_partition_id, "partition-id = 1.5"),
    (_no_answer, "has no 'fedlowrank' config record"),
])
def test_a_malformed_query_answer_ignores_that_node_only(answer, reason, caplog):
    bad = victim()
    run_config = {"config": "tiny", "set": "run.rounds=2", "flower.node-timeout": 0.0}
    cfg, settings = load_run_config(run_config)
    run = ServerRun(build_run(cfg, tiny_task()))
    strategy = MethodStrategy(run, settings)
    grid = QueryTamperingGrid(run_config, cfg.partition.num_clients, node=bad, answer=answer)
    with caplog.at_level("WARNING"):
        strategy.connect(grid)
        strategy.start(grid, state_arrays(run.server), num_rounds=2, timeout=1.0, evaluate_fn=strategy.evaluate)
    assert bad not in strategy.nodes and len(strategy.nodes) == cfg.partition.num_clients - 1
    line = next(line for line in caplog.text.splitlines() if f"ignoring node {1000 + bad}: " in line)
    assert reason in line
    assert [r["round"] for r in run.history] == [1, 2]
    assert run.history[0]["dropped"] == [bad] and bad not in run.history[0]["replied"]


# -- weights: what a node declares about its own data is capped ---------------------------------------------
def test_a_declared_size_weighs_at_most_max_examples_per_node(tmp_path, caplog):
    """Two nodes with their own files; node 0 claims 10¹² examples in its query answer and in its replies. Its
    reply is accepted but weighs at most server.max_examples_per_node (default: the server's largest client), not
    10¹² against the other node's 14."""
    paths = node_files(tmp_path, (30, 14))
    sets = ("method.name=fedit", "partition.num_clients=2", f"data.labels={TINY_LABELS}", "data.header=false")
    cfg, settings = load_run_config({"config": "tiny", "set": " ".join(f"'{s}'" for s in sets)})
    run = ServerRun(build_run(cfg, tiny_task()))
    cap = max(len(p) for p in run.parts)
    weights = []
    aggregate = run.method.aggregate
    run.method.aggregate = lambda server, replies, rnd: (weights.append({r.client: r.num_examples for r in replies}),
                                                         aggregate(server, replies, rnd))[1]
    strategy = MethodStrategy(run, settings)

    def inflate(content):
        content[ROUTE]["num-examples"] = 10**12

    def inflate_reply(client, reply):
        if client == 0:
            reply.content["scalars"]["num_examples"] = 10**12

    run_config = {"config": "tiny", "set": " ".join(f"'{s}'" for s in sets), "flower.node-timeout": 0.0}
    grid = QueryTamperingGrid(run_config, 2, node=0, answer=inflate, tamper=inflate_reply,
                              node_data=dict(enumerate(paths)))
    with caplog.at_level("WARNING"):
        strategy.connect(grid)
        strategy.start(grid, state_arrays(run.server), num_rounds=cfg.run.rounds, timeout=1.0, evaluate_fn=strategy.evaluate)
    assert strategy.node_sizes == {0: 10**12, 1: 14}
    assert weights and all(w == {0: cap, 1: 14} for w in weights)
    assert f"declares {10**12} examples of its own; its replies weigh at most {cap}" in caplog.text
    with pytest.raises(ConfigError, match=r"server.max_examples_per_node must be >= 0"):
        tiny_config("server.max_examples_per_node=-1")


# -- bounded updates: server.update_clip and server.aggregate, the same in both runtimes ----------------------
def _huge_b(reply: Message) -> Message:
    out = Message(reply)
    key = next(k for k in out.tensors() if k.endswith("lora_B"))
    out[key] = torch.full_like(out[key], 3e38)
    return out


def _simulate(*sets: str, poisoned: int) -> Simulation:
    sim = Simulation(tiny_config("run.clients_per_round=3", "run.rounds=1", *sets), task=tiny_task(),
                     tamper=lambda rnd, k, r: _huge_b(r) if k == poisoned else r)
    sim.run()
    return sim


def _global_max(sim) -> float:
    return max(float(t.abs().max()) for t in sim.server.tensors().values() if t.is_floating_point())


def test_update_clip_and_robust_aggregates_bound_a_huge_update():
    bad = victim("run.clients_per_round=3")
    default = _simulate(poisoned=bad)  # server.outlier_ratio rejects it
    assert _global_max(default) < 10 and default.history[0]["rejected"][0]["client"] == bad
    off = "server.outlier_ratio=inf"  # below: the other defences alone
    assert _global_max(_simulate(off, poisoned=bad)) > 1e36  # no defence: one client writes 3e38 into the model
    clipped = _simulate(off, "server.update_clip=1.0", poisoned=bad)
    assert _global_max(clipped) < 10
    assert clipped.history[0]["robust"]["clipped"] >= 1 and clipped.history[0]["robust"]["max_update_norm"] > 1e38
    for name in ("median", "trimmed-mean"):
        robust = _simulate(off, f"server.aggregate={name}", "server.trim_fraction=0.34", poisoned=bad)
        assert _global_max(robust) < 10 and robust.history[0]["robust"]["aggregate"] == name


def test_defaults_change_nothing_bit_for_bit():
    plain = Simulation(tiny_config(), task=tiny_task())
    plain.run()
    explicit = Simulation(tiny_config("server.aggregate=mean", "server.update_clip=inf"), task=tiny_task())
    explicit.run()
    assert_same_state(plain.server, explicit.server)
    assert "robust" not in plain.history[0]


@pytest.mark.parametrize("sets", [("server.update_clip=0.5", "server.outlier_ratio=inf"),
                                  ("server.aggregate=trimmed-mean", "server.trim_fraction=0.34", "run.clients_per_round=3",
                                   "server.outlier_ratio=inf"),
                                  ("server.aggregate=median", "run.clients_per_round=3", "server.outlier_ratio=inf"),
                                  ("run.clients_per_round=3",)])
def test_server_side_defences_are_the_same_on_flower_and_in_the_simulator(sets):
    bad = victim(*sets)

    def flower_attack(client, reply):
        if client == bad:
            key = lora_b(reply.content)
            old = reply.content["arrays"][key]
            reply.content["arrays"][key] = Array(np.full(old.shape, 1e3, dtype=np.float32))

    def sim_attack(rnd, client, reply):
        if client != bad:
            return reply
        out = Message(reply)
        key = next(k for k in out.tensors() if k.endswith("lora_B"))
        out[key] = torch.full_like(out[key], 1e3)
        return out

    sim, *_ = run_flower(*sets, tamper=flower_attack)
    ref = Simulation(tiny_config(*sets), task=tiny_task(), tamper=sim_attack)
    ref.run()
    assert_same_state(sim.server, ref.server)
    assert [r.get("robust") for r in sim.history] == [r.get("robust") for r in ref.history]
    assert [r.get("rejected") for r in sim.history] == [r.get("rejected") for r in ref.history]
    assert _global_max(ref) < 10


def test_coordinate_median_and_trimmed_mean():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 4, generator=g, dtype=torch.float64)
    torch.testing.assert_close(coordinate_aggregate(x, "median", 0.0), torch.from_numpy(np.median(x.numpy(), 0)))
    torch.testing.assert_close(coordinate_aggregate(x[:4], "median", 0.0), torch.from_numpy(np.median(x[:4].numpy(), 0)))
    s = np.sort(x.numpy(), 0)
    torch.testing.assert_close(coordinate_aggregate(x, "trimmed-mean", 0.3), torch.from_numpy(s[2:5].mean(0)))
    torch.testing.assert_close(coordinate_aggregate(x, "trimmed-mean", 0.0), x.mean(0))


@pytest.mark.parametrize("sets, message", [
    (("method.name=florg", "server.aggregate=median"), "method 'florg' has none: its server step needs individual"),
    (("method.name=hetlora", "server.aggregate=median"), "method 'hetlora' has none: its server step weighs"),
    (("method.name=fedit-qr", "lora.ranks=[1,2]", "server.aggregate=median"), "needs equal client ranks"),
    (("server.aggregate=median", "server.weighting=uniform", "privacy.mode=central", "privacy.clip=1.0"),
     "with privacy.mode = 'central'"),
    (("server.aggregate=mode",), "server.aggregate must be one of mean, median, trimmed-mean; got 'mode'"),
    (("server.trim_fraction=0.5",), r"server.trim_fraction must be in \[0, 0.5\), got 0.5"),
    (("server.update_clip=0",), r"server.update_clip must be > 0 \(inf = off\), got 0.0"),
    (("server.outlier_ratio=0.5",), r"server.outlier_ratio must be >= 1 \(inf = off\), got 0.5"),
])
def test_robust_settings_are_refused_with_the_reason(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", list(sets))


def test_secagg_refuses_server_side_defences_it_cannot_apply():
    with pytest.raises(ConfigError, match="flower.secagg with server.aggregate or server.update_clip"):
        load_run_config({"config": "tiny", "set": "server.weighting=uniform server.update_clip=1.0",
                         "flower.secagg": True})


# -- fuzz: whatever a node sends, it is taken or rejected with a reason --------------------------------------
@pytest.fixture(scope="module")
def honest():
    """A strategy on the tiny run and client 0's honest reply records to its round-1 broadcast."""
    cfg, flower_settings = load_run_config({"config": "tiny", "flower.node-timeout": 0.0})
    task = tiny_task()
    strategy = MethodStrategy(ServerRun(build_run(cfg, task)), flower_settings)
    node = build_run(cfg, task)
    down = wire(strategy.run.method.broadcast(strategy.run.server, 0, 1))
    reply, _, _ = client_update(node.method, node.model, down, node.method.init_client(0), task, node.parts[0], cfg,
                                0, 1, node.training_plan(one_at_a_time=True))
    return strategy, down, to_records(reply)


_values = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1), st.floats(), st.text(max_size=20),
                    st.binary(max_size=20), st.lists(st.integers(-5, 5), max_size=3))
_arrays = st.builds(lambda dtype, shape, stype, data: Array(dtype=dtype, shape=tuple(shape), stype=stype, data=data),
                    st.sampled_from(["float32", "float64", "bfloat16", "int64", "bool", "<U3", "nonsense"]),
                    st.lists(st.integers(0, 6), max_size=3),
                    st.sampled_from(["numpy.ndarray", "torch.bfloat16", "pickle"]),
                    st.one_of(st.binary(max_size=64), st.just(np.lib.format.MAGIC_PREFIX + b"\x01\x00garbage")))


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_replies_are_taken_or_rejected_with_a_reason(honest, data):
    strategy, down, records = honest
    content = RecordDict({name: type(r)(dict(r)) for name, r in records.items()})
    for _ in range(data.draw(st.integers(1, 3))):
        what = data.draw(st.sampled_from(["array", "new array", "scalar", "json", "drop record", "metrics"]))
        if what in ("array", "new array"):
            names = list(content["arrays"]) if what == "array" and "arrays" in content else ["x"]
            if "arrays" in content:
                content["arrays"][data.draw(st.sampled_from(names))] = data.draw(_arrays)
        elif what == "scalar" and "scalars" in content:
            key = data.draw(st.sampled_from(["num_examples", "train_loss", "extra"]))
            value = data.draw(_values)
            if value is not None and not isinstance(value, list) or isinstance(value, list) and value:
                content["scalars"][key] = value
        elif what == "json":
            content["scalars.json"] = ConfigRecord({"k": data.draw(st.text(max_size=30))})
        elif what == "drop record":
            name = data.draw(st.sampled_from(["arrays", "scalars", "scalars.json"]))
            if name in content:
                del content[name]
        else:
            content["metrics"] = MetricRecord({"compute-seconds": data.draw(st.floats(allow_nan=False))})
    got = RoundReplies(1, [0])
    strategy.take_reply(got, 0, down, content)  # never raises
    assert len(got.ledger) == 1
    if got.rejected:
        assert not got.usable and got.rejected[0]["reason"]
    else:
        [reply] = got.usable
        assert 1 <= reply.num_examples <= len(strategy.run.parts[0]) and math.isfinite(reply.message["train_loss"])
    assert got.compute >= 0


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(answer=st.dictionaries(st.sampled_from(["partition-id", "num-partitions", "num-examples", "other"]),
                              st.one_of(st.integers(-3, 10**13), st.floats(), st.text(max_size=5), st.booleans()),
                              max_size=4),
       wrapped=st.booleans())
def test_fuzzed_query_answers_are_read_or_refused_with_a_reason(honest, answer, wrapped):
    strategy = honest[0]
    content = RecordDict({ROUTE: ConfigRecord(answer)} if wrapped else {"other": ConfigRecord(answer)})
    try:
        k, size = strategy.read_answer(content)
    except MalformedReply as exc:
        assert str(exc)
        return
    assert type(k) is int and 0 <= k < strategy.num_clients and answer["num-partitions"] == strategy.num_clients
    assert size is None or (type(size) is int and size >= 1)

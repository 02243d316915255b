"""The Flower runtime in one process: records, config mapping, and every method through the Strategy and the
ClientApp, against the in-process simulator (same seeds, same partition => the same global state).

A loop-back ``Grid`` hands each message to the real ``ClientApp`` with a per-node ``Context`` (its
``node_config`` and persistent ``state``), as a SuperNode does; the client side builds its own
``Simulation`` from the run config, so nothing is shared with the server but the messages.
The real SuperLink/SuperNode processes are exercised in ``test_flower_deployment.py``.
"""

from __future__ import annotations

import json
import math
import shlex

import pytest

pytest.importorskip("flwr")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from flwr.app import ConfigRecord, Context, Error, RecordDict  # noqa: E402
from flwr.app import Message as FlowerMessage  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402
from helpers import run_tiny, tiny_task  # noqa: E402

import fedlowrank.runtime.run as run_module  # noqa: E402
import fedlowrank.runtime.simulator as simulator  # noqa: E402
from fedlowrank.config import ConfigError  # noqa: E402
from fedlowrank.message import Message, Reply, State  # noqa: E402
from fedlowrank.methods import available_methods  # noqa: E402
from fedlowrank.runtime.engine import client_update, sample_clients  # noqa: E402
from fedlowrank.runtime.flower import client_app  # noqa: E402
from fedlowrank.runtime.flower.records import (from_records, put_records, records_nbytes, to_array,  # noqa: E402
                                              to_records, to_tensor)
from fedlowrank.runtime.flower.settings import load_run_config  # noqa: E402
from fedlowrank.runtime.flower.strategy import MethodStrategy, state_arrays  # noqa: E402


class LoopGrid(Grid):
    """Delivers each message to ``client_app.app`` in this process; nodes in ``drop`` never reply to training;
    ``tamper(client, reply)`` may edit a reply on its way back; nodes in ``broken`` get an invalid run config."""

    def __init__(self, run_config, num_clients: int, drop=(), tamper=None, broken=(), node_data=None):
        self.contexts = {1000 + k: Context(7, 1000 + k, {"partition-id": k, "num-partitions": num_clients},
                                           RecordDict(), dict(run_config)) for k in range(num_clients)}
        for k, path in (node_data or {}).items():  # nodes that bring their own training file
            self.contexts[1000 + k].node_config["data-train"] = str(path)
        for k in broken:
            self.contexts[1000 + k].run_config["set"] += " train.lr=-1"
        self.drop, self.tamper, self.sent = {1000 + k for k in drop}, tamper, 0

    def set_run(self, run_id):
        pass

    @property
    def run(self):
        raise NotImplementedError

    def create_message(self, *args, **kwargs):
        raise NotImplementedError

    def push_messages(self, messages):
        raise NotImplementedError

    def pull_messages(self, message_ids):
        raise NotImplementedError

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for msg in messages:
            self.sent += 1
            msg.metadata.__dict__["_message_id"] = f"msg-{self.sent}"
            node = msg.metadata.dst_node_id
            if node in self.drop and msg.metadata.message_type == "train":
                continue  # the node answered the partition query, then vanished mid-round
            try:
                reply = client_app.app(msg, self.contexts[node])
            except Exception as exc:  # what a SuperNode turns a ClientApp exception into
                reply = FlowerMessage(Error(code=0, reason=repr(exc)), reply_to=msg)
            if self.tamper is not None and not reply.has_error() and msg.metadata.message_type == "train":
                self.tamper(node - 1000, reply)
            replies.append(reply)
        return replies


@pytest.fixture(autouse=True)
def flower_process(monkeypatch):
    """This process plays SuperLink and SuperNodes: Flower needs a task identity to build messages, and the
    client side reuses the tiny task's data (its model, method and state are its own)."""
    for name in ("run_id", "node_id", "task_id"):
        monkeypatch.setattr(TaskIdentity, f"_{name}", 7)
    monkeypatch.setattr(run_module, "build_task", lambda cfg, cohorts=False: tiny_task())
    client_app._runs.clear()
    yield
    client_app._runs.clear()


def run_flower(*sets: str, drop=(), tamper=None, broken=(), run_dir=None, node_data=None):
    """The tiny run of ``sets`` through MethodStrategy + ClientApp; returns (server-side Simulation, grid, strategy).
    The server writes ``run_dir`` when given, as the ServerApp does; ``node_data`` = {client: own training file}."""
    run_config = {"config": "tiny", "set": shlex.join(sets), "flower.node-timeout": 0.0}
    cfg, settings = load_run_config(run_config)
    sim = simulator.Simulation(cfg, task=tiny_task(), run_dir=run_dir)
    strategy = MethodStrategy(sim, settings)
    grid = LoopGrid(run_config, cfg.partition.num_clients, drop, tamper, broken, node_data)
    strategy.connect(grid)
    strategy.start(grid, state_arrays(sim.server), num_rounds=cfg.run.rounds, timeout=1.0,
                   evaluate_fn=strategy.evaluate)
    return sim, grid, strategy


def assert_same_state(a: State, b: State, exact: bool = True) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            if exact:
                assert torch.equal(a[k], b[k]), k
            else:
                torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)
        else:
            assert a[k] == b[k] or (isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k])), k


# -- records -----------------------------------------------------------------------------------------
def test_records_nbytes_counts_as_flower_does_and_takes_an_empty_string():
    msg = Message({"w": torch.zeros(3, 5), "flag": True, "n": 7, "x": 0.5, "name": "abc", "ids": [1, 2, 3]})
    content = RecordDict(to_records(msg))
    assert records_nbytes(content) == sum(r.count_bytes() for r in content.values()) > 3 * 5 * 4
    # Flower 1.41's ConfigRecord.count_bytes refuses "" (SecAgg+'s FitRes status carries one); ours counts 0 + key
    status = RecordDict({"status": ConfigRecord({"code": 0, "message": ""}), "keys": ConfigRecord({"k": [b"ab", b""]})})
    assert records_nbytes(status) == (4 + 8) + (7 + 0) + (1 + 2)


def test_records_round_trip_is_exact_for_every_dtype_shape_and_scalar():
    g = torch.Generator().manual_seed(0)
    msg = Message({
        "m.lora_A": torch.randn(3, 5, generator=g), "m.lora_B": torch.randn(7, 2, generator=g, dtype=torch.float64),
        "stacked": torch.randn(4, 3, 5, generator=g).to(torch.bfloat16), "half": torch.randn(2, generator=g).half(),
        "ids": torch.tensor([3, -1], dtype=torch.int64), "mask": torch.tensor([True, False]),
        "empty": torch.zeros(0, 4), "scalar_t": torch.tensor(2.5),
        "num_examples": 12, "train_loss": 0.25, "name": "x", "flag": False, "seeds": [1, 2, 3], "none": None,
        "nested": {"a": [1.5, "b"]}, "big": 2**70, "nan": float("nan"),
    })
    content = RecordDict(to_records(msg))
    back = from_records(content, Message)
    assert back.to_bytes() == msg.to_bytes()  # same dtypes, shapes, bytes and scalars (typed)
    assert type(back["flag"]) is bool and type(back["num_examples"]) is int and back["none"] is None
    assert from_records(RecordDict(), State) is None


# -- config mapping ----------------------------------------------------------------------------------
def test_run_config_maps_to_set_overrides():
    cfg, settings = load_run_config({"config": "tiny", "method.name": "fedit", "lora.rank": "", "run.rounds": 3,
                                     "train.lr": 0.01, "set": "method.correction=scaffold lora.alpha=8",
                                     "flower.round-timeout": 20})
    assert cfg.method == {"name": "fedit", "correction": "scaffold"}
    assert (cfg.run.rounds, cfg.lora.rank, cfg.lora.alpha, cfg.train.lr) == (3, 2, 8.0, 0.01)  # "" keeps tiny's rank
    assert settings.round_timeout == 20.0
    with pytest.raises(ConfigError, match="flower.round-timout"):
        load_run_config({"config": "tiny", "flower.round-timout": 3})
    with pytest.raises(ConfigError, match="train.lr must be > 0"):
        load_run_config({"config": "tiny", "set": "train.lr=-1"})


# -- every method, Flower vs simulator ----------------------------------------------------------------
SGD_ONLY = ("ssf", "fedsub")  # methods defined with plain SGD local steps
CASES = [(name, ("train.optimizer=sgd",) if name in SGD_ONLY else ()) for name, cls in available_methods().items()
         if not cls.pooled] + [
    ("fedit", ("method.correction=scaffold",)),
    *[(name, ("lora.ranks=[1,2]", f'compare.methods=["{name}"]')) for name, cls in available_methods().items() if cls.supports_heterogeneous_ranks],
    # coded runs, a method of each family (docs/codecs.md): the same coded bytes, residuals and global model
    ("fedit", ("uplink.codec=int4", "uplink.rounding=stochastic", "uplink.error_feedback=true", "downlink.codec=int8")),
    ("fedavg-full", ("uplink.codec=topk", "uplink.error_feedback=true", "uplink.lossless=zlib", "downlink.codec=bf16")),
    ("florg", ("uplink.codec=int8", "uplink.lossless=lzma", "downlink.codec=fp16")),
    ("ssf", ("train.optimizer=sgd", "uplink.codec=int8", "uplink.error_feedback=true", "downlink.codec=int4")),
    ("fedalt", ("uplink.codec=int4", "uplink.levels=nf4", "uplink.error_feedback=true")),
    ("ravan", ("uplink.codec=bf16", "downlink.lossless=zlib")),
    ("fedsvd", ("uplink.codec=topk", "uplink.topk_count=3", "uplink.error_feedback=true")),
]


@pytest.mark.parametrize("method,sets", CASES, ids=[f"{m}{'-' + '-'.join(s) if s else ''}" for m, s in CASES])
def test_flower_run_equals_simulator(method, sets):
    sets = (f"method.name={method}", *sets)
    try:
        ref = run_tiny(method, *sets[1:])
    except Exception as exc:  # not a Flower question: the method does not run on this config at all
        pytest.skip(f"{method} {sets[1:]} fails in the simulator too: {exc!r}")
    sim, grid, strategy = run_flower(*sets)
    assert_same_state(sim.server, ref.server)
    assert sim.ledger.rows == ref.ledger.rows  # bytes counted from the same serialised messages
    compared = ("clients", "replied", "rejected", "skipped", "train_loss")
    if not ref.method.personalized:  # a personalised method's metric on Flower is its shared model's (docs)
        compared += ("accuracy", "per_client")
    for flower_row, sim_row in zip(sim.history, ref.history, strict=True):
        for key in compared:
            assert flower_row.get(key) == sim_row.get(key), key
        assert flower_row["flower_bytes_up"] > 0 and "dropped" not in flower_row
    assert_same_node_states(grid, strategy, ref)


def test_a_pooled_reference_is_refused_on_flower():
    """``centralized`` pools the round's clients' data, which on Flower stays on each node."""
    with pytest.raises(ValueError, match="method.name = 'centralized'.*pooled data"):
        run_flower("method.name=centralized")


def test_flower_evaluates_the_model_before_training_as_round_zero():
    sim, *_ = run_flower("method.name=fedit", "run.rounds=1")
    before = simulator.Simulation(sim.cfg, task=tiny_task()).evaluate()
    assert sim.initial_eval["loss"] == pytest.approx(before["loss"]) and sim.summary()["initial"] == sim.initial_eval


def assert_same_node_states(grid, strategy, ref) -> None:
    """Each client's state in its node's context.state, once committed by what the server aggregated, is the
    simulator's state of that client (and a client the simulator never committed has none)."""
    for k in range(ref.cfg.partition.num_clients):
        state = client_app.committed_state(grid.contexts[1000 + k].state, strategy.accepted.get(k, 0))
        if k in ref.store:
            assert_same_state(state, ref.store[k])
        else:
            assert state is None, k


# -- failures ----------------------------------------------------------------------------------------
def test_dropped_client_round_aggregates_the_remaining_replies(caplog):
    cfg, _ = load_run_config({"config": "tiny", "set": "method.name=scaffold"})
    sampled = sample_clients(cfg.run.seed, 1, cfg.partition.num_clients, cfg.run.clients_per_round)
    lost, kept = sampled[1], sampled[0]
    with caplog.at_level("WARNING"):
        sim, *_ = run_flower("method.name=scaffold", "run.rounds=1", drop=[lost])
    row = sim.history[0]
    assert row["replied"] == [kept] and row["dropped"] == [lost] and "skipped" not in row
    assert f"client {lost} dropped (no reply from node {1000 + lost} within flower.round-timeout" in caplog.text
    assert "1 usable replies of 2 sampled clients; run.min_replies = 1 is met, aggregated them" in caplog.text
    assert {"round": 1, "client": lost, "down": sim.ledger.rows[1]["down"], "up": 0} in sim.ledger.rows
    # the global state is the method's aggregate of the one reply
    ref = simulator.Simulation(cfg, task=tiny_task())
    reply, _, _ = client_update(ref.method, ref.model, ref.method.broadcast(ref.server, kept, 1),
                                ref.method.init_client(kept), ref.task, ref.parts[kept], cfg, kept, 1,
                                ref.training_plan())
    expected = ref.method.aggregate(ref.server, [Reply(kept, reply["num_examples"], reply)], 1)
    assert_same_state(sim.server, expected)


def test_below_min_replies_keeps_the_global_state(caplog):
    cfg, _ = load_run_config({"config": "tiny"})
    lost = sample_clients(cfg.run.seed, 1, cfg.partition.num_clients, cfg.run.clients_per_round)[0]
    with caplog.at_level("WARNING"):
        sim, *_ = run_flower("run.rounds=1", "run.min_replies=2", drop=[lost])
    initial = simulator.Simulation(cfg, task=tiny_task()).server
    assert_same_state(sim.server, initial)
    assert sim.history[0]["skipped"] and sim.history[0]["dropped"] == [lost]
    assert "fewer than run.min_replies = 2: round skipped, global state unchanged" in caplog.text


def test_non_finite_reply_is_rejected_and_logged(caplog):
    def poison(client, reply):
        if client == poisoned:
            reply.content["scalars"]["train_loss"] = float("nan")

    cfg, _ = load_run_config({"config": "tiny"})
    poisoned = sample_clients(cfg.run.seed, 1, cfg.partition.num_clients, cfg.run.clients_per_round)[1]
    with caplog.at_level("WARNING"):
        sim, *_ = run_flower("run.rounds=1", tamper=poison)
    assert sim.history[0]["rejected"] == [{"client": poisoned, "reason": "train_loss must be a finite number, got nan"}]
    assert sim.history[0]["replied"] == [c for c in sim.history[0]["clients"] if c != poisoned]
    assert all(torch.isfinite(t).all() for t in sim.server.tensors().values())
    assert f"rejected the reply of client {poisoned}: train_loss must be a finite number" in caplog.text


def test_a_malformed_coded_reply_is_rejected_with_its_reason_never_raised():
    """A node's coded reply whose top-k indices point outside the tensor (or whose header lies) is a bad reply."""
    def corrupt(client, reply):
        arrays = reply.content["arrays"]
        if client == bad_index:
            raw = to_tensor(arrays["@i"])
            arrays["@i"] = to_array(torch.full_like(raw, 0xFF))
        elif client == bad_header:
            header = json.loads(reply.content["scalars.json"]["@codec"])
            reply.content["scalars.json"]["@codec"] = json.dumps({**header, "topk_count": 5})

    cfg, _ = load_run_config({"config": "tiny", "set": "run.clients_per_round=3"})
    bad_index, bad_header, good = sample_clients(cfg.run.seed, 1, cfg.partition.num_clients, 3)
    sim, *_ = run_flower("run.rounds=1", "run.clients_per_round=3", "uplink.codec=topk", "uplink.topk_count=2",
                         tamper=corrupt)
    reasons = {r["client"]: r["reason"] for r in sim.history[0]["rejected"]}
    assert "top-k indices must increase and stay below" in reasons[bad_index]
    assert "the header says" in reasons[bad_header] and "'topk_count': 5" in reasons[bad_header]
    assert sim.history[0]["replied"] == [good]


def test_a_rejected_reply_never_advances_its_clients_state():
    """SCAFFOLD: client P's reply of its first round is poisoned and rejected. Its node must not keep the control
    variate it computed in that round, or the server's c would stop being the mean of the clients' cᵢ. The run
    equals the simulator's with the same reply rejected: global state and every node's state."""
    sets = ("method.name=scaffold", "run.rounds=4")
    cfg, _ = load_run_config({"config": "tiny", "set": shlex.join(sets)})
    m, per_round = cfg.partition.num_clients, cfg.run.clients_per_round
    rounds = {k: [r for r in range(1, 5) if k in sample_clients(cfg.run.seed, r, m, per_round)] for k in range(m)}
    poisoned = next(k for k, rs in rounds.items() if len(rs) >= 2)   # rejected first, sampled again later
    seen = []

    def poison_flower(client, reply):
        if client == poisoned and not seen:
            seen.append(client)
            reply.content["scalars"]["train_loss"] = float("nan")

    def poison_sim(rnd, client, reply):
        if client == poisoned and rnd == rounds[poisoned][0]:
            reply = Message(reply)
            reply["train_loss"] = float("nan")
        return reply

    sim, grid, strategy = run_flower(*sets, tamper=poison_flower)
    ref = simulator.Simulation(cfg, task=tiny_task(), tamper=poison_sim)
    ref.run()
    assert [r.get("rejected") for r in sim.history] == [r.get("rejected") for r in ref.history]
    assert any(r.get("rejected") for r in sim.history)
    assert_same_state(sim.server, ref.server)
    assert_same_node_states(grid, strategy, ref)


def test_pending_state_is_committed_only_for_the_round_the_server_aggregated():
    records = RecordDict()
    assert client_app.committed_state(records, 0) is None
    put_records(records, State({"c": torch.zeros(2)}), client_app.PENDING)
    records[client_app.PENDING_ROUND] = ConfigRecord({"round": 3})
    assert client_app.committed_state(records, 2) is None            # round 3's reply was not aggregated
    assert not any(name.startswith(client_app.PENDING) for name in records)
    put_records(records, State({"c": torch.ones(2)}), client_app.PENDING)
    records[client_app.PENDING_ROUND] = ConfigRecord({"round": 5})
    assert torch.equal(client_app.committed_state(records, 5)["c"], torch.ones(2))
    assert torch.equal(client_app.committed_state(records, 5)["c"], torch.ones(2))   # idempotent


def test_failing_client_is_a_dropout_not_a_crash(caplog):
    """A SuperNode whose ClientApp raises (here: its run config is invalid) sends an error reply."""
    cfg, _ = load_run_config({"config": "tiny"})
    broken, kept = sample_clients(cfg.run.seed, 1, cfg.partition.num_clients, cfg.run.clients_per_round)
    with caplog.at_level("WARNING"):
        sim, *_ = run_flower("run.rounds=1", broken=[broken])
    assert sim.history[0]["replied"] == [kept] and sim.history[0]["dropped"] == [broken]
    assert f"client {broken} dropped (node {1000 + broken} answered with an error" in caplog.text and "train.lr must be > 0" in caplog.text


# -- the server's run directory ------------------------------------------------------------------------
def test_flower_run_directory_exports_and_resumes_in_the_simulator(tmp_path):
    """The server writes the simulator's checkpoints (server state, history, ledger; not the clients' states,
    which stay on the nodes): `fedlowrank export` and `resume` work on a Flower run directory."""
    from fedlowrank.export import export_run
    from fedlowrank.runtime.checkpoint import checkpoint_folders

    run_dir = tmp_path / "flower"
    sim, *_ = run_flower("method.name=fedit", "run.rounds=3", "run.checkpoint_every=2", run_dir=run_dir)
    sim.close()  # what the ServerApp does at the end
    assert sorted(checkpoint_folders(run_dir)) == [2, 3]
    report = export_run(run_dir, tmp_path / "export", "peft", task=tiny_task())
    assert report["round"] == 3 and (tmp_path / "export" / "adapter_model.safetensors").is_file()
    notes = []
    resumed = simulator.Simulation.resume(run_dir, task=tiny_task(), round=2, warn=notes.append)
    # FedIT's clients keep no state (no note that theirs stayed on the SuperNodes): the simulator continues the
    # Flower run exactly
    assert len(notes) == 1 and "cut back to round 2" in notes[0]
    resumed.run()
    assert_same_state(resumed.server, run_tiny("fedit", rounds=3).server)
    assert [r["round"] for r in resumed.history] == [1, 2, 3]


# -- nodes that bring their own data (node config data-train) ------------------------------------------
TINY_LABELS = '["business","entertainment","politics","sports","tech"]'  # the tiny task's classes (BBC News), sorted


def node_files(tmp_path, sizes=(30, 14)) -> list:
    """One TSV per node (text<TAB>label) cut from the tiny task's training examples, consecutive and disjoint."""
    data, paths, start = tiny_task().data, [], 0
    for k, n in enumerate(sizes):
        rows = [f"{data.train_texts[i]}\t{data.label_names[data.train_labels[i]]}" for i in range(start, start + n)]
        paths.append(tmp_path / f"node{k}.tsv")
        paths[-1].write_text("\n".join(rows) + "\n", encoding="utf-8")
        start += n
    return paths


@pytest.mark.parametrize("method", ["fedit", "scaffold"])
def test_nodes_with_their_own_files_equal_the_simulator_on_those_files(tmp_path, method):
    """Two nodes train on all of their own files; the server aggregates and evaluates on its own test set. The
    run equals the simulator's on the concatenated files with each client's part its file."""
    from fedlowrank.tasks.data import TextData
    from fedlowrank.tasks.text import TextClassification

    sizes = (30, 14)
    paths = node_files(tmp_path, sizes)
    sets = (f"method.name={method}", "partition.num_clients=2", f"data.labels={TINY_LABELS}", "data.header=false")
    trained = []
    sim, grid, strategy = run_flower(*sets, node_data=dict(enumerate(paths)),
                                     tamper=lambda k, reply: trained.append((k, reply.content["metrics"]["num-examples"])))
    assert strategy.node_sizes == {0: sizes[0], 1: sizes[1]}  # learnt from the partition query
    assert sorted(set(trained)) == [(0, sizes[0]), (1, sizes[1])]  # each node trained on all of its own file
    node_run = client_app._runs[next(iter(client_app._runs))]  # the last node's run (client 1)
    tiny = tiny_task()
    assert node_run.task.data.label_names == tiny.data.label_names
    assert node_run.task.train_labels.tolist() == tiny.data.train_labels[sizes[0]:sum(sizes)].tolist()
    n = sum(sizes)
    own = TextData(tiny.data.train_texts[:n], tiny.data.train_labels[:n], tiny.data.test_texts,
                   tiny.data.test_labels, tiny.data.label_names)
    cfg, _ = load_run_config({"config": "tiny", "set": shlex.join(sets)})
    ref = simulator.Simulation(cfg, task=TextClassification(own, "tiny-bert", cfg.task.max_length),
                               parts=[np.arange(0, sizes[0]), np.arange(sizes[0], n)])
    ref.run()
    assert_same_state(sim.server, ref.server)
    for flower_row, sim_row in zip(sim.history, ref.history, strict=True):
        for key in ("clients", "replied", "train_loss", "accuracy"):
            assert flower_row.get(key) == sim_row.get(key), key
    assert_same_node_states(grid, strategy, ref)


def test_own_data_needs_data_labels_and_refuses_a_label_outside_them(tmp_path):
    paths = node_files(tmp_path, (12, 12))
    base = ("partition.num_clients=2", "data.header=false")
    node = Context(7, 1, {"partition-id": 0, "num-partitions": 2, "data-train": str(paths[0])}, RecordDict(),
                   {"config": "tiny", "set": shlex.join(base)})
    with pytest.raises(ValueError, match=r"^node config data-train: set data.labels"):
        client_app.query(None, node)
    lines = paths[1].read_text().splitlines()
    lines[4] = lines[4].rsplit("\t", 1)[0] + "\tWeather"
    paths[1].write_text("\n".join(lines) + "\n")
    config = {"config": "tiny", "set": shlex.join((*base, f"data.labels={TINY_LABELS}"))}
    node = Context(7, 1, {"partition-id": 1, "num-partitions": 2, "data-train": str(paths[1])}, RecordDict(), config)
    with pytest.raises(ValueError, match=rf"^{paths[1]}:5: label 'Weather' is not in data.labels "
                                         r"\(business, entertainment, politics, sports, tech\)$"):
        client_app.query(None, node)


def test_own_data_file_missing_is_one_error_naming_the_node_config_key(tmp_path):
    config = {"config": "tiny", "set": shlex.join(("partition.num_clients=2", f"data.labels={TINY_LABELS}"))}
    node = Context(7, 1, {"partition-id": 0, "num-partitions": 2, "data-train": str(tmp_path / "absent.tsv")},
                   RecordDict(), config)
    with pytest.raises(FileNotFoundError, match=rf"^node config data-train: no file {tmp_path / 'absent.tsv'}$"):
        client_app.query(None, node)


def test_data_labels_number_the_servers_classes_in_their_order(tmp_path):
    """The server's own data (data.source = files) is numbered by data.labels, as the nodes' files are."""
    from fedlowrank.tasks.data import load_text_files

    path = tmp_path / "server.tsv"
    path.write_text("a text\tb\nanother\ta\nthird\tb\n")
    test = tmp_path / "test.tsv"
    test.write_text("x\ta\n")
    data = load_text_files(path, test, header="false", label_names=["b", "c", "a"])
    assert data.label_names == ["b", "c", "a"]
    assert data.train_labels.tolist() == [0, 2, 0] and data.test_labels.tolist() == [2]
    with pytest.raises(ValueError, match=rf"^{path}:2: label 'a' is not in data.labels \(b, c\)$"):
        load_text_files(path, test, header="false", label_names=["b", "c"])

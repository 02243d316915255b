"""A reply is checked against what its method declares it uploads (``Method.upload_spec``), and an outlying update is
rejected: one bad node never ends a run nor moves the global state, in every registered method.

Each attack below is sent by one client of round 1; the run must finish with the state of a run in which those
clients simply did not reply (``run.dropout_schedule``), in the simulator and over Flower's message contract.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedlowrank.config import load_config
from fedlowrank.message import Message
from fedlowrank.methods import available_methods
from fedlowrank.runtime.engine import sample_clients
from fedlowrank.runtime.simulator import Simulation

from helpers import tiny_task

# settings a method requires on the tiny task (SSF's and FedSub's plain SGD local steps)
METHOD_SETTINGS = {"ssf": ["train.optimizer=sgd", "train.lr=0.05"], "fedsub": ["train.optimizer=sgd", "train.lr=0.05"]}
ROUND = ["partition.num_clients=7", "partition.kind=iid", "run.clients_per_round=7", "run.rounds=2"]  # 6 bad, 1 honest


def _target(reply: Message, i: int) -> str:
    """The i-th floating tensor of the reply (cyclically, sorted by name): each attack hits a different one."""
    keys = sorted(k for k, t in reply.tensors().items() if t.is_floating_point())
    return keys[i % len(keys)]


def _wrong_shape(reply, key):
    reply[key] = torch.zeros(reply[key].shape[0] + 1, *reply[key].shape[1:], dtype=reply[key].dtype)


def _extra(reply, key):
    reply["evil"] = torch.zeros(7, 7)


def _missing(reply, key):
    del reply[key]


def _float64(reply, key):
    reply[key] = reply[key].double()


def _nan(reply, key):
    reply[key] = reply[key].clone()
    reply[key].view(-1)[0] = float("nan")


def _huge(reply, key):
    reply[key] = torch.full_like(reply[key], 3e38)


# attack -> what the rejection reason says
ATTACKS = {_wrong_shape: "expected", _extra: "unexpected tensors: evil", _missing: "missing tensors", _float64:
           "torch.float64", _nan: "non-finite", _huge: "server.outlier_ratio"}


def attack(reply: Message, which: int) -> Message:
    """``reply`` with attack number ``which`` (of :data:`ATTACKS`) applied (a new message)."""
    out = Message(reply)
    fn = list(ATTACKS)[which]
    fn(out, _target(reply, which))
    return out


def _cfg(method: str, *sets: str):
    return load_config("tiny", [f"method.name={method}", *ROUND, *METHOD_SETTINGS.get(method, []), *sets])


def attackers(cfg) -> list[int]:
    """The clients of round 1 that attack (one per attack); the others reply honestly."""
    return sample_clients(cfg.run.seed, 1, cfg.partition.num_clients, cfg.run.clients_per_round)[:len(ATTACKS)]


def assert_same_state(a, b):
    assert set(a.tensors()) == set(b.tensors())
    for k, v in a.tensors().items():
        assert torch.equal(v, b[k]), k


# every federated method; a reference row (centralized, local-only) has no client reply that could be tampered with
FEDERATED = sorted(name for name, cls in available_methods().items() if not cls.reference)


@pytest.mark.parametrize("method, sets", [(m, ()) for m in FEDERATED] +
                         [("fedgalore", ("method.upload=segments",))])  # tensors whose number the client chooses
def test_bad_replies_are_rejected_and_the_run_ends_with_the_honest_result(method, sets):
    cfg = _cfg(method, *sets)
    bad = attackers(cfg)
    plan = {k: i for i, k in enumerate(bad)}
    attacked = Simulation(cfg, task=tiny_task(), tamper=lambda rnd, k, r: attack(r, plan[k]) if rnd == 1 and k in plan else r)
    attacked.run()
    absent = Simulation(_cfg(method, *sets, f"run.dropout_schedule={[[1, k] for k in bad]}"), task=tiny_task())
    absent.run()
    reasons = {r["client"]: r["reason"] for r in attacked.history[0]["rejected"]}
    assert sorted(reasons) == sorted(bad)
    for k, i in plan.items():
        assert list(ATTACKS.values())[i] in reasons[k], (k, reasons[k])
    assert "rejected" not in attacked.history[1]
    assert_same_state(attacked.server, absent.server)
    for ra, rb in zip(attacked.history, absent.history, strict=True):
        assert (ra["replied"], ra["train_loss"], ra.get("accuracy")) == (rb["replied"], rb["train_loss"], rb.get("accuracy"))



def _replies(*norms: float, examples=None):
    from fedlowrank.message import Reply

    examples = examples or [8] * len(norms)
    return [Reply(k, n_k, Message({"w": torch.tensor([n, 0.0]), "num_examples": n_k, "train_loss": 0.0}))
            for k, (n, n_k) in enumerate(zip(norms, examples))], {k: Message({"w": torch.zeros(2)}) for k in range(len(norms))}


@pytest.mark.parametrize("norms, rejected", [
    ((1.0, 2.0, 100.0), [2]),         # median of the others: 1.5
    ((1.0, 100.0), [1]),              # two replies: each measured against the other
    ((5.0,), []),                     # a lone reply sent zeros, with no earlier round: nothing to measure it against
    ((1.0, 1.0, 1.0, 10.0), []),      # at the bound: kept
    ((1.0, 1.0, 1.0, 10.5), [3]),
    ((0.0, 0.0, 0.0), []),
])
def test_an_update_is_measured_against_the_median_of_the_rounds_other_updates(norms, rejected):
    from fedlowrank.runtime.robust import outlying_replies

    replies, downs = _replies(*norms)
    kept, out, norm = outlying_replies(replies, downs, 10.0, load_config("tiny").train)
    assert [r["client"] for r in out] == rejected
    assert [r.client for r in kept] == [k for k in range(len(norms)) if k not in rejected]
    assert all("server.outlier_ratio = 10 times" in r["reason"] for r in out)
    steps = load_config("tiny").train.local_steps  # the norms are per local step
    assert norm == pytest.approx(float(np.median([n for k, n in enumerate(norms) if k not in rejected])) / steps)


@pytest.mark.parametrize("norm, earlier, sent, initial, kept", [  # norm: of the whole update, over 2 local steps
    (10.0, 0.5, 0.0, 0.0, True),      # 5 per step: within 10 times the newest earlier round's median
    (10.2, 0.5, 100.0, 0.0, False),   # beyond it: what it was sent does not matter then
    (18.0, None, 1.0, 0.0, True),     # no earlier round: within 10 times the norm of what it was sent
    (22.0, None, 1.0, 0.0, False),
    (22.0, None, 0.0, 2.0, True),     # it was sent zeros: measured against its initial client state
    (42.0, None, 0.0, 2.0, False),
])
def test_a_lone_reply_is_measured_against_earlier_rounds_or_what_it_starts_from(norm, earlier, sent, initial, kept):
    from fedlowrank.runtime.robust import outlying_replies

    replies, _ = _replies(norm)
    downs = {0: Message({"w": torch.tensor([0.0, sent])})}
    start = {0: Message({"own": torch.tensor([initial])})}
    got, out, _ = outlying_replies(replies, downs, 10.0, load_config("tiny").train, earlier, start.__getitem__)
    assert (len(got), len(out)) == ((1, 0) if kept else (0, 1))
    if not kept:
        assert ("earlier round" if earlier else "what it starts from") in out[0]["reason"]


def _everything_huge(reply: Message) -> Message:
    out = Message(reply)
    for key, t in reply.tensors().items():
        if t.is_floating_point():
            out[key] = torch.full_like(t, 3e38)
    return out


@pytest.mark.parametrize("method", FEDERATED)
def test_a_lone_bad_reply_never_ends_nor_poisons_the_run(method):
    """Two clients a round with the default ``run.min_replies = 1``. Round 1: the other sampled client drops out and
    the one left sends 3e38 everywhere (measured against what it was sent); round 2: both reply honestly; round 3:
    one drops out and the other sends 3e38 (measured against round 2's replies). Both bad replies are rejected and
    the run ends with the state of the run in which those clients did not reply."""
    sets = ["run.clients_per_round=2", "run.rounds=3", *METHOD_SETTINGS.get(method, [])]
    cfg = load_config("tiny", [f"method.name={method}", *sets])
    sampled = {rnd: sample_clients(cfg.run.seed, rnd, cfg.partition.num_clients, 2) for rnd in (1, 3)}
    bad = {rnd: clients[0] for rnd, clients in sampled.items()}
    gone = [[rnd, clients[1]] for rnd, clients in sampled.items()]
    attacked = Simulation(load_config("tiny", [f"method.name={method}", *sets, f"run.dropout_schedule={gone}"]),
                          task=tiny_task(), tamper=lambda rnd, k, r: _everything_huge(r) if bad.get(rnd) == k else r)
    attacked.run()
    absent = Simulation(load_config("tiny", [f"method.name={method}", *sets, "run.dropout_schedule="
                                             f"{gone + [[rnd, k] for rnd, k in bad.items()]}"]), task=tiny_task())
    absent.run()
    for rnd in (1, 3):
        row = attacked.history[rnd - 1]
        assert row["skipped"] and [r["client"] for r in row["rejected"]] == [bad[rnd]], row
        assert "server.outlier_ratio" in row["rejected"][0]["reason"]
    assert "update_norm" in attacked.history[1] and "rejected" not in attacked.history[1]
    assert_same_state(attacked.server, absent.server)
    assert all(math.isfinite(r["train_loss"]) for r in attacked.history if not r.get("skipped"))


def test_with_local_epochs_an_update_is_measured_per_local_step():
    """train.local_epochs = 1, batch 8: a client with 80 examples takes 10 steps, one with 8 takes 1; its update
    norm 100 is 10 per step, within 10 times the others' 1.5."""
    from fedlowrank.runtime.robust import outlying_replies

    replies, downs = _replies(1.0, 2.0, 100.0, examples=[8, 8, 80])
    train = load_config("tiny", ["train.local_epochs=1", "train.batch_size=8"]).train
    assert outlying_replies(replies, downs, 10.0, train)[1] == []
    assert [r["client"] for r in outlying_replies(replies, downs, 10.0, load_config("tiny").train)[1]] == [2]


def test_the_outlier_rule_is_off_under_central_dp_and_when_inf():
    from fedlowrank.runtime.robust import outlier_ratio

    assert outlier_ratio(load_config("tiny")) == 10.0
    assert outlier_ratio(load_config("tiny", ["server.outlier_ratio=inf"])) == float("inf")
    assert outlier_ratio(load_config("tiny", ["privacy.mode=central", "privacy.clip=1.0",
                                              "server.weighting=uniform"])) == float("inf")


def test_one_bad_node_alone_in_its_round_skips_the_round_and_never_ends_the_run():
    """One client per round: its NaN reply leaves round 1 without a usable reply; the round is skipped with the
    global state unchanged (no DivergenceError: that is for a run diverging from honest replies)."""
    sets = ["run.clients_per_round=1", "run.rounds=2"]
    attacked = Simulation(load_config("tiny", sets), task=tiny_task(), tamper=lambda rnd, k, r: attack(r, 4) if rnd == 1 else r)
    attacked.run()
    first = attacked.history[0]
    absent = Simulation(load_config("tiny", [*sets, f"run.dropout_schedule=[[1, {first['clients'][0]}]]"]),
                        task=tiny_task())
    absent.run()
    assert first["skipped"] and "non-finite" in first["rejected"][0]["reason"]
    assert_same_state(attacked.server, absent.server)


SEGMENTS_LIST = "galore_segments must be a list of at most 1024 basis indices >= -1"


@pytest.mark.parametrize("key, value, reason", [
    ("galore_segments", "0", SEGMENTS_LIST), ("galore_segments", list(range(2000)), SEGMENTS_LIST),
    ("galore_segments", [0, "1"], SEGMENTS_LIST), ("galore_segments", [-2], SEGMENTS_LIST),
    ("galore_decay", float("nan"), "galore_decay must be a number in (0, 1], got nan"),
    ("galore_decay", 3e38, "galore_decay must be a number in (0, 1], got 3e+38"),
    ("galore_basis_index", "x", "galore_basis_index must be an integer >= -1, got 'x'"),
    ("galore_basis_index", None, "galore_basis_index must be an integer >= -1, got None"),
])
def test_fedgalore_scalars_the_server_reads_are_checked(key, value, reason):
    def tamper(rnd, k, reply):
        out = Message(reply)
        if value is None:
            del out[key]
        else:
            out[key] = value
        return out if k == bad else reply

    cfg = _cfg("fedgalore", "method.upload=segments", "run.rounds=1")
    bad = attackers(cfg)[0]
    sim = Simulation(cfg, task=tiny_task(), tamper=tamper)
    sim.run()
    assert sim.history[0]["rejected"] == [{"client": bad, "reason": reason}]

"""Checkpoints and exact resume, bad replies, dropout, divergence."""

import json

import pytest
import torch

from fedlowrank.config import load_config
from fedlowrank.methods import available_methods
from fedlowrank.runtime.checkpoint import CheckpointError, latest_checkpoint
from fedlowrank.runtime.simulator import DivergenceError, Simulation

from helpers import tiny_task

# settings a method requires on the tiny task (e.g. SSF's plain SGD local steps)
METHOD_SETTINGS = {"ssf": ["train.optimizer=sgd", "train.lr=0.05"], "fedsub": ["train.optimizer=sgd", "train.lr=0.05"]}
STABLE = ("accuracy", "loss", "train_loss", "bytes_up", "bytes_down", "clients", "replied")


def _stable_diagnostics(row):
    """Diagnostics without wall-clock timings (which legitimately differ between runs)."""
    return {k: v for k, v in row.get("diagnostics", {}).items() if "seconds" not in k and "time" not in k}


def _cfg(method, *sets, rounds=5):
    return load_config("tiny", [f"method.name={method}", f"run.rounds={rounds}", "run.checkpoint_every=1",
                                "run.clients_per_round=3", *METHOD_SETTINGS.get(method, []), *sets])


def _assert_same_run(a: Simulation, b: Simulation):
    assert a.round == b.round
    assert set(a.server) == set(b.server)
    for k, v in a.server.items():
        assert torch.equal(v, b.server[k]) if isinstance(v, torch.Tensor) else v == b.server[k], k
    assert set(a.store) == set(b.store)
    for c in a.store:
        for k, v in a.store[c].items():
            assert torch.equal(v, b.store[c][k]) if isinstance(v, torch.Tensor) else v == b.store[c][k], (c, k)
    assert a.ledger.rows == b.ledger.rows
    assert not any("rejected" in r or "skipped" in r for r in a.history)  # honest clients are never rejected
    for ra, rb in zip(a.history, b.history, strict=True):
        assert json.dumps({k: ra.get(k) for k in STABLE}) == json.dumps({k: rb.get(k) for k in STABLE})
        assert json.dumps(_stable_diagnostics(ra)) == json.dumps(_stable_diagnostics(rb))


@pytest.mark.parametrize("method", sorted(available_methods()))
def test_resume_is_bit_identical(method, tmp_path):
    straight = Simulation(_cfg(method), task=tiny_task(), run_dir=tmp_path / "a")
    straight.run()
    fresh = Simulation(_cfg(method), task=tiny_task())  # its schema starts from the initial states
    for client, state in [(None, straight.server)] + [(k, straight.store[k]) for k in sorted(straight.store)]:
        assert fresh.state_schema(client).problem(state) is None, client  # the method declares what it keeps
    interrupted = Simulation(_cfg(method), task=tiny_task(), run_dir=tmp_path / "b")
    interrupted.run_round()
    interrupted.run_round()
    del interrupted  # as if killed after round 2
    resumed = Simulation.resume(tmp_path / "b", task=tiny_task())
    assert resumed.round == 2
    resumed.run()
    _assert_same_run(straight, resumed)
    lines = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in lines] == [1, 2, 3, 4, 5]


def test_corrupted_or_truncated_checkpoint_is_refused(tmp_path):
    # one checkpoint only: with an older intact one, resume falls back to it (tests/test_rundirs.py)
    sim = Simulation(_cfg("fedit", rounds=1), task=tiny_task(), run_dir=tmp_path)
    sim.run()
    ck = latest_checkpoint(tmp_path)
    data = (ck / "server.safetensors").read_bytes()
    (ck / "server.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        Simulation.resume(tmp_path, task=tiny_task())
    flipped = bytearray(data)
    flipped[-1] ^= 0xFF
    (ck / "server.safetensors").write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="corrupted"):
        Simulation.resume(tmp_path, task=tiny_task())
    (ck / "meta.json").write_text("{")
    with pytest.raises(CheckpointError, match="meta.json"):
        Simulation.resume(tmp_path, task=tiny_task())
    with pytest.raises(CheckpointError, match="no checkpoint"):
        Simulation.resume(tmp_path / "nothing", task=tiny_task())


def test_interrupted_checkpoint_write_leaves_the_previous_one(tmp_path, monkeypatch):
    sim = Simulation(_cfg("fedit", rounds=3), task=tiny_task(), run_dir=tmp_path)
    sim.run_round()
    import fedlowrank.runtime.checkpoint as ckmod

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckmod.os, "replace", crash)
    with pytest.raises(OSError):
        sim.run_round()
    monkeypatch.undo()
    sim.close()  # as if its process had died: the run directory's lock is released
    assert latest_checkpoint(tmp_path).name == "round-00001"
    assert Simulation.resume(tmp_path, task=tiny_task()).round == 1


def _first_key(reply, suffix):
    return next(k for k in reply.tensors() if k.endswith(suffix))


def _tamper_shape(reply):
    k = _first_key(reply, "lora_A")
    reply[k] = torch.zeros(reply[k].shape[0] + 1, reply[k].shape[1])
    return reply


def _tamper_dtype(reply):
    k = _first_key(reply, "lora_B")
    reply[k] = reply[k].double()
    return reply


def _tamper_nan(reply):
    k = _first_key(reply, "lora_B")
    reply[k] = reply[k].clone()
    reply[k][0, 0] = float("nan")
    return reply


def _tamper_size(reply):
    reply["padding"] = torch.zeros(1 << 20)
    return reply


def _tamper_missing(reply):
    del reply[_first_key(reply, "lora_A")]
    return reply


def _tamper_examples(reply):
    reply["num_examples"] = 10**9
    return reply


@pytest.mark.parametrize("tamper, reason", [
    (_tamper_shape, "expected"), (_tamper_dtype, "expected"), (_tamper_nan, "non-finite"),
    (_tamper_size, "exceeds"), (_tamper_missing, "missing"), (_tamper_examples, "num_examples"),
])
def test_bad_reply_is_rejected_and_leaves_global_state_as_without_it(tamper, reason):
    cfg = load_config("tiny", ["run.rounds=2", "run.clients_per_round=3"])
    honest = Simulation(cfg, task=tiny_task())
    victim = honest.run_round()["clients"][0]
    without = Simulation(load_config("tiny", ["run.rounds=2", "run.clients_per_round=3",
                                              f"run.dropout_schedule=[[1, {victim}]]"]), task=tiny_task())
    without.run()
    attacked = Simulation(cfg, task=tiny_task(),
                          tamper=lambda rnd, k, r: tamper(r) if (rnd, k) == (1, victim) else r)
    attacked.run()
    assert attacked.history[0]["rejected"][0]["client"] == victim
    assert reason in attacked.history[0]["rejected"][0]["reason"]
    for k, v in without.server.items():
        assert torch.equal(v, attacked.server[k])
    assert victim not in attacked.store or victim in without.store


def test_too_few_replies_skip_the_round():
    sim = Simulation(load_config("tiny", ["run.rounds=1", "run.clients_per_round=2", "run.min_replies=2",
                                          "run.dropout_schedule=[[1, 0], [1, 1], [1, 2], [1, 3]]"]), task=tiny_task())
    before = {k: v.clone() for k, v in sim.server.tensors().items()}
    row = sim.run_round()
    assert row["skipped"] and row["bytes_up"] == 0
    assert all(torch.equal(before[k], v) for k, v in sim.server.tensors().items())


def test_dropout_probability_is_seeded():
    a = Simulation(load_config("tiny", ["run.rounds=6", "run.dropout=0.5"]), task=tiny_task())
    a.run()
    b = Simulation(load_config("tiny", ["run.rounds=6", "run.dropout=0.5"]), task=tiny_task())
    b.run()
    assert [r.get("dropped") for r in a.history] == [r.get("dropped") for r in b.history]
    assert any(r.get("dropped") for r in a.history)


def test_divergence_stops_naming_round_and_method_and_keeps_last_checkpoint(tmp_path):
    cfg = load_config("tiny", ["run.rounds=4", "run.checkpoint_every=1"])
    sim = Simulation(cfg, task=tiny_task(), run_dir=tmp_path)
    sim.run_round()
    sim.cfg.train.lr, sim.cfg.train.optimizer = 1e30, "sgd"  # make the next round's training blow up
    with pytest.raises(DivergenceError, match=r"round 2: method 'fedit'"):
        sim.run()
    assert latest_checkpoint(tmp_path).name == "round-00001"


def test_metric_bound_stops_the_run():
    cfg = load_config("tiny", ["run.rounds=3", "run.stop_metric=loss", "run.stop_above=0.1"])
    with pytest.raises(DivergenceError, match="loss"):
        Simulation(cfg, task=tiny_task()).run()

"""The Python API (``fedlowrank.run``): what it returns beside the summary on request, the metrics rows and the
final global state, equal to those of the run directory and of the simulator."""

import json

import torch

import fedlowrank
from fedlowrank.config import load_config
from fedlowrank.runtime.simulator import Simulation

SETS = ["run.rounds=2", "run.eval_every=1"]


def test_run_returns_the_history_and_the_final_state_on_request(tmp_path):
    plain = fedlowrank.run("tiny", SETS)
    assert "history" not in plain and "state" not in plain
    got = fedlowrank.run("tiny", SETS, out=tmp_path / "run", history=True, state=True)
    written = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in got["history"]] == [1, 2]
    assert json.loads(json.dumps(got["history"])) == written
    assert got["history"][-1]["cum_bytes_up"] == got["bytes_up"] == plain["bytes_up"]
    sim = Simulation(load_config("tiny", SETS))
    sim.run()
    assert set(got["state"].tensors()) == set(sim.server.tensors())
    assert all(torch.equal(got["state"][k], sim.server[k]) for k in sim.server.tensors())


def test_a_vectorised_run_returns_its_rows_too():
    config = {"run": {"rounds": 4, "clients_per_round": 2, "eval_every": 2, "seed": 3, "vectorized": True},
              "task": {"kind": "matrix-regression", "options": {"num_clients": 4, "dim": 8, "outputs": 3, "samples": 6}},
              "partition": {"kind": "natural", "num_clients": 4},
              "train": {"optimizer": "sgd", "lr": 0.02, "local_steps": 3, "batch_size": 4},
              "lora": {"rank": 2, "alpha": 2.0}, "method": {"name": "ssf"}}
    got = fedlowrank.run(config, history=True)
    assert [r["round"] for r in got["history"]] == [2, 4]
    assert got["history"][-1]["rel_error"] == got["rel_error"]

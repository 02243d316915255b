"""A real Flower federation (a SuperLink and two SuperNodes, as in test_flower_deployment.py) running SCAFFOLD, where
SuperNode 0's ClientApp is malicious: in round 1 every control-variate delta it sends is a [7, 7] tensor, in rounds 2
and 3 its ``lora_B`` holds 3e38; in round 3 the honest SuperNode 1 fails, so that the bad reply is the round's only
one (measured against round 2's). The ServerApp rejects the three bad replies, the run completes (exit 0), and its
global state is the simulator's with client 0 not replying in any round and client 1 not in round 3."""

from __future__ import annotations

import json
import shutil
import sys
import time

import pytest

pytest.importorskip("flwr")
if sys.platform != "linux":
    pytest.skip("the process clean-up reads /proc", allow_module_level=True)

from helpers import run_tiny  # noqa: E402
from test_flower_deployment import APP, SETS, Federation, assert_close, launched, load_state  # noqa: E402

MALICIOUS = '''
import numpy as np
from flwr.app import Array
from flwr.clientapp import ClientApp

from fedlowrank.runtime.flower import client_app as honest
from fedlowrank.runtime.flower.node import ROUTE

app = ClientApp()
app.query()(honest.query)


@app.train()
def train(msg, context):
    rnd = int(msg.content[ROUTE]["round"])
    if context.node_config["partition-id"] == 1 and rnd == 3:
        raise RuntimeError("the honest node fails in round 3")
    reply = honest.train(msg, context)
    if context.node_config["partition-id"] == 0:
        arrays = reply.content["arrays"]
        for key in list(arrays):
            if rnd == 1 and key.startswith("scaffold.dc/"):
                arrays[key] = Array(np.zeros((7, 7), dtype=np.float32))
            elif rnd >= 2 and key.endswith("lora_B"):
                arrays[key] = Array(np.full(arrays[key].shape, 3e38, dtype=np.float32))
    return reply
'''


@pytest.fixture
def federation(tmp_path):
    yield from launched(Federation(tmp_path))


def test_a_malicious_supernode_cannot_end_a_scaffold_run(federation, tmp_path):
    app = tmp_path / "malicious_app"
    app.mkdir()
    (app / "malicious.py").write_text(MALICIOUS)
    shutil.copy(APP / "pyproject.toml", app / "pyproject.toml")
    text = (app / "pyproject.toml").read_text()
    (app / "pyproject.toml").write_text(text.replace('clientapp = "fedlowrank.runtime.flower.client_app:app"',
                                                     'clientapp = "malicious:app"'))
    run_dir = tmp_path / "run"
    overrides = tmp_path / "run.toml"
    quoted = " ".join(f"'{s}'" for s in (*SETS, "method.name=scaffold"))
    overrides.write_text(f'config = "tiny"\nset = "{quoted}"\n"run.rounds" = 3\n"flower.run-dir" = "{run_dir}"\n'
                         f'"flower.round-timeout" = 120.0\n')
    t0 = time.monotonic()
    cli = federation.launch_app("malicious", "--run-config", str(overrides), app=app)
    assert cli.wait(timeout=300) == 0, federation.dump()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["replied"] for r in rows] == [[1], [1], []]
    assert "expected torch.float32 (2, 32)" in rows[0]["rejected"][0]["reason"], rows[0]["rejected"]
    assert "server.outlier_ratio" in rows[1]["rejected"][0]["reason"], rows[1]["rejected"]
    assert rows[2]["skipped"] and "earlier round" in rows[2]["rejected"][0]["reason"], rows[2]
    assert rows[2]["dropped"] == [1]
    ref = run_tiny("scaffold", *SETS, "run.dropout_schedule=[[1, 0], [2, 0], [3, 0], [3, 1]]", rounds=3)
    assert_close(load_state(run_dir), ref.server)
    print(f"malicious node test: {time.monotonic() - t0:.1f} s")

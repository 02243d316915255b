import pytest

from fedlowrank.config import ConfigError, load_config, parse_override
from fedlowrank.runtime.simulator import Simulation

from helpers import tiny_task


@pytest.mark.parametrize("override, field", [
    ("lora.alpha=0", "lora.alpha"),
    ("lora.alpha=-1", "lora.alpha"),
    ("run.clients_per_round=9", "run.clients_per_round"),
    ("method.name=nope", "method.name"),
    ("method.bogus=1", "method.bogus"),
    ("lora.scaling=sqrt", "lora.scaling"),
    ("train.optimizer=lbfgs", "train.optimizer"),
    ("partition.kind=random", "partition.kind"),
    ("partition.alpha=0", "partition.alpha"),
    ("run.rounds=0", "run.rounds"),
    ("run.rounds=1.5", "run.rounds"),
    ("train.lr=fast", "train.lr"),
    ("lora.dropout=1.0", "lora.dropout"),
    ("server.weighting=median", "server.weighting"),
    ("run.bogus=1", "run.bogus"),
    ("bogus.key=1", "bogus"),
    ("lora.ranks=[2,4]", "lora.ranks"),  # fedit does not support heterogeneous ranks
    ('data.labels=["a","a"]', "data.labels lists a class twice"),
    ('data.labels=["a"]', "data.labels needs at least 2 classes"),
    ('data.labels=["a"," b"]', "data.labels must be a list of non-empty class names"),
    ("data.labels=[1,2]", "data.labels must be a list of non-empty class names"),
    ('data.labels=["a","b"]', "data.labels is for task.kind = 'text-classification'"),  # with matrix below
])
def test_bad_values_fail_naming_the_field(override, field):
    config = "matrix" if "is for task.kind" in field else "tiny"
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(config, [override])


def test_errors_found_when_the_model_is_built():
    with pytest.raises(ValueError, match=r"lora.rank must be in \[1, 32\]"):
        Simulation(load_config("tiny", ["lora.rank=33"]), task=tiny_task())
    with pytest.raises(ValueError, match="lora.targets: 'qkv' matches no nn.Linear"):
        from fedlowrank.tasks import build_task

        Simulation(load_config("tiny", ["lora.targets=['qkv']"]), task=build_task(load_config("tiny", ["lora.targets=['qkv']"])))
    with pytest.raises(ValueError, match="more than the 200 training examples"):
        Simulation(load_config("tiny", ["partition.num_clients=300", "partition.min_partition_size=0"]), task=tiny_task())


def test_overrides_are_typed():
    assert parse_override("lora.ranks=[2, 4]") == (["lora", "ranks"], [2, 4])
    assert parse_override("method.beta=adaptive") == (["method", "beta"], "adaptive")
    assert parse_override("run.seed=3") == (["run", "seed"], 3)
    cfg = load_config("tiny", ["lora.rank=4", "train.lr=0.01", "method.correction=scaffold"])
    assert cfg.lora.rank == 4 and cfg.train.lr == 0.01 and cfg.method_options == {"correction": "scaffold"}
    with pytest.raises(ConfigError, match="section.key"):
        parse_override("rank=4")
    with pytest.raises(ConfigError, match="no file"):
        load_config("does-not-exist.toml")


def test_heterogeneous_ranks_dealt_round_robin():
    cfg = load_config("tiny", ["method.name=fedit"])
    assert cfg.client_ranks() == [2, 2, 2, 2]
    cfg.lora.ranks = [1, 2]
    assert cfg.client_ranks() == [1, 2, 1, 2]


def test_bundled_configs_validate_with_every_compared_method():
    """As ``compare`` configures each method: its preset, then the config's overrides for it."""
    from fedlowrank.config import bundled_configs
    from fedlowrank.methods import preset_overrides

    assert {"main", "tiny", "agnews"} <= set(bundled_configs())
    for name in bundled_configs():
        cfg = load_config(name)
        for method in cfg.compare.methods:
            load_config(name, [f"method.name={method}", *preset_overrides(method),
                               *cfg.compare.overrides.get(method, [])])


def test_agnews_of_the_bundled_config_is_found_from_any_directory(tmp_path, monkeypatch):
    """The bundled config names no folder: FEDLOWRANK_DATA's copy is found whatever the working directory; a
    relative data.path is the working directory's."""
    from fedlowrank.tasks.hub import KNOWN_SETS, local_copy

    assert load_config("agnews").data.path == ""
    for name in ("train.tsv", "test.tsv"):
        (tmp_path / "data" / "agnews").mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / "agnews" / name).write_text("a\tWorld\n")
    monkeypatch.setenv("FEDLOWRANK_DATA", str(tmp_path / "data"))
    (tmp_path / "elsewhere" / "mine").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert local_copy(KNOWN_SETS["agnews"], "") == tmp_path / "data" / "agnews"
    with pytest.raises(FileNotFoundError, match="data.path: 'mine' holds no AG News train.tsv"):
        local_copy(KNOWN_SETS["agnews"], "mine")

"""The method contract's declarations: one declaration of the correction options, and what every registered method
declares agrees with what it implements."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fedlowrank
import fedlowrank.cli
from fedlowrank.message import State
from fedlowrank.methods import available_methods, get_method, preset_overrides
from fedlowrank.message import State
from fedlowrank.methods.base import Corrected, Method
from fedlowrank.schema import declared
from fedlowrank.tasks import available_tasks
from fedlowrank.tasks.base import Task

from helpers import run_tiny

SNAPSHOT = Path(__file__).parent / "data" / "method_declarations.json"
# options that the one corrected base gave methods that lacked them: SCAFFOLD's refresh rule, for the methods that
# allow SCAFFOLD (full fine-tuning, FedGaLore) and for RAVAN (as for every LoRA method refusing SCAFFOLD)
ADDED = {name: {"cv_grad"} for name in ("fedavg-full", "scaffold-full", "fedgalore", "fedgalore-minus", "ravan")}


def _declarations(name, cls) -> dict:
    options = {k: {"default": d.default, "allowed": list(d.setting.allowed()) if d.setting.allowed() else None}
               for k, d in declared(cls).items() if k not in ADDED.get(name, ())}
    return {"options": options, "preset": preset_overrides(name)}


def test_options_defaults_and_presets_unchanged_by_the_corrected_base():
    before = json.loads(SNAPSHOT.read_text())
    after = json.loads(json.dumps({n: _declarations(n, c) for n, c in available_methods().items()}))
    assert {n: after[n] for n in before} == before


def test_the_correction_options_are_declared_once():
    """Every method with a ``correction`` option is a :class:`Corrected`; ``mu`` and ``cv_grad`` are its declarations
    (a method only narrows ``correction``'s default and allowed values)."""
    base = declared(Corrected)
    for name, cls in available_methods().items():
        options = declared(cls)
        if "correction" not in options:
            continue
        assert issubclass(cls, Corrected), name
        for key in ("mu", "cv_grad"):
            assert options[key].setting is base[key].setting, (name, key)
        assert set(options["correction"].setting.allowed()) <= set(base["correction"].setting.allowed()), name


@pytest.mark.parametrize("name, listed, unlisted", [
    ("fedit", {"correction", "mu", "cv_grad"}, set()),
    ("ravan", {"correction", "mu"}, {"cv_grad"}),  # FedProx only: SCAFFOLD's refresh rule cannot apply
    ("scaffold", {"correction", "mu", "cv_grad"}, set()),
    ("local-only", {"correction"}, {"mu", "cv_grad"}),
])
def test_methods_lists_only_the_correction_options_that_can_apply(name, listed, unlisted, capsys):
    cls = available_methods()[name]
    assert listed <= set(cls.listed_options()) and not unlisted & set(cls.listed_options())
    assert fedlowrank.cli.main(["methods", name]) == 0
    out = capsys.readouterr().out
    assert all(f"method.{k} =" in out for k in listed) and not any(f"method.{k} =" in out for k in unlisted)
    corrections = cls.listed_options()["correction"].meaning.split(" (")[0]  # the why after it may name others
    assert ("SCAFFOLD" in corrections) == ("cv_grad" in listed) and ("FedProx" in corrections) == ("mu" in listed)


@pytest.mark.parametrize("name, key, value", [("ravan", "cv_grad", "last"), ("local-only", "mu", 0.1),
                                                 ("centralized", "cv_grad", "option2")])
def test_setting_an_option_the_method_does_not_use_is_refused_at_config_time(name, key, value):
    from fedlowrank.config import load_config
    from fedlowrank.schema import ConfigError

    with pytest.raises(ConfigError, match=rf"method\.{key} = .* changes nothing in method '{name}' "
                                          rf"\(`fedlowrank methods {name}` lists"):
        load_config("tiny", [f"method.name={name}", f"method.{key}={value!r}".replace("'", '"')])
    default = declared(available_methods()[name])[key].default  # the default, as a config.json may hold it, passes
    assert load_config("tiny", [f"method.name={name}", f"method.{key}={default!r}".replace("'", '"')])
    assert load_config("tiny", ["method.name=fedit", f"method.{key}={value!r}".replace("'", '"')])  # fedit uses both


def test_a_corrected_method_makes_its_corrections_from_its_options():
    for name in ("fedit", "fedavg-full", "florg", "ravan"):
        method = get_method(name, correction="fedprox", mu=0.5)
        assert [type(c).__name__ for c in method.composed_corrections()] == ["FedProx"], name
        assert method.composed_corrections()[0].mu == 0.5


def test_each_prepared_fit_has_its_own_corrections_and_changes_nothing_of_the_method():
    """Two clients' fits prepared one after the other (as a cohort prepares its members') each hold their own
    started copies of the composed corrections; the method's own stay as made."""
    from fedlowrank.runtime.engine import client_trainer

    sim = run_tiny("fedit", "method.correction=fedprox+scaffold", "run.clients_per_round=2", rounds=1)
    method, before = sim.method, dict(vars(sim.method))
    fits = []
    for k in (0, 1):
        view = sim.model.shared_copy()
        trainer = client_trainer(view, sim.task, sim.parts[k], sim.cfg, k, 2)
        fits.append(method.prepare_fit(view, method.broadcast(sim.server, k, 2), State(), trainer))
    ids = [{id(c) for c in fit.corrections} for fit in fits]
    assert len(ids[0]) == len(ids[1]) == 2 and not ids[0] & ids[1]
    assert not ids[0] & {id(c) for c in method.composed_corrections()}
    assert fits[0].corrections[0]._anchor.keys() == fits[0].params.keys()
    assert vars(method) == before


def test_supports_cohorts_is_derived_from_the_two_phases():
    """A method trains in cohorts exactly when it has prepare_fit and finish_fit and keeps Method.train; declaring
    it is refused."""
    for name, cls in available_methods().items():
        phases = cls.prepare_fit is not Method.prepare_fit and cls.finish_fit is not Method.finish_fit
        assert cls.supports_cohorts == (phases and cls.train is Method.train), name
    with pytest.raises(TypeError, match="supports_cohorts is derived"):
        type("Declares", (Method,), {"supports_cohorts": True})


# -- optional hooks: declared, and the declarations agree with what each method does ---------------------------
# settings under which a declared per-client downlink shows (RAVAN's: clients training different heads)
PROBE_SETTINGS = {"ssf": ["train.optimizer=sgd", "train.lr=0.05"], "fedsub": ["train.optimizer=sgd", "train.lr=0.05"],
                  "ravan": ["method.client_heads=[1, 3]"], "fedlease": ["method.warmup_rounds=1"],
                  "fslora": ["lora.ranks=[1]", "lora.server_rank=2"]}


def _same(a, b) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
                                    for k in a)


@pytest.fixture(scope="module")
def one_round_each():
    """Every registered method after one round of 3 clients on the tiny task (one local step each)."""
    runs = {}
    for name in available_methods():
        runs[name] = run_tiny(name, "partition.num_clients=3", "run.clients_per_round=3", "train.local_steps=1",
                              *PROBE_SETTINGS.get(name, []), rounds=1)
    return runs


def test_per_client_downlink_is_declared_exactly_by_the_methods_that_have_one(one_round_each):
    """Undeclared: two clients of equal rank receive the same message; declared: they do not (after a round)."""
    for name, sim in one_round_each.items():
        m = sim.method
        same = _same(m.broadcast(sim.server, 0, 2), m.broadcast(sim.server, 1, 2))
        assert m.per_client_downlink != same, name


def test_client_state_is_declared_exactly_by_the_methods_that_keep_one(one_round_each):
    """``keeps_client_state()`` (the method's ``client_state`` or a composed correction's) iff a client's state is
    non-empty after it trained; a method declaring none starts every client from an empty state."""
    for name, sim in one_round_each.items():
        m = sim.method
        kept = any(sim.store.get(k) for k in range(3) if sim.store.get(k) is not None)
        assert m.keeps_client_state() == kept, name
        if not m.client_state:
            assert len(m.init_client(0)) == 0, name
    assert get_method("fedit", correction="scaffold").keeps_client_state()
    assert not get_method("fedit").keeps_client_state()


def test_upload_templates_name_every_reply_tensor_and_exact_entries_are_patterns(one_round_each):
    """Every tensor an honest reply carries (``upload_spec`` of each client's broadcast, after a round) is named by
    one of the method's ``upload_templates()`` (error feedback's residuals in a client's state are checked against
    them); no message name starts with the codecs' reserved ``@``; ``exact_entries`` are shell patterns."""
    from fedlowrank.codecs import PART, RESIDUAL
    from fedlowrank.runtime.checkpoint import StateSchema

    for name, sim in one_round_each.items():
        m = sim.method
        schema = StateSchema(State(), tuple(RESIDUAL + t for t in m.upload_templates()), sim.server,
                             sim.model.target_names, list(sim.model.head_parameters()), 3)
        for k in range(3):
            down = m.broadcast(sim.server, k, 2)
            assert not any(key.startswith(PART) for key in down), name
            for key, spec in m.upload_spec(down, 2).items():
                assert not key.startswith(PART), (name, key)
                assert schema.problem({RESIDUAL + key: torch.zeros(spec.shape, dtype=spec.dtype)}) is None, (name, key)
        assert all(isinstance(p, str) and p for p in m.exact_entries), name
    fedit = one_round_each["fedit"]
    schema = StateSchema(State(), tuple(RESIDUAL + t for t in fedit.method.upload_templates()), fedit.server,
                         fedit.model.target_names, list(fedit.model.head_parameters()), 3)
    assert schema.problem({RESIDUAL + "scaffold.dc/head/classifier.weight": torch.zeros(2)}) is not None
    assert get_method("fedit", correction="scaffold").upload_templates()[-1] == "scaffold.dc/{key}"


def test_a_vectorised_round_is_declared_exactly_by_the_methods_that_have_one():
    """``batched`` iff the class defines ``batched_round`` itself or inherits one it declares (FedGaLore inherits
    FedAvg-full's and declares it does not apply); the same for a task's ``batched_grad``."""
    for name, cls in available_methods().items():
        own = next(c for c in cls.__mro__ if "batched_round" in c.__dict__) is not Method
        assert cls.batched <= own, name
        assert cls.batched or "batched_round" not in cls.__dict__, name
    for kind, cls in available_tasks().items():
        assert cls.batched == (cls.batched_grad is not Task.batched_grad), kind


def test_the_vectorised_runner_reads_the_declarations():
    from fedlowrank.config import load_config
    from fedlowrank.runtime.vectorized import check_vectorizable

    check_vectorizable(load_config("matrix", ["method.name=fedavg-full"]))
    for sets in (["method.name=fedgalore", "method.state_sync=none"], ["method.name=fedit"]):
        with pytest.raises(ValueError, match="no vectorised round"):
            check_vectorizable(load_config("matrix", sets))


def test_no_runtime_probes_a_method_or_task_with_hasattr():
    """Optional hooks are declarations: nothing in the runtimes looks for them by name."""
    src = Path(fedlowrank.__file__).parent
    for path in [*(src / "runtime").rglob("*.py"), src / "config" / "checks.py"]:
        text = path.read_text()
        for hook in ("batched_round", "batched_grad", "init_client", "load_personal", "prepare_fit"):
            assert f'"{hook}")' not in text, (path, hook)


# -- rank, optimizer and server-step requirements: checked at config time from the declarations -----------------
@pytest.mark.parametrize("sets,message", [
    (["method.name=ssf", "train.optimizer=adamw"],
     "train.optimizer = 'adamw': method 'ssf' needs one of sgd (the local steps are the paper's plain SGD"),
    (["method.name=fedsub", "train.optimizer=momentum"], "train.optimizer = 'momentum': method 'fedsub' needs one of sgd"),
    (["method.name=fedgalore", "train.optimizer=sgd"],
     "train.optimizer = 'sgd': method 'fedgalore' needs one of adam, adamw (method.state_sync = 'ajive'"),
    (["method.name=florg", "server.lr=1.5"],
     "server.lr = 1.5: method 'florg' needs server.lr <= 1 (Q must stay positive semi-definite)"),
    (["method.name=fedalt", "lora.ranks=[2, 4]"], "lora.ranks: method 'fedalt' does not support heterogeneous ranks: "
                                                  "the Rest-of-World is a mean of factors"),
    (["method.name=florg", "lora.ranks=[2, 4]"], "lora.ranks: method 'florg' does not support heterogeneous ranks"),
])
def test_a_requirement_is_refused_at_config_time_in_one_line(sets, message):
    from fedlowrank.config import load_config
    from fedlowrank.schema import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config("tiny", sets)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_what_a_requirement_allows_passes():
    from fedlowrank.config import load_config

    load_config("tiny", ["method.name=fedgalore", "train.optimizer=sgd", "method.state_sync=none"])
    load_config("tiny", ["method.name=florg", "server.lr=1.0"])
    load_config("tiny", ["method.name=ssf", "train.optimizer=sgd"])


@pytest.mark.parametrize("correction,noted", [("scaffold", True), ("none", False)])
def test_resuming_a_flower_checkpoint_notes_lost_client_states_only_for_a_method_that_keeps_them(tmp_path, correction,
                                                                                                   noted):
    from fedlowrank.runtime.simulator import Simulation

    from helpers import tiny_config, tiny_task

    cfg = tiny_config("method.name=fedit", f"method.correction={correction}", "run.rounds=1")
    sim = Simulation(cfg, task=tiny_task(), run_dir=tmp_path / "run")
    sim.client_states = False  # as the Flower server's run: the clients' states stayed on the nodes
    sim.run()
    sim.close()
    notes: list[str] = []
    resumed = Simulation.resume(tmp_path / "run", task=tiny_task(), warn=notes.append)
    resumed.close()
    assert any("stayed on the SuperNodes" in n for n in notes) == noted

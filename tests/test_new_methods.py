"""What FedSVD, FedRot-LoRA and RAVAN share: ``fedlowrank methods NAME`` shows every declaration and why mixed ranks
are refused; a tampered reply is rejected and leaves the global state as without it; their protocols in
benchmarks/protocols.py resolve to valid configs, RAVAN's at FedIT's number of trained parameters."""

import json

import pytest
import torch
from helpers import benchmark_module, tiny_config, tiny_task
from test_florg_protocol import protocols  # noqa: F401  (the fixture)

from fedlowrank.cli import main
from fedlowrank.config import load_config
from fedlowrank.experiments.compare import method_settings, setup_of
from fedlowrank.experiments.stats import mean_interval
from fedlowrank.methods import available_methods
from fedlowrank.runtime.simulator import Simulation

METHODS = ["fedsvd", "fedrot-lora", "ravan"]


@pytest.mark.parametrize("name", METHODS)
def test_methods_name_shows_every_option_that_applies_and_why_mixed_ranks_are_refused(name, capsys):
    assert main(["methods", name]) == 0
    out = capsys.readouterr().out
    cls = available_methods()[name]
    assert out.startswith(f"{name}\n  {cls.description}\n  paper: {cls.paper}\n") and "arXiv:" in cls.paper
    assert f"\n  equal client ranks only: {cls.heterogeneous_ranks_refusal}\n" in out and "privacy: central, local" in out
    for key, d in cls.listed_options().items():
        assert f"    method.{key} = {json.dumps(d.default, ensure_ascii=False)}\n        {d.meaning}\n" in out, key


def _first(reply, marker):
    return next(k for k in sorted(reply.tensors()) if marker in k)


TAMPER = {"a wrong shape": lambda r, k: r.update({k: torch.zeros(r[k].shape[0] + 1, r[k].shape[1])}),
          "float64": lambda r, k: r.update({k: r[k].double()}),
          "a missing tensor": lambda r, k: r.pop(k),
          "an extra tensor": lambda r, k: r.update({k + "x": r[k]})}


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("tamper", sorted(TAMPER))
def test_a_tampered_reply_is_rejected_and_the_round_aggregates_without_it(name, tamper):
    marker = ".ravan_H." if name == "ravan" else ".lora_B"
    sets = [f"method.name={name}", "run.rounds=1", "run.clients_per_round=3"]
    honest = Simulation(tiny_config(*sets), task=tiny_task())
    victim = honest.run_round()["clients"][0]
    without = Simulation(tiny_config(*sets, f"run.dropout_schedule=[[1, {victim}]]"), task=tiny_task())
    without.run()

    def attack(rnd, k, reply):
        if k == victim:
            TAMPER[tamper](reply, _first(reply, marker))
        return reply

    attacked = Simulation(tiny_config(*sets), task=tiny_task(), tamper=attack)
    attacked.run()
    assert [r["client"] for r in attacked.history[0]["rejected"]] == [victim]
    for k, v in without.server.items():
        assert torch.equal(v, attacked.server[k]) if isinstance(v, torch.Tensor) else v == attacked.server[k], k

NAMES = ["fedrot-10", "fedrot-50", "fedsvd", "fedsvd-dp", "ravan-params"]


def resolved(p, method: str):
    base = load_config(p.config, [f"method.name={method}", *p.sets])
    return load_config(p.config, method_settings(base, method, p.sets))


@pytest.mark.parametrize("name", NAMES)
def test_every_method_of_the_protocol_resolves_to_a_valid_config(protocols, name):  # noqa: F811
    p = protocols[name]
    assert len(p.seeds.split(",")) >= 6 and p.reference == p.methods[0]
    for method in p.methods:
        assert resolved(p, method).method_name == method


def test_ravan_trains_as_many_parameters_per_target_as_fedit(protocols):  # noqa: F811
    p = protocols["ravan-params"]
    ravan, fedit = resolved(p, "ravan"), resolved(p, "fedit")
    d = 384                                                   # MiniLM-L6's hidden size: query, value are 384×384
    assert ravan.method_options["heads"] * ravan.lora.rank ** 2 == fedit.lora.rank * (d + d) == 3072
    assert resolved(protocols["fedrot-50"], "fedit").partition.num_clients == 50


@pytest.mark.parametrize("name", ["fedsvd", "fedsvd-dp"])
def test_fedsvd_protocols_train_every_method_with_plain_sgd_at_one_step_size(protocols, name):  # noqa: F811
    """FedSVD's code trains FedSVD, FFA-LoRA and FedIT alike; FedIT's AdamW preset must not decide the verdict."""
    for method in protocols[name].methods:
        cfg = resolved(protocols[name], method)
        assert (cfg.train.optimizer, cfg.train.head_lr) == ("sgd", 0.0), method


def test_fedlease_s_verdict_reads_the_runs_fedalt_s_protocol_compared(tmp_path):
    """``fedlease-tasks`` makes no runs: it is ``fedalt-tasks``'s comparison read against FedLEASE."""
    module = benchmark_module("protocols")
    fedalt, fedlease = module.PROTOCOLS["fedalt-tasks"], module.PROTOCOLS["fedlease-tasks"]
    assert fedlease.runs_of == "fedalt-tasks" and fedlease.reference == "fedlease" and fedalt.reference == "fedalt"
    assert (set(fedlease.methods), fedlease.sets, fedlease.config) == (set(fedalt.methods), fedalt.sets, fedalt.config)
    with pytest.raises(SystemExit, match="run protocol fedalt-tasks first"):
        module.run_protocol("fedlease-tasks", tmp_path, 1, smoke=False)
    rows = [{"method": m, "lr": 1e-3, "head_lr": 0.0, "optimizer": "adamw", "weighting": "num_examples",
             "settings": [], "in_force": [], "reference_row": None,
             "runs": [{"seed": s, "final": 0.1 * s + i / 100, "best": 0.1 * s + i / 100} for s in range(6)],
             "final": mean_interval([0.1 * s + i / 100 for s in range(6)]).to_dict(),
             "best": mean_interval([0.1 * s + i / 100 for s in range(6)]).to_dict(),
             "bytes_up": 0.0, "bytes_down": 0.0, "time": 1.0, "epsilon": None}
            for i, m in enumerate(fedalt.methods)]
    done = tmp_path / "fedalt-tasks" / "compare" / "results.json"
    done.parent.mkdir(parents=True)
    done.write_text(json.dumps({"metric": "exact_match", "metric_description": "exact_match", "higher_is_better": True,
                                "confidence": 0.95, "alpha": 0.05, "seeds": list(range(6)),
                                "setup": setup_of(load_config(fedalt.config, fedalt.sets), {"num_train": 1200},
                                                  list(range(6))),
                                "reference": "fedalt", "tuned": None, "rows": rows, "paired": []}))
    results = module.run_protocol("fedlease-tasks", tmp_path, 1, smoke=False)
    assert results["reference"] == "fedlease" and {p["method"] for p in results["paired"]} == {"fedalt", "fedit",
                                                                                                "local-only"}
    wins = {p["method"]: (p["final"]["wins"], p["final"]["losses"]) for p in results["paired"]}
    assert wins == {"fedalt": (0, 6), "fedit": (6, 0), "local-only": (6, 0)}  # 0.01 below, 0.01 and 0.02 above
    assert json.loads((tmp_path / "fedlease-tasks" / "results.json").read_text())["reference"] == "fedlease"
    assert "fedlease" in (tmp_path / "fedlease-tasks" / "results.md").read_text()
    with pytest.raises(SystemExit, match="--seeds 8: protocol fedalt-tasks compared seeds"):
        module.run_protocol("fedlease-tasks", tmp_path, 1, smoke=False, seeds=8)

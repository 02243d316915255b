"""Export of personalised methods' clients (``--client N|all``): FedALT's and FedLEASE's routed mixtures written
with ``--format routed`` and loaded back over a fresh base reproduce the run's own evaluation of each client;
FedSA-LoRA's client exports as a PEFT LoRA; bad ``--client`` values and formats get one line naming the field."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_config, tiny_task

from fedlowrank.adapters.routed import RoutedLoRALinear
from fedlowrank.cli import main
from fedlowrank.export import ROUTED_CONFIG, ROUTED_WEIGHTS, export_run, load_peft, load_routed
from fedlowrank.runtime.evaluation import scalar_metrics
from fedlowrank.runtime.simulator import Simulation


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Finished 2-round tiny runs (4 clients, all sampled every round) with checkpoints, by method."""
    out = {}
    for method in ("fedalt", "fedlease", "fedsa-lora", "fedit"):
        run_dir = tmp_path_factory.mktemp(method)
        sim = Simulation(tiny_config(f"method.name={method}", "run.rounds=2", "run.clients_per_round=4",
                                     "run.checkpoint_every=1", "train.lr=0.02"), task=tiny_task(), run_dir=run_dir)
        sim.run()
        out[method] = (run_dir, sim)
    return out


def recorded(sim: Simulation, client: int) -> dict[str, float]:
    """The run's own test metrics of ``client``'s model at its last round (its ``per_client`` entry)."""
    entry = next(e for e in sim.history[-1]["per_client"] if e["client"] == client)
    return scalar_metrics(entry["test"])


def fresh_base(report: dict):
    """The base the export names, loaded with transformers as a user would."""
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(report["base_model"],
                                                              num_labels=len(report["id2label"]))


@pytest.mark.parametrize("method", ["fedalt", "fedlease"])
def test_a_routed_clients_export_reproduces_the_runs_evaluation_of_that_client(runs, tmp_path, method):
    run_dir, sim = runs[method]
    report = export_run(run_dir, tmp_path / "c1", "routed", task=tiny_task(), client=1)
    assert {ROUTED_WEIGHTS, ROUTED_CONFIG, "README.md", "export.json"} <= set(report["files"])
    assert report["client"] == 1 and report["check"]["recorded"] == recorded(sim, 1)
    net = load_routed(fresh_base(report), tmp_path / "c1")
    assert all(isinstance(net.get_submodule(n), RoutedLoRALinear) for n in sim.model.target_names)
    again = scalar_metrics(sim.task.evaluate(net))
    for key, value in recorded(sim, 1).items():
        assert again[key] == pytest.approx(value, abs=1e-5), key
    card = (tmp_path / "c1" / "README.md").read_text()
    assert "client: 1's own model" in card and "load_routed(base, 'c1')" in card


def test_fedalts_client_export_holds_its_own_lora_its_rest_of_world_and_its_router(runs, tmp_path):
    """What client k serves: its own factors and router (its state) and the leave-one-out mean of the others'
    latest uploads as the second expert."""
    from safetensors.torch import load_file

    run_dir, sim = runs["fedalt"]
    export_run(run_dir, tmp_path / "c2", "routed", task=tiny_task(), client=2)
    tensors = load_file(str(tmp_path / "c2" / ROUTED_WEIGHTS))
    state, row = sim.store[2], sim.method.rest_of_world(sim.server, 2)
    for name in sim.model.target_names:
        torch.testing.assert_close(tensors[f"{name}.lora_A"], state[f"{name}.lora_A"])
        torch.testing.assert_close(tensors[f"{name}.router"], state[f"{name}.router"])
        torch.testing.assert_close(tensors[f"{name}.others_B"], row[f"{name}.lora_B"][None])
    for key, value in state.tensors().items():
        if key.startswith("classifier"):
            torch.testing.assert_close(tensors[f"head/{key.removeprefix('head/')}"], value)


def test_every_clients_export_is_one_named_folder_each(runs, tmp_path):
    run_dir, sim = runs["fedlease"]
    assert main(["export", str(run_dir), "--format", "routed", "--client", "all", "--out", str(tmp_path / "all")]) == 0
    top = json.loads((tmp_path / "all" / "export.json").read_text())
    assert top["clients"] == [0, 1, 2, 3] and sorted(top["check"]) == ["0", "1", "2", "3"]
    for k in range(4):
        folder = tmp_path / "all" / f"client-{k}"
        report = json.loads((folder / "export.json").read_text())
        assert report["client"] == k and (folder / ROUTED_WEIGHTS).is_file()
        assert report["check"]["exported"] == pytest.approx(recorded(sim, k), abs=1e-5)
    assert (tmp_path / "all" / ".fedlowrank-run").is_file()


def test_the_cli_names_a_clients_export_folder_after_the_client(runs, capsys):
    run_dir, _ = runs["fedalt"]
    assert main(["export", str(run_dir), "--format", "routed", "--client", "3"]) == 0
    assert (run_dir / "export-routed-client-3" / ROUTED_WEIGHTS).is_file()


def test_a_lora_clients_export_is_a_peft_adapter_of_its_own_model(runs, tmp_path):
    """FedSA-LoRA: client k's own B with the shared A, as PEFT loads it."""
    run_dir, sim = runs["fedsa-lora"]
    report = export_run(run_dir, tmp_path / "c0", "peft", task=tiny_task(), client=0)
    peft_model = load_peft(tiny_task().build_model().net, tmp_path / "c0")
    assert scalar_metrics(sim.task.evaluate(peft_model)) == pytest.approx(recorded(sim, 0), abs=1e-5)
    assert report["check"]["exported"] == pytest.approx(report["check"]["recorded"], abs=1e-5)


@pytest.mark.parametrize("method, fmt, client, message", [
    ("fedalt", "routed", 4, r"--client must be a client index in 0\.\.3 or 'all', got 4"),
    ("fedalt", "routed", -1, r"--client must be a client index in 0\.\.3"),
    ("fedit", "peft", 0, "--client applies to personalised methods .* method 'fedit' trains one global model"),
    ("fedit", "routed", None, "--format routed holds routed mixtures of LoRA experts .* use --format peft or merged"),
    ("fedalt", "peft", 0, "routed mixture of LoRA experts .* export it with --format routed"),
    ("fedlease", "merged", None, "routed mixture of LoRA experts .* export it with --format routed"),
    ("fedalt", "routed", None, None),  # the global model: allowed
])
def test_bad_client_or_format_is_one_line(runs, tmp_path, method, fmt, client, message):
    run_dir, _ = runs[method]
    if message is None:
        assert export_run(run_dir, tmp_path / "x", fmt, task=tiny_task(), client=client)["format"] == fmt
        return
    with pytest.raises(ValueError, match=message):
        export_run(run_dir, tmp_path / "x", fmt, task=tiny_task(), client=client)
    assert not (tmp_path / "x").exists()


def test_a_client_that_never_trained_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    sim = Simulation(tiny_config("method.name=fedalt", "run.rounds=1", "run.clients_per_round=2",
                                 "run.checkpoint_every=1"), task=tiny_task(), run_dir=run_dir)
    sim.run()
    missing = next(k for k in range(4) if k not in sim.store)
    with pytest.raises(ValueError, match=f"--client {missing}: client {missing} never trained in this run"):
        export_run(run_dir, tmp_path / "x", "routed", task=tiny_task(), client=missing)


def test_a_client_that_is_not_a_number_is_one_cli_line(runs, capsys):
    run_dir, _ = runs["fedalt"]
    assert main(["export", str(run_dir), "--format", "routed", "--client", "first"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --client must be a client index (0, 1, ...) or 'all', got 'first'"]

"""Export round trips: PEFT adapters (exact and SVD re-factorised) and merged models, loaded back by PEFT and
transformers and compared with the run's own global model."""

import json
import warnings

import pytest
import torch
from helpers import tiny_config, tiny_task
from safetensors.torch import load_file, save_file

from fedlowrank.cli import main
from fedlowrank.export import (
    _lora_from_run,
    _save_peft,
    export_run,
    load_global_simulation,
    load_peft,
)
from fedlowrank.runtime.simulator import Simulation


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Finished 2-round tiny runs with checkpoints, and their in-memory global models (the reference)."""
    out = {}
    for key, sets in {"fedit": ["method.name=fedit"], "fedit-rslora": ["method.name=fedit", "lora.scaling=rslora"],
                      "fedex-lora": ["method.name=fedex-lora"], "fedavg-full": ["method.name=fedavg-full"]}.items():
        run_dir = tmp_path_factory.mktemp(key)
        sim = Simulation(tiny_config(*sets, "run.checkpoint_every=1", "train.lr=0.02"), task=tiny_task(),
                         run_dir=run_dir)
        sim.run()
        sim.method.load_global(sim.model, sim.server)
        out[key] = (run_dir, sim)
    return out


def _logits(net) -> torch.Tensor:
    task = tiny_task()
    with torch.no_grad():
        return net.eval()(input_ids=task.test_ids[:16], attention_mask=task.test_mask[:16]).logits


def _pristine():
    return tiny_task().build_model().net


def _load_strict(path):
    """PeftModel.from_pretrained, failing on any missing/unexpected-keys warning; then load the same adapter a
    second time through load_adapter to read PEFT's own missing/unexpected key lists."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(missing|unexpected).*")
        peft_model = load_peft(_pristine(), path)
    result = peft_model.load_adapter(str(path), adapter_name="again")
    return peft_model, result


@pytest.mark.parametrize("key", ["fedit", "fedit-rslora"])
def test_peft_round_trip_of_a_lora_run_is_exact(runs, tmp_path, key):
    run_dir, sim = runs[key]
    report = export_run(run_dir, tmp_path / "peft", "peft", task=tiny_task())
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(report["files"]) and not report["svd"]
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["classifier"] and config["r"] == 2 and config["lora_alpha"] == 4.0
    assert config["use_rslora"] == (key == "fedit-rslora")
    peft_model, result = _load_strict(tmp_path / "peft")
    assert result.missing_keys == [] and result.unexpected_keys == []
    for name, mod in sim.model.adapters().items():
        layer = peft_model.base_model.model.get_submodule(name)
        assert layer.lora_B["default"].weight.abs().max() > 0  # the pitfall: keys loaded but lora_B left at 0
        assert torch.allclose(layer.get_delta_weight("default"), mod.adapter_delta(), atol=1e-6)
    assert torch.allclose(_logits(peft_model), _logits(sim.model.net), atol=1e-5)
    assert report["check"]["exported"]["loss"] == pytest.approx(report["check"]["run"]["loss"], abs=1e-5)


def test_cli_export_writes_into_the_run_directory_by_default(runs, capsys):
    run_dir, _ = runs["fedit"]
    assert main(["export", str(run_dir), "--rank", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["out_dir"] == str(run_dir / "export-peft-r1") and report["svd"] and report["peft"]["r"] == 1
    assert (run_dir / "export-peft-r1" / "adapter_model.safetensors").is_file()


def test_keys_without_the_peft_prefix_are_caught(runs, tmp_path):
    """The known pitfall: LoRA keys without ``base_model.model.`` load "successfully" with lora_B left at zero."""
    run_dir, _ = runs["fedit"]
    path = tmp_path / "peft"
    export_run(run_dir, path, "peft", task=tiny_task())
    weights = load_file(str(path / "adapter_model.safetensors"))
    save_file({k.removeprefix("base_model.model.") if ".lora_" in k else k: v for k, v in weights.items()},
              str(path / "adapter_model.safetensors"))
    with pytest.raises(UserWarning, match="missing adapter keys"):
        _load_strict(path)


def test_heterogeneous_module_ranks_and_scales_round_trip(runs, tmp_path):
    """Modules of different ranks go to rank_pattern; B is rescaled so PEFT's α/r reproduces each module's s."""
    model = load_global_simulation(runs["fedit"][0], tiny_task()).model  # a copy of the global model to modify
    name = model.target_names[0]
    gen = torch.Generator().manual_seed(0)
    mod = model.target(name)
    mod.set_factors(torch.randn(1, mod.in_features, generator=gen), torch.randn(mod.out_features, 1, generator=gen))
    mod.scale = 0.3  # a scale off the α/r rule (as ILoRA sets it)
    factors, alpha, rule = _lora_from_run(model)
    info = _save_peft(model, _pristine(), factors, alpha, rule, tmp_path)
    assert info["rank_pattern"] == {name: 1}
    peft_model, result = _load_strict(tmp_path)
    assert result.unexpected_keys == [] and result.missing_keys == []
    assert torch.allclose(_logits(peft_model), _logits(model.net), atol=1e-5)


@pytest.mark.parametrize("method", ["fedex-lora", "fedavg-full"])
def test_plain_peft_export_of_a_non_lora_update_is_refused(runs, tmp_path, method):
    run_dir, _ = runs[method]
    with pytest.raises(ValueError, match=r"not a rank-r LoRA.*--rank.*--format merged"):
        export_run(run_dir, tmp_path / "x", "peft", task=tiny_task())
    assert main(["export", str(run_dir), "--out", str(tmp_path / "y")]) == 2  # the CLI says it and exits 2
    assert not (tmp_path / "y").exists()


@pytest.mark.parametrize("method", ["fedex-lora", "fedavg-full"])
def test_svd_export_reports_the_true_error_and_is_exact_at_full_rank(runs, tmp_path, method):
    run_dir, sim = runs[method]
    pristine = _pristine()
    truth = {}
    for name in sim.model.target_names:
        mod = sim.model.target(name)
        w = mod.frozen_weight() + mod.adapter_delta() if hasattr(mod, "frozen_weight") else mod.weight
        truth[name] = (w - pristine.get_submodule(name).weight).detach().double()
    report = export_run(run_dir, tmp_path / "r1", "peft", rank=1, task=tiny_task())
    peft_model, result = _load_strict(tmp_path / "r1")
    assert result.missing_keys == [] and result.unexpected_keys == []
    num = den = 0.0
    for name, delta in truth.items():
        exported = peft_model.base_model.model.get_submodule(name).get_delta_weight("default").double()
        err = float(torch.linalg.norm(delta - exported))
        assert report["rel_error"][name] == pytest.approx(err / float(torch.linalg.norm(delta)), rel=1e-4)
        assert report["rel_error"][name] > 0.05  # a rank-1 truncation of these updates loses something
        num, den = num + err ** 2, den + float(torch.linalg.norm(delta)) ** 2
    assert report["rel_error_overall"] == pytest.approx((num / den) ** 0.5, rel=1e-4)

    full = export_run(run_dir, tmp_path / "r32", "peft", rank=32, task=tiny_task())
    assert full["rel_error_overall"] < 1e-6
    assert torch.allclose(_logits(_load_strict(tmp_path / "r32")[0]), _logits(sim.model.net), atol=1e-4)
    with pytest.raises(ValueError, match=r"--rank must be in \[1, 32\]"):
        export_run(run_dir, tmp_path / "r33", "peft", rank=33, task=tiny_task())


def test_merged_export_loads_with_transformers_and_leaves_the_run_untouched(runs, tmp_path):
    from transformers import AutoModelForSequenceClassification

    run_dir, sim = runs["fedex-lora"]  # a base delta and a LoRA: both must be merged
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    report = export_run(run_dir, tmp_path / "merged", "merged", task=tiny_task())
    assert "model.safetensors" in report["files"] and "config.json" in report["files"]
    net = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "merged"))
    assert torch.allclose(_logits(net), _logits(sim.model.net), atol=1e-5)
    assert not torch.allclose(_logits(net), _logits(_pristine()), atol=1e-3)  # the update is really there
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    with pytest.raises(ValueError, match="--rank applies to --format peft only"):
        export_run(run_dir, tmp_path / "m2", "merged", rank=2, task=tiny_task())

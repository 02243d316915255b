"""LLaMA and GPT-2 shapes for every method: peft-style target selection, non-square targets (tiny-llama's k/v
projections are 32 → 16), GPT-2's fused Conv1D as targets, and PEFT export round trips of causal LMs."""

import json

import pytest
import torch
from helpers import tiny_config, tiny_task
from lm_helpers import RandomTokensLM, lm_config, lm_task

from fedlowrank.adapters.targets import resolve_targets
from fedlowrank.config import ConfigError
from fedlowrank.export import export_run
from fedlowrank.methods import available_methods
from fedlowrank.models.loading import Conv1DLinear, load_model, pretrained_id
from fedlowrank.runtime.simulator import Simulation

LAYER0 = "model.layers.0.self_attn."


# -- target selection (peft's target_modules semantics) -------------------------------------------------------
def test_targets_follow_peft_semantics():
    net = load_model("tiny-llama", "causal-lm").net
    out = ("lm_head",)
    assert resolve_targets(net, ["q_proj", "v_proj"], out) == [
        f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qv"]
    assert resolve_targets(net, ["self_attn.k_proj", f"{LAYER0}o_proj"], out) == [
        f"{LAYER0}k_proj", f"{LAYER0}o_proj", "model.layers.1.self_attn.k_proj"]
    assert resolve_targets(net, r".*\.1\.self_attn\.(q|v)_proj", out) == [
        "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]
    everything = resolve_targets(net, "all-linear", out)
    assert len(everything) == 14 and "lm_head" not in everything  # 7 linears per layer, never the output layer
    assert resolve_targets(net, ["all-linear"], out) == everything
    with pytest.raises(ValueError, match="lora.targets: 'query' matches no nn.Linear module; allowed suffixes: "
                                         "down_proj, gate_proj, k_proj"):
        resolve_targets(net, ["query"], out)
    with pytest.raises(ValueError, match="lora.targets: the regular expression 'q_proj' matches no nn.Linear"):
        resolve_targets(net, "q_proj", out)  # a string is a full-match regex, as in peft
    with pytest.raises(ValueError, match="not a valid regular expression"):
        resolve_targets(net, "(", out)


def test_config_takes_a_target_list_a_regex_or_all_linear():
    assert tiny_config("lora.targets=all-linear").lora.targets == "all-linear"
    assert tiny_config('lora.targets=["query", "key"]').lora.targets == ["query", "key"]
    assert tiny_config(r"lora.targets=.*\.0\..*query").lora.targets == r".*\.0\..*query"
    with pytest.raises(ConfigError, match="lora.targets must be a list"):
        tiny_config("lora.targets=3")


# -- every method on a LLaMA with non-square targets ----------------------------------------------------------
@pytest.mark.parametrize("method", sorted(available_methods()))
def test_every_method_runs_a_round_on_tiny_llama_with_non_square_targets(method):
    task = lm_task("tiny-llama", ("q_proj", "k_proj", "v_proj"))
    sim = Simulation(lm_config(method), task=task)
    assert (sim.model.base_linear(f"{LAYER0}k_proj").out_features,
            sim.model.base_linear(f"{LAYER0}k_proj").in_features) == (16, 32)
    before = float(task.evaluate(sim.model.net)["loss"])
    sim.run()
    row = sim.history[-1]
    assert len(row["replied"]) == (1 if sim.method.pooled else 2) and row["loss"] != before and row["loss"] == pytest.approx(before, abs=0.05)
    sim.method.load_global(sim.model, sim.server)
    for name, mod in sim.model.adapters().items():
        delta = mod.adapter_delta() if mod.base_delta is None else mod.base_delta + mod.adapter_delta()
        assert tuple(delta.shape) == tuple(mod.base.weight.shape), name


# -- GPT-2's Conv1D --------------------------------------------------------------------------------------------
def test_gpt2_conv1d_becomes_an_equal_linear_and_c_attn_is_the_default_target():
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    from fedlowrank.models.bundled import BUNDLED_FOLDERS

    reference = AutoModelForCausalLM.from_pretrained(BUNDLED_FOLDERS["tiny-gpt2"]()).eval()
    loaded = load_model("tiny-gpt2", "causal-lm")
    assert not any(isinstance(m, Conv1D) for m in loaded.net.modules())
    c_attn = loaded.net.get_submodule("transformer.h.0.attn.c_attn")
    assert isinstance(c_attn, Conv1DLinear) and tuple(c_attn.weight.shape) == (96, 32)  # [out, in]
    x = torch.randint(3, 259, (2, 9))
    with torch.no_grad():
        assert torch.allclose(loaded.net(input_ids=x).logits, reference(input_ids=x).logits, atol=1e-6)
    assert lm_task("tiny-gpt2").build_model().target_names == ["transformer.h.0.attn.c_attn",
                                                               "transformer.h.1.attn.c_attn"]


def _run(tmp_path, task, method="fedit", *sets):
    run_dir = tmp_path / f"run-{method}"
    sim = Simulation(lm_config(method, "run.checkpoint_every=1", "train.lr=0.05", *sets), task=task, run_dir=run_dir)
    sim.run()
    sim.method.load_global(sim.model, sim.server)
    return run_dir, sim


def _logits(net, task):
    with torch.no_grad():
        return net.eval()(input_ids=task.tokens[-8:]).logits


def _saved_copy(tmp_path, name):
    """A bundled tiny model saved as a user's folder (so that base_model_name_or_path resolves anywhere)."""
    from fedlowrank.export import hf_backbone

    loaded, folder = load_model(name, "causal-lm"), tmp_path / name
    hf_backbone(loaded.net).save_pretrained(str(folder))
    loaded.tokenizer.save_pretrained(str(folder))
    return str(folder)


@pytest.mark.parametrize("model,method", [("tiny-gpt2", "fedit"), ("tiny-gpt2", "fedrpca"), ("tiny-llama", "fedit")])
def test_causal_lm_export_loads_with_auto_peft_and_gives_the_same_logits(tmp_path, model, method):
    from peft import AutoPeftModelForCausalLM

    task = RandomTokensLM(_saved_copy(tmp_path, model))
    run_dir, sim = _run(tmp_path, task, method)
    report = export_run(run_dir, tmp_path / "adapter", "peft", task=task)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["task_type"] == "CAUSAL_LM" and config["base_model_name_or_path"] == task.loaded.source
    assert config["fan_in_fan_out"] == (model == "tiny-gpt2")
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(report["files"])
    exported = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter")).eval()
    assert torch.allclose(_logits(exported, task), _logits(sim.model.net, task), atol=1e-5)
    with exported.disable_adapter():  # the adapter carries the update: without it the logits are the base's
        assert not torch.allclose(_logits(exported, task), _logits(sim.model.net, task), atol=1e-4)


def test_gpt2_merged_export_is_a_transformers_gpt2(tmp_path):
    from transformers import GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    task = lm_task("tiny-gpt2")
    run_dir, sim = _run(tmp_path, task, "fedit")
    export_run(run_dir, tmp_path / "merged", "merged", task=task)
    merged = GPT2LMHeadModel.from_pretrained(str(tmp_path / "merged"))
    assert isinstance(merged.get_submodule("transformer.h.0.attn.c_attn"), Conv1D)
    assert torch.allclose(_logits(merged, task), _logits(sim.model.net, task), atol=1e-5)


def test_classification_export_is_seq_cls_with_class_names(tmp_path):
    run_dir = tmp_path / "run"
    Simulation(tiny_config("run.rounds=1", "run.checkpoint_every=1"), task=tiny_task(), run_dir=run_dir).run()
    report = export_run(run_dir, tmp_path / "adapter", "peft", task=tiny_task())
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and config["base_model_name_or_path"] == pretrained_id("tiny-bert")
    assert config["modules_to_save"] == ["classifier"]
    assert report["id2label"] == {str(i): n for i, n in enumerate(tiny_task().data.label_names)}
    assert "tokenizer.json" in report["files"] or "vocab.txt" in report["files"]

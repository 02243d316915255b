"""The model ladder without downloads (``task.model = "arch:NAME[@TOKENIZER]"``): public configs, random weights,
for speed and memory only."""

import pytest
import torch

from fedlowrank.config import load_config
from fedlowrank.experiments.compare import run_comparison
from fedlowrank.experiments.tune import run_tuning
from fedlowrank.models import architectures
from fedlowrank.models.architectures import ARCHITECTURES, Architecture, parameter_count, parse_spec
from fedlowrank.models.bundled import tiny_tokenizer
from fedlowrank.models.loading import load_model
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.tasks import build_task

TINY = Architecture("tiny-test", "none", "LlamaConfig", dict(
    vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True), 0)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_each_architecture_has_the_released_models_parameter_count(name):
    arch = ARCHITECTURES[name]
    assert parameter_count(arch) == arch.parameters  # built on the meta device: nothing allocated


def test_the_1b_architecture_has_the_public_shape():
    cfg = architectures.architecture_config(ARCHITECTURES["llama-3.2-1b"])
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.vocab_size, cfg.tie_word_embeddings) == (2048, 16, 32, 8, 128256, True)
    assert cfg.rope_parameters["rope_type"] == "llama3" and cfg.rope_parameters["factor"] == 32.0


def test_an_arch_model_is_random_with_the_tokenizers_ids(monkeypatch):
    monkeypatch.setitem(ARCHITECTURES, "tiny-test", TINY)
    loaded = load_model("arch:tiny-test", "causal-lm")
    tok = tiny_tokenizer()
    assert loaded.speed_and_memory_only and loaded.source == "arch:tiny-test" and loaded.model_type == "llama"
    assert len(loaded.tokenizer) == len(tok) and loaded.net.get_input_embeddings().num_embeddings == 300
    cfg = loaded.net.config
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (tok.pad_token_id, tok.bos_token_id,
                                                                        tok.eos_token_id)
    again = load_model("arch:tiny-test@bytes", "causal-lm")  # seeded: the same random weights
    for (n, a), (_, b) in zip(loaded.net.state_dict().items(), again.net.state_dict().items()):
        assert torch.equal(a, b), n
    assert loaded.output_modules == ("lm_head",)


@pytest.mark.parametrize("spec,match", [
    ("arch:gpt-9", r"task.model = 'arch:gpt-9': no architecture 'gpt-9'; allowed: arch:smollm2-135m, "),
    ("arch:smollm2-135m@/no/such/folder", r"tokenizer '/no/such/folder' is neither 'bytes', a bundled causal LM"),
])
def test_bad_arch_specs_are_one_line(spec, match):
    with pytest.raises(ValueError, match=match):
        load_model(spec, "causal-lm")


def test_a_tokenizer_larger_than_the_architecture_is_refused(monkeypatch):
    monkeypatch.setitem(ARCHITECTURES, "tiny-test", Architecture("tiny-test", "none", "LlamaConfig",
                                                                 {**TINY.params, "vocab_size": 100}, 0))
    with pytest.raises(ValueError, match="the tokenizer has 259 tokens, more than the architecture's vocabulary of 100"):
        load_model("arch:tiny-test", "causal-lm")


def test_an_arch_model_is_refused_for_classification():
    with pytest.raises(ValueError, match="is a causal LM architecture; use task.kind = 'causal-lm'"):
        load_model("arch:smollm2-135m", "sequence-classification", num_labels=2)
    assert parse_spec("arch:llama-3.1-8b@smollm2-135m") == (ARCHITECTURES["llama-3.1-8b"], "smollm2-135m")


def test_a_run_with_an_arch_model_trains_and_skips_evaluation(monkeypatch, caplog):
    monkeypatch.setitem(ARCHITECTURES, "tiny-test", TINY)
    cfg = load_config("tiny-lm", ["task.model=arch:tiny-test", "partition.kind=iid", "run.rounds=1",
                                  "task.options.eval_generate=2"])
    with caplog.at_level("WARNING", logger="fedlowrank"):
        sim = Simulation(cfg, task=build_task(cfg))
        sim.run()
    row = sim.history[-1]
    assert row["train_loss"] > 0 and not {"loss", "perplexity", "exact_match"} & set(row)
    assert "has random weights: it measures speed and memory only; evaluation skipped" in caplog.text


@pytest.mark.parametrize("run", [run_comparison, run_tuning])
def test_compare_and_tune_refuse_an_arch_model(run):
    with pytest.raises(ValueError, match=r"has random weights: it measures speed and memory only; `fedlowrank "
                                         r"(compare|tune)` reports model quality"):
        run("tiny-lm", overrides=["task.model=arch:llama-3.2-1b"])

"""The causal-LM task on the random tiny LLaMA (bundled config ``tiny-lm``): tokenizer from the model, response-only
loss, chat template, exact-match extraction, batched generation, every method, exact resume, run directory."""

from __future__ import annotations

import json
import math
import shutil
from functools import lru_cache

import numpy as np
import pytest
import torch

from fedlowrank.config import load_config
from fedlowrank.methods import available_methods
from fedlowrank.models.loading import load_model
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.tasks import build_task
from fedlowrank.tasks.causal_lm import (IGNORE, PLAIN_TEMPLATE, CausalLM, collate, encode_example, extract_answer,
                                        generate, prompt_ids)
from fedlowrank.tasks.instructions import InstructionData, load_instruction_hf

SGD_ONLY = {"ssf": ["train.optimizer=sgd", "train.lr=0.05"], "fedsub": ["train.optimizer=sgd", "train.lr=0.05"]}


@lru_cache(maxsize=None)
def tiny_lm_task():
    """The task of the bundled ``tiny-lm`` config, built once (tiny LLaMA, 48 packaged arithmetic problems)."""
    return build_task(load_config("tiny-lm"))


def tiny_lm_config(*sets: str):
    return load_config("tiny-lm", list(sets))


def _pairs(n: int) -> InstructionData:
    prompts = [f"What is {i} + {i + 3}?" for i in range(n)]
    answers = [f"{i} + {i + 3} = {2 * i + 3}\n#### {2 * i + 3}" for i in range(n)]
    return InstructionData(prompts, answers, prompts[:4], answers[:4])


# -- exact match -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,expected", [
    ("She has 40 + 2 = 42 apples.\n#### 42", "42"),
    ("#### 1,234", "1234"),
    ("The answer is 1,234.", "1234"),
    ("He lost 7 dollars, so the change is -5.", "-5"),
    ("#### -3", "-3"),
    ("It costs $3.50 in total.", "3.5"),
    ("#### 3.5", "3.5"),
    ("So 4.00 hours.", "4"),
    ("Between 3-5 of them, say 12 people.", "12"),
    ("pages 3-5", "5"),
    ("first 12, then #### 7 and 9 more", "7"),
    ("I do not know.", None),
    ("#### none", None),
    ("", None),
])
def test_final_number_extraction(text, expected):
    assert extract_answer(text) == expected


def test_reference_and_prediction_match_after_normalisation():
    assert extract_answer("... = 3.50\n#### 3.50") == extract_answer("The answer is 3.5.")
    assert extract_answer("#### 1,000") == extract_answer("so 1000 in all") == "1000"
    assert extract_answer("#### 12") != extract_answer("The answer is 120.")


# -- tokenizer and formatting ------------------------------------------------------------------------------------
def test_the_tokenizer_comes_from_the_model_folder(tmp_path):
    """A tiny LLaMA folder with its own tokenizer is tokenised with that tokenizer; without one it is refused."""
    from transformers import AutoTokenizer

    loaded = load_model("tiny-llama", "causal-lm")
    folder = tmp_path / "my-llama"
    loaded.net.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    task = CausalLM(_pairs(8), str(folder), max_length=64, eval_examples=2)
    own = AutoTokenizer.from_pretrained(folder)
    assert len(task.tokenizer) == len(own) == 259
    assert task.train[0].ids == own.apply_chat_template([{"role": "user", "content": "What is 0 + 3?"}],
                                                        add_generation_prompt=True, tokenize=True)["input_ids"] \
        + own("0 + 3 = 3\n#### 3", add_special_tokens=False)["input_ids"] + [own.eos_token_id]
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(folder, bare)
    for f in bare.iterdir():
        if "token" in f.name or f.name in ("chat_template.jinja",):
            f.unlink()
    with pytest.raises(ValueError, match="task.model"):
        CausalLM(_pairs(8), str(bare))


def test_chat_template_when_present_else_plain_template():
    tok = load_model("tiny-llama", "causal-lm").tokenizer
    ids = prompt_ids(tok, "Why?")
    assert tok.decode(ids) == "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n"
    tok.chat_template = None
    try:
        assert tok.decode(prompt_ids(tok, "Why?")) == PLAIN_TEMPLATE.format(prompt="Why?")
    finally:
        tok.chat_template = load_model("tiny-llama", "causal-lm").tokenizer.chat_template


def test_prompt_tokens_carry_no_loss_token_by_token():
    tok = load_model("tiny-llama", "causal-lm").tokenizer
    examples = [encode_example(tok, p, r, 512) for p, r in (("Hi?", "Yes. #### 1"), ("A longer question?", "No"))]
    batch = collate(examples, tok.pad_token_id)
    assert batch["input_ids"].shape == (2, max(len(e.ids) for e in examples))  # padded to the batch's longest
    for i, e in enumerate(examples):
        n, p = len(e.ids), e.prompt_len
        assert p == len(prompt_ids(tok, ["Hi?", "A longer question?"][i]))
        assert batch["labels"][i, :p].tolist() == [IGNORE] * p  # every prompt token: no loss
        assert batch["labels"][i, p:n].tolist() == e.ids[p:]  # every response token (and the eos) has its label
        assert e.ids[-1] == tok.eos_token_id
        assert batch["labels"][i, n:].tolist() == [IGNORE] * (batch["labels"].shape[1] - n)  # padding
        assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (batch["labels"].shape[1] - n)
        assert batch["input_ids"][i, n:].eq(tok.pad_token_id).all()


def test_loss_ignores_prompt_tokens():
    """Changing a prompt token changes the loss only through the context, never by being a target: the loss of a
    batch equals the mean cross-entropy over response positions computed by hand."""
    task = tiny_lm_task()
    net = task.build_model().net
    batch = task.batch(np.arange(3))
    logits = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    terms = []
    for i in range(3):
        e = task.train[i]
        for t in range(e.prompt_len, len(e.ids)):
            terms.append(-torch.log_softmax(logits[i, t - 1], -1)[e.ids[t]])
    torch.testing.assert_close(task.loss(net, batch), torch.stack(terms).mean())


def test_truncation_is_counted_and_reported():
    task = CausalLM(_pairs(6), "tiny-llama", max_length=40, eval_examples=2)
    lengths = [len(encode_example(task.tokenizer, p, r, 10_000).ids) for p, r in zip(task.data.train_prompts,
                                                                                      task.data.train_responses)]
    prompts = [len(prompt_ids(task.tokenizer, p)) for p in task.data.train_prompts]
    t = task.describe()["truncation"]["train"]
    assert t == {"examples": 6, "truncated": sum(n > 40 for n in lengths),
                 "lost_response": sum(p >= 40 for p in prompts)}
    assert t["truncated"] == 6 and all(len(e.ids) == 40 for e in task.train)
    short = CausalLM(_pairs(6), "tiny-llama", max_length=30, eval_examples=2)
    assert short.describe()["truncation"]["train"]["lost_response"] == 6  # prompts of 31+ bytes: nothing left
    batch = short.batch(np.arange(2))
    loss = short.loss(short.build_model().net, batch)
    assert loss.item() == 0.0  # no response token left: no loss (not NaN)


# -- generation and evaluation -------------------------------------------------------------------------------
def test_batched_generation_equals_one_by_one():
    task = tiny_lm_task()
    model = task.build_model()
    torch.manual_seed(1)
    for p in model.net.parameters():  # a less uniform model than the random init, so that greedy choices vary
        p.data.add_(torch.randn_like(p) * 0.5)
    prompts = [prompt_ids(task.tokenizer, q) for q in ("Hi", "How many eggs are there in 3 dozen?", "7 + 5 = ?")]
    batched = generate(model.net, task.tokenizer, prompts, max_new_tokens=12, batch_size=3)
    single = [generate(model.net, task.tokenizer, [p], max_new_tokens=12, batch_size=1)[0] for p in prompts]
    assert batched == single
    assert len({tuple(b) for b in batched}) > 1  # not one constant output
    assert all(len(b) <= 12 and task.tokenizer.eos_token_id not in b for b in batched)


def test_evaluation_metrics_and_fixed_subsets():
    task = tiny_lm_task()
    metrics = task.evaluate(task.build_model().net)
    assert set(metrics) == {"loss", "perplexity", "exact_match"}
    assert math.isclose(metrics["perplexity"], math.exp(metrics["loss"]))
    assert 4 < metrics["loss"] < 8  # near ln(259) = 5.56 for a random model
    assert len(task.generate_idx) == 4 and len(task.eval_idx) == 8
    again = build_task(tiny_lm_config("run.seed=5"))
    assert np.array_equal(again.eval_idx, task.eval_idx)  # the same questions whatever the run's seed
    records = task.pop_generations()
    assert len(records) == 2 and set(records[0]) == {"test_index", "prompt", "reference", "output", "extracted",
                                                     "correct"}
    assert task.pop_generations() == []


def test_run_directory_has_generations_and_the_split_report(tmp_path):
    sim = Simulation(tiny_lm_config(), task=tiny_lm_task(), run_dir=tmp_path)
    sim.run()
    rows = [json.loads(x) for x in (tmp_path / "generations-round2.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[0]["reference"].endswith(rows[0]["reference"].split("####")[-1])
    report = json.loads((tmp_path / "partition.json").read_text())
    assert "k-means" in report["split_on"] and report["split_names"] == ["cluster 0", "cluster 1", "cluster 2"]
    assert np.array(report["label_histograms"]).sum() == 48
    assert report["task"]["truncation"]["train"]["examples"] == 48
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"loss", "perplexity", "exact_match"} <= set(metrics[-1])


# -- every method, resume ---------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def base_loss() -> float:
    task = tiny_lm_task()
    return task.evaluate(task.build_model().net)["loss"]


@pytest.mark.parametrize("method", sorted(available_methods()))
def test_every_method_runs_one_round_of_causal_lm(method):
    cfg = tiny_lm_config(f"method.name={method}", "run.rounds=1", "train.lr=0.01", "train.batch_size=2",
                         *SGD_ONLY.get(method, []))
    sim = Simulation(cfg, task=tiny_lm_task())
    base = base_loss()
    row = sim.run_round()
    assert row["replied"] == row["clients"] and math.isfinite(row["train_loss"])
    assert math.isfinite(row["loss"]) and row["loss"] != base  # the global model moved


def test_causal_lm_resume_is_bit_identical(tmp_path):
    sets = ("method.name=scaffold", "run.rounds=3", "run.checkpoint_every=1")
    straight = Simulation(tiny_lm_config(*sets), task=tiny_lm_task(), run_dir=tmp_path / "a")
    straight.run()
    interrupted = Simulation(tiny_lm_config(*sets), task=tiny_lm_task(), run_dir=tmp_path / "b")
    interrupted.run_round()
    del interrupted
    resumed = Simulation.resume(tmp_path / "b", task=tiny_lm_task())
    assert resumed.round == 1
    resumed.run()
    for k, v in straight.server.tensors().items():
        assert torch.equal(v, resumed.server[k]), k
    for c in straight.store:
        for k, v in straight.store[c].tensors().items():
            assert torch.equal(v, resumed.store[c][k]), (c, k)
    keys = ("loss", "perplexity", "exact_match", "train_loss", "bytes_up", "clients")
    assert [{k: r[k] for k in keys} for r in straight.history] == [{k: r[k] for k in keys} for r in resumed.history]
    assert (tmp_path / "b" / "generations-round3.jsonl").read_text() == \
        (tmp_path / "a" / "generations-round3.jsonl").read_text()


# -- data sources ------------------------------------------------------------------------------------------------
def test_files_and_hugging_face_datasets_give_the_same_pairs(tmp_path):
    pytest.importorskip("datasets")
    rows = [{"prompt": f"q{i}", "completion": f"a{i} #### {i}", "topic": "x" if i % 2 else "y"} for i in range(10)]
    for split, part in (("train", rows[:8]), ("test", rows[8:])):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    sets = ["task.kind=causal-lm", "task.model=tiny-llama", "data.prompt_column=prompt",
            "data.response_column=completion", f"data.train={tmp_path / 'train.jsonl'}",
            f"data.test={tmp_path / 'test.jsonl'}", "partition.partition_by=topic", "partition.num_clients=2",
            "run.clients_per_round=2"]
    from fedlowrank.tasks.instructions import load_instructions

    files = load_instructions(load_config(None, ["data.source=files", *sets]).data, "topic", 0)
    hf = load_instruction_hf("json", "prompt", "completion", ["topic"],
                             {"train": str(tmp_path / "train.jsonl"), "test": str(tmp_path / "test.jsonl")})
    assert files == hf and files.train_prompts[3] == "q3" and files.train_columns["topic"][3] == "x"
    with pytest.raises(ValueError, match="data.response_column = 'answer'"):
        load_instruction_hf("json", "prompt", "answer", None, {"train": str(tmp_path / "train.jsonl"),
                                                               "test": str(tmp_path / "test.jsonl")})
    cfg = load_config(None, ["data.source=hf", "data.hf_name=json", "partition.kind=natural", *sets])
    sim = Simulation(cfg)
    assert [sorted({files.train_columns["topic"][i] for i in p}) for p in sim.parts] == [["x"], ["y"]]
    assert sim.split.what == "column 'topic'"


def test_unknown_task_option_is_named():
    with pytest.raises(ValueError, match="task.options.eval_generations is not an option of causal-lm"):
        build_task(tiny_lm_config("task.options.eval_generations=3"))


def test_tiny_lm_reads_the_packaged_problems_and_gsm8k_names_a_wrong_path():
    task = tiny_lm_task()
    assert task.describe()["num_train"] == 48 and task.data.test_responses[0].split("####")[-1].strip()
    with pytest.raises(FileNotFoundError, match="data.path: 'nowhere' holds no GSM8K"):
        build_task(tiny_lm_config("data.source=gsm8k", "data.path=nowhere"))


# -- Flower ------------------------------------------------------------------------------------------------------
def test_causal_lm_config_runs_unchanged_in_flower(monkeypatch):
    """The ``tiny-lm`` config through Flower's Strategy and ClientApp (the loop-back grid of ``test_flower``) gives
    the simulator's global model, losses and exact matches."""
    pytest.importorskip("flwr")
    from flwr.supercore.task_identity import TaskIdentity
    from test_flower import LoopGrid, assert_same_state

    import fedlowrank.runtime.run as run_module
    import fedlowrank.runtime.simulator as simulator
    from fedlowrank.runtime.flower import client_app
    from fedlowrank.runtime.flower.settings import load_run_config
    from fedlowrank.runtime.flower.strategy import MethodStrategy, state_arrays

    for name in ("run_id", "node_id", "task_id"):
        monkeypatch.setattr(TaskIdentity, f"_{name}", 7)
    monkeypatch.setattr(run_module, "build_task", lambda cfg, cohorts=False: tiny_lm_task())
    client_app._runs.clear()
    run_config = {"config": "tiny-lm", "set": "method.name=fedit", "flower.node-timeout": 0.0}
    cfg, settings = load_run_config(run_config)
    sim = simulator.Simulation(cfg, task=tiny_lm_task())
    strategy = MethodStrategy(sim, settings)
    grid = LoopGrid(run_config, cfg.partition.num_clients)
    strategy.connect(grid)
    strategy.start(grid, state_arrays(sim.server), num_rounds=cfg.run.rounds, timeout=1.0,
                   evaluate_fn=strategy.evaluate)
    client_app._runs.clear()
    ref = Simulation(cfg, task=tiny_lm_task())
    ref.run()
    assert_same_state(sim.server, ref.server)
    keys = ("clients", "replied", "train_loss", "loss", "perplexity", "exact_match")
    assert [{k: r.get(k) for k in keys} for r in sim.history] == [{k: r.get(k) for k in keys} for r in ref.history]


def test_wrong_source_or_partition_settings_are_named():
    from fedlowrank.config import ConfigError

    with pytest.raises(ValueError, match="data.source = 'bbc-news' is not instruction data"):
        build_task(tiny_lm_config("data.source=bbc-news"))
    with pytest.raises(ValueError, match="use task.kind = 'causal-lm'"):
        build_task(load_config("tiny", ["data.source=gsm8k"]))
    with pytest.raises(ConfigError, match="partition.num_clusters must be >= 2"):
        tiny_lm_config("partition.num_clusters=1")
    with pytest.raises(ValueError, match="partition.partition_by = 'topic': the data was read without"):
        tiny_lm_task().column_values("topic")


def test_compare_reports_held_out_loss_for_causal_lm(tmp_path, capsys):
    from fedlowrank.cli import main

    assert main(["compare", "tiny-lm", "--methods", "fedit", "--out", str(tmp_path), "--quiet",
                 "--set", "run.rounds=1"]) == 0
    assert "| method | final loss | best loss |" in capsys.readouterr().out
    assert json.loads((tmp_path / "results.json").read_text())["metric"] == "loss"


def test_bundled_gsm8k_config_is_valid_and_its_options_are_the_task_s():
    import inspect

    cfg = load_config("gsm8k")
    assert (cfg.task.kind, cfg.task.model, cfg.data.source, cfg.partition.kind) == \
        ("causal-lm", "smollm2-135m", "gsm8k", "clusters")
    assert set(cfg.task.options) <= set(inspect.signature(CausalLM).parameters)
    assert {"ilora", "florg", "fedgalore", "fedit"} <= set(cfg.compare.methods)


# -- export --------------------------------------------------------------------------------------------------------
def test_exported_adapter_generates_the_same_tokens_as_the_run(tmp_path, capsys):
    """``fedlowrank run`` + ``fedlowrank export`` of a tiny-LLaMA run: peft's AutoPeftModelForCausalLM loads the
    adapter (its base from ``base_model_name_or_path``, the user's folder) and greedy generation gives the run's
    global model's tokens."""
    from peft import AutoPeftModelForCausalLM

    from fedlowrank.cli import main
    from fedlowrank.export import load_global_simulation

    loaded = load_model("tiny-llama", "causal-lm")
    folder = tmp_path / "my-llama"
    loaded.net.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    run_dir = tmp_path / "run"
    assert main(["run", "tiny-lm", "--out", str(run_dir), "--quiet", "--set", f"task.model={folder}",
                 "--set", "run.checkpoint_every=1", "--set", "train.lr=0.05", "--set", "run.rounds=1"]) == 0
    assert main(["export", str(run_dir), "--out", str(tmp_path / "adapter")]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["task_type"] == "CAUSAL_LM" and config["base_model_name_or_path"] == str(folder)
    exported = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter")).eval()
    sim = load_global_simulation(run_dir)
    tok = sim.task.tokenizer
    prompts = [prompt_ids(tok, q) for q in sim.task.data.test_prompts[:3]]
    ours = generate(sim.model.net, tok, prompts, max_new_tokens=16, batch_size=3)
    theirs = generate(exported, tok, prompts, max_new_tokens=16, batch_size=3)
    assert ours == theirs and any(ours)
    with exported.disable_adapter():  # the adapter carries the update: the base model alone answers otherwise
        assert generate(exported, tok, prompts, max_new_tokens=16, batch_size=3) != ours


def test_all_linear_targets_every_linear_but_the_output_layer():
    task = build_task(tiny_lm_config('lora.targets="all-linear"'))
    model = task.build_model()
    assert "lm_head" not in model.target_names and not model.head_names
    linears = [n for n, m in model.net.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    assert sorted(model.target_names) == sorted(linears)

"""``fedlowrank export --format merged``: for every method whose update is a weight delta the merged model gives the
run's logits (to 1e-5 in fp32), a routed mixture is refused with the reason, the folder is a plain Hugging Face
model (safetensors, config, tokenizer, generation config) that ``AutoModelFor*`` loads in a fresh process where
fedlowrank cannot be imported, and ``--dtype bf16|fp16`` writes the weights in that dtype."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_config, tiny_task
from lm_helpers import lm_config, lm_task
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fedlowrank.adapters.routed import RoutedLoRALinear
from fedlowrank.cli import main
from fedlowrank.export import export_base, export_run, load_export, load_global_simulation
from fedlowrank.methods import available_methods
from fedlowrank.runtime.simulator import Simulation

SGD = {"ssf": ["train.optimizer=sgd", "train.lr=0.05"], "fedsub": ["train.optimizer=sgd", "train.lr=0.05"]}

# A user's fresh process with no fedlowrank: any import of it fails; load each merged folder with transformers'
# Auto class, run the batch, save the logits and the parameters' dtype.
LOADER = """
import importlib.abc, json, sys
class NoFedlowrank(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "fedlowrank":
            raise ImportError("fedlowrank is not installed here")
sys.meta_path.insert(0, NoFedlowrank())
import torch, transformers
from safetensors.torch import load_file, save_file
for job in json.loads(sys.argv[1]):
    model = getattr(transformers, job["cls"]).from_pretrained(job["export"]).eval()
    with torch.no_grad():
        logits = model(**load_file(job["inputs"])).logits.float()
    save_file({"logits": logits.contiguous()}, job["out"])
    print(job["export"], next(model.parameters()).dtype)
assert not [m for m in sys.modules if m.split(".")[0] == "fedlowrank"]
"""


def logits(net, batch) -> torch.Tensor:
    with torch.no_grad():
        return net.eval()(**batch).logits.float()


def tiny_batch() -> dict[str, torch.Tensor]:
    task = tiny_task()
    return {"input_ids": task.test_ids[:16], "attention_mask": task.test_mask[:16]}


@pytest.mark.parametrize("method", sorted(available_methods()))
def test_every_weight_delta_method_merges_to_the_runs_logits(method, tmp_path):
    cfg = tiny_config(f"method.name={method}", "run.rounds=1", "train.lr=0.02", *SGD.get(method, []))
    sim = Simulation(cfg, task=tiny_task(), run_dir=tmp_path / "run")
    sim.run()
    sim.method.load_global(sim.model, sim.server)
    routed = any(isinstance(m, RoutedLoRALinear) for _, m in sim.model.targets())
    if routed:  # an update that depends on each token through a router is no weight delta
        with pytest.raises(ValueError, match="router.*--format routed"):
            export_run(tmp_path / "run", tmp_path / "merged", "merged", task=tiny_task())
        assert not (tmp_path / "merged").exists()
        return
    export_run(tmp_path / "run", tmp_path / "merged", "merged", task=tiny_task())
    merged = load_export(tmp_path / "merged", "merged", export_base(tiny_task()))
    assert type(merged).__module__.startswith("transformers.")  # a plain transformers model: no adapter modules
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert torch.allclose(logits(merged, tiny_batch()), logits(sim.model.net, tiny_batch()), atol=1e-5)


@pytest.fixture(scope="module")
def fresh_process(tmp_path_factory):
    """Merged exports of a tiny-BERT, a tiny-LLaMA and a tiny-GPT-2 (Conv1D) run in fp32, and of the LLaMA one in
    bf16, loaded by the Auto classes in one process that cannot import fedlowrank; per export: (folder, the run's
    logits, the loaded export's logits, what the loader printed)."""
    root = tmp_path_factory.mktemp("merged")
    jobs, expected = [], {}
    cases = {"tiny-bert": (tiny_config("run.rounds=1", "train.lr=0.02"), tiny_task(), tiny_batch(),
                           "AutoModelForSequenceClassification")}
    for model in ("tiny-llama", "tiny-gpt2"):
        task = lm_task(model)
        cases[model] = (lm_config("fedit", "train.lr=0.05"), task,
                        {"input_ids": task.tokens[-8:]}, "AutoModelForCausalLM")
    for key, (cfg, task, batch, cls) in cases.items():
        Simulation(cfg, task=task, run_dir=root / f"run-{key}").run()
        save_file(batch, str(root / f"inputs-{key}.safetensors"))
        run_logits = logits(load_global_simulation(root / f"run-{key}", task).model.net, batch)
        for dtype in ("fp32", "bf16") if key == "tiny-llama" else ("fp32",):
            name = f"{key}-{dtype}"
            export_run(root / f"run-{key}", root / name, "merged", task=task, dtype=dtype)
            jobs.append({"cls": cls, "export": str(root / name), "inputs": str(root / f"inputs-{key}.safetensors"),
                         "out": str(root / f"out-{name}.safetensors")})
            expected[name] = run_logits
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", LOADER, json.dumps(jobs)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: (root / name, run, load_file(str(root / f"out-{name}.safetensors"))["logits"], proc.stdout)
            for name, run in expected.items()}


@pytest.mark.parametrize("name", ["tiny-bert-fp32", "tiny-llama-fp32", "tiny-gpt2-fp32"])
def test_a_merged_folder_loads_without_fedlowrank_and_gives_the_runs_logits(fresh_process, name):
    folder, run, exported, _ = fresh_process[name]
    assert torch.allclose(exported, run, atol=1e-5), (exported - run).abs().max()
    files = {p.name for p in folder.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer_config.json", "README.md", "export.json"} <= files
    assert "adapter_config.json" not in files and "pytorch_model.bin" not in files
    if name != "tiny-bert-fp32":
        assert "generation_config.json" in files
    assert "AutoModelFor" in (folder / "README.md").read_text() and "fp32" in (folder / "README.md").read_text()


def test_dtype_bf16_writes_bf16_weights_that_load_as_bf16(fresh_process):
    folder, run, exported, printed = fresh_process["tiny-llama-bf16"]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert f"{folder} torch.bfloat16" in printed
    assert json.loads((folder / "export.json").read_text())["dtype"] == "bf16"
    assert not torch.equal(exported, run) and torch.allclose(exported, run, atol=0.05 * run.abs().max())


def test_dtype_is_refused_for_adapters_and_unknown_values(tmp_path, capsys):
    run_dir = tmp_path / "run"
    Simulation(tiny_config("run.rounds=1"), task=tiny_task(), run_dir=run_dir).run()
    assert main(["export", str(run_dir), "--format", "peft", "--dtype", "bf16"]) == 2
    assert "--dtype bf16 applies to --format merged only" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
        main(["export", str(run_dir), "--format", "merged", "--dtype", "fp8"])
    assert "--dtype: invalid choice: 'fp8'" in capsys.readouterr().err
    assert not (run_dir / "export-peft-bf16").exists()


def test_export_prints_only_its_own_line(tmp_path):
    """No bitsandbytes notice about an optional kernel, no transformers FutureWarning peft causes: a fresh process
    (where bitsandbytes is imported for the first time) says where the export went, nothing else."""
    run_dir = tmp_path / "run"
    Simulation(tiny_config("run.rounds=1"), task=tiny_task(), run_dir=run_dir).run()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    proc = subprocess.run([sys.executable, "-m", "fedlowrank", "export", str(run_dir), "--out", str(tmp_path / "e")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stderr.splitlines() == [f"exported to {tmp_path / 'e'}"], proc.stderr


def test_the_optional_kernel_notice_alone_is_dropped():
    import logging

    from fedlowrank.models import BITSANDBYTES_CPU_LOGGER

    def record(message):
        return logging.LogRecord(BITSANDBYTES_CPU_LOGGER.name, logging.WARNING, __file__, 1, message, (), None)

    assert not BITSANDBYTES_CPU_LOGGER.filter(record("Failed to load CPU gemm_4bit_forward from kernels-community: x"))
    assert BITSANDBYTES_CPU_LOGGER.filter(record("any other warning of bitsandbytes"))

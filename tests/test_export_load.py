"""Exports load like every other adapter: ``base_model_name_or_path`` is the bundled model's hub id, a random test
model's absolute cached folder, or the user's folder, so ``AutoPeftModelFor*`` and ``AutoModelFor*`` load an
export in a fresh process, offline, and give the run's logits; the export's README.md is a filled model card."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_config, tiny_task
from lm_helpers import lm_config, lm_task
from safetensors.torch import load_file, save_file

from fedlowrank import __version__
from fedlowrank.export import export_run, load_global_simulation
from fedlowrank.models.bundled import minilm_path
from fedlowrank.models.loading import HUB_IDS, pretrained_id
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.tasks import build_task

SRC = Path(__file__).resolve().parents[1] / "src"
MINILM = "sentence-transformers/all-MiniLM-L6-v2"

# What a user does in a fresh process: load each export with the Auto classes, run the batch, save the logits.
LOADER = """
import json, sys
import peft, torch, transformers
from safetensors.torch import load_file, save_file
for job in json.loads(sys.argv[1]):
    cls = getattr(peft, job["cls"], None) or getattr(transformers, job["cls"])
    model = cls.from_pretrained(job["export"], **job["kwargs"]).eval()
    with torch.no_grad():
        logits = model(**load_file(job["inputs"])).logits
    ids = transformers.AutoTokenizer.from_pretrained(job["export"])("Federated fine-tuning")["input_ids"]
    save_file({"logits": logits.contiguous(), "ids": torch.tensor(ids)}, job["out"])
"""


def _global_logits(run_dir, task, batch):
    net = load_global_simulation(run_dir, task).model.net.eval()
    with torch.no_grad():
        return net(**batch).logits


@pytest.fixture(scope="module")
def loaded_back(tmp_path_factory):
    """Exports of a MiniLM run (peft, merged), a tiny-bert run (peft) and a tiny-llama run (peft), loaded back by
    the Auto classes in one fresh process with HF_HUB_OFFLINE=1, whose working directory holds MiniLM under its hub
    id (as the hub cache would); per export: (report, the run's logits, the loaded export's logits, its ids of a
    test sentence, the run's tokenizer's ids)."""
    root = tmp_path_factory.mktemp("exports")
    (root / MINILM).parent.mkdir()
    (root / MINILM).symlink_to(minilm_path())
    minilm = build_task(tiny_config("task.model=minilm", "partition.kind=iid", "data.max_train_examples=48",
                                    "data.max_test_examples=8"))
    tasks = {"minilm": minilm, "tiny-bert": tiny_task(), "tiny-llama": lm_task("tiny-llama")}
    configs = {"minilm": tiny_config("task.model=minilm", "partition.kind=iid", "data.max_train_examples=48",
                                     "data.max_test_examples=8", "run.rounds=1", "train.lr=0.02"),
               "tiny-bert": tiny_config("run.rounds=1", "train.lr=0.02"),
               "tiny-llama": lm_config("fedit", "train.lr=0.05")}
    jobs, expected = [], {}
    for key, task in tasks.items():
        run_dir = root / f"run-{key}"
        Simulation(configs[key], task=task, run_dir=run_dir).run()
        if key == "tiny-llama":
            batch = {"input_ids": task.tokens[-8:]}
        else:
            batch = {"input_ids": task.test_ids[:8], "attention_mask": task.test_mask[:8]}
        save_file(batch, str(root / f"inputs-{key}.safetensors"))
        formats = ("peft", "merged") if key == "minilm" else ("peft",)
        for fmt in formats:
            name = f"{key}-{fmt}"
            report = export_run(run_dir, root / name, fmt, task=task)
            if key == "tiny-llama":
                cls, kwargs = "AutoPeftModelForCausalLM", {}
            elif fmt == "peft":
                cls, kwargs = "AutoPeftModelForSequenceClassification", {"num_labels": len(report["id2label"])}
            else:
                cls, kwargs = "AutoModelForSequenceClassification", {}
            jobs.append({"cls": cls, "export": name, "kwargs": kwargs, "inputs": f"inputs-{key}.safetensors",
                         "out": f"out-{name}.safetensors"})
            ids = task.loaded.tokenizer("Federated fine-tuning")["input_ids"]
            expected[name] = (report, _global_logits(run_dir, task, batch), ids)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(SRC)}
    proc = subprocess.run([sys.executable, "-c", LOADER, json.dumps(jobs)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {}
    for name, (report, logits, ids) in expected.items():
        got = load_file(str(root / f"out-{name}.safetensors"))
        out[name] = (report, logits, got["logits"], got["ids"].tolist(), ids, root / name)
    return out


@pytest.mark.parametrize("name", ["minilm-peft", "minilm-merged", "tiny-bert-peft", "tiny-llama-peft"])
def test_an_export_loads_with_the_auto_classes_and_gives_the_runs_logits(loaded_back, name):
    report, run_logits, export_logits, export_ids, run_ids, _ = loaded_back[name]
    assert torch.allclose(export_logits, run_logits, atol=1e-5), (export_logits - run_logits).abs().max()
    assert export_ids == run_ids  # the exported tokenizer is the run's


def test_base_model_is_the_hub_id_of_a_bundled_model_and_a_folder_of_a_random_one(loaded_back):
    configs = {name: json.loads((path / "adapter_config.json").read_text())
               for name, (*_, path) in loaded_back.items() if name.endswith("-peft")}
    assert configs["minilm-peft"]["base_model_name_or_path"] == MINILM
    for name in ("tiny-bert-peft", "tiny-llama-peft"):
        base = Path(configs[name]["base_model_name_or_path"])
        assert base.is_absolute() and (base / "config.json").is_file(), base
    assert loaded_back["minilm-peft"][0]["base_model"] == MINILM
    assert loaded_back["minilm-peft"][0]["task_model"] == "minilm"


def test_the_model_card_says_what_was_trained_and_how_to_load_it(loaded_back):
    for name, (report, *_, path) in loaded_back.items():
        card = (path / "README.md").read_text()
        assert card.startswith("---\n") and ".venv" not in card and "More Information Needed" not in card, name
        for needed in (f"with fedlowrank {__version__}", "fedit", "rounds: 1 of 1",
                       "clients: 4, 2 per round", "## Test metrics", "## How to load", f"'{path.name}'"):
            assert needed in card, (name, needed)
        for metric, value in report["check"]["exported"].items():
            assert f"| {metric} |" in card and f"{value:.6g}" in card, (name, metric)
    assert "base_model: " + MINILM in (loaded_back["minilm-peft"][-1] / "README.md").read_text()
    assert "AutoPeftModelForSequenceClassification.from_pretrained('minilm-peft', num_labels=5)" in \
        (loaded_back["minilm-peft"][-1] / "README.md").read_text()
    assert "data: `bbc-news`" in (loaded_back["tiny-bert-peft"][-1] / "README.md").read_text()


def test_pretrained_id(tmp_path):
    assert pretrained_id("minilm") == MINILM and pretrained_id("smollm2-135m") == HUB_IDS["smollm2-135m"]
    assert pretrained_id("org/some-model") == "org/some-model" and pretrained_id(str(tmp_path)) == str(tmp_path)
    assert pretrained_id("resnet20") == "resnet20"  # not a transformers model: nothing to point at
    for name in ("tiny-bert", "tiny-llama", "tiny-gpt2", "tiny-vit", "tiny-clip"):
        folder = Path(pretrained_id(name))
        assert folder.is_absolute() and (folder / "config.json").is_file(), name


def test_the_model_cards_offline_snippet_loads_the_adapter_over_the_packaged_base(loaded_back, tmp_path):
    """Where the hub cannot be reached (offline, no cache, no hub-id folder in the working directory), the card's
    second snippet loads the adapter over fedlowrank's packaged MiniLM and gives the run's logits."""
    import re

    report, run_logits, *_, path = loaded_back["minilm-peft"]
    snippets = re.findall(r"```python\n(.*?)```", (path / "README.md").read_text(), re.S)
    assert len(snippets) == 2 and "BUNDLED_FOLDERS['minilm']()" in snippets[1], snippets
    assert "fedlowrank assets install minilm" in (path / "README.md").read_text()
    assert "pip install fedlowrank`" not in (path / "README.md").read_text()  # fedlowrank is not on PyPI
    assert "`classifier.weight` and `classifier.bias` as MISSING (newly initialized)" in (path / "README.md").read_text()
    assert len(re.findall("```python", (loaded_back["tiny-bert-peft"][-1] / "README.md").read_text())) == 1
    assert len(re.findall("```python", (loaded_back["minilm-merged"][-1] / "README.md").read_text())) == 1
    (tmp_path / path.name).symlink_to(path)
    inputs = path.parent / "inputs-minilm.safetensors"
    code = (snippets[1] + "import torch\nfrom safetensors.torch import load_file, save_file\nwith torch.no_grad():\n"
            f"    logits = model.eval()(**load_file({str(inputs)!r})).logits\n"
            "save_file({'logits': logits.contiguous()}, 'out.safetensors')\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(SRC)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.allclose(load_file(str(tmp_path / "out.safetensors"))["logits"], run_logits, atol=1e-5)

"""A data set is registered in one file: the task-heterogeneous instruction mix (``tasks/task_mix.py``) is known to
the causal-LM task, the config, the data catalog and ``compare``'s reports with no other file naming it, and a tiny
run trains on it with one task per client."""

from __future__ import annotations

from pathlib import Path

import pytest

import fedlowrank
from fedlowrank.config import load_config
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.tasks import task_class
from fedlowrank.tasks.catalog import data_name, data_source, known_data
from fedlowrank.tasks.causal_lm import extract_answer
from fedlowrank.tasks.task_mix import TASKS, TOPICS, topic_instruction

from helpers import require_dataset

MIX = ["data.source=task-mix", "partition.kind=shards", "partition.partition_by=task", "partition.classes_per_client=1",
       "partition.num_clients=3", "run.clients_per_round=3"]


def test_the_mix_is_named_in_one_file_only():
    src = Path(fedlowrank.__file__).parent
    naming = [p.relative_to(src).as_posix() for p in src.rglob("*.py") if '"task-mix"' in p.read_text()]
    assert naming == ["tasks/task_mix.py"]


def test_the_registry_lists_it():
    assert "task-mix" in task_class("causal-lm").data_sources
    assert known_data()["task-mix"].title == "task mix"
    cfg = load_config("tiny-lm", MIX)
    assert data_name(cfg) == "task mix" and data_source(cfg).startswith("task mix: 400 training and 100 test")
    with pytest.raises(ValueError, match="data.source"):
        load_config("tiny", ["data.source=task-mix"])  # text classification does not read it


def test_a_topic_instruction_is_scored_by_its_final_number():
    for i, label in enumerate(TOPICS):
        prompt, response = topic_instruction("Stocks fell.", label)
        assert "Stocks fell." in prompt and extract_answer(response) == str(i + 1)


def test_another_column_is_refused_in_one_line():
    require_dataset("gsm8k")
    require_dataset("agnews")
    with pytest.raises(ValueError, match="partition.partition_by = 'skill': data.source = 'task-mix' has one column"):
        Simulation(load_config("tiny-lm", [*MIX, "partition.partition_by=skill"]))


def test_a_tiny_run_gives_each_client_one_task(tmp_path):
    require_dataset("gsm8k")
    require_dataset("agnews")
    cfg = load_config("tiny-lm", [*MIX, "method.name=fedalt", "run.rounds=1", "train.local_steps=1",
                                  "data.max_train_examples=0", "data.max_test_examples=6"])
    sim = Simulation(cfg, run_dir=tmp_path / "run")
    tasks = sim.task.data.train_columns["task"]
    assert sorted({tasks[i] for part in sim.parts for i in part}) == sorted(TASKS)
    assert all(len({tasks[i] for i in part}) == 1 for part in sim.parts)
    sim.run()
    assert sim.history[-1]["round"] == 1 and 0 <= sim.history[-1]["exact_match"] <= 1

"""Task-heterogeneous instruction data for the causal-LM task (``data.source = "task-mix"``): three tasks built
from the data the project ships, each example carrying its task in the column ``task``, so that
``partition.partition_by = "task"`` gives each client one task (``partition.kind = "shards"`` with
``partition.classes_per_client = 1``, or ``"natural"``: one client per task). This is the task-level non-IID setting
of FedALT (arXiv:2503.11880: eight clients, one FLAN task each) and FedLEASE (arXiv:2509.15087) at CPU scale.

* ``arithmetic``: the packaged word problems (:mod:`.arithmetic`);
* ``gsm8k``: GSM8K (a local copy or the hub: :mod:`.hub`);
* ``topic``: AG News topic classification as an instruction: the prompt gives the article and the numbered topics
  (1 World, 2 Sports, 3 Business, 4 Sci/Tech), the response names the topic and ends with ``#### <number>``.

Each task gives :data:`PER_TASK` training and test examples (a seeded draw, stream ``"task-mix"``), the packaged
arithmetic set's sizes, so no task outnumbers another; ``data.max_*_examples`` then subsample the mix. Every response
ends with ``#### <number>``, so the causal-LM task's ``exact_match`` (``task.options.eval_generate`` > 0) scores all
three tasks alike: the final number of the generated answer against the reference's. The test examples carry
their ``task`` as well, so that a run partitioned by it scores each client on its own task's test examples
(:mod:`fedlowrank.runtime.evaluation`).
"""

from __future__ import annotations

import numpy as np

from ..seeding import numpy_rng
from .catalog import DataSet, register_data
from .hub import describe
from .instructions import InstructionData, load_arithmetic, load_gsm8k, register_instructions

TASKS = ("arithmetic", "gsm8k", "topic")
PER_TASK = (400, 100)  # training and test examples of each task
TOPICS = ("World", "Sports", "Business", "Sci/Tech")  # AG News's classes, numbered from 1 in the prompts


def topic_instruction(text: str, label: str) -> tuple[str, str]:
    """(prompt, response) of an AG News article ``text`` whose topic is ``label`` (one of :data:`TOPICS`)."""
    choices = ", ".join(f"{i + 1} {t}" for i, t in enumerate(TOPICS))
    prompt = f"Which topic is this news article about? Topics: {choices}.\nArticle: {text}\nAnswer with its number."
    return prompt, f"The topic is {label}.\n#### {TOPICS.index(label) + 1}"


def _topics() -> InstructionData:
    from .data import load_agnews

    data = load_agnews(label_names=list(TOPICS))
    train = [topic_instruction(t, data.label_names[y]) for t, y in zip(data.train_texts, data.train_labels)]
    test = [topic_instruction(t, data.label_names[y]) for t, y in zip(data.test_texts, data.test_labels)]
    return InstructionData([p for p, _ in train], [r for _, r in train], [p for p, _ in test], [r for _, r in test])


def load_task_mix(d, extra: list[str], seed: int) -> InstructionData:
    """The three tasks' examples (:data:`PER_TASK` of each), with the column ``task`` (declared on the test
    examples too: each client is scored on its own task's); ``extra`` may ask for ``task`` only
    (``partition.partition_by``)."""
    if any(c != "task" for c in extra):
        raise ValueError(f"partition.partition_by = {extra[0]!r}: data.source = 'task-mix' has one column, 'task'")
    parts = {"arithmetic": load_arithmetic(), "gsm8k": load_gsm8k(), "topic": _topics()}
    out = InstructionData([], [], [], [], {"task": []}, {"task": []})
    for name in TASKS:
        data = parts[name]
        picks = []
        for n, k, split in ((len(data.train_prompts), PER_TASK[0], "train"), (len(data.test_prompts), PER_TASK[1],
                                                                              "test")):
            picks.append(np.sort(numpy_rng(0, "task-mix", name, split).permutation(n)[:k]))
        part = data.select(*picks)
        out.train_prompts += part.train_prompts
        out.train_responses += part.train_responses
        out.test_prompts += part.test_prompts
        out.test_responses += part.test_responses
        out.train_columns["task"] += [name] * len(part.train_prompts)
        out.test_columns["task"] += [name] * len(part.test_prompts)
    if not extra:
        out.train_columns = {}
    return out


register_instructions("task-mix", (), load_task_mix)
register_data(DataSet("task-mix", "task mix", lambda cfg: (
    f"task mix: {PER_TASK[0]} training and {PER_TASK[1]} test examples of each of arithmetic word problems "
    f"(packaged), {describe('gsm8k', '')} and {describe('agnews', '')} as topic instructions")))

__all__ = ["TASKS", "PER_TASK", "TOPICS", "topic_instruction", "load_task_mix"]

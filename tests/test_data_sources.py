"""Where data comes from: the packaged sets (BBC News for ``tiny``, the arithmetic word problems for ``tiny-lm``), and
AG News / GSM8K from ``data.path``, ``$FEDLOWRANK_DATA`` or the Hugging Face hub (``datasets``, its real schema,
served offline by a patched ``load_dataset``). Tests on the real AG News and GSM8K skip when neither a local copy
nor the ``datasets`` cache has them."""

from __future__ import annotations

import re

import numpy as np
import pytest
from helpers import require_dataset

from fedlowrank import cli
from fedlowrank.config import load_config
from fedlowrank.tasks import build_task
from fedlowrank.tasks import hub as hub_module
from fedlowrank.tasks.arithmetic import NUM_TEST, NUM_TRAIN, PACKAGED, SKILLS, jsonl, problems
from fedlowrank.tasks.causal_lm import extract_answer
from fedlowrank.tasks.data import load_agnews, load_hf
from fedlowrank.tasks.hub import ENV, HubUnavailable, describe
from fedlowrank.tasks.instructions import load_gsm8k, load_instruction_files

AGNEWS_CLASSES = ["World", "Sports", "Business", "Sci/Tech"]  # the hub's ClassLabel names, in its id order
AGNEWS_ROWS = [(f"story {i} about {AGNEWS_CLASSES[i % 4].lower()}", i % 4) for i in range(16)]
GSM8K_ROWS = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(10)]


def agnews_copy(folder):
    """A local AG News copy (``train.tsv``: 12 rows, ``test.tsv``: 4; text<TAB>class name, no header)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.tsv", AGNEWS_ROWS[:12]), ("test.tsv", AGNEWS_ROWS[12:])):
        (folder / name).write_text("".join(f"{t}\t{AGNEWS_CLASSES[y]}\n" for t, y in rows), encoding="utf-8")
    return folder


def gsm8k_copy(folder):
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", GSM8K_ROWS[:8]), ("test.jsonl", GSM8K_ROWS[8:])):
        (folder / name).write_text(jsonl(rows), encoding="utf-8")
    return folder


@pytest.fixture
def no_local_copy(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)


@pytest.fixture
def hub(monkeypatch, no_local_copy):
    """``datasets.load_dataset`` answering as the hub does for AG News and GSM8K (their features and splits); the
    calls are recorded in the returned list."""
    datasets = pytest.importorskip("datasets")
    calls = []

    def load_dataset(name, config=None, data_files=None):
        calls.append((name, config))
        if name == "fancyzhx/ag_news" and config is None:
            features = datasets.Features({"text": datasets.Value("string"),
                                          "label": datasets.ClassLabel(names=AGNEWS_CLASSES)})
            return datasets.DatasetDict({
                split: datasets.Dataset.from_dict({"text": [t for t, _ in rows], "label": [y for _, y in rows]},
                                                  features=features)
                for split, rows in (("train", AGNEWS_ROWS[:12]), ("test", AGNEWS_ROWS[12:]))})
        if name == "openai/gsm8k" and config == "main":
            return datasets.DatasetDict({split: datasets.Dataset.from_list(rows)
                                         for split, rows in (("train", GSM8K_ROWS[:8]), ("test", GSM8K_ROWS[8:]))})
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


# -- the packaged data of tiny and tiny-lm -----------------------------------------------------------------------
def test_tiny_and_tiny_lm_need_no_data_outside_the_package(monkeypatch, no_local_copy):
    """The tests' defaults read only what ships with fedlowrank: no local copy, no hub."""
    def no_hub(*args, **kwargs):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(hub_module, "hub_splits", no_hub)
    tiny = build_task(load_config("tiny"))
    assert tiny.data.label_names == ["business", "entertainment", "politics", "sports", "tech"]
    assert len(tiny.data.train_texts) == 200 and len(tiny.data.test_texts) == 64
    lm = build_task(load_config("tiny-lm"))
    assert lm.describe()["num_train"] == 48 and len(lm.data.test_prompts) == 16


def test_packaged_arithmetic_problems_are_the_generator_s_and_their_arithmetic_is_right():
    records = problems(NUM_TRAIN + NUM_TEST)
    assert (PACKAGED / "train.jsonl").read_text(encoding="utf-8") == jsonl(records[:NUM_TRAIN])
    assert (PACKAGED / "test.jsonl").read_text(encoding="utf-8") == jsonl(records[NUM_TRAIN:])
    assert len({r["question"] for r in records}) == len(records)  # no question twice, within or across the files
    assert {r["skill"] for r in records} == set(SKILLS)
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b}
    for r in records:
        steps = re.findall(r"(\d+) ([-+*/]) (\d+) = \$?(\d+)", r["answer"])
        assert steps, r["answer"]
        for a, op, b, result in steps:
            assert ops[op](int(a), int(b)) == int(result), r["answer"]
        assert extract_answer(r["answer"]) == steps[-1][3] and int(steps[-1][3]) >= 0


def test_arithmetic_source_reads_the_packaged_files_with_their_skill_column():
    cfg = load_config("tiny-lm", ["data.max_train_examples=0", "data.max_test_examples=0",
                                  "partition.kind=natural", "partition.partition_by=skill", "partition.num_clients=5"])
    task = build_task(cfg)
    assert len(task.data.train_prompts) == NUM_TRAIN and len(task.data.test_prompts) == NUM_TEST
    assert set(task.column_values("skill")) == set(SKILLS)
    with pytest.raises(ValueError, match="data.source = 'arithmetic' is instruction data"):
        build_task(load_config("tiny", ["data.source=arithmetic"]))


# -- AG News and GSM8K: data.path, FEDLOWRANK_DATA, the hub ----------------------------------------------------
def test_data_path_comes_first_then_fedlowrank_data(tmp_path, monkeypatch, hub):
    given = agnews_copy(tmp_path / "given")
    agnews_copy(tmp_path / "env" / "agnews")
    (tmp_path / "env" / "agnews" / "train.tsv").write_text("w\tWorld\nx\tSports\ny\tBusiness\nz\tSci/Tech\n")
    monkeypatch.setenv(ENV, str(tmp_path / "env"))
    assert load_agnews("").train_texts == ["w", "x", "y", "z"]  # FEDLOWRANK_DATA's copy
    assert describe("agnews", "") == f"AG News files in {(tmp_path / 'env' / 'agnews').resolve()} ({ENV})"
    assert len(load_agnews(str(given)).train_texts) == 12  # data.path wins
    assert describe("agnews", str(given)) == f"AG News files in {given.resolve()}"
    monkeypatch.chdir(given)
    assert len(load_agnews(".").train_texts) == 12  # a relative data.path is the working directory's
    assert hub == []


def test_fedlowrank_data_without_the_set_falls_back_to_the_hub(tmp_path, monkeypatch, hub):
    gsm8k_copy(tmp_path / "gsm8k")
    monkeypatch.setenv(ENV, str(tmp_path))  # holds gsm8k/, not agnews/
    assert load_gsm8k("").train_prompts == [r["question"] for r in GSM8K_ROWS[:8]]
    assert hub == []
    assert load_agnews("").label_names == sorted(AGNEWS_CLASSES)
    assert hub == [("fancyzhx/ag_news", None)]
    assert describe("agnews", "") == "AG News from the Hugging Face hub (fancyzhx/ag_news)"


def test_data_path_without_the_files_names_them_and_how_to_provide_them(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "train.tsv").write_text("a\tWorld\n")
    message = (rf"^data.path: '{re.escape(str(tmp_path / 'mine'))}' holds no AG News test.tsv \(looked in .*\); set "
               r"data.path to a folder holding train.tsv and test.tsv \(text<TAB>label, no header.*FEDLOWRANK_DATA "
               r"to a folder holding agnews/, or go online for the hub's fancyzhx/ag_news")
    with pytest.raises(FileNotFoundError, match=message):
        load_agnews(str(tmp_path / "mine"))
    with pytest.raises(FileNotFoundError, match=r"^data.path: 'nowhere' holds no GSM8K train.jsonl and test.jsonl"):
        build_task(load_config("tiny-lm", ["data.source=gsm8k", "data.path=nowhere"]))


def test_agnews_from_the_hub_equals_its_local_copy(tmp_path, hub):
    """The hub's class-label ids (World = 0, Sports, Business, Sci/Tech) become the class names of the TSV copy, so
    both number the classes alike (sorted names) and give the same examples and ids."""
    local = load_agnews(str(agnews_copy(tmp_path / "agnews")))
    remote = load_agnews("")
    assert hub == [("fancyzhx/ag_news", None)]
    assert remote.label_names == local.label_names == ["Business", "Sci/Tech", "Sports", "World"]
    assert remote.train_texts == local.train_texts and remote.test_texts == local.test_texts
    assert np.array_equal(remote.train_labels, local.train_labels)
    assert np.array_equal(remote.test_labels, local.test_labels)
    ordered = load_agnews("", AGNEWS_CLASSES)  # data.labels: the hub's own order
    assert ordered.label_names == AGNEWS_CLASSES and ordered.train_labels.tolist()[:4] == [0, 1, 2, 3]
    by_name = load_hf("fancyzhx/ag_news", "text", "label")  # data.source = "hf" reads class labels alike
    assert by_name.label_names == local.label_names and np.array_equal(by_name.train_labels, local.train_labels)


def test_gsm8k_from_the_hub_equals_its_local_copy(tmp_path, hub):
    folder = gsm8k_copy(tmp_path / "gsm8k")
    local = load_gsm8k(str(folder))
    remote = load_gsm8k("")
    assert hub == [("openai/gsm8k", "main")]
    assert remote == local == load_instruction_files(folder / "train.jsonl", folder / "test.jsonl")
    assert remote.test_responses == [r["answer"] for r in GSM8K_ROWS[8:]]


def test_the_bundled_configs_load_agnews_and_gsm8k_from_the_hub(hub):
    agnews = build_task(load_config("agnews", ["task.model=tiny-bert"]))
    assert agnews.data.label_names == ["Business", "Sci/Tech", "Sports", "World"]
    cfg = load_config("gsm8k", ["task.model=tiny-llama", "partition.kind=iid", "partition.min_partition_size=1",
                                "task.options.eval_examples=2", "task.options.eval_generate=0"])
    assert build_task(cfg).data.train_prompts == [r["question"] for r in GSM8K_ROWS[:8]]
    assert hub == [("fancyzhx/ag_news", None), ("openai/gsm8k", "main")]


def test_hub_label_missing_is_refused_with_its_row(monkeypatch, no_local_copy):
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["a", "b"])})
    splits = {"train": datasets.Dataset.from_dict({"text": ["x", "y", "z"], "label": [0, 1, -1]}, features=features),
              "test": datasets.Dataset.from_dict({"text": ["w"], "label": [0]}, features=features)}
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config=None, data_files=None: splits)
    with pytest.raises(ValueError, match=r"^'some/set' split 'train' row 2: no label \('label' = -1\)"):
        load_hf("some/set", "text", "label")


def test_offline_without_a_local_copy_is_one_error_line(tmp_path, monkeypatch, capsys):
    """``fedlowrank run agnews`` with no local copy and no hub: exit 2, one error line naming the hub id, the
    folder looked in and how to provide the data (after one line saying it tries the hub)."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv(ENV, str(tmp_path / "data"))

    def offline(name, config=None, data_files=None):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    assert cli.main(["run", "agnews", "--quiet", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("data.source = 'agnews': no local copy") and len(err) == 2
    line = err[1]
    assert line.startswith("error: data.source = 'agnews': cannot load 'fancyzhx/ag_news' with `datasets` "
                           "(ConnectionError: Couldn't reach 'fancyzhx/ag_news' on the Hub")
    assert f"{tmp_path / 'data' / 'agnews'} (FEDLOWRANK_DATA) holds no train.tsv and test.tsv" in line
    assert "set data.path to a folder holding train.tsv and test.tsv" in line


def test_without_datasets_and_a_local_copy_the_error_says_both(monkeypatch, no_local_copy):
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)
    with pytest.raises(HubUnavailable, match=r"^data.source = 'gsm8k' needs the package `datasets`: pip install "
                                             r"datasets; no local copy: data.path is empty and FEDLOWRANK_DATA is "
                                             r"not set; set data.path to a folder holding train.jsonl and "
                                             r"test.jsonl"):
        load_gsm8k("")


# -- the real AG News and GSM8K (skipped where neither a local copy nor the datasets cache has them) ------------
def test_real_agnews_has_the_four_classes_and_runs():
    require_dataset("agnews")
    task = build_task(load_config("agnews", ["task.model=tiny-bert", "data.max_train_examples=400",
                                             "data.max_test_examples=100"]))
    assert task.data.label_names == ["Business", "Sci/Tech", "Sports", "World"]
    assert len(task.data.train_texts) == 400 and set(task.data.train_labels.tolist()) == {0, 1, 2, 3}


def test_real_gsm8k_answers_end_with_their_number():
    require_dataset("gsm8k")
    data = load_gsm8k("")
    assert len(data.train_prompts) == 7473 and len(data.test_prompts) == 1319
    assert all(extract_answer(a) is not None and "####" in a for a in data.test_responses)
    assert data.train_prompts[0].startswith("Natalia sold clips")

"""Data files: every bad input is one error naming the file, the line and the field; headers are never examples."""

import json

import pytest

from fedlowrank import cli
from fedlowrank.config import ConfigError, load_config
from fedlowrank.tasks.data import load_hf, load_text_files
from fedlowrank.tasks.hub import KNOWN_SETS, local_copy
from fedlowrank.tasks.table import read_table


def write(path, lines, encoding="utf-8"):
    path.write_text("".join(line + "\n" for line in lines), encoding=encoding)
    return path


def sst2_like(path, n=40):
    """An SST-2 style TSV: a ``sentence\\tlabel`` header, then n sentences with labels 0/1."""
    return write(path, ["sentence\tlabel"] + [f"sentence number {i}\t{i % 2}" for i in range(n)])


def test_sst2_header_with_index_defaults_is_a_header_not_an_example(tmp_path, capsys):
    data = load_text_files(sst2_like(tmp_path / "sst2.tsv"), None)
    assert data.label_names == ["0", "1"]
    assert len(data.train_texts) + len(data.test_texts) == 40
    assert "sentence" not in data.train_texts + data.test_texts
    assert "line 1 (sentence | label) is read as a header" in capsys.readouterr().err


def test_header_false_reads_line_1_as_an_example(tmp_path, capsys):
    data = load_text_files(sst2_like(tmp_path / "sst2.tsv"), None, header="false")
    assert data.label_names == ["0", "1", "label"]
    assert "sentence" in data.train_texts + data.test_texts
    assert "header" not in capsys.readouterr().err


def test_header_auto_detects_an_unknown_header_by_its_unique_label_cell(tmp_path, capsys):
    path = write(tmp_path / "t.tsv", ["phrase\tpolarity"] + [f"p{i}\t{'pos' if i % 2 else 'neg'}" for i in range(10)])
    table = read_table(path, [0, 1], "auto", label_position=1)
    assert table.header == ["phrase", "polarity"] and table.lines[0] == 2 and len(table.rows) == 10
    assert "its label cell 'polarity' occurs on no other line" in capsys.readouterr().err


def test_header_auto_keeps_a_headerless_first_row_and_class_name_labels(tmp_path, capsys):
    path = write(tmp_path / "news.tsv", [f"story {i}\t{['World', 'Sports', 'Business'][i % 3]}" for i in range(9)])
    table = read_table(path, [0, 1], "auto", label_position=1)
    assert table.header is None and table.rows[0] == ("story 0", "World") and len(table.rows) == 9
    assert capsys.readouterr().err == ""


def test_column_names_imply_a_header_and_header_true_skips_line_1(tmp_path):
    path = write(tmp_path / "t.csv", ["id,text,label", '1,"hello, world",a', "2,bye,b"])
    table = read_table(path, ["text", "label"], "auto")
    assert table.rows == [("hello, world", "a"), ("bye", "b")] and table.lines == [2, 3]
    assert read_table(path, [1, 2], "true").rows == table.rows


def test_column_name_with_header_false_is_refused(tmp_path):
    path = sst2_like(tmp_path / "sst2.tsv")
    with pytest.raises(ValueError, match="data.text_column = 'sentence' names a column.*data.header = false"):
        read_table(path, ["sentence", "label"], "false", ("data.text_column", "data.label_column"))


def test_ragged_row_names_file_and_line(tmp_path):
    path = write(tmp_path / "r.tsv", ["a\tx", "b\ty", "c\tx\textra", "d\ty"])
    with pytest.raises(ValueError, match=r"r\.tsv:3: expected 2 fields \(as on line 1\), got 3"):
        load_text_files(path, None)
    short = write(tmp_path / "s.tsv", ["a\tx", "b\ty", "", "only-text"])
    with pytest.raises(ValueError, match=r"s\.tsv:4: expected 2 fields \(as on line 1\), got 1"):
        load_text_files(short, None)


def test_label_only_in_test_is_refused_with_its_line(tmp_path):
    train = write(tmp_path / "train.tsv", ["a\tx", "b\ty", "c\tx", "d\ty"])
    test = write(tmp_path / "test.tsv", ["e\tx", "f\tz", "g\ty"])
    with pytest.raises(ValueError, match=r"test\.tsv:2: test label 'z' never occurs in training \(.*train\.tsv; "
                                         r"its labels: x, y\)"):
        load_text_files(train, test)


def test_single_class_training_set_is_refused(tmp_path):
    train = write(tmp_path / "one.tsv", ["a\tx", "b\tx", "c\tx"])
    with pytest.raises(ValueError, match=r"one\.tsv: every training example has the label 'x'.*at least 2 classes"):
        load_text_files(train, None)


def test_split_that_moves_a_whole_class_to_test_is_refused(tmp_path):
    train = write(tmp_path / "few.tsv", ["a\tx", "b\tx", "c\tx", "d\tx", "e\ty"])
    with pytest.raises(ValueError, match=r"few\.tsv:5: class 'y' has 1 example\(s\).*data.test_fraction = 0.6"):
        load_text_files(train, None, test_fraction=0.6)
    data = load_text_files(train, None, test_fraction=0.2)
    assert sorted(data.train_labels.tolist() + data.test_labels.tolist()) == [0, 0, 0, 0, 1]
    assert set(data.train_labels.tolist()) == {0, 1}


def test_split_that_leaves_no_test_example_is_refused(tmp_path):
    train = write(tmp_path / "tiny.tsv", ["a\tx", "b\ty"])
    with pytest.raises(ValueError, match=r"tiny\.tsv: the stratified split .* leaves no test example"):
        load_text_files(train, None)


def test_empty_and_header_only_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"empty\.tsv: the file is empty"):
        load_text_files(write(tmp_path / "empty.tsv", ["", "  "]), None)
    with pytest.raises(ValueError, match=r"head\.tsv: holds only a header row \(line 1\), no examples"):
        load_text_files(write(tmp_path / "head.tsv", ["sentence\tlabel"]), None)
    with pytest.raises(ValueError, match=r"empty\.jsonl: the file is empty"):
        load_text_files(write(tmp_path / "empty.jsonl", []), None, "text", "label")


def test_column_out_of_range_names_the_field_and_the_width(tmp_path):
    path = write(tmp_path / "t.tsv", ["a\tx", "b\ty"])
    with pytest.raises(ValueError, match=r"data.label_column = 5 is out of range: .*t\.tsv has 2 field\(s\) per row "
                                         r"\(line 1\); allowed: 0..1"):
        load_text_files(path, None, 0, 5)


def test_text_column_equal_to_label_column_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="data.text_column and data.label_column must differ, both are '1'"):
        load_config("tiny", ["data.text_column=1", "data.label_column=1"])
    path = write(tmp_path / "t.tsv", ["text\tlabel", "a\tx"])
    with pytest.raises(ValueError, match=r"data.text_column and data.label_column both select column 1 of .*t\.tsv"):
        load_text_files(path, None, "label", 1)


def test_jsonl_missing_key_names_line_key_and_keys_present(tmp_path):
    path = write(tmp_path / "d.jsonl", [json.dumps({"text": "a", "label": "x"}), "",
                                        json.dumps({"text": "b", "tag": "y"})])
    with pytest.raises(ValueError, match=r"d\.jsonl:3: no key 'label' \(data.label_column\); keys on this line: "
                                         r"text, tag"):
        load_text_files(path, None, "text", "label")


def test_jsonl_read_with_index_columns_asks_for_key_names(tmp_path):
    path = write(tmp_path / "d.jsonl", [json.dumps({"review": "a", "stars": 1})] * 3)
    with pytest.raises(ValueError, match=r"d\.jsonl: a \.jsonl row is keyed.*data.text_column = 0 is an index; set "
                                         r"data.text_column / data.label_column to key names \(keys of line 1: "
                                         r"review, stars\)"):
        load_text_files(path, None)


def test_jsonl_lone_surrogate_is_refused_with_its_line_and_key(tmp_path, capsys):
    """``"w0\\ud800"`` is valid JSON but no text: one error line naming the file, the line and the key (the
    tokenizer would fail with a TypeError), through the command too; a full surrogate pair is its character."""
    lines = [json.dumps({"text": f"w{i}", "label": f"c{i % 2}"}) for i in range(20)]
    lines[6] = '{"text": "w0\\ud800", "label": "c0"}'
    path = write(tmp_path / "d.jsonl", lines)
    with pytest.raises(ValueError, match=r"d\.jsonl:7: key 'text' \(data.text_column\) holds a lone UTF-16 "
                                         r"surrogate \(\\ud800 at character 2\)"):
        load_text_files(path, None, "text", "label")
    assert cli.main(["run", "tiny", "--set", "data.source=files", "--set", f"data.train={path}", "--set",
                     "data.text_column=text", "--set", "data.label_column=label", "--out",
                     str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds a lone UTF-16 surrogate" in err[0] and "internal error" not in err[0], err
    pair = write(tmp_path / "p.jsonl", ['{"t": "x\\ud83d\\ude00", "y": "a"}'])
    assert read_table(pair, ["t", "y"]).rows == [("x\U0001f600", "a")]


def test_jsonl_numbers_are_labels_as_strings(tmp_path):
    path = write(tmp_path / "d.jsonl", [json.dumps({"t": f"s{i}", "y": i % 2}) for i in range(10)])
    table = read_table(path, ["t", "y"])
    assert table.rows[:2] == [("s0", "0"), ("s1", "1")] and table.lines[-1] == 10


def test_empty_label_cell_is_refused_with_its_line(tmp_path):
    path = write(tmp_path / "t.tsv", ["a\tx", "b\ty", "c\t  ", "d\tx", "e\ty"])
    with pytest.raises(ValueError, match=r"^.*t\.tsv:3: empty label \(data.label_column = 1\); every example needs a "
                                         r"class name$"):
        load_text_files(path, None)
    jsonl = write(tmp_path / "d.jsonl", [json.dumps({"text": f"s{i}", "label": "" if i == 4 else i % 2})
                                         for i in range(6)])
    with pytest.raises(ValueError, match=r"d\.jsonl:5: empty label \(data.label_column = 'label'\)"):
        load_text_files(jsonl, None, "text", "label")


@pytest.mark.parametrize("value", [True, False])
def test_jsonl_boolean_is_refused_not_read_as_a_class_name(tmp_path, value):
    rows = [{"text": f"s{i}", "label": i % 2} for i in range(6)]
    rows[3]["label"] = value
    path = write(tmp_path / "d.jsonl", [json.dumps(r) for r in rows])
    with pytest.raises(ValueError, match=rf"^.*d\.jsonl:4: key 'label' \(data.label_column\) holds {json.dumps(value)}; "
                                         r"expected a string or a number$"):
        load_text_files(path, None, "text", "label")


def test_repeated_header_row_is_refused_not_read_as_a_class(tmp_path):
    """Two files joined with their headers: line 1 is the header and its copy further down is refused, whether the
    columns are named or indexed."""
    lines = ["text\tlabel"] + [f"s{i}\t{i % 2}" for i in range(6)] + ["text\tlabel"] + [f"t{i}\t{i % 2}" for i in range(6)]
    path = write(tmp_path / "joined.tsv", lines)
    for columns in (("text", "label"), (0, 1)):
        with pytest.raises(ValueError, match=r"^.*joined\.tsv:8: repeats the header row of line 1 \(text \| label\); "
                                             r"a header belongs on line 1 only$"):
            load_text_files(path, None, *columns)


def test_header_row_inside_a_headerless_file_is_refused(tmp_path, capsys):
    """A headerless file followed by a file with a header (data.header = auto, indexed columns)."""
    lines = [f"s{i}\t{'x' if i % 2 else 'y'}" for i in range(6)] + ["sentence\tlabel"] + ["t\tx", "u\ty"]
    path = write(tmp_path / "joined.tsv", lines)
    with pytest.raises(ValueError, match=r"^.*joined\.tsv:7: \(sentence \| label\) looks like a header row inside "
                                         r"the data; remove it, or set data.header = false to read it as an "
                                         r"example$"):
        load_text_files(path, None)
    data = load_text_files(path, None, header="false")
    assert "label" in data.label_names  # what the user asked for


def test_bad_json_line_is_named(tmp_path):
    path = write(tmp_path / "d.jsonl", [json.dumps({"text": "a", "label": "x"}), '{"text": "b", "label": }'])
    with pytest.raises(ValueError, match=r"d\.jsonl:2: invalid JSON \(Expecting value at column 24\)"):
        load_text_files(path, None, "text", "label")


def test_non_utf8_byte_is_named_with_line_and_offset(tmp_path):
    path = tmp_path / "latin.tsv"
    path.write_bytes(b"a\tx\nb\ty\ncaf\xe9\tx\n")
    with pytest.raises(ValueError, match=r"latin\.tsv:3: not UTF-8 \(byte 0xe9 at byte offset 11 of the file, 3 of "
                                         r"the line\)"):
        load_text_files(path, None)


def test_utf8_byte_order_mark_is_not_part_of_the_first_column_name(tmp_path):
    path = tmp_path / "bom.csv"
    path.write_bytes(b"\xef\xbb\xbftext,label\nhi,a\nho,b\n")
    assert read_table(path, ["text", "label"]).rows == [("hi", "a"), ("ho", "b")]


def test_missing_column_name_lists_the_header(tmp_path):
    path = sst2_like(tmp_path / "sst2.tsv")
    with pytest.raises(ValueError, match=r"data.text_column = 'text' is not a column of .*sst2\.tsv; its header "
                                         r"\(line 1\) has: sentence, label"):
        load_text_files(path, None, "text", "label")


def test_malformed_csv_quote_is_named_with_its_line(tmp_path):
    path = write(tmp_path / "q.csv", ["text,label", "fine,a", '"bad"quote,b'])
    with pytest.raises(ValueError, match=r"q\.csv:3: ',' expected after '\"'"):
        read_table(path, ["text", "label"])


def test_unknown_format_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"d\.txt: data files must end in \.tsv, \.csv, \.jsonl"):
        read_table(write(tmp_path / "d.txt", ["a\tb"]), [0, 1])


@pytest.mark.parametrize("override, message", [
    ("data.max_train_examples=-5", "data.max_train_examples must be >= 0"),
    ("data.max_test_examples=-1", "data.max_test_examples must be >= 0"),
    ("data.test_fraction=1.0", r"data.test_fraction must be in \(0, 1\)"),
    ("data.test_fraction=0", r"data.test_fraction must be in \(0, 1\)"),
    ("data.header=maybe", "data.header must be one of auto, true, false; got 'maybe'"),
    ("data.source=files", "data.train: a file path is required"),
])
def test_bad_data_config_is_refused_by_load_config(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", [override])


def test_data_header_takes_toml_booleans():
    assert load_config("tiny", ["data.header=false"]).data.header == "false"
    assert load_config("tiny", ["data.header=true"]).data.header == "true"


def test_hf_source_without_datasets_is_one_line(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)
    with pytest.raises(ValueError, match="data.source = 'hf' needs the package `datasets`: pip install datasets"):
        load_hf("glue", "sentence", "label")


def test_agnews_files_read_as_before():
    folder = local_copy(KNOWN_SETS["agnews"], "")
    if folder is None:
        pytest.skip("needs a local AG News copy in $FEDLOWRANK_DATA/agnews (.ci/run sets it)")
    data = load_text_files(folder / "train.tsv", folder / "test.tsv", header="false")
    assert (len(data.train_texts), len(data.test_texts)) == (10_001, 7_600)
    assert data.label_names == ["Business", "Sci/Tech", "Sports", "World"]
    auto = load_text_files(folder / "train.tsv", folder / "test.tsv")
    assert auto.train_texts == data.train_texts and (auto.train_labels == data.train_labels).all()


def test_cli_run_with_a_bad_file_prints_one_error_line(tmp_path, capsys):
    path = write(tmp_path / "bad.tsv", ["a\tx", "b\ty", "c\tx\tz"])
    code = cli.main(["run", "tiny", "--quiet", "--out", str(tmp_path / "run"),
                     "--set", "data.source=files", "--set", f"data.train={path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert len(err) == 1 and err[0].startswith("error: ") and "bad.tsv:3: expected 2 fields" in err[0]


# -- JSON labels by value, huge numbers, line ends, long fields ---------------------------------------------------
def test_jsonl_numeric_labels_compare_as_values(tmp_path):
    """``1`` and ``1.0`` are one class, ``0`` and ``0.0`` another (they were four)."""
    path = write(tmp_path / "d.jsonl", [json.dumps({"text": f"s{i}", "label": [0, 1, 0.0, 1.0][i % 4]})
                                        for i in range(20)])
    data = load_text_files(path, None, "text", "label")
    assert data.label_names == ["0", "1"]
    texts, labels = data.train_texts + data.test_texts, [*data.train_labels, *data.test_labels]
    assert all(int(texts[j][1:]) % 2 == labels[j] for j in range(20))
    table = read_table(write(tmp_path / "f.jsonl", [json.dumps({"t": "a", "y": y}) for y in (0.5, 2.50, 1e20, 3)]),
                       ["t", "y"])
    assert table.column(1) == ["0.5", "2.5", "100000000000000000000", "3"]


def test_jsonl_label_mixing_strings_and_numbers_is_refused_with_its_lines(tmp_path):
    rows = [json.dumps({"text": f"s{i}", "label": i % 2}) for i in range(6)]
    rows[4] = json.dumps({"text": "s4", "label": "1.0"})
    path = write(tmp_path / "d.jsonl", rows)
    with pytest.raises(ValueError, match=r"^.*d\.jsonl:5: key 'label' \(data.label_column\) mixes strings and numbers "
                                         r"\(line 5: \"1\.0\", line 1: 0\); write every label the same way$"):
        load_text_files(path, None, "text", "label")


@pytest.mark.parametrize("value, reason", [("1" * 5000, "Exceeds the limit"), ("NaN", "NaN is not a JSON value"),
                                           ("[" * 5000 + "]" * 5000, "nested deeper")])
def test_jsonl_value_python_cannot_read_is_one_user_error_line(tmp_path, value, reason):
    rows = [json.dumps({"text": f"s{i}", "label": i % 2}) for i in range(4)] + ['{"text": "x", "label": ' + value + "}"]
    path = write(tmp_path / "d.jsonl", rows)
    with pytest.raises(ValueError, match=rf"d\.jsonl:5: invalid JSON \(.*{reason}") as exc:
        load_text_files(path, None, "text", "label")
    line = cli.error_line(exc.value)
    assert line.startswith("error: ") and "internal error" not in line and len(line) < 300, line


def test_jsonl_lines_end_at_newline_only(tmp_path):
    """U+2028, U+2029 and U+0085 are valid raw inside a JSON string; ``splitlines`` would cut the line there."""
    texts = ["a\u2028b", "c\u0085d", "e\u2029f", "g\x1ch", "i\rj"]
    lines = [json.dumps({"text": t, "label": i % 2}, ensure_ascii=False) for i, t in enumerate(texts)]
    path = tmp_path / "d.jsonl"
    path.write_bytes(("\n".join(lines) + "\r\n").encode())
    table = read_table(path, ["text", "label"])
    assert table.column(0) == texts and table.lines == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("suffix, sep", [(".csv", ","), (".tsv", "\t")])
def test_delimited_field_as_long_as_jsonl_accepts(tmp_path, suffix, sep):
    import csv

    long = "w" * 1_000_000
    path = write(tmp_path / f"d{suffix}", [f"{long}{sep}x", f"short{sep}y", f"s{sep}x"])
    before = csv.field_size_limit()
    assert read_table(path, [0, 1], "false").column(0)[0] == long
    assert csv.field_size_limit() == before  # the process-wide limit is put back

"""A strict reader of data tables (``.tsv``, ``.csv``, ``.jsonl``) shared by every task.

:func:`read_table` returns the asked columns of every row, or raises ``ValueError`` naming the file, the
1-based line and the config field at fault: a non-UTF-8 byte, invalid JSON (a number of more digits than Python
converts, nesting deeper than the parser goes), a missing key, a ragged row, an unknown column, an index out of
range, two fields selecting one column, an empty or header-only file, a header row repeated further down, a JSON
value that is not a string or a number, a label column mixing JSON strings and numbers. No row is ever dropped;
blank lines are skipped. JSON numbers become text by value (``1`` and ``1.0`` are both ``"1"``). A JSONL file's
lines end at ``\n`` only (a JSON string may hold U+2028 or U+0085); a CSV/TSV field may be as long as the file.
The rules are documented in ``docs/data.md``.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..schema import check_choice

HEADER_MODES = ("auto", "true", "false")
FORMATS = (".tsv", ".csv", ".jsonl")
# Header cells that ``header = "auto"`` recognises when every selected cell of line 1 is one of them.
COLUMN_NAMES = frozenset({
    "text", "texts", "sentence", "sentence1", "sentence2", "content", "review", "document", "title", "description",
    "body", "tweet", "question", "answer", "prompt", "response", "input", "output", "instruction", "completion",
    "label", "labels", "class", "category", "target", "sentiment", "topic", "y", "id",
})


@dataclass
class Table:
    """The selected cells of a file: ``rows[i][j]`` is column ``columns[j]`` of the row on line ``lines[i]``."""

    path: Path
    rows: list[tuple[str, ...]]
    lines: list[int]
    header: list[str] | None

    def column(self, j: int) -> list[str]:
        """The ``j``-th selected column (``j`` indexes the ``columns`` given to :func:`read_table`)."""
        return [row[j] for row in self.rows]


def column_spec(value: str | int) -> str | int:
    """A column as written in the config: digits are a 0-based index, anything else a column (or key) name."""
    if isinstance(value, int):
        return value
    return int(value) if value.isdigit() else value


def read_table(path: str | Path, columns: list[str | int], header: str = "auto",
               field_names: list[str] | tuple[str, ...] | None = None, label_position: int | None = None) -> Table:
    """Read the ``columns`` (names or 0-based indices; JSONL: key names) of every row of ``path``.

    Args:
        header: ``"true"`` (line 1 names the columns), ``"false"`` (line 1 is data) or ``"auto"``: column names
            imply a header; with indices only, line 1 is a header when each selected cell is a usual column name
            (:data:`COLUMN_NAMES`) or when its ``label_position`` cell occurs on no other line while the other lines
            repeat their labels. A detected header is announced on stderr. JSONL has no header row.
        field_names: the config field of each column (``"data.text_column"``...), used in error messages.
        label_position: which of ``columns`` holds categorical labels (for header detection), if any.
    """
    path = Path(path)
    names = list(field_names) if field_names is not None else [f"column {c!r}" for c in columns]
    if len(names) != len(columns):
        raise ValueError(f"read_table: {len(columns)} columns but {len(names)} field names")
    check_choice("data.header", header, HEADER_MODES)
    if not path.is_file():
        raise FileNotFoundError(f"no data file {path}")
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"{path}: data files must end in {', '.join(FORMATS)}; got {suffix or 'no suffix'!r}")
    text = _decode(path)
    if suffix == ".jsonl":
        return _read_jsonl(path, text, columns, names, label_position)
    return _read_delimited(path, text, columns, names, header, label_position)


def _decode(path: Path) -> str:
    raw = path.read_bytes()
    skip = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0
    try:
        return raw[skip:].decode("utf-8")
    except UnicodeDecodeError as exc:
        at = skip + exc.start
        line = raw.count(b"\n", 0, at) + 1
        column = at - (raw.rfind(b"\n", 0, at) + 1)
        raise ValueError(f"{path}:{line}: not UTF-8 (byte 0x{raw[at]:02x} at byte offset {at} of the file, "
                         f"{column} of the line); save the file as UTF-8") from None


def _parse_json_line(path: Path, number: int, line: str) -> dict:
    """The JSON object on line ``number``; ``NaN`` and ``Infinity`` are not JSON and are refused as such."""
    def refuse_constant(name: str):
        raise ValueError(f"{name} is not a JSON value")

    try:
        record = json.loads(line, parse_constant=refuse_constant)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{number}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    except ValueError as exc:  # an integer of more digits than int() converts, or NaN/Infinity
        raise ValueError(f"{path}:{number}: invalid JSON ({str(exc).split(';')[0]}); write such a value as a "
                         "string") from None
    except RecursionError:
        raise ValueError(f"{path}:{number}: invalid JSON (nested deeper than the parser goes)") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}:{number}: expected a JSON object per line, got {type(record).__name__}")
    return record


def _refuse_lone_surrogate(path: Path, number: int, key: str, name: str, value: str) -> None:
    """Refuse a JSON string holding half of a UTF-16 surrogate pair (``"\\ud800"`` alone), which is no character: no
    tokenizer can encode it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{path}:{number}: key {key!r} ({name}) holds a lone UTF-16 surrogate "
                         f"(\\u{ord(value[exc.start]):04x} at character {exc.start}), which is no character; "
                         "write the character itself or its full surrogate pair") from None


def number_text(value: int | float) -> str:
    """A JSON number as text, by value: an integral number as its integer's digits (``1`` and ``1.0`` → ``"1"``),
    any other as Python's shortest round-tripping form (``0.5``)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else repr(value)


def _read_jsonl(path: Path, text: str, columns: list[str | int], names: list[str],
                label_position: int | None) -> Table:
    records: list[tuple[int, dict]] = []
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            records.append((number, _parse_json_line(path, number, line)))
    if not records:
        raise ValueError(f"{path}: the file is empty (no JSON lines)")
    indexed = [(name, c) for name, c in zip(names, columns) if not isinstance(c, str)]
    if indexed:
        keys = ", ".join(records[0][1]) or "none"
        raise ValueError(f"{path}: a .jsonl row is keyed, not positional, but {indexed[0][0]} = {indexed[0][1]} is "
                         f"an index; set {' / '.join(names)} to key names (keys of line {records[0][0]}: {keys})")
    _refuse_duplicates(path, columns, names)
    rows: list[tuple[str, ...]] = []
    for number, record in records:
        cells = []
        for name, key in zip(names, columns):
            if key not in record:
                raise ValueError(f"{path}:{number}: no key {key!r} ({name}); keys on this line: "
                                 f"{', '.join(record) or 'none'}")
            value = record[key]
            if value is None or isinstance(value, (bool, list, dict)):
                raise ValueError(f"{path}:{number}: key {key!r} ({name}) holds {json.dumps(value)[:40]}; "
                                 "expected a string or a number")
            if isinstance(value, str):
                _refuse_lone_surrogate(path, number, key, name, value)
            cells.append(value if isinstance(value, str) else number_text(value))
        rows.append(tuple(cells))
    if label_position is not None:
        _refuse_mixed_labels(path, records, columns[label_position], names[label_position])
    return Table(path, rows, [n for n, _ in records], None)


def _refuse_mixed_labels(path: Path, records: list[tuple[int, dict]], key: str, name: str) -> None:
    """Refuse a label key that holds JSON strings on some lines and numbers on others (``"1.0"`` and ``1`` would
    be two classes, or one, by accident of spelling). A blank string is left to the empty-label check."""
    first: dict[bool, tuple[int, Any]] = {}
    for number, record in records:
        value = record[key]
        if not isinstance(value, str) or value.strip():
            first.setdefault(isinstance(value, str), (number, value))
    if len(first) == 2:
        (n_text, text), (n_num, num) = first[True], first[False]
        raise ValueError(f"{path}:{max(n_text, n_num)}: key {key!r} ({name}) mixes strings and numbers (line "
                         f"{n_text}: {json.dumps(text)[:40]}, line {n_num}: {json.dumps(num)[:40]}); write every "
                         "label the same way")


def _read_delimited(path: Path, text: str, columns: list[str | int], names: list[str], header: str,
                    label_position: int | None) -> Table:
    if path.suffix.lower() == ".tsv":
        reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t", quoting=csv.QUOTE_NONE)
    else:
        reader = csv.reader(io.StringIO(text, newline=""), delimiter=",", quoting=csv.QUOTE_MINIMAL, strict=True)
    records: list[tuple[int, list[str]]] = []
    line = 1
    limit = csv.field_size_limit(max(len(text), csv.field_size_limit()))  # a field may be as long as the file
    try:
        for cells in reader:
            if any(c.strip() for c in cells):
                records.append((line, cells))
            line = reader.line_num + 1
    except csv.Error as exc:
        raise ValueError(f"{path}:{line}: {exc}") from None
    finally:
        csv.field_size_limit(limit)
    if not records:
        raise ValueError(f"{path}: the file is empty")

    by_name = [(name, c) for name, c in zip(names, columns) if isinstance(c, str)]
    if by_name and header == "false":
        raise ValueError(f"{by_name[0][0]} = {by_name[0][1]!r} names a column, which needs a header row, but "
                         "data.header = false; give a 0-based column index instead")
    first_line, first = records[0]
    width = len(first)
    for c, name in zip(columns, names):
        if isinstance(c, int) and not 0 <= c < width:
            raise ValueError(f"{name} = {c} is out of range: {path} has {width} field(s) per row (line {first_line}); "
                             f"allowed: 0..{width - 1}")
    hint = ("; a .tsv has no quoting, so a tab inside a text splits it" if path.suffix.lower() == ".tsv"
            else "; quote a field that holds a comma")
    for number, cells in records:
        if len(cells) != width:
            raise ValueError(f"{path}:{number}: expected {width} fields (as on line {first_line}), got {len(cells)}"
                             + hint)
    if by_name or header == "true":
        has_header = True
    elif header == "false":
        has_header = False
    else:
        reason = _header_reason(records, columns, label_position)
        has_header = reason is not None
        if has_header:
            print(f"{path}: line {first_line} ({' | '.join(c[:40] for c in first)}) is read as a header, not an example: {reason}; "
                  "set data.header = true or false to decide yourself", file=sys.stderr, flush=True)

    head = [c.strip() for c in first] if has_header else None
    index: list[int] = []
    for c, name in zip(columns, names):
        if isinstance(c, str):
            if c not in head:
                raise ValueError(f"{name} = {c!r} is not a column of {path}; its header (line {first_line}) has: "
                                 f"{', '.join(head)}")
            index.append(head.index(c))
        else:
            index.append(c)
    _refuse_duplicates(path, index, names)

    body = records[1:] if has_header else records
    if not body:
        raise ValueError(f"{path}: holds only a header row (line {first_line}), no examples")
    _refuse_header_rows(path, body, index, head, first_line, header == "auto")
    return Table(path, [tuple(cells[i] for i in index) for _, cells in body], [n for n, _ in body], head)


def _refuse_header_rows(path: Path, body: list[tuple[int, list[str]]], index: list[int], head: list[str] | None,
                        first_line: int, auto: bool) -> None:
    """Refuse a data row that is a header: a copy of the header ``head`` (files joined with their headers), or, in a
    file read without one under ``data.header = auto``, a row whose selected cells are all usual column names."""
    for number, cells in body:
        if head is not None and [c.strip() for c in cells] == head:
            raise ValueError(f"{path}:{number}: repeats the header row of line {first_line} ({' | '.join(head)}); "
                             "a header belongs on line 1 only")
        selected = [cells[i].strip() for i in index]
        if head is None and auto and all(c.lower() in COLUMN_NAMES for c in selected):
            raise ValueError(f"{path}:{number}: ({' | '.join(selected)}) looks like a header row inside the data; "
                             "remove it, or set data.header = false to read it as an example")


def _refuse_duplicates(path: Path, selected: list, names: list[str]) -> None:
    for b, column in enumerate(selected):
        a = selected.index(column)
        if a != b:
            raise ValueError(f"{names[a]} and {names[b]} both select column {column!r} of {path}; they must differ")


def _header_reason(records: list[tuple[int, list[str]]], columns: list[int], label_position: int | None) -> str | None:
    """Why line 1 of a file read by column indices is a header, or ``None`` when it looks like data."""
    first = [records[0][1][c].strip() for c in columns]
    if all(cell.lower() in COLUMN_NAMES for cell in first):
        return f"{', '.join(repr(c) for c in first)} are column names"
    if label_position is None:
        return None
    label = first[label_position]
    rest = [cells[columns[label_position]].strip() for _, cells in records[1:]]
    if rest and label not in rest and len(set(rest)) < len(rest):
        return f"its label cell {label!r} occurs on no other line"
    return None

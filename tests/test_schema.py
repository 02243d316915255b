"""The declaration primitive (fedlowrank.schema): coercion, bounds, choices, checks, the messages they give, and
the descriptions ``fedlowrank config`` and ``fedlowrank methods NAME`` print."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fedlowrank.schema import ConfigError, Schema, check_choice, declared, distinct, setting, with_default

ROOT = Path(__file__).resolve().parents[1]


def _even(value: int, key: str) -> None:
    if value % 2:
        raise ValueError(f"{key} must be even, got {value}")


@dataclass
class Sample(Schema):
    prefix = "sample"

    flag: bool = setting(False, "a switch")
    count: int = setting(3, "how many", ge=1, le=10, reason="ten is plenty")
    rate: float = setting(0.5, "a share", gt=0, lt=1)
    bound: float = setting(math.inf, "an upper bound", ge=0, allow_inf=True)
    mode: str = setting("a", "a variant", choices=("a", "b"))
    header: str = setting("auto", "a switch spelled as a string", choices=("auto", "true", "false"))
    column: str = setting("0", "a name or an index")
    names: list[str] = setting([], "some names", check=distinct)
    pair: tuple[float, float] = setting((0.1, 0.2), "two shares", ge=0, lt=1)
    table: dict[str, list[int]] = setting({}, "lists by name", ge=0)
    either: float | str = setting("auto", "a number or auto", gt=0, choices=("auto",))
    anything: Any = setting(None, "whatever")
    even: int = setting(2, "an even number", check=_even, form="an even integer")
    picked: str = setting("x", "from a registry", choices=lambda: ("x", "y"))


@pytest.mark.parametrize("key, value, coerced", [
    ("count", 4.0, 4),
    ("bound", 2, 2.0),
    ("bound", float("inf"), math.inf),
    ("header", True, "true"),
    ("column", 2, "2"),
    ("pair", [0, 0.5], (0.0, 0.5)),
    ("table", {"a": [1, 2.0]}, {"a": [1, 2]}),
    ("either", 2, 2.0),
    ("either", "auto", "auto"),
    ("anything", {"x": [1]}, {"x": [1]}),
    ("picked", "y", "y"),
])
def test_values_are_coerced_to_the_declared_type(key, value, coerced):
    got = getattr(Sample(**{key: value}), key)
    assert got == coerced and type(got) is type(coerced)


@pytest.mark.parametrize("key, value, message", [
    ("flag", 1, "sample.flag must be true or false, got 1"),
    ("count", 1.5, "sample.count must be an integer, got 1.5"),
    ("count", True, "sample.count must be an integer, got True"),
    ("count", 0, "sample.count must be in [1, 10] (ten is plenty), got 0"),
    ("rate", "x", "sample.rate must be a number, got 'x'"),
    ("rate", float("nan"), "sample.rate must be a finite number, got nan"),
    ("rate", float("inf"), "sample.rate must be a finite number, got inf"),
    ("rate", 1.0, "sample.rate must be in (0, 1), got 1.0"),
    ("bound", float("nan"), "sample.bound must be a finite number or inf, got nan"),
    ("bound", -1, "sample.bound must be >= 0, got -1.0"),
    ("mode", "c", "sample.mode must be one of a, b; got 'c'"),
    ("mode", 3, "sample.mode must be one of a, b; got '3'"),
    ("header", "yes", "sample.header must be one of auto, true, false; got 'yes'"),
    ("column", 1.5, "sample.column must be a string, got 1.5"),
    ("names", "abc", "sample.names must be a list of strings, got 'abc'"),
    ("names", ["a", 1], "sample.names[1] must be a string, got 1"),
    ("names", ["a", "a"], "sample.names lists 'a' twice"),
    ("pair", [0.1], "sample.pair must be a list of 2 numbers in [0, 1), got [0.1]"),
    ("pair", ["a", 0.1], "sample.pair[0] must be a number, got 'a'"),
    ("pair", [0.1, 1.0], "sample.pair[1] must be in [0, 1), got 1.0"),
    ("table", {"a": [-1]}, "sample.table.a[0] must be >= 0, got -1"),
    ("table", [1], "sample.table must be a table of lists of integers >= 0, got [1]"),
    ("either", "x", "sample.either must be a number > 0 or auto, got 'x'"),
    ("either", 0, "sample.either must be a number > 0 or auto, got 0"),
    ("even", 3, "sample.even must be even, got 3"),
    ("even", "x", "sample.even must be an even integer, got 'x'"),
    ("picked", "z", "sample.picked must be one of x, y; got 'z'"),
])
def test_a_wrong_value_is_one_line_naming_the_key_and_what_is_allowed(key, value, message):
    with pytest.raises(ConfigError) as err:
        Sample(**{key: value})
    assert str(err.value) == message


def test_unknown_keys_are_named_with_the_allowed_ones_and_defaults_are_not_shared():
    with pytest.raises(ConfigError, match=r"^sample\.bogus is not an option of sample; allowed: flag, count, rate, "):
        Sample.from_values({"bogus": 1}, "an option of sample")
    with pytest.raises(ConfigError, match=r"^sample\.bogus is not a config key; allowed: flag, "):
        Sample.from_values({"count": 2, "bogus": 1})
    a, b = Sample(), Sample.from_values({"count": 2})
    a.names.append("x")
    assert b.names == [] and b.count == 2 and Sample().table == {}


def test_descriptions_say_type_bounds_and_choices():
    described = {k: d.describe() for k, d in declared(Sample).items()}
    assert described == {
        "flag": "true or false", "count": "an integer in [1, 10]", "rate": "a number in (0, 1)",
        "bound": "a number >= 0 (inf allowed)", "mode": "one of a, b", "header": "one of auto, true, false",
        "column": "a string", "names": "a list of strings", "pair": "a list of 2 numbers in [0, 1)",
        "table": "a table of lists of integers >= 0", "either": "a number > 0 or auto", "anything": "any value",
        "even": "an even integer", "picked": "one of x, y"}
    assert declared(Sample)["count"].meaning == "how many" and declared(Sample)["names"].default == []


def test_an_undeclared_field_is_refused_and_with_default_keeps_the_declaration():
    @dataclass
    class Plain(Schema):
        prefix = "plain"
        size: int = 3

    with pytest.raises(TypeError, match=r"Plain\.size is not declared: write it as `size: <class 'int'> = setting"):
        Plain()

    @dataclass
    class Narrower(Sample):
        count: int = with_default(Sample, "count", 7)

    assert Narrower().count == 7
    assert declared(Narrower)["count"].setting == declared(Sample)["count"].setting
    with pytest.raises(ConfigError, match=r"sample\.count must be in \[1, 10\]"):
        Narrower(count=11)
    assert [f.name for f in dataclasses.fields(Narrower)] == [f.name for f in dataclasses.fields(Sample)]


def test_check_choice_is_the_one_message_for_variant_arguments():
    check_choice("side", "left", ("left", "right"))
    with pytest.raises(ConfigError, match=r"^side must be one of left, right, ''; got 'up'$"):
        check_choice("side", "up", ("left", "right", ""))


def test_the_declaration_floor_imports_nothing_of_fedlowrank(tmp_path):
    """methods/, tasks/ and training/ declare their settings with it, so it must sit below all of them."""
    (tmp_path / "floor.py").write_text((ROOT / "src" / "fedlowrank" / "schema.py").read_text())
    code = "import sys, floor; print(sorted(k for k in sys.modules if k.startswith('fedlowrank')))"
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr

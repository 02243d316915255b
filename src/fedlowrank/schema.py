"""Declared settings: every config key and every option of a method or a task is ONE declaration (type, default,
bounds or allowed values, meaning) that validation, ``fedlowrank config``, ``fedlowrank methods NAME``,
docs/configuration.md and the error messages all read. This module imports nothing of fedlowrank, so that
methods, tasks and training can declare their settings without importing upwards.

A schema is a dataclass that derives from :class:`Schema`; each field is declared with :func:`setting`, and the
field's annotation is its type::

    @dataclass
    class TrainConfig(Schema):
        prefix = "train"
        lr: float = setting(5e-4, "local learning rate", gt=0)
        optimizer: str = setting("adamw", "local optimizer", choices=("sgd", "adamw"))

Making a schema object coerces and checks every field (:meth:`Schema.__post_init__`); a wrong value raises
:class:`ConfigError`, one line that names the key (``train.lr``) and what is allowed.

Types: ``bool``, ``int``, ``float``, ``str``, ``list[T]``, ``tuple[T1, T2, ...]`` (fixed length),
``dict[str, T]``, unions of these (``float | str``) and ``Any``. Coercion: an ``int`` takes a whole float
(``1e3``); a ``float`` takes an int and must be finite unless ``allow_inf`` (nan never passes); a ``str`` key takes
an integer (a column index) and, when its choices are spelled ``"true"``/``"false"``, a boolean.

Bounds (``ge``, ``gt``, ``le``, ``lt``) and ``choices`` (the allowed strings: a tuple, or a function returning one,
for registries) apply to a list's, tuple's or table's items; ``reason`` is said with a bound's error (why the
limit, or what its edge values mean). A rule that types, bounds and choices cannot say (a device string, distinct
names) is a ``check(value, key)`` function raising ``ValueError``, with ``form`` saying in words what it allows.
A subclass that only changes an inherited key's default writes it with :func:`with_default`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Mapping, Union


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message names the field."""


_SPEC = "fedlowrank.setting"


@dataclass(frozen=True)
class Setting:
    """What a declared key allows and means (see the module docstring for each attribute)."""

    meaning: str
    choices: tuple | Callable[[], Iterable] | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    allow_inf: bool = False
    reason: str = ""
    check: Callable[[Any, str], None] | None = None
    form: str = ""

    def allowed(self) -> tuple | None:
        """The allowed values, or ``None`` when any value of the type is allowed."""
        return tuple(self.choices()) if callable(self.choices) else self.choices


def setting(default: Any, meaning: str, *, choices: tuple | Callable[[], Iterable] | None = None,
            ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None,
            allow_inf: bool = False, reason: str = "", check: Callable[[Any, str], None] | None = None,
            form: str = "") -> Any:
    """A declared dataclass field: ``default`` (lists and tables are copied for each object) and what it allows
    and means."""
    spec = Setting(meaning, choices, ge, gt, le, lt, allow_inf, reason, check, form)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata={_SPEC: spec})
    return dataclasses.field(default=default, metadata={_SPEC: spec})


def with_default(cls: type, name: str, default: Any) -> Any:
    """The declaration of ``cls``'s key ``name`` with another default: a subclass's own default of an inherited
    option (``procrustes: bool = with_default(FLoRG, "procrustes", False)``)."""
    return setting(default, **dataclasses.asdict(declared(cls)[name].setting))


@dataclass(frozen=True)
class Declared:
    """One declared key of a schema: its name, type (the resolved annotation), setting and default."""

    name: str
    type: Any
    setting: Setting
    default: Any

    @property
    def meaning(self) -> str:
        return self.setting.meaning

    def describe(self) -> str:
        """What the key allows, in words: ``an integer >= 1``, ``one of sgd, adamw``, ``a list of strings``."""
        return self.setting.form or describe(self.type, self.setting)

    def check(self, key: str, value: Any) -> Any:
        """``value`` coerced to the declared type; :class:`ConfigError` naming ``key`` when it is not allowed."""
        if self.setting.form:
            try:
                value = _check(key, self.type, self.setting, value, True)
            except ConfigError:
                raise ConfigError(f"{key} must be {self.setting.form}, got {value!r}") from None
        else:
            value = _check(key, self.type, self.setting, value, True)
        if self.setting.check is not None:
            try:
                self.setting.check(value, key)
            except ConfigError:
                raise
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        return value


@functools.cache
def declared(cls: type) -> dict[str, Declared]:
    """The declared keys of the dataclass ``cls``, in field order. A field given without :func:`setting` is an
    error: every key carries its type and meaning."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Declared] = {}
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(_SPEC)
        if spec is None:
            raise TypeError(f"{cls.__qualname__}.{f.name} is not declared: write it as "
                            f"`{f.name}: {hints[f.name]} = setting(default, meaning, ...)`")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        out[f.name] = Declared(f.name, hints[f.name], spec, default)
    return out


class Schema:
    """Base of a dataclass of declared settings (a config section, a method's or a task's options): making one
    coerces and checks every field. ``prefix`` names its keys in messages (``train`` → ``train.lr``)."""

    prefix: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for name, decl in declared(type(self)).items():
            setattr(self, name, decl.check(f"{self.prefix}.{name}", getattr(self, name)))

    @classmethod
    def from_values(cls, values: Mapping[str, Any], owner: str = "a config key"):
        """``cls(**values)``, after refusing a key that is not declared (``owner`` says what keys are: ``a config
        key``, ``an option of fedit``)."""
        known = declared(cls)
        unknown = [k for k in values if k not in known]
        if unknown:
            raise ConfigError(f"{cls.prefix}.{unknown[0]} is not {owner}; allowed: {', '.join(known) or 'none'}")
        return cls(**values)


def check_choice(key: str, value: Any, allowed: Iterable) -> None:
    """``value`` is one of ``allowed``, else :class:`ConfigError` naming ``key``: the one check for arguments that
    name a variant (``side``, ``solver``), where no declaration stands before them."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(f"{key} must be one of {_listing(allowed)}; got {value!r}")


def distinct(values: Iterable, key: str) -> None:
    """A ``check`` for lists whose items must differ (class ids, domain names)."""
    seen = set()
    for v in values:
        if v in seen:
            raise ConfigError(f"{key} lists {v!r} twice")
        seen.add(v)


def increasing(values: Iterable, key: str) -> None:
    """A ``check`` for lists whose items must strictly increase (sequence-length buckets)."""
    values = list(values)
    if any(a >= b for a, b in zip(values, values[1:])):
        raise ConfigError(f"{key} must be increasing, got {values}")


# -- coercion and checks -------------------------------------------------------------------------------------
def _check(key: str, hint: Any, spec: Setting, value: Any, top: bool) -> Any:
    if hint is Any:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        for alt in args:
            if _fits(alt, value):
                if typing.get_origin(alt) in (list, tuple, dict):
                    return _check(key, alt, spec, value, top)
                try:
                    return _check(key, alt, spec, value, top)
                except ConfigError:
                    break
        raise ConfigError(f"{key} must be {describe(hint, spec)}, got {value!r}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)) or (origin is tuple and len(value) != len(args)):
            raise ConfigError(f"{key} must be {describe(hint, spec)}, got {value!r}")
        items = args * len(value) if origin is list else args
        out = [_check(f"{key}[{i}]", t, spec, v, False) for i, (t, v) in enumerate(zip(items, value))]
        return out if origin is list else tuple(out)
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key} must be {describe(hint, spec)}, got {value!r}")
        return {k: _check(f"{key}.{k}", args[1], spec, v, False) for k, v in value.items()}
    return _scalar(key, hint, spec, value, top)


def _fits(hint: Any, value: Any) -> bool:
    """Whether ``value``'s kind is that of the union member ``hint`` (which member checks it)."""
    origin = typing.get_origin(hint) or hint
    if origin is bool:
        return isinstance(value, bool)
    if origin in (int, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is str:
        return isinstance(value, str)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple))
    if origin is dict:
        return isinstance(value, dict)
    return hint is Any


def _scalar(key: str, hint: Any, spec: Setting, value: Any, top: bool) -> Any:
    if hint not in (bool, int, float, str):
        raise TypeError(f"{key}: a declared type must be bool, int, float, str, list, tuple, dict or a union of "
                        f"them, not {hint!r}")

    def wrong() -> ConfigError:  # the type only: a bound or choice has its own message below
        wanted = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[hint]
        if isinstance(value, float) and not math.isfinite(value):
            wanted = "a finite number" + (" or inf" if spec.allow_inf else "")
        return ConfigError(f"{key} must be {wanted}, got {value!r}")

    if hint is bool:
        if not isinstance(value, bool):
            raise wrong()
        return value
    if hint is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong()
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise wrong()
        try:
            value = float(value)
        except OverflowError:
            raise wrong() from None
        if math.isnan(value) or (math.isinf(value) and not spec.allow_inf):
            raise wrong()
    elif hint is str:
        allowed = spec.allowed() or ()
        if isinstance(value, bool) and {"true", "false"} <= set(allowed):
            value = "true" if value else "false"
        elif top and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            raise wrong()
    allowed = spec.allowed()
    if hint is str and allowed is not None and value not in allowed:
        raise ConfigError(f"{key} must be one of {_listing(allowed)}; got {value!r}")
    if hint in (int, float) and not _within(spec, value):
        reason = f" ({spec.reason})" if spec.reason else ""
        raise ConfigError(f"{key} must be {_bounds(spec)}{reason}, got {value!r}")
    return value


def _within(spec: Setting, v: float) -> bool:
    return ((spec.ge is None or v >= spec.ge) and (spec.gt is None or v > spec.gt)
            and (spec.le is None or v <= spec.le) and (spec.lt is None or v < spec.lt))


# -- descriptions ----------------------------------------------------------------------------------------------
def describe(hint: Any, spec: Setting, plural: bool = False) -> str:
    """What ``hint`` with ``spec`` allows, in words (singular: ``an integer >= 1``; plural: ``integers >= 1``)."""
    if hint is Any:
        return "values" if plural else "any value"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a, spec, plural) for a in args)
    if origin is list:
        return ("lists" if plural else "a list") + " of " + describe(args[0], spec, True)
    if origin is tuple:
        if len(set(args)) == 1:
            return ("lists" if plural else "a list") + f" of {len(args)} " + describe(args[0], spec, True)
        return ("lists" if plural else "a list") + " of " + ", ".join(describe(a, spec) for a in args)
    if origin is dict:
        return ("tables" if plural else "a table") + " of " + describe(args[1], spec, True)
    allowed = spec.allowed()
    if hint is bool:
        return "true/false values" if plural else "true or false"
    if hint is str and allowed is not None:
        if len(allowed) == 1:
            return _listing(allowed)
        return ("values among " if plural else "one of ") + _listing(allowed)
    noun = {int: ("an integer", "integers"), float: ("a number", "numbers"), str: ("a string", "strings")}[hint]
    text = noun[plural]
    if hint in (int, float) and _bounds(spec):
        text += " " + _bounds(spec)
    if hint is float and spec.allow_inf:
        text += " (inf allowed)"
    return text


def _bounds(spec: Setting) -> str:
    low = ("[", spec.ge) if spec.ge is not None else ("(", spec.gt) if spec.gt is not None else None
    high = ("]", spec.le) if spec.le is not None else (")", spec.lt) if spec.lt is not None else None
    if low and high:
        return f"in {low[0]}{_num(low[1])}, {_num(high[1])}{high[0]}"
    if low:
        return f"{'>=' if low[0] == '[' else '>'} {_num(low[1])}"
    if high:
        return f"{'<=' if high[0] == ']' else '<'} {_num(high[1])}"
    return ""


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _listing(values: Iterable) -> str:
    return ", ".join("''" if v == "" else str(v) for v in values)


__all__ = ["ConfigError", "Declared", "Schema", "Setting", "check_choice", "declared", "describe", "distinct", "setting",
           "with_default"]

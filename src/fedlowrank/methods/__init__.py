"""Method registry. Every module in this package registers its methods with :func:`register`.

``get_method(name, **options)`` builds a method by its registered name, its options checked against their
declarations (the method's dataclass fields, :mod:`fedlowrank.schema`); ``available_methods()`` lists them.
``preset_overrides(name)`` and ``lr_grid(name)`` give a method's paper defaults (``Method.preset``,
``Method.lr_grid``) for ``compare`` and ``tune``.
"""

from __future__ import annotations

import importlib
import json
import pkgutil

from .base import LoRAMethod, Method, SetupInfo

_REGISTRY: dict[str, type[Method]] = {}

DEFAULT_LR_GRID: tuple[float, ...] = (3e-4, 1e-3, 3e-3)
"""Learning rates tuned over for a method whose paper names no grid (AdamW scale)."""
SGD_LR_GRID: tuple[float, ...] = (3e-3, 1e-2, 3e-2, 1e-1)
"""Learning rates for the methods whose preset trains with plain SGD and whose paper names no grid."""


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: register a method under ``cls.name`` (lower case, hyphens)."""
    if not cls.name or cls.name != cls.name.lower() or " " in cls.name or "_" in cls.name:
        raise ValueError(f"method name must be lower case with hyphens, got {cls.name!r}")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"method {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def _load_all() -> None:
    for mod in pkgutil.iter_modules(__path__):
        if mod.name != "base":
            importlib.import_module(f"{__name__}.{mod.name}")


def available_methods() -> dict[str, type[Method]]:
    _load_all()
    return dict(sorted(_REGISTRY.items()))


def method_class(name: str) -> type[Method]:
    methods = available_methods()
    if name not in methods:
        raise ValueError(f"method.name: unknown method {name!r}; allowed: {', '.join(methods)}")
    return methods[name]


def get_method(name: str, **options) -> Method:
    """Build the method registered as ``name`` with its options, each checked against its declaration: an unknown
    option, a value of the wrong type or out of its bounds or choices raises
    :class:`~fedlowrank.schema.ConfigError` naming ``method.OPTION`` and what is allowed."""
    return method_class(name).from_values(options, f"an option of {name}")


def _toml_value(value) -> str:
    """A preset value as ``--set`` reads it back (TOML): strings quoted, booleans lower case, lists in brackets."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def preset_overrides(name: str) -> list[str]:
    """The paper's own settings of method ``name`` as ``--set`` strings, e.g. ``['server.weighting="uniform"']``.

    ``compare`` and ``tune`` apply them before the user's ``compare.overrides`` and ``--set`` (the user wins).
    """
    return [f"{key}={_toml_value(value)}" for key, value in method_class(name).preset.items()]


def lr_grid(name: str) -> list[float]:
    """The learning rates to tune method ``name`` over: its paper's grid, else :data:`DEFAULT_LR_GRID`."""
    return list(method_class(name).lr_grid or DEFAULT_LR_GRID)


__all__ = ["Method", "LoRAMethod", "SetupInfo", "register", "get_method", "method_class", "available_methods",
           "preset_overrides", "lr_grid", "DEFAULT_LR_GRID", "SGD_LR_GRID"]

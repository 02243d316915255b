"""Method registry. Every module in this package registers its methods with :func:`register`.

``get_method(name, **options)`` builds a method by its registered name; ``available_methods()`` lists them.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

from .base import LoRAMethod, Method, SetupInfo

_REGISTRY: dict[str, type[Method]] = {}


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
    """Build the method registered as ``name`` with its options (unknown options are an error)."""
    cls = method_class(name)
    allowed = cls.options()
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"method.{unknown[0]}: not an option of {name!r}; allowed: {', '.join(sorted(allowed)) or 'none'}")
    if dataclasses.is_dataclass(cls):
        return cls(**options)
    return cls()


__all__ = ["Method", "LoRAMethod", "SetupInfo", "register", "get_method", "method_class", "available_methods"]

"""Reading a configuration: a TOML file, a bundled config by name or a dict, then ``--set section.key=value``
overrides; every section made from its values (its keys checked), then :func:`~.checks.validate`."""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path
from typing import Any

from ..configs import bundled_configs, bundled_text
from ..schema import ConfigError
from .checks import validate
from .sections import METHOD_NAME, SECTIONS, RunConfig


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"section.key=value"`` → (path, value); the value is read as TOML (``5``, ``0.1``, ``[2,4]``, ``true``)
    and as a plain string when it is not valid TOML."""
    if "=" not in text:
        raise ConfigError(f"--set expects section.key=value, got {text!r}")
    key, value = text.split("=", 1)
    path = key.strip().split(".")
    if len(path) < 2 or not all(path):
        raise ConfigError(f"--set key must be section.key, got {key!r}")
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value
    except RecursionError:
        raise ConfigError(f"--set {key}: the value is nested deeper than the TOML parser goes") from None
    return path, parsed


def read_toml(source: str | Path | dict[str, Any] | None) -> dict[str, Any]:
    """Load a TOML file (UTF-8, a leading byte-order mark ignored), or a bundled config by name (``main``,
    ``tiny``...); a dict is copied; ``None`` = empty."""
    if source is None:
        return {}
    if isinstance(source, dict):
        return copy.deepcopy(source)
    path = Path(source)
    if path.is_dir():
        raise ConfigError(f"config {source}: a folder, not a TOML file")
    if path.exists():
        try:
            text = path.read_bytes().decode("utf-8").removeprefix("\ufeff")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config {source}: not a TOML text file (byte {exc.start} is not UTF-8)") from None
    else:
        text = bundled_text(str(source))
        if text is None:
            raise ConfigError(f"config: no file {source!r} and no bundled config of that name "
                              f"(bundled: {', '.join(bundled_configs())})")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {source}: invalid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"config {source}: arrays or tables nested deeper than the TOML parser goes") from None


def from_dict(raw: dict[str, Any], method_checks: bool = True) -> RunConfig:
    """Build and validate a :class:`RunConfig` from a (TOML-shaped) dict (``method_checks``: see :func:`validate`)."""
    for section, values in raw.items():
        if section not in (*SECTIONS, "method"):
            raise ConfigError(f"unknown config section [{section}]; allowed: {', '.join((*SECTIONS, 'method'))}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{section}] must be a table")
    method = dict(raw.get("method", {}))
    method.setdefault("name", METHOD_NAME.default)
    method["name"] = METHOD_NAME.check("method.name", method["name"])
    cfg = RunConfig(**{name: cls.from_values(raw.get(name, {})) for name, cls in SECTIONS.items()}, method=method)
    validate(cfg, method_checks)
    return cfg


def load_config(source: str | Path | dict[str, Any] | None = None,
                overrides: list[str] | tuple[str, ...] = (), method_checks: bool = True) -> RunConfig:
    """TOML file (or bundled name, or a TOML-shaped dict) + ``--set`` overrides → validated :class:`RunConfig`
    (``method_checks``: see :func:`validate`)."""
    raw = read_toml(source)
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {text}: {part} is not a table")
        node[path[-1]] = value
    lora = raw.get("lora")
    if isinstance(lora, dict) and lora.get("ranks") == []:
        raise ConfigError("lora.ranks is empty: give one rank per client (fewer are dealt round-robin), "
                          "or leave it out to use lora.rank")
    return from_dict(raw, method_checks)

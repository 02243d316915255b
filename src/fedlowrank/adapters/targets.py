"""Target modules per architecture, resolved against a concrete model.

transformers 5 names BERT's attention ``query/key/value`` but LLaMA's and ViT's ``q_proj/k_proj/v_proj``.
"""

from __future__ import annotations

from torch import nn

DEFAULT_TARGETS: dict[str, list[str]] = {
    "bert": ["query", "value"],
    "roberta": ["query", "value"],
    "llama": ["q_proj", "v_proj"],
    "vit": ["q_proj", "v_proj"],
}


def linear_suffixes(net: nn.Module) -> list[str]:
    """The distinct last name components of the model's ``nn.Linear`` modules (what a target may name)."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in net.named_modules() if isinstance(m, nn.Linear)})


def resolve_targets(net: nn.Module, patterns: list[str], exclude_prefixes: tuple[str, ...] = ()) -> list[str]:
    """Full names of the ``nn.Linear`` modules whose last name component is one of ``patterns``.

    Modules under ``exclude_prefixes`` (e.g. the head) are skipped. A pattern that matches nothing is an error
    naming the allowed suffixes.
    """
    names = [n for n, m in net.named_modules()
             if isinstance(m, nn.Linear) and not n.startswith(exclude_prefixes)]
    out: list[str] = []
    for pattern in patterns:
        hits = [n for n in names if n.rsplit(".", 1)[-1] == pattern]
        if not hits:
            raise ValueError(f"lora.targets: {pattern!r} matches no nn.Linear module; "
                             f"allowed: {', '.join(linear_suffixes(net))}")
        out.extend(hits)
    return sorted(set(out), key=names.index)


def default_targets(model_type: str) -> list[str]:
    if model_type not in DEFAULT_TARGETS:
        raise ValueError(f"no default LoRA targets for model type {model_type!r}; set lora.targets "
                         f"(known types: {', '.join(DEFAULT_TARGETS)})")
    return DEFAULT_TARGETS[model_type]

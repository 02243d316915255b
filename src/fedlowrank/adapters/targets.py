"""Target modules per architecture, resolved against a concrete model with peft's ``target_modules`` semantics.

``lora.targets`` is either

* a list of names: each entry matches a module whose full name equals it or ends with ``"." + entry``
  (a suffix such as ``q_proj`` or ``self_attn.v_proj``, or a full name such as ``model.layers.0.self_attn.q_proj``);
* a string: ``"all-linear"`` (every ``nn.Linear`` except the output layer / head), or a regular expression that
  must match a module's full name entirely (``re.fullmatch``), e.g. ``".*\\.layers\\.[0-3]\\..*(q|v)_proj"``;
* empty: the architecture's default (:data:`DEFAULT_TARGETS`).

transformers 5 names BERT's attention ``query/key/value`` but LLaMA's and ViT's ``q_proj/k_proj/v_proj``;
GPT-2's fused ``c_attn`` is a ``Conv1D`` that :func:`fedlowrank.models.loading.load_model` turns into an equivalent
``nn.Linear`` (see :class:`fedlowrank.models.loading.Conv1DLinear`).
"""

from __future__ import annotations

import re

from torch import nn

ALL_LINEAR = "all-linear"
DEFAULT_TARGETS: dict[str, list[str]] = {
    "bert": ["query", "value"],
    "roberta": ["query", "value"],
    "llama": ["q_proj", "v_proj"],
    "vit": ["q_proj", "v_proj"],
    "gpt2": ["c_attn"],
    "clip": ["q_proj", "v_proj"],  # CLIPForImageClassification's vision tower (attention out is out_proj)
    "resnet20": ["stem", "conv1", "conv2"],  # fedlowrank.models.resnet: every convolution (trained from scratch)
}


TARGETABLE = (nn.Linear, nn.Conv2d)  # a convolution is adapted as its [out, in·kh·kw] matrix


def linear_suffixes(net: nn.Module) -> list[str]:
    """The distinct last name components of the model's ``nn.Linear``/``nn.Conv2d`` modules (what a target may
    name)."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in net.named_modules() if isinstance(m, TARGETABLE)})


def resolve_targets(net: nn.Module, spec: list[str] | str, exclude: tuple[str, ...] = ()) -> list[str]:
    """Full names of the ``nn.Linear`` (or, named explicitly, ``nn.Conv2d``) modules that ``spec`` (peft
    semantics, see the module docstring) selects, in model order. The modules named in ``exclude`` and everything under them (the head / output layer) are
    never targets. A list entry or a regular expression that matches nothing is an error naming
    ``lora.targets`` and the allowed suffixes."""
    under = tuple(f"{m}." for m in exclude)
    names = [n for n, m in net.named_modules()
             if isinstance(m, TARGETABLE) and n not in exclude and not n.startswith(under)]
    linear = [n for n in names if isinstance(net.get_submodule(n), nn.Linear)]  # what all-linear selects
    allowed = f"allowed suffixes: {', '.join(linear_suffixes(net))}, or {ALL_LINEAR!r}, or a regular expression"
    if isinstance(spec, str):
        if spec == ALL_LINEAR:
            return linear
        try:
            hits = [n for n in names if re.fullmatch(spec, n)]
        except re.error as exc:
            raise ValueError(f"lora.targets: {spec!r} is not a valid regular expression ({exc})") from None
        if not hits:
            raise ValueError(f"lora.targets: the regular expression {spec!r} matches no nn.Linear module's full "
                             f"name (e.g. {names[0] if names else 'none'}); {allowed}")
        return hits
    if ALL_LINEAR in spec:
        return linear
    out: set[str] = set()
    for pattern in spec:
        hits = [n for n in names if n == pattern or n.endswith("." + pattern)]
        if not hits:
            raise ValueError(f"lora.targets: {pattern!r} matches no nn.Linear module; {allowed}")
        out.update(hits)
    return [n for n in names if n in out]


def default_targets(model_type: str) -> list[str]:
    if model_type not in DEFAULT_TARGETS:
        raise ValueError(f"no default LoRA targets for model type {model_type!r}; set lora.targets "
                         f"(known types: {', '.join(DEFAULT_TARGETS)})")
    return DEFAULT_TARGETS[model_type]
